"""Read and write safetensors files and model directories as numpy arrays, bfloat16 included.

numpy has no bfloat16, so BF16 tensors are read as ``uint16`` bit patterns (the trainer's publishing
convention) and the file's dtype tag is kept next to them, so writing back reproduces the same file layout
and tags. This reader does not need torch.

Invariants: the header is validated structurally before any tensor is read: a JSON object (no NaN, no
duplicate keys) whose ``__metadata__`` is an object of strings and whose every tensor entry has a known
``dtype``, a ``shape`` of non-negative integers and ``data_offsets`` ``[begin, end]`` inside the data, holding
exactly dtype size x numel bytes, with no two tensors' bytes overlapping; anything else is a
``SafetensorsError`` (a ``ValueError``) naming the file and tensor. Arrays are aligned views of one buffer
per file. ``save_weights`` writes each file through ``tandem.weights.outpath.atomic_output`` (a temporary
name renamed over the target, which must be new or a regular file), so readers never see half a file, and
writes a model directory only into a new or empty one. A model directory holds ``*.safetensors`` files (one
``model.safetensors`` or several shards); its other files (config, tokenizer) are copied unchanged by
``save_weights``.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tandem.core.errors import TandemError
from tandem.weights.outpath import atomic_output, check_output_dir
from tandem.weights.seam import byte_view

ST_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
    "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?", "F8_E4M3": "u1",
    "F8_E5M2": "u1",
}  # fmt: skip
NP_TAGS = {"<f8": "F64", "<f4": "F32", "<f2": "F16", "<i8": "I64", "<i4": "I32", "<i2": "I16", "|i1": "I8",
           "<u8": "U64", "<u4": "U32", "<u2": "U16", "|u1": "U8", "|b1": "BOOL"}  # fmt: skip


@dataclass
class WeightSet:
    """Tensors of a safetensors file or model directory, with what is needed to write them back alike."""

    path: Path
    tensors: dict[str, np.ndarray]
    tags: dict[str, str]  # safetensors dtype tag per tensor (BF16 for uint16 bfloat16 bit patterns)
    files: dict[str, list[str]] = field(default_factory=dict)  # file name -> tensor names, in file order
    metadata: dict[str, dict[str, str] | None] = field(default_factory=dict)

    @property
    def is_dir(self) -> bool:
        return self.path.is_dir()


class SafetensorsError(TandemError, ValueError):
    """A safetensors file is malformed; the message names the file and, where one is at fault, the tensor."""


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {_short(key)} appears twice")
        out[key] = value
    return out


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not a JSON value")


def _parse_header(path: Path, raw: bytes) -> tuple[dict[str, object], dict[str, str] | None]:
    """The header's tensor entries (unvalidated) and its metadata; a header that is not a JSON object of
    objects, or whose metadata is not an object of strings, is a ``SafetensorsError``."""
    try:
        header = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        what = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise SafetensorsError(f"{str(path)!r} is not a safetensors file (bad header: {what})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(
            f"{str(path)!r} is not a safetensors file (its header is a JSON {type(header).__name__}, "
            f"not an object of tensors)"
        )
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise SafetensorsError(
            f"{str(path)!r}: __metadata__ is {_short(meta)}; it must be an object of string values"
        )
    return header, meta


def _is_count(x: object) -> bool:
    return type(x) is int and x >= 0  # not bool, not float


@dataclass(frozen=True)
class _Entry:
    name: str
    tag: str
    shape: tuple[int, ...]
    start: int
    end: int


def _entry(path: Path, name: str, info: object, data_len: int) -> _Entry:
    """One tensor's header entry, checked: an object with a known ``dtype``, a ``shape`` of non-negative
    integers and ``data_offsets`` ``[begin, end]`` inside the data whose length is dtype size x numel."""
    where = f"{str(path)!r}: tensor {_short(name)}"
    if not isinstance(info, dict):
        raise SafetensorsError(
            f"{where} has a malformed entry {_short(info)}; expected an object with dtype, shape and "
            f"data_offsets"
        )
    tag, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(tag, str) or tag not in ST_DTYPES:
        raise SafetensorsError(f"{where} has unsupported dtype {_short(tag)}; known: {', '.join(ST_DTYPES)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise SafetensorsError(
            f"{where} has shape {_short(shape)}; a shape is a list of non-negative integers"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(x) for x in offsets)):
        raise SafetensorsError(
            f"{where} has data_offsets {_short(offsets)}; expected [begin, end], two non-negative integers"
        )
    a, b = offsets
    nbytes = math.prod(shape) * np.dtype(ST_DTYPES[tag]).itemsize
    if not a <= b <= data_len or b - a != nbytes:
        raise SafetensorsError(
            f"{where} has a bad byte range [{_short(a, 24)}, {_short(b, 24)}) for {tag} {_short(shape)}: it "
            f"must lie in the {data_len} data bytes and hold {_short(nbytes, 24)} bytes"
        )
    return _Entry(name, tag, tuple(shape), a, b)


def _read_file(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str], list[str], dict[str, str] | None]:
    buf = np.fromfile(path, dtype=np.uint8)
    if buf.shape[0] < 8:
        raise SafetensorsError(f"{str(path)!r} is not a safetensors file (only {buf.shape[0]} bytes)")
    n = int(buf[:8].view("<u8")[0])
    if n > buf.shape[0] - 8 or n > MAX_HEADER_BYTES:
        raise SafetensorsError(
            f"{str(path)!r} is not a safetensors file (header length {n} exceeds the file or "
            f"{MAX_HEADER_BYTES} bytes)"
        )
    header, meta = _parse_header(path, buf[8 : 8 + n].tobytes())
    data = buf[8 + n :]
    entries = sorted(
        (_entry(path, k, v, data.shape[0]) for k, v in header.items()), key=lambda e: (e.start, e.end)
    )
    filled = [e for e in entries if e.end > e.start]  # empty tensors own no bytes
    for prev, cur in zip(filled, filled[1:], strict=False):
        if cur.start < prev.end:
            raise SafetensorsError(
                f"{str(path)!r}: tensors {_short(prev.name)} [{prev.start}, {prev.end}) and "
                f"{_short(cur.name)} [{cur.start}, {cur.end}) overlap; each tensor needs its own bytes"
            )
    tensors, tags = {}, {}
    for e in entries:
        tensors[e.name], tags[e.name] = _tensor(path, e, data), e.tag
    return tensors, tags, list(tensors), meta


def _tensor(path: Path, e: _Entry, data: np.ndarray) -> np.ndarray:
    dtype = np.dtype(ST_DTYPES[e.tag])
    raw = data[e.start : e.end]
    if raw.ctypes.data % dtype.itemsize:
        raw = raw.copy()
    try:
        return raw.view(dtype).reshape(e.shape)
    except ValueError as err:  # e.g. more dimensions than numpy supports
        raise SafetensorsError(f"{str(path)!r}: tensor {_short(e.name)} cannot be read: {err}") from None


def load_weights(path: str | Path) -> WeightSet:
    """A ``.safetensors`` file, or a directory holding ``*.safetensors`` files (a HF model directory)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"directory {str(p)!r} has no *.safetensors file; pass a model directory")
    elif p.is_file():
        files = [p]
    else:
        raise FileNotFoundError(f"{str(p)!r} does not exist; pass a .safetensors file or a model directory")
    ws = WeightSet(p, {}, {})
    for f in files:
        tensors, tags, order, meta = _read_file(f)
        dup = sorted(set(tensors) & set(ws.tensors))
        if dup:
            raise SafetensorsError(f"{str(f)!r} repeats tensors of another shard: {dup[:5]}")
        ws.tensors.update(tensors)
        ws.tags.update(tags)
        ws.files[f.name] = order
        ws.metadata[f.name] = meta
    return ws


def tag_for(arr: np.ndarray, like: str | None = None) -> str:
    """The safetensors tag to write ``arr`` with: ``like`` (the source file's tag) when it fits the array."""
    if like is not None and np.dtype(ST_DTYPES.get(like, "V")) == arr.dtype:
        return like
    if arr.dtype.str not in NP_TAGS:
        raise ValueError(f"dtype {arr.dtype} cannot be written to safetensors")
    return NP_TAGS[arr.dtype.str]


def write_safetensors(
    path: str | Path, tensors: dict[str, np.ndarray], tags: dict[str, str] | None = None,
    metadata: dict[str, str] | None = None, order: list[str] | None = None,
) -> Path:  # fmt: skip
    """Write one safetensors file atomically; ``tags`` keeps e.g. BF16 for uint16 arrays."""
    path, tags = Path(path), tags or {}
    header: dict[str, object] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    names = order or sorted(tensors)
    for name in names:
        arr = tensors[name]
        header[name] = {"dtype": tag_for(arr, tags.get(name)), "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}  # fmt: skip
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with atomic_output(path) as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            f.write(byte_view(tensors[name]))
    return path


def save_weights(out: str | Path, like: WeightSet, tensors: dict[str, np.ndarray]) -> Path:
    """Write ``tensors`` in ``like``'s layout: one file, or a directory with the same shards and files.

    A directory output must be new or empty (``OutputPathError`` before anything is written); if writing it
    fails, the files written so far are removed again (and the directory, if this call made it)."""
    out = Path(out)
    if not like.is_dir:
        name = next(iter(like.files))
        return write_safetensors(out, tensors, like.tags, like.metadata.get(name), like.files[name])
    check_output_dir(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        for src in like.path.iterdir():
            if src.is_file() and src.suffix != ".safetensors":
                written.append(out / src.name)
                shutil.copy2(src, out / src.name)
        for fname, names in like.files.items():
            shard = {n: tensors[n] for n in names}
            written.append(out / fname)
            write_safetensors(out / fname, shard, like.tags, like.metadata.get(fname), names)
    except BaseException:
        for p in written:
            with contextlib.suppress(OSError):
                p.unlink()
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    return out


def dtype_mismatch(a: dict[str, str], b: dict[str, str], what_a: str, what_b: str) -> str | None:
    """None if every tensor in both maps has the same safetensors dtype tag, else a message naming the first
    tensor that differs and both tags (e.g. BF16 and U16, which numpy reads alike)."""
    bad = [n for n in sorted(a.keys() & b.keys()) if a[n] != b[n]]
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    return f"tensor {bad[0]!r} is {a[bad[0]]} in {what_a} but {b[bad[0]]} in {what_b}{more}"
