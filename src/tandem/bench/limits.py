"""Bounds on `tandem bench` options, checked before a benchmark loads a model, starts Ray or writes a file.

Every check returns None when the value is usable, else one line naming the option, the value (long
integers abbreviated, so a 4000-digit typo cannot flood the terminal), the bound and what to do; ``require``
raises the first such line as ``BenchInputError`` (a ``TandemError`` and a ``ValueError``), which the CLI
prints as ``error: ...`` with exit status 2. Only the standard library (and ``tandem.core.errors``) is
imported here, so the checks run before torch, a model or Ray is touched.

The bounds, and why:
- counts: at least 1 (or the option's own floor);
- threads (``threads``): at most ``THREADS_PER_CPU`` x ``os.cpu_count()``. torch starts that many OpenMP
  threads (at 100000 thread creation fails and the process segfaults); beyond the cores a CPU benchmark only
  measures oversubscription, and 4 per core leaves room to measure a little of it on purpose;
- processes and concurrent jobs (``processes``: engine and relay processes, client processes, sandboxes at
  a time): at most ``PROCS_PER_CPU`` x ``os.cpu_count()``, for the same reason; each is a process of its own;
- timed rounds (``repeats``): at most ``MAX_REPEATS``; the best of a few rounds is what counts, so more than
  that is a typo that would run for days;
- seeds (``seed``): 0..2**63-1, the range every consumer takes (``torch.manual_seed`` takes -2**63..2**64-1,
  numpy's ``default_rng`` no negative seed, and a seed must fit a signed 64-bit integer wherever it is
  stored); a larger one made torch fail with "Overflow when unpacking long long", which named no option;
- learning rates (``learning_rate``): in (0, 1]: AdamW moves every weight by about lr per step, so past 1
  the versions are noise (and past float32's range, 3.4e38, torch's optimizer step raised an overflow);
- context (``fits_context``): the tokens a sequence needs at most the model's ``max_position_embeddings``
  (and the engine's ``max_seq_len``): past it the engine refuses the request in the middle of the run, or
  the model runs at positions it was never trained on;
- memory and disk (``fits_memory``, ``fits_disk``): a lower-bound estimate of the run's dominant allocation
  (KV caches, weight versions kept, workspace copies) against ``MemAvailable`` or the free bytes of the
  filesystem it writes to. An estimate that is a lower bound never refuses a run that would have fit.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from tandem.core.errors import TandemError

THREADS_PER_CPU = 4
PROCS_PER_CPU = 4
MAX_REPEATS = 1000
SEED_MAX = 2**63 - 1
MAX_LR = 1.0
GIB = 2**30


class BenchInputError(TandemError, ValueError):
    """A `tandem bench` option is out of range; the message names it, its value and what to do."""


def shown(value: object) -> str:
    """``value`` for a message: an integer of more than 24 digits as its first digits and its length."""
    text = str(value)
    if isinstance(value, int) and len(text.lstrip("-")) > 24:
        return f"{text[:12]}...({len(text.lstrip('-'))} digits)"
    return text


def gib(n: int) -> str:
    """``n`` bytes in GiB with one decimal (any size: a count too large for a float is abbreviated)."""
    return f"{n / GIB:.1f}" if n < 2**1000 else shown(n // GIB)


def require(*problems: str | None) -> None:
    """Raise ``BenchInputError`` with the first problem that is not None."""
    for p in problems:
        if p is not None:
            raise BenchInputError(p)


def cpus() -> int:
    return os.cpu_count() or 1


def at_least(flag: str, value: int, low: int = 1, why: str = "") -> str | None:
    why = f" ({why})" if why else ""
    return None if value >= low else f"{flag} must be >= {low}{why}, got {shown(value)}"


def in_range(flag: str, value: int, low: int, high: int, why: str) -> str | None:
    """``low <= value <= high``; ``why`` explains the upper bound and what to pass instead."""
    if low <= value <= high:
        return None
    return f"{flag} must be in {low}..{high} ({why}), got {shown(value)}"


def threads(value: int, flag: str = "--threads") -> str | None:
    n = cpus()
    why = f"at most {THREADS_PER_CPU} per CPU, this machine has {n}; pass about the number of cores"
    return in_range(flag, value, 1, THREADS_PER_CPU * n, why)


def processes(flag: str, value: int) -> str | None:
    n = cpus()
    why = f"each is a process of its own: at most {PROCS_PER_CPU} per CPU, this machine has {n}"
    return in_range(flag, value, 1, PROCS_PER_CPU * n, why)


def repeats(value: int, flag: str = "--repeats") -> str | None:
    return in_range(flag, value, 1, MAX_REPEATS, "the best of a few rounds counts; pass e.g. 3")


def seed(value: int, flag: str = "--seed") -> str | None:
    return in_range(flag, value, 0, SEED_MAX, "2**63-1, the range torch and numpy seeds share")


def learning_rate(flag: str, value: float | None) -> str | None:
    """None for an unset option; else ``0 < value <= MAX_LR``."""
    if value is None or 0 < value <= MAX_LR:
        return None
    why = "AdamW moves every weight by about lr per step, so above 1 the versions are noise; pass e.g. 1e-5"
    return f"{flag} must be a number in (0, {MAX_LR}] ({why}), got {value}"


def fits_context(flags: tuple[str, ...], needed: int, limit: int, holder: str, how: str = "") -> str | None:
    """``needed`` tokens per sequence (set by ``flags``; ``how``: the sum, for the message) fit the
    ``limit`` of ``holder``."""
    if needed <= limit:
        return None
    how = f" ({how})" if how else ""
    return (
        f"{' with '.join(flags)}: {shown(needed)} tokens of context per sequence{how}, more than {holder} "
        f"holds ({limit}); lower {' or '.join(flags)}"
    )


def mem_available() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def fits_memory(flags: tuple[str, ...], needed: int, what: str) -> str | None:
    """``needed`` bytes (at least: ``what``) fit the memory available now; None where it cannot be read."""
    free = mem_available()
    if free is None or needed <= free:
        return None
    return (
        f"{' with '.join(flags)}: at least {gib(needed)} GiB of memory ({what}), this machine has "
        f"{gib(free)} GiB available; lower {' or '.join(flags)}"
    )


def fits_disk(flag: str, directory: Path, needed: int, what: str) -> str | None:
    """``needed`` bytes (``what``) fit the free space of ``directory``'s filesystem."""
    free = shutil.disk_usage(directory).free
    if needed <= free:
        return None
    return (
        f"{flag} needs {shown(needed)} bytes ({gib(needed)} GiB: {what}) in {directory}, which has {free} "
        f"bytes ({gib(free)} GiB) free; lower {flag} or point TMPDIR at a filesystem with room"
    )


# ---- what a model needs -------------------------------------------------------------------------------


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """A model directory's config.json (the caller checked it exists)."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def context_of(config: dict[str, Any]) -> int:
    """The longest sequence a model config is built for (``max_position_embeddings``)."""
    return int(config.get("max_position_embeddings") or 0) or 2**31


def kv_bytes_per_token(config: dict[str, Any], elem_bytes: int = 4) -> int:
    """Keys and values of one token over every layer (fp32 by default: the benchmarks' engines)."""
    heads = int(config.get("num_attention_heads", 1))
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return 2 * int(config["num_hidden_layers"]) * kv * head_dim * elem_bytes


def dense_params(config: dict[str, Any], vocab: int) -> int:
    """Parameters of a dense Qwen3 config (attention, MLP, norms, embedding; the head only when untied)."""
    h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or h // heads)
    attention = 2 * h * heads * hd + 2 * h * kv * hd + 2 * hd  # q, o; k, v; q_norm, k_norm
    per_layer = attention + 3 * h * int(config["intermediate_size"]) + 2 * h  # MLP; the two norms
    head = 0 if config.get("tie_word_embeddings", True) else vocab * h
    return vocab * h + layers * per_layer + h + head


def _tensor_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file: its size less the 8-byte length and the JSON header."""
    with path.open("rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header


def params_on_disk(model_dir: str | Path) -> int:
    """Parameters of a model directory, from its safetensors data bytes and the config's dtype."""
    config = read_config(model_dir)
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    elem = 2 if dtype in ("bfloat16", "float16") else 4
    return sum(_tensor_bytes(f) for f in Path(model_dir).glob("*.safetensors")) // elem
