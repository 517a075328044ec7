"""Model-level deltas: ``encode_delta(prev, cur) -> Delta``, ``decode_delta``, ``apply_delta_inplace``, and
the single-file format (``save_delta`` / ``load_delta``).

Invariants:
- A ``Delta`` names the version it applies to and the version it produces by their ``tensors_hash``
  (``base_hash``, ``target_hash``; each checked in its own scheme, ``tandem.weights.seam``, so deltas
  written with v1 hashes still apply) and holds one checksummed blob per tensor (``tandem.weights.codec``).
- ``prev`` and ``cur`` must hold the same tensor names, each with one dtype and shape on both sides; anything
  else is a ``ValueError`` naming the tensors.
- With ``verify=True`` (the default) applying refuses a base whose hash is not ``base_hash``
  (``WrongBaseError``, nothing is written), and checks the result against ``target_hash``
  (``CorruptDeltaError``). Every blob's crc32 is checked before any tensor is written, also with
  ``verify=False``.
- ``prepare_delta`` decodes against live tensors without writing them; ``PreparedDelta.apply`` then writes
  only the changed elements of sparse tensors (dense ones are copied whole), so an engine pauses only for
  that scatter. ``apply_delta_inplace`` is the two in sequence and reports, per tensor that changed, the
  flat indices written or None for "whole tensor".
- File format: ``MAGIC``, a little-endian uint32 header length, the zstd-compressed (checksummed) JSON
  header ``{base_hash, target_hash, meta, names, sizes}`` (every field's type is checked on load:
  ``CorruptDeltaError`` naming the field or tensor), then the blobs in ``names`` order. Files are written
  through ``tandem.weights.outpath.atomic_output`` (a temporary name renamed over a new path or a regular
  file, removed on failure), so a reader never sees a half-written delta.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from tandem.core.errors import TandemError
from tandem.weights.blob import MODE_NAMES, CorruptDeltaError, parse_header
from tandem.weights.codec import TensorEncoder, run_tasks
from tandem.weights.decode_kernels import scatter_bits
from tandem.weights.decoder import Patch, TensorDecoder, output_block
from tandem.weights.outpath import atomic_output
from tandem.weights.seam import short_hash, tensors_hash, tensors_hash_as

MAGIC = b"TNDDELT1"


class WrongBaseError(TandemError, ValueError):
    """A delta was applied to tensors that are not its base version."""


@dataclass
class Delta:
    base_hash: str
    target_hash: str
    blobs: dict[str, bytes]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs.values())


@dataclass(frozen=True)
class TensorStat:
    """What ``inspect`` shows for one tensor of a delta."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    mode: str
    changed: int
    nbytes: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def density(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    @property
    def bits_per_param(self) -> float:
        return 8 * self.nbytes / self.numel if self.numel else 0.0


def check_names(prev: dict[str, np.ndarray], cur: dict[str, np.ndarray], what: str = "new") -> None:
    missing, extra = sorted(set(prev) - set(cur)), sorted(set(cur) - set(prev))
    if missing or extra:
        raise ValueError(
            f"tensor sets differ: missing from {what}: {missing[:5]}{'...' if len(missing) > 5 else ''}; "
            f"only in {what}: {extra[:5]}{'...' if len(extra) > 5 else ''}; both sides need the same names"
        )


def _by_size(items: list[Any], size: Any) -> list[Any]:
    return sorted(items, key=size, reverse=True)


def encode_delta(
    prev: dict[str, np.ndarray],
    cur: dict[str, np.ndarray],
    threads: int = 1,
    base_hash: str | None = None,
    target_hash: str | None = None,
    meta: dict[str, Any] | None = None,
) -> Delta:
    """Encode every tensor of ``cur`` against ``prev`` on ``threads`` threads. Pass the versions' hashes when
    they are already known (the publisher has them) to skip hashing both models."""
    check_names(prev, cur)
    encoders = [TensorEncoder(name, prev[name], cur[name]) for name in sorted(cur)]
    big_first = _by_size(encoders, lambda e: e.n)
    run_tasks([t for e in big_first for t in e.scan_tasks()], threads)
    for e in encoders:
        e.plan()
    run_tasks([t for e in big_first for t in e.encode_tasks()], threads)
    return Delta(
        base_hash or tensors_hash(prev),
        target_hash or tensors_hash(cur),
        {e.name: e.blob() for e in encoders},
        dict(meta or {}),
    )


def _check_base(tensors: dict[str, np.ndarray], delta: Delta, verify: bool) -> None:
    check_names(tensors, delta.blobs, what="the delta")
    if verify:
        actual = tensors_hash_as(delta.base_hash, tensors)
        if actual != delta.base_hash:
            raise WrongBaseError(
                f"this delta applies to base {short_hash(delta.base_hash)}, but the given weights hash to "
                f"{short_hash(actual)}; apply it to the version it was made from"
            )


def _check_target(tensors: dict[str, np.ndarray], delta: Delta) -> None:
    actual = tensors_hash_as(delta.target_hash, tensors)
    if actual != delta.target_hash:
        raise CorruptDeltaError(
            f"decoded weights hash to {short_hash(actual)}, not the delta's target "
            f"{short_hash(delta.target_hash)}; refetch the delta or a full snapshot"
        )


def decode_delta(
    prev: dict[str, np.ndarray], delta: Delta, threads: int = 1, verify: bool = True
) -> dict[str, np.ndarray]:
    """New arrays for the target version, views of one ``output_block`` (``prev`` is not modified)."""
    _check_base(prev, delta, verify)
    outs = output_block({name: prev[name] for name in sorted(delta.blobs)})
    decoders = [TensorDecoder(name, prev[name], delta.blobs[name], out=outs[name]) for name in outs]
    run_tasks([t for d in _by_size(decoders, lambda d: d.header.numel) for t in d.tasks()], threads)
    out = {d.name: d.finish() for d in decoders}
    if verify:
        _check_target(out, delta)
    return out


@dataclass
class PreparedDelta:
    """A delta decoded against live tensors but not yet written: ``apply`` is the only (short) write step."""

    target_hash: str
    patches: dict[str, Patch]

    @property
    def changed_elements(self) -> int:
        return sum(p.indices.shape[0] if p.indices is not None else 0 for p in self.patches.values())

    def apply(self, tensors: dict[str, np.ndarray], threads: int = 1) -> dict[str, np.ndarray | None]:
        """Write every patch into ``tensors`` (the base it was prepared against). Returns, for each tensor
        that changed, the sorted flat indices written, or None when the whole tensor was rewritten."""
        changed = [p for p in self.patches.values() if p.changed]
        out: dict[str, np.ndarray | None] = {}

        def one(p: Patch) -> None:
            out[p.name] = p.apply(tensors[p.name])

        run_tasks([partial(one, p) for p in changed], threads)
        return out


def prepare_delta(
    tensors: dict[str, np.ndarray], delta: Delta, threads: int = 1, verify: bool = True
) -> PreparedDelta:
    """Decode ``delta`` against ``tensors`` without writing them (an engine keeps serving meanwhile). With
    ``verify`` the base hash is checked first (``WrongBaseError``)."""
    _check_base(tensors, delta, verify)
    for name, t in tensors.items():
        if not (t.flags.writeable and t.flags.c_contiguous):
            raise ValueError(f"tensor {name!r} must be writable and C-contiguous to be patched in place")
    decoders = [TensorDecoder(n, tensors[n], delta.blobs[n], prepare=True) for n in delta.blobs]
    run_tasks([t for d in _by_size(decoders, lambda d: d.header.numel) for t in d.tasks()], threads)
    return PreparedDelta(delta.target_hash, {d.name: d.patch() for d in decoders})


def apply_delta_inplace(
    tensors: dict[str, np.ndarray], delta: Delta, threads: int = 1, verify: bool = True
) -> dict[str, np.ndarray | None]:
    """Patch ``tensors`` (writable, C-contiguous) to the target version: ``prepare_delta`` then
    ``PreparedDelta.apply``, so nothing is written unless every blob decoded. Returns, for each tensor that
    changed, the sorted flat indices written, or None when the whole tensor was rewritten. If the target
    check fails afterwards the tensors are in an unknown state: reload a full snapshot."""
    changed = prepare_delta(tensors, delta, threads, verify).apply(tensors, threads)
    if verify:
        _check_target(tensors, delta)
    return changed


def warm_kernels() -> None:
    """Compile (or load from numba's cache, about 0.5 s) every kernel specialisation of the codec: encode,
    decode and in-place apply of sparse, medium and dense deltas of bf16 and fp32 tensors, and the scatter
    of host-share patches, so that the first real delta does not pay it. Idempotent; cheap once done
    (milliseconds)."""
    rng = np.random.default_rng(0)
    for dt in (np.uint16, np.float32):
        n = 1 << 14
        p = rng.integers(0, 1 << 12, n).astype(dt)
        for frac in (0.003, 0.05, 0.6):
            c = p.copy()
            idx = rng.choice(n, int(n * frac), replace=False)
            c[idx] = (c[idx].view(np.uint16 if dt == np.uint16 else np.uint32) + 1).view(dt)
            d = encode_delta({"w": p}, {"w": c})
            decode_delta({"w": p}, d)
            apply_delta_inplace({"w": p.copy()}, d)
            scatter_bits(p.copy(), np.sort(idx).astype(np.int64), c[np.sort(idx)])  # host-share patches


def delta_stats(delta: Delta) -> list[TensorStat]:
    out = []
    for name in sorted(delta.blobs):
        h = parse_header(delta.blobs[name], name)
        size = len(delta.blobs[name])
        out.append(TensorStat(name, h.dtype_tag, h.shape, MODE_NAMES[h.mode], h.changed, size))
    return out


# ============================================================================ file format
def dumps_delta(delta: Delta) -> bytes:
    names = sorted(delta.blobs)
    header = {
        "base_hash": delta.base_hash,
        "target_hash": delta.target_hash,
        "meta": delta.meta,
        "names": names,
        "sizes": [len(delta.blobs[n]) for n in names],
    }
    packed = zstandard.ZstdCompressor(level=19, write_checksum=True).compress(json.dumps(header).encode())
    return b"".join([MAGIC, len(packed).to_bytes(4, "little"), packed, *(delta.blobs[n] for n in names)])


def loads_delta(data: bytes | memoryview, source: str = "delta") -> Delta:
    data = memoryview(data)
    if len(data) < 12 or bytes(data[:8]) != MAGIC:
        raise CorruptDeltaError(f"{source} is not a tandem delta file (bad magic)")
    hlen = int.from_bytes(data[8:12], "little")
    try:
        header = json.loads(zstandard.ZstdDecompressor().decompress(data[12 : 12 + hlen]))
        if not isinstance(header, dict):
            raise TypeError(f"it is a JSON {type(header).__name__}, not an object")
        names, sizes = header["names"], header["sizes"]
        base, target, meta = header["base_hash"], header["target_hash"], header.get("meta", {})
    except (zstandard.ZstdError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptDeltaError(f"{source} has a corrupt header: {e}") from None
    _check_header(source, names, sizes, base, target, meta)
    if 12 + hlen + sum(sizes) != len(data):
        raise CorruptDeltaError(f"{source} is truncated or has trailing bytes; refetch it")
    blobs, pos = {}, 12 + hlen
    for name, size in zip(names, sizes, strict=True):
        blobs[name] = bytes(data[pos : pos + size])
        pos += size
    return Delta(base, target, blobs, meta)


def _check_header(source: str, names: Any, sizes: Any, base: Any, target: Any, meta: Any) -> None:
    """The header's fields have their types: names unique strings, sizes non-negative integers (one per
    name), hashes strings, meta an object; else ``CorruptDeltaError`` naming the field (and tensor)."""

    def bad(what: str) -> CorruptDeltaError:
        return CorruptDeltaError(f"{source} has a corrupt header: {what}; refetch it")

    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise bad("'names' is not a list of tensor names")
    if len(set(names)) != len(names):
        raise bad("'names' repeats a tensor")
    if not isinstance(sizes, list) or len(sizes) != len(names):
        raise bad(f"'sizes' is not a list of {len(names)} blob sizes")
    for name, size in zip(names, sizes, strict=True):
        if type(size) is not int or size < 0:
            raise bad(f"blob size of tensor {name!r} is {repr(size)[:40]}, not a non-negative integer")
    if not isinstance(base, str) or not isinstance(target, str):
        raise bad("'base_hash' and 'target_hash' must be strings")
    if not isinstance(meta, dict):
        raise bad("'meta' is not an object")


def save_delta(path: str | Path, delta: Delta) -> Path:
    """Write ``delta`` atomically (``tandem.weights.outpath.atomic_output``: a new path or a regular file)."""
    path = Path(path)
    with atomic_output(path) as f:
        f.write(dumps_delta(delta))
    return path


def load_delta(path: str | Path) -> Delta:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"delta file {str(path)!r} does not exist")
    return loads_delta(path.read_bytes(), source=f"delta file {str(path)!r}")
