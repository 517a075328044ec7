"""The task families of the built-in tasks (data for ``tandem.env.tasks``): 9-10 per difficulty level.

A family is a one-sentence spec, a reference body and plausible buggy bodies (off-by-one, wrong operator,
``>`` vs ``>=``, wrong constant, missing edge case), all ``str.format`` templates over the instance's
parameters (``K``, ``M``, ``C``, ``W``), plus an input generator and the edge cases every hidden test file
includes. Invariant: for every parameter draw, the reference body is valid Python returning a literal-
representable value (int, bool, str, list, dict), so expected outputs can be written with ``repr``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Args = tuple[Any, ...]
Params = dict[str, Any]

WORDS = (
    "cat dog sun tree apple moon sky red blue car bird fish book door star idea ocean lemon river tea go a "
    "house stone cloud"
).split()
LETTERS = "abcdeinorst"


@dataclass(frozen=True)
class Family:
    """A task template: spec/body/bug templates are ``str.format``-ed with the instance's parameters."""

    name: str
    level: int
    args: str
    spec: str
    body: str
    bugs: tuple[str, ...]
    params: Callable[[random.Random], Params]
    gen: Callable[[random.Random, Params], Args]
    edges: Callable[[Params], list[Args]]


def _ints(r: random.Random, lo: int = -5, hi: int = 15, n: int = 7) -> list[int]:
    return [r.randint(lo, hi) for _ in range(r.randint(1, n))]


def _word(r: random.Random) -> str:
    return "".join(r.choice(LETTERS) for _ in range(r.randint(1, 8)))


def _k(lo: int, hi: int) -> Callable[[random.Random], Params]:
    return lambda r: {"K": r.randint(lo, hi)}


def _c(r: random.Random) -> Params:
    return {"C": r.choice("aeinorst")}


def _none(r: random.Random) -> Params:
    return {}


def _x(r: random.Random, p: Params) -> Args:
    return (r.randint(-20, 50),)


def _s(r: random.Random, p: Params) -> Args:
    return (_word(r),)


def _xs(r: random.Random, p: Params) -> Args:
    return (_ints(r),)


def _ws(r: random.Random, p: Params) -> Args:
    return ([r.choice(WORDS) for _ in range(r.randint(1, 6))],)


# fmt: off
F = Family
FAMILIES: list[Family] = [
    # level 1: one-line arithmetic and string operations
    F("add", 1, "x", "return x plus {K}", "return x + {K}",
      ("return x - {K}", "return x + {K} + 1", "return x * {K}"), _k(2, 20), _x,
      lambda p: [(0,), (-p["K"],)]),
    F("times", 1, "x", "return x times {K}", "return x * {K}",
      ("return x + {K}", "return x * {K} + 1", "return x ** {K}"), _k(2, 9), _x,
      lambda p: [(0,), (1,), (-3,)]),
    F("minus", 1, "x", "return {K} minus x", "return {K} - x",
      ("return x - {K}", "return {K} + x", "return {K} - x - 1"), _k(2, 20), _x, lambda p: [(0,), (p["K"],)]),
    F("repeat", 1, "s", "return the string s repeated {K} times", "return s * {K}",
      ("return s * ({K} - 1)", "return s + s", "return s * {K} + s"), _k(2, 5), _s,
      lambda p: [("",), ("a",)]),
    F("mod", 1, "x", "return the remainder of x divided by {K}", "return x % {K}",
      ("return x // {K}", "return {K} % x", "return x % ({K} + 1)"), _k(2, 9),
      lambda r, p: (r.randint(0, 60),), lambda p: [(0,), (p["K"],), (p["K"] - 1,)]),
    F("suffix", 1, "s", "return s followed by {W!r}", "return s + {W!r}",
      ("return {W!r} + s", "return s + {W!r}[1:]", "return s"), lambda r: {"W": r.choice(WORDS[:20])}, _s,
      lambda p: [("",), ("ab",)]),
    F("prefix", 1, "s", "return the first {K} characters of s", "return s[:{K}]",
      ("return s[:{K} - 1]", "return s[{K}:]", "return s[:{K} + 1]"), _k(2, 5), _s,
      lambda p: [("",), ("abcdefghij",)]),
    F("greater", 1, "x", "return True if x is greater than {K}, else False", "return x > {K}",
      ("return x >= {K}", "return x < {K}", "return x > {K} + 1"), _k(0, 20), _x,
      lambda p: [(p["K"],), (p["K"] + 1,), (p["K"] - 1,)]),
    F("absdiff", 1, "x", "return the absolute difference between x and {K}", "return abs(x - {K})",
      ("return x - {K}", "return abs(x + {K})", "return {K} - x"), _k(1, 20), _x,
      lambda p: [(p["K"],), (0,), (p["K"] + 5,)]),
    # level 2: small list and string operations with a constant
    F("sum_gt", 2, "xs", "return the sum of the numbers in xs greater than {K}",
      "return sum(v for v in xs if v > {K})",
      ("return sum(v for v in xs if v >= {K})", "return sum(v for v in xs if v < {K})", "return sum(xs)"),
      _k(0, 9), _xs, lambda p: [([],), ([p["K"]],), ([p["K"], p["K"] + 1, -1],)]),
    F("count_lt", 2, "xs", "return how many numbers in xs are less than {K}",
      "return sum(1 for v in xs if v < {K})",
      ("return sum(1 for v in xs if v <= {K})", "return sum(1 for v in xs if v > {K})", "return len(xs)"),
      _k(0, 9), _xs, lambda p: [([],), ([p["K"], p["K"] - 1, p["K"] + 3],)]),
    F("count_char", 2, "s", "return how many times {C!r} appears in s", "return s.count({C!r})",
      ("return s[1:].count({C!r})", "return len(s) - s.count({C!r})", "return int({C!r} in s)"), _c, _s,
      lambda p: [("",), (p["C"] * 3,), (p["C"] + "x" + p["C"],)]),
    F("vowels", 2, "s", "return the number of vowels (a, e, i, o, u) in s",
      "return sum(c in 'aeiou' for c in s)",
      ("return sum(c in 'aeio' for c in s)", "return sum(c not in 'aeiou' for c in s)",
       "return sum(c in 'aeiou' for c in s[1:])"), _none, _s,
      lambda p: [("",), ("aeiou",), ("xyz",), ("u",)]),
    F("long_words", 2, "ws", "return the words in ws longer than {K} letters, in order",
      "return [w for w in ws if len(w) > {K}]",
      ("return [w for w in ws if len(w) >= {K}]", "return [w for w in ws if len(w) < {K}]",
       "return [w for w in ws if len(w) > {K}][1:]"), _k(2, 4), _ws,
      lambda p: [([],), (["a" * p["K"], "b" * (p["K"] + 1), "c" * (p["K"] + 2)],)]),
    F("max_default", 2, "xs", "return the largest number in xs, or {K} if xs is empty",
      "return max(xs, default={K})",
      ("return max(xs)", "return max(xs + [{K}])", "return min(xs, default={K})"), _k(-5, 5), _xs,
      lambda p: [([],), ([p["K"] - 3, p["K"] - 5],), ([1, 7],)]),
    F("scale", 2, "xs", "return a list of the numbers in xs, each multiplied by {K}",
      "return [v * {K} for v in xs]",
      ("return [v + {K} for v in xs]", "return [v * {K} for v in xs[1:]]", "return xs * {K}"), _k(2, 9), _xs,
      lambda p: [([],), ([0, 1],)]),
    F("first_gt", 2, "xs", "return the index of the first number in xs greater than {K}, or -1 if none",
      "return next((i for i, v in enumerate(xs) if v > {K}), -1)",
      ("return next((i for i, v in enumerate(xs) if v >= {K}), -1)",
       "return next((i for i, v in enumerate(xs) if v > {K}), 0)",
       "return next((i + 1 for i, v in enumerate(xs) if v > {K}), -1)"), _k(0, 9), _xs,
      lambda p: [([],), ([p["K"], p["K"] + 1],), ([p["K"] + 2],)]),
    F("remove_char", 2, "s", "return s with every {C!r} removed", "return s.replace({C!r}, '')",
      ("return s.replace({C!r}, '', 1)", "return s.strip({C!r})", "return s.replace({C!r}, ' ')"), _c, _s,
      lambda p: [("",), ("x" + p["C"] + "y" + p["C"] + "z",), (p["C"] * 2 + "b",)]),
    F("sum_first", 2, "xs", "return the sum of the first {K} numbers in xs", "return sum(xs[:{K}])",
      ("return sum(xs[:{K} - 1])", "return sum(xs[{K}:])", "return sum(xs[1:{K} + 1])"), _k(2, 5), _xs,
      lambda p: [([],), ([1, 2, 3, 4, 5, 6, 7],)]),
    # level 3: two-step combinations
    F("filter_scale", 3, "xs", "return the numbers in xs greater than {K}, each multiplied by {M}",
      "return [v * {M} for v in xs if v > {K}]",
      ("return [v * {M} for v in xs if v >= {K}]", "return [v + {M} for v in xs if v > {K}]",
       "return [v * {M} for v in xs]"), lambda r: {"K": r.randint(0, 6), "M": r.randint(2, 5)}, _xs,
      lambda p: [([],), ([p["K"], p["K"] + 1, -2],)]),
    F("word_counts", 3, "ws", "return a dict mapping each word in ws with at least {K} letters to its count",
      "d = {{}}\nfor w in ws:\n    if len(w) >= {K}:\n        d[w] = d.get(w, 0) + 1\nreturn d",
      ("d = {{}}\nfor w in ws:\n    if len(w) > {K}:\n        d[w] = d.get(w, 0) + 1\nreturn d",
       "d = {{}}\nfor w in ws:\n    if len(w) >= {K}:\n        d[w] = 1\nreturn d",
       "d = {{}}\nfor w in ws:\n    if len(w) >= {K}:\n        d[w] = d.get(w, 1) + 1\nreturn d"),
      _k(2, 4), _ws,
      lambda p: [([],), (["a" * p["K"]] * 2 + ["b" * (p["K"] - 1)],), (["sun", "sun", "apple"],)]),
    F("running_max", 3, "xs", "return the running maximum of xs: item i is the largest of xs[:i + 1]",
      "out = []\nfor v in xs:\n    out.append(max(out[-1], v) if out else v)\nreturn out",
      ("out = []\nfor v in xs:\n    out.append(max(out[-1] if out else 0, v))\nreturn out",
       "out = []\nfor v in xs:\n    out.append(min(out[-1], v) if out else v)\nreturn out",
       "return sorted(xs)"),
      _none, _xs, lambda p: [([],), ([-3, -5, -1],), ([2, 1, 3],)]),
    F("prefix_sums", 3, "xs", "return the running totals of xs: item i is the sum of xs[:i + 1]",
      "out, t = [], 0\nfor v in xs:\n    t += v\n    out.append(t)\nreturn out",
      ("out, t = [], 0\nfor v in xs:\n    out.append(t)\n    t += v\nreturn out",
       "out, t = [], 0\nfor v in xs:\n    t = v\n    out.append(t)\nreturn out",
       "return [sum(xs[:i]) for i in range(1, len(xs))]"), _none, _xs,
      lambda p: [([],), ([5],), ([1, 2, 3],)]),
    F("lens_starting", 3, "ws", "return the lengths of the words in ws that start with {C!r}",
      "return [len(w) for w in ws if w.startswith({C!r})]",
      ("return [len(w) for w in ws if w.endswith({C!r})]",
       "return [len(w) - 1 for w in ws if w.startswith({C!r})]",
       "return [len(w) for w in ws if {C!r} in w]"), _c, _ws,
      lambda p: [([],), ([p["C"] + "xy", "x" + p["C"], "y" + p["C"] + "z", p["C"]],)]),
    F("rises", 3, "xs", "return how many numbers in xs are greater than the number just before them",
      "return sum(b > a for a, b in zip(xs, xs[1:]))",
      ("return sum(b >= a for a, b in zip(xs, xs[1:]))", "return sum(b < a for a, b in zip(xs, xs[1:]))",
       "return sum(b > a for a, b in zip(xs, xs[2:]))"), _none, _xs,
      lambda p: [([],), ([1, 1, 2],), ([3],), ([1, 2, 3, 4],)]),
    F("digits_gt", 3, "n", "return how many digits of the non-negative integer n are greater than {K}",
      "return sum(int(c) > {K} for c in str(n))",
      ("return sum(int(c) >= {K} for c in str(n))", "return sum(int(c) > {K} for c in str(n)[1:])",
       "return sum(int(c) < {K} for c in str(n))"), _k(2, 7), lambda r, p: (r.randint(0, 99999),),
      lambda p: [(0,), (p["K"],), (int(str(p["K"] + 1) * 2),)]),
    F("top_k", 3, "xs", "return the {K} largest numbers in xs, largest first",
      "return sorted(xs, reverse=True)[:{K}]",
      ("return sorted(xs)[:{K}]", "return sorted(xs, reverse=True)[:{K} - 1]", "return sorted(xs)[-{K}:]"),
      _k(2, 4), _xs, lambda p: [([],), ([1],), ([1, 9, 3, 7, 5],)]),
    F("dedupe", 3, "xs", "return xs without duplicates, keeping the first occurrence of each number in order",
      "return list(dict.fromkeys(xs))",
      ("return sorted(set(xs))", "return [v for v in xs if xs.count(v) == 1]",
       "return list(dict.fromkeys(xs[1:]))"), _none, lambda r, p: (_ints(r, 0, 6, 8),),
      lambda p: [([],), ([3, 1, 3, 2, 1],)]),
    F("clamp", 3, "xs", "return xs with every number above {K} replaced by {K}",
      "return [min(v, {K}) for v in xs]",
      ("return [max(v, {K}) for v in xs]", "return [min(v, {K} - 1) for v in xs]",
       "return [v for v in xs if v <= {K}]"), _k(3, 9), _xs, lambda p: [([],), ([p["K"], p["K"] + 1],)]),
]
del F
# fmt: on

FAMILIES_BY_LEVEL: dict[int, list[Family]] = {}
for _f in FAMILIES:
    FAMILIES_BY_LEVEL.setdefault(_f.level, []).append(_f)
LEVELS = sorted(FAMILIES_BY_LEVEL)
