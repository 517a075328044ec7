"""npm-style version ranges: ``1.2.3``, ``^1.2.3``, ``~1.2.3``, and ``>=``/``>``/``<=``/``<`` comparators."""

from __future__ import annotations

from semver.version import Version, parse

_OPERATORS = (">=", "<=", ">", "<", "^", "~", "=")


def _caret_upper(v: Version) -> Version:
    """The first version a caret range excludes: the next change of the left-most non-zero part."""
    if v.major > 0:
        return Version(v.major + 1, 0, 0)
    if v.minor > 0:
        return Version(0, v.minor + 1, 0)
    return Version(0, 0, v.patch + 1)


def _matches(key: tuple, part: str) -> bool:
    for op in _OPERATORS:
        if part.startswith(op):
            target = parse(part[len(op) :])
            break
    else:
        op, target = "=", parse(part)
    t = target.key()
    if op == "^":
        return t <= key < _caret_upper(target).key()
    if op == "~":
        return t <= key < Version(target.major, target.minor + 1, 0).key()
    if op == ">=":
        return key >= t
    if op == "<=":
        return key <= t
    if op == ">":
        return key > t
    if op == "<":
        return key < t
    return key == t


def satisfies(version: str, spec: str) -> bool:
    """Whether ``version`` is in the range ``spec`` (space-separated parts must all match)."""
    key = parse(version).key()
    return all(_matches(key, part) for part in spec.split())


def max_satisfying(versions: list[str], spec: str) -> str | None:
    """The highest of ``versions`` in the range ``spec``, or None."""
    ok = [v for v in versions if satisfies(v, spec)]
    return max(ok, key=lambda v: parse(v).key()) if ok else None
