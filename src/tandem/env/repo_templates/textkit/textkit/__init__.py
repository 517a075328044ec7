"""textkit: small text utilities (wrapping, case conversion, slugs, word statistics)."""

from textkit.case import camel_case, snake_case, title_case, words
from textkit.slug import slugify
from textkit.stats import tokens, top_words, word_count
from textkit.wrap import indent, wrap

__all__ = [
    "camel_case",
    "indent",
    "slugify",
    "snake_case",
    "title_case",
    "tokens",
    "top_words",
    "word_count",
    "words",
    "wrap",
]
