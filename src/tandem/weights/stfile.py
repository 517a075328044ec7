"""Read and write safetensors files and model directories as numpy arrays, bfloat16 included.

numpy has no bfloat16, so BF16 tensors are read as ``uint16`` bit patterns (the trainer's publishing
convention) and the file's dtype tag is kept next to them, so writing back reproduces the same file layout
and tags. This reader does not need torch.

Invariants: every tensor's byte range is checked against its dtype and shape and must lie inside the file
(``ValueError`` naming the file and tensor otherwise); arrays are aligned views of one buffer per file;
``save_weights`` writes each file to a temporary name and renames it, so readers never see half a file. A
model directory holds ``*.safetensors`` files (one ``model.safetensors`` or several shards); its other files
(config, tokenizer) are copied unchanged by ``save_weights``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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


def _read_file(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str], list[str], dict[str, str] | None]:
    buf = np.fromfile(path, dtype=np.uint8)
    if buf.shape[0] < 8:
        raise ValueError(f"{str(path)!r} is not a safetensors file (only {buf.shape[0]} bytes)")
    n = int(buf[:8].view("<u8")[0])
    if n > buf.shape[0] - 8:
        raise ValueError(f"{str(path)!r} is not a safetensors file (header length {n} exceeds the file)")
    try:
        header = json.loads(buf[8 : 8 + n].tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not a safetensors file (bad header: {e})") from None
    meta = header.pop("__metadata__", None)
    data = buf[8 + n :]
    tensors, tags = {}, {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]):
        tensors[name], tags[name] = _tensor(path, name, info, data)
    return tensors, tags, list(tensors), meta


def _tensor(path: Path, name: str, info: dict, data: np.ndarray) -> tuple[np.ndarray, str]:
    tag = info.get("dtype")
    if tag not in ST_DTYPES:
        raise ValueError(f"{str(path)!r}: tensor {name!r} has unsupported dtype {tag!r}")
    dtype = np.dtype(ST_DTYPES[tag])
    shape = tuple(int(d) for d in info.get("shape", []))
    a, b = (int(x) for x in info.get("data_offsets", [0, -1]))
    if not 0 <= a <= b <= data.shape[0] or b - a != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise ValueError(f"{str(path)!r}: tensor {name!r} has a bad byte range [{a}, {b}) for {tag} {shape}")
    raw = data[a:b]
    if raw.ctypes.data % dtype.itemsize:
        raw = raw.copy()
    return raw.view(dtype).reshape(shape), tag


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
            raise ValueError(f"{str(f)!r} repeats tensors of another shard: {dup[:5]}")
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
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            f.write(memoryview(np.ascontiguousarray(tensors[name])).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def save_weights(out: str | Path, like: WeightSet, tensors: dict[str, np.ndarray]) -> Path:
    """Write ``tensors`` in ``like``'s layout: one file, or a directory with the same shards and files."""
    out = Path(out)
    if not like.is_dir:
        name = next(iter(like.files))
        return write_safetensors(out, tensors, like.tags, like.metadata.get(name), like.files[name])
    out.mkdir(parents=True, exist_ok=True)
    for src in like.path.iterdir():
        if src.is_file() and src.suffix != ".safetensors":
            shutil.copy2(src, out / src.name)
    for fname, names in like.files.items():
        shard = {n: tensors[n] for n in names}
        write_safetensors(out / fname, shard, like.tags, like.metadata.get(fname), names)
    return out
