"""Lazy package exports: a package's public names imported on first use.

Invariant: ``from package import Name`` and ``package.Name`` behave as with eager imports (same object, an
``AttributeError`` naming the package for unknown names), but importing one light submodule of the package
(the CLI does this for every command) does not pay for its heavy siblings (torch, transformers, Ray).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` for ``where`` (public name -> module defining it)."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    return __getattr__
