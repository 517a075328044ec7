"""Load any local HF causal LM directory and its tokenizer, offline, with clear errors.

Invariants: nothing is downloaded (``local_files_only=True``); every failure is a ``ModelLoadError`` that
names the path, what is missing or unreadable, and how to point tandem at a usable directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.core.errors import ModelLoadError
from tandem.model.chat import ChatTemplate

HINT = (
    "point the command's --model (or a run's --set model.path=DIR) at a directory containing config.json "
    "and tokenizer.json"
)
DTYPES = ("float32", "bfloat16")


def _check_dir(path: str | Path, need_weights: bool) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(f"model directory {str(p)!r} does not exist; {HINT}")
    if not (p / "tokenizer.json").is_file():
        raise ModelLoadError(f"{str(p)!r} has no tokenizer.json (a fast HF tokenizer is required); {HINT}")
    if need_weights:
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{str(p)!r} has no config.json; {HINT}")
        try:
            json.loads((p / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{str(p / 'config.json')!r} is unreadable ({e}); {HINT}") from None
        if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
            raise ModelLoadError(f"{str(p)!r} has no weights (*.safetensors or *.bin); {HINT}")
    return p


GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
"""``tokenizer_class`` values (``tokenizer_config.json``) that name transformers' generic fast tokenizer,
which ``load_tokenizer`` builds without ``AutoTokenizer``."""


def _tokenizer_class(p: Path) -> str | None:
    try:
        value = json.loads((p / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def load_tokenizer(path: str | Path) -> Any:
    """The HF fast tokenizer saved in ``path``.

    A directory whose ``tokenizer_config.json`` names the generic fast tokenizer (the shipped model's) is
    loaded with that class directly: the object is the one ``AutoTokenizer`` returns (same class, vocabulary,
    special tokens and encodings; tests/model/test_load.py), but importing ``AutoTokenizer`` imports torch
    and transformers' model registry, 4.7 s against 0.9 s in a fresh process here, which every rollout
    actor and CLI command that only tokenizes paid at startup. Any other class goes through
    ``AutoTokenizer``."""
    p = _check_dir(path, need_weights=False)
    try:
        if _tokenizer_class(p) in GENERIC_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one clear error
        raise ModelLoadError(f"could not load the tokenizer in {str(p)!r}: {e}; {HINT}") from None


def load_model(path: str | Path, dtype: str = "float32") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local HF causal LM directory; the model is in eval mode on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; use one of {DTYPES}")
    p = _check_dir(path, need_weights=True)
    tok = load_tokenizer(p)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(p), local_files_only=True, dtype=getattr(torch, dtype)
        )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load the model in {str(p)!r}: {e}; {HINT}") from None
    model.eval()
    return model, tok


def load_chat_format(path: str | Path) -> ChatTemplate:
    """The ``ChatTemplate`` over the tokenizer in ``path``."""
    return ChatTemplate(load_tokenizer(path))


def checkpoint_parameters(path: str | Path) -> int | None:
    """Number of parameters stored in the ``*.safetensors`` files of the model directory ``path``, read
    from their headers only (no weights loaded; a tied embedding is stored, and counted, once). None when
    the directory has no safetensors file or a header cannot be read (e.g. ``*.bin`` checkpoints)."""
    import struct

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    try:
        for f in files:
            with f.open("rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                if size > 100_000_000:
                    return None
                header = json.loads(fh.read(size))
            for name, info in header.items():
                if name != "__metadata__":
                    count = 1
                    for dim in info["shape"]:
                        count *= int(dim)
                    total += count
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total
