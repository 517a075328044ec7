"""Semantic versions: parsing, precedence and bumping (https://semver.org)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_VERSION = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z.-]+))?(?:\+([0-9A-Za-z.-]+))?$"
)


@dataclass(frozen=True)
class Version:
    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()
    build: str = ""

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + self.build
        return text

    def key(self) -> tuple:
        """Precedence: build metadata is ignored, a prerelease comes before its release, and numeric
        prerelease identifiers compare as numbers and before alphanumeric ones."""
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.prerelease)
        return (self.major, self.minor, self.patch, 0 if self.prerelease else 1, pre)


def parse(text: str) -> Version:
    """``"1.2.3-rc.1+build.5"`` -> Version(1, 2, 3, ("rc", "1"), "build.5"); ValueError if malformed."""
    m = _VERSION.match(text.strip())
    if not m:
        raise ValueError(f"not a semantic version: {text!r}; expected MAJOR.MINOR.PATCH")
    major, minor, patch, pre, build = m.groups()
    return Version(int(major), int(minor), int(patch), tuple(pre.split(".")) if pre else (), build or "")


def compare(a: str, b: str) -> int:
    """-1, 0 or 1 as version ``a`` has lower, equal or higher precedence than ``b``."""
    ka, kb = parse(a).key(), parse(b).key()
    return (ka > kb) - (ka < kb)


def sort_versions(versions: list[str]) -> list[str]:
    """``versions`` from lowest to highest precedence."""
    return sorted(versions, key=lambda v: parse(v).key())


def bump(text: str, part: str) -> str:
    """The next ``major``, ``minor`` or ``patch`` release after ``text``; lower parts are reset to 0."""
    v = parse(text)
    if part == "major":
        return f"{v.major + 1}.0.0"
    if part == "minor":
        return f"{v.major}.{v.minor + 1}.0"
    if part == "patch":
        return f"{v.major}.{v.minor}.{v.patch + 1}"
    raise ValueError(f"part must be 'major', 'minor' or 'patch', got {part!r}")
