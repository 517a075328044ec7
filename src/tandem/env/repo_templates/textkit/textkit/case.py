"""Case conversion: snake_case, camelCase and Title Case."""

from __future__ import annotations

import re

_WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
MINOR_WORDS = frozenset("a an and as at but by for in of on or the to".split())


def words(s: str) -> list[str]:
    """The words of an identifier or phrase: ``"parseHTTPResponse2"`` -> ``parse, HTTP, Response, 2``."""
    return _WORD.findall(s)


def snake_case(s: str) -> str:
    """``"parseHttpResponse"`` -> ``"parse_http_response"``."""
    return "_".join(w.lower() for w in words(s))


def camel_case(s: str) -> str:
    """``"parse_http_response"`` -> ``"parseHttpResponse"``; no words give ``""``."""
    ws = [w.lower() for w in words(s)]
    if not ws:
        return ""
    return ws[0] + "".join(w.capitalize() for w in ws[1:])


def title_case(s: str) -> str:
    """Capitalize every word except minor ones (``of``, ``the``, ...); the first and last word always."""
    ws = s.split()
    out = []
    for i, w in enumerate(ws):
        if 0 < i < len(ws) - 1 and w.lower() in MINOR_WORDS:
            out.append(w.lower())
        else:
            out.append(w[:1].upper() + w[1:].lower())
    return " ".join(out)
