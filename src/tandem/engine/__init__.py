"""Layer 2: inference engines. ``BuiltinEngine`` is the built-in transformers engine (CPU default, tests)."""

from tandem.engine.builtin import BuiltinEngine
from tandem.engine.sampling import sample

__all__ = ["BuiltinEngine", "sample"]
