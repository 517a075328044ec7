"""The byte layout of one tensor's delta blob, and how a tensor's dtype maps onto the ordered-key model.

Layout (all integers are LEB128 varints unless sized)::

    0xD1 (format byte) | mode (1 byte) | dtype tag | ndim | dims... | changed elements | mode payload | crc32

``crc32`` (4 bytes, little endian; zlib's CRC-32, computed with zlib-ng's, about 14x faster here than
the system zlib's) covers every byte before it; ``parse_header`` verifies it first, so no decoder ever
runs on a corrupted blob. The dtype tag is one byte for the common dtypes (see ``DTYPE_CODES``) or 0
followed by the length-prefixed numpy ``dtype.str``. Modes: ``IDENT`` (no payload), ``SPARSE`` and
``DENSE`` (rANS-coded changes, see ``tandem.weights.kernels``), ``QUAD`` (element classes and escape
symbols as zstd frames, whose Huffman literal coder decodes faster than our rANS; see
``tandem.weights.kernels``), ``LIST`` (a few changes, each a varint gap and a varint ``z``: no tables to
build, for tensors such as norms whose version changes a handful of elements), ``RAW`` (the new tensor's
bytes), ``XOR_ZSTD`` (zstd of ``prev XOR cur`` bytes: the fallback for dtypes without an ordered-key
model). Mode number 5 was the quad mode with rANS
streams, written before 2026-12-01: ``parse_header`` refuses it by name (a store reader then falls back to a
full snapshot).

Ordered-key dtypes: float32 (width 32), float16 and bfloat16 (width 16). ``uint16`` is read as bfloat16 bit
patterns, because that is how the trainer publishes bfloat16 (numpy has no bfloat16); the mapping is a
bijection on 16-bit patterns, so a genuine uint16 tensor still round-trips bit-exactly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from zlib_ng.zlib_ng import crc32

from tandem.core.errors import TandemError
from tandem.weights.tables import read_varint, write_varint

FORMAT = 0xD1
IDENT, SPARSE, DENSE, RAW, XOR_ZSTD = range(5)
RETIRED_RANS_QUAD = 5  # the quad mode with rANS streams (before 2026-12-01): no longer decoded
QUAD = 6
LIST = 7
MODE_NAMES = {
    IDENT: "ident", SPARSE: "sparse", DENSE: "dense", RAW: "raw", XOR_ZSTD: "xor_zstd", QUAD: "quad",
    LIST: "list",
}  # fmt: skip
DTYPE_CODES = {"float32": 1, "float16": 2, "uint16": 3, "bfloat16": 4}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class CorruptDeltaError(TandemError, ValueError):
    """A delta (file or tensor blob) failed its checksum or is inconsistent with its base."""


@dataclass(frozen=True)
class KeySpec:
    """How a tensor maps onto ordered keys: its unsigned bit-pattern dtype, sign bit and width mask."""

    bits_dtype: np.dtype
    sign: int
    mask: int
    lanes: int  # elements per uint64 word


@dataclass(frozen=True)
class BlobHeader:
    mode: int
    dtype_tag: str
    shape: tuple[int, ...]
    changed: int
    payload_start: int  # offset of the mode payload
    payload_end: int  # offset of the crc32 trailer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@functools.cache
def dtype_tag(dtype: np.dtype) -> str:
    return dtype.name if dtype.name in DTYPE_CODES else dtype.str


@functools.cache
def key_spec(dtype: np.dtype) -> KeySpec | None:
    """The ordered-key model for this dtype, or None when it takes the XOR+zstd fallback (cached: dtypes
    are hashable and few)."""
    if not dtype.isnative:
        return None
    if dtype == np.float32:
        return KeySpec(np.dtype(np.uint32), 1 << 31, (1 << 32) - 1, 2)
    if dtype in (np.float16, np.uint16) or dtype.name == "bfloat16":
        return KeySpec(np.dtype(np.uint16), 1 << 15, (1 << 16) - 1, 4)
    return None


def write_header(out: bytearray, mode: int, dtype: np.dtype, shape: tuple[int, ...], changed: int) -> None:
    out.append(FORMAT)
    out.append(mode)
    tag = dtype_tag(dtype)
    code = DTYPE_CODES.get(tag, 0)
    out.append(code)
    if code == 0:
        raw = tag.encode()
        write_varint(out, len(raw))
        out += raw
    write_varint(out, len(shape))
    for d in shape:
        write_varint(out, int(d))
    write_varint(out, changed)


def seal(out: bytearray) -> bytes:
    out += crc32(out).to_bytes(4, "little")
    return bytes(out)


def parse_header(blob: bytes | memoryview, name: str = "tensor") -> BlobHeader:
    """Verify the checksum and read the header; raises ``CorruptDeltaError`` naming the tensor."""
    if len(blob) < 8:
        raise CorruptDeltaError(f"delta blob of {name!r} is truncated ({len(blob)} bytes)")
    end = len(blob) - 4
    stored = int.from_bytes(blob[end:], "little")
    actual = crc32(memoryview(blob)[:end])  # no copy of the payload
    if stored != actual:
        raise CorruptDeltaError(
            f"delta blob of {name!r} is corrupt: crc32 {actual:08x} != stored {stored:08x}; refetch it"
        )
    if blob[0] == FORMAT and blob[1] == RETIRED_RANS_QUAD:
        raise CorruptDeltaError(
            f"delta blob of {name!r} is in the rANS quad mode of tandem before 2026-12-01, which this "
            f"version no longer decodes; fetch a full snapshot (or republish the version)"
        )
    if blob[0] != FORMAT or blob[1] not in MODE_NAMES:
        raise CorruptDeltaError(f"delta blob of {name!r} has unknown format {blob[0]:#x} / mode {blob[1]}")
    mode, code, pos = blob[1], blob[2], 3
    try:
        if code == 0:
            n, pos = read_varint(blob, pos)
            tag = bytes(blob[pos : pos + n]).decode()
            pos += n
        else:
            tag = CODE_DTYPES[code]
        ndim, pos = _varint(blob, pos, end)
        shape = []
        for _ in range(ndim):
            d, pos = _varint(blob, pos, end)
            shape.append(d)
        changed, pos = _varint(blob, pos, end)
    except (KeyError, UnicodeDecodeError, ValueError) as e:
        raise CorruptDeltaError(f"delta blob of {name!r} has a corrupt header: {e}") from None
    if code == 0 and not _known_numpy_tag(tag):
        raise CorruptDeltaError(
            f"delta blob of {name!r} has an unknown dtype tag {tag[:40]!r} (not a numpy dtype string); "
            f"refetch it"
        )
    if pos > end:
        raise CorruptDeltaError(f"delta blob of {name!r} has a corrupt header (runs past the end)")
    return BlobHeader(mode, tag, tuple(shape), changed, pos, end)


def _varint(blob: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    """``read_varint`` with a fast path for the one- and two-byte values header fields are."""
    if pos + 1 < end:
        b0, b1 = blob[pos], blob[pos + 1]
        if b0 < 0x80:
            return b0, pos + 1
        if b1 < 0x80:
            return (b0 & 0x7F) | (b1 << 7), pos + 2
    return read_varint(blob, pos)


@functools.lru_cache(maxsize=256)
def _known_numpy_tag(tag: str) -> bool:
    """``tag`` is what ``dtype_tag`` writes for some plain numpy dtype (its ``dtype.str``, no objects)."""
    try:
        dt = np.dtype(tag)
    except (TypeError, ValueError, SyntaxError):
        return False
    return dt.str == tag and not dt.hasobject and dt.itemsize > 0


def check_match(name: str, header: BlobHeader, prev: np.ndarray) -> None:
    """Refuse a base tensor whose dtype or shape is not the one the blob was encoded against."""
    tag = dtype_tag(prev.dtype)
    if tag != header.dtype_tag or tuple(prev.shape) != header.shape:
        raise ValueError(
            f"tensor {name!r}: the delta expects dtype {header.dtype_tag} shape {list(header.shape)}, "
            f"but the base tensor is dtype {tag} shape {list(prev.shape)}; apply it to the version it was "
            f"made from"
        )
