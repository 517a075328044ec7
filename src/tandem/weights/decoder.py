"""Lossless delta codec, decoder side: ``decode_tensor(prev, blob)`` and the two-phase in-place patch.

Invariants:
- A blob is checksummed (crc32) and checked against its base's dtype and shape before anything is decoded
  (``CorruptDeltaError`` / ``ValueError`` naming the tensor), and every chunk's streams must end exactly
  where the encoder left them; a chunk that fails writes nothing.
- ``TensorDecoder`` never writes to ``prev``. With ``prepare=False`` it produces a new array; with
  ``prepare=True`` it produces a ``Patch``: for sparse and list tensors the flat indices and new bit
  patterns of the changed elements, for the others the whole new tensor (a view of ``out`` when given).
  ``Patch.apply`` is the only step that writes into live weights, so an engine decodes while serving and
  pauses only for the scatter.
- Work is split into the encoder's chunks; kernels release the GIL, so ``tasks()`` run in parallel.
- ``changed_positions(blob)`` needs no base: which elements a delta changes is coded apart from their base
  values (gaps in the sparse and list modes, per-element classes or symbols in the quad and dense modes,
  where "unchanged" is its own class).
- A quad chunk's zstd frames decode to exactly the bytes the chunk needs or the chunk fails
  (``tandem.weights.zframes``); nothing is allocated by what a frame claims.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial

import numpy as np
import zstandard
from numba import njit

from tandem.weights import decode_kernels as D
from tandem.weights import kernels as K
from tandem.weights import zframes
from tandem.weights.blob import (
    DENSE,
    IDENT,
    LIST,
    QUAD,
    RAW,
    SPARSE,
    CorruptDeltaError,
    check_match,
    key_spec,
    parse_header,
)
from tandem.weights.codec import QUAD_DIRECTORY, Task, chunk_ranges, run_tasks
from tandem.weights.entropy import NJIT, golomb_params
from tandem.weights.tables import Table, get_varint, parse_table, read_varint


@dataclass
class _ChunkStream:
    start: int
    stop: int
    count: int
    rwords: np.ndarray  # one row per rANS stream, zero-padded
    rlens: np.ndarray
    bwords: np.ndarray
    nbits: int


@dataclass
class Patch:
    """What turns one live tensor into its next version: either the sorted flat ``indices`` and their new
    ``values`` (bit patterns of the tensor's key width), or a ``whole`` new tensor, or nothing (unchanged)."""

    name: str
    shape: tuple[int, ...]
    indices: np.ndarray | None = None
    values: np.ndarray | None = None
    whole: np.ndarray | None = None

    @property
    def changed(self) -> bool:
        return self.whole is not None or (self.indices is not None and self.indices.shape[0] > 0)

    def apply(self, tensor: np.ndarray) -> np.ndarray | None:
        """Write into ``tensor`` (writable, C-contiguous, the base this patch was decoded against). Returns
        the flat indices written, or None when the whole tensor was replaced."""
        if not (tensor.flags.writeable and tensor.flags.c_contiguous) or tensor.shape != self.shape:
            raise ValueError(
                f"tensor {self.name!r} must be writable, C-contiguous and of shape {list(self.shape)} to be "
                f"patched, got shape {list(tensor.shape)}"
            )
        if self.whole is not None:
            np.copyto(tensor, self.whole)
            return None
        if self.indices is not None and self.indices.shape[0]:
            flat = tensor.reshape(-1).view(self.values.dtype)
            D.scatter(flat, self.indices, self.values)
        return self.indices


class TensorDecoder:
    """Parse (and checksum) a blob against its base, then run ``tasks()`` and call ``finish()``."""

    def __init__(
        self, name: str, prev: np.ndarray, blob: bytes, prepare: bool = False, positions_only: bool = False,
        out: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """``out``: where the new tensor goes when one is made (an array like ``prev``, e.g. a view of
        ``output_block``); a new array when None."""
        self.name = name
        self.header = h = parse_header(blob, name)
        if not positions_only:  # else ``prev`` only names the key width (``changed_positions``)
            check_match(name, h, prev)
        self.blob = memoryview(blob)
        self.prev = prev if prev.flags.c_contiguous else np.ascontiguousarray(prev)
        self.prepare = prepare
        self.spec = key_spec(prev.dtype)
        self.sparse = h.mode == SPARSE
        makes_tensor = not positions_only and not (prepare and h.mode in (SPARSE, LIST, IDENT))
        self.out = (np.empty_like(self.prev) if out is None else out) if makes_tensor else None
        self.status: list[int] = []
        self.streams: list[_ChunkStream] = []
        self.quad_frames: list[tuple[memoryview, memoryview]] = []  # per quad chunk: quads', escapes' frame
        self._idx = self._vals = _NO_Z  # a sparse patch's flat positions and new values (see ``tasks``)
        if h.mode in (SPARSE, DENSE, QUAD, LIST) and self.spec is None:
            raise CorruptDeltaError(f"delta blob of {name!r}: mode {h.mode} is invalid for {prev.dtype}")
        if h.mode in (SPARSE, DENSE, QUAD):
            self._parse_streams()
        elif h.mode == LIST and (2 * h.changed > h.payload_end - h.payload_start or h.changed > h.numel):
            raise CorruptDeltaError(f"delta blob of {name!r} lists more changes than it holds")

    # -------------------------------------------------------------- parsing
    def _parse_streams(self) -> None:
        h = self.header
        buf, pos = np.frombuffer(self.blob, np.uint8), h.payload_start
        try:
            if self.sparse:
                self.gap_mode = buf[pos]
                pos += 1
                self.gap_table = _UNIFORM_GAPS
                self.golomb_m = 1
                if self.gap_mode == K.GAP_TABLE:
                    self.gap_table, pos = parse_table(buf, pos)
                else:
                    self.golomb_m, pos = read_varint(self.blob, pos)
                    if not 1 <= self.golomb_m <= max(1, h.numel):  # a gap is never longer than the tensor
                        raise ValueError(f"Golomb parameter {self.golomb_m} for {h.numel} elements")
            if h.mode != QUAD:  # the quad mode's streams are zstd frames, which carry their own tables
                self.table, pos = parse_table(buf, pos)
            log2 = self.blob[pos]
            if log2 > MAX_CHUNK_LOG2:
                raise ValueError(f"chunk of 2**{log2} elements")
            chunk = 1 << log2
            pos += 1
        except (ValueError, IndexError) as e:
            raise CorruptDeltaError(f"delta blob of {self.name!r} is inconsistent: {e}") from None
        end = h.payload_end
        if h.mode == QUAD:
            self._parse_quad_chunks(buf, pos, chunk)
            return
        rows = 2 if self.sparse else K.LANES
        for a in range(0, h.numel, chunk):
            b = min(a + chunk, h.numel)
            count, pos, rwords, rlens, bwords, nbits = _read_chunk(buf, pos, end, rows, self.sparse, b - a)
            if pos < 0:
                raise CorruptDeltaError(f"delta blob of {self.name!r}: a chunk runs past its end")
            self.streams.append(_ChunkStream(a, b, count, rwords, rlens, bwords, nbits))
        counts_ok = not self.sparse or sum(s.count for s in self.streams) == h.changed
        if pos != h.payload_end or not counts_ok:
            raise CorruptDeltaError(f"delta blob of {self.name!r} is inconsistent: payload size or counts")

    def _parse_quad_chunks(self, buf: np.ndarray, pos: int, chunk: int) -> None:
        """The quad chunks' directories (layout in ``tandem.weights.kernels``): each chunk's escape count,
        its two frames and its raw bits, checked to lie inside the payload."""
        h, end, blob = self.header, self.header.payload_end, self.blob
        for a in range(0, h.numel, chunk):
            b = min(a + chunk, h.numel)
            if pos + QUAD_DIRECTORY.size > end:
                raise CorruptDeltaError(f"delta blob of {self.name!r}: a chunk runs past its end")
            escapes, qlen, elen, nbits = QUAD_DIRECTORY.unpack_from(blob, pos)
            pos += QUAD_DIRECTORY.size
            nbytes = (nbits + 7) // 8
            if escapes > b - a or pos + qlen + elen + nbytes > end:
                raise CorruptDeltaError(f"delta blob of {self.name!r}: a chunk runs past its end")
            at = pos + qlen + elen
            if nbytes:
                bwords = np.zeros(nbytes // 8 + 3, np.uint64)
                bwords.view(np.uint8)[:nbytes] = buf[at : at + nbytes]
            else:
                bwords = _NO_RAW_BITS  # read-only zeros: nothing writes a chunk's bit words
            self.quad_frames.append((blob[pos : pos + qlen], blob[pos + qlen : at]))
            self.streams.append(_ChunkStream(a, b, escapes, _NO_WORDS, _NO_LENS, bwords, nbits))
            pos = at + nbytes
        if pos != end:
            raise CorruptDeltaError(f"delta blob of {self.name!r} is inconsistent: payload size or counts")

    # -------------------------------------------------------------- decoding
    def tasks(self) -> list[Task]:
        mode = self.header.mode
        self.status = [1] * len(self.streams)
        if mode == SPARSE:
            if self.out is None:  # the patch: every chunk decodes into its slice of the tensor's arrays
                self._idx = np.empty(self.header.changed, np.int64)
                self._vals = np.empty(self.header.changed, self.spec.bits_dtype)
                self._first = np.cumsum([0] + [s.count for s in self.streams])
            return [partial(self._sparse, k) for k in range(len(self.streams))]
        if mode == LIST:
            self.status = [1]
            return [self._list]
        if mode == DENSE:
            return [partial(self._dense, k) for k in range(len(self.streams))]
        if mode == QUAD:
            return [partial(self._quad, k) for k in range(len(self.streams))]
        if mode == IDENT:
            if self.out is None:
                return []
            flat_p, flat_o = self.prev.reshape(-1), self.out.reshape(-1)
            return [partial(np.copyto, flat_o[a:b], flat_p[a:b]) for a, b in chunk_ranges(self.header.numel)]
        return [self._whole]

    def _sparse(self, k: int) -> None:
        s, t, g, spec = self.streams[k], self.table, self.gap_table, self.spec
        p = self.prev.reshape(-1).view(spec.bits_dtype)[s.start : s.stop]
        b, u = golomb_params(self.golomb_m)
        if self.out is None:  # the patch's positions and new values, straight into this chunk's slices
            lo, hi = self._first[k], self._first[k + 1]
            idx, z, vals = self._idx[lo:hi], _NO_Z, self._vals[lo:hi]
        else:
            idx, z, vals = np.empty(s.count, np.int64), np.empty(s.count, np.int64), _no_values(spec)
        self.status[k] = D.decode_sparse_chunk(
            s.stop - s.start, s.count, self.gap_mode, g.lut, g.freq, g.cum, t.lut, t.freq, t.cum,
            self.golomb_m, b, u, s.rwords, s.rlens, s.bwords, s.nbits, idx, z, p, spec.sign, spec.mask,
            s.start, vals,
        )  # fmt: skip
        if self.status[k] != 0 or self.out is None:
            return  # a bad stream never touches the output (and a patch with a bad chunk is never made)
        o = self.out.reshape(-1).view(spec.bits_dtype)[s.start : s.stop]
        np.copyto(o, p)
        D.patch_chunk(p, o, idx, z, spec.sign, spec.mask)

    def _list(self) -> None:
        spec = self.spec
        p = self.prev.reshape(-1).view(spec.bits_dtype)
        idx, vals = self._list_changes(p)
        if self.status[0] != 0 or self.out is None:
            return  # a bad list writes nothing; a patch keeps the positions and values
        o = self.out.reshape(-1).view(spec.bits_dtype)
        np.copyto(o, p)
        D.scatter(o, idx, vals)

    def _list_changes(self, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The list's flat positions and (unless ``p`` is empty) new values; sets ``status[0]``."""
        h, spec = self.header, self.spec
        payload = np.frombuffer(self.blob[h.payload_start : h.payload_end], np.uint8)
        idx = np.empty(h.changed, np.int64)
        vals = np.empty(h.changed if p.shape[0] else 0, spec.bits_dtype)
        self.status = [D.decode_list(payload, h.changed, h.numel, p, idx, vals, spec.sign, spec.mask)]
        self._idx, self._vals = idx, vals
        return idx, vals

    def _dense(self, k: int) -> None:
        s, t, spec = self.streams[k], self.table, self.spec
        p = self.prev.reshape(-1).view(spec.bits_dtype)[s.start : s.stop]
        o = self.out.reshape(-1).view(spec.bits_dtype)[s.start : s.stop]
        self.status[k] = D.decode_dense_chunk(
            p, o, t.lut, t.fc, s.rwords, s.rlens, s.bwords, s.nbits, spec.sign, spec.mask, K.DKEY
        )

    def _quad(self, k: int) -> None:
        s, spec = self.streams[k], self.spec
        try:
            quads, esyms = self._quad_symbols(k)
        except ValueError:
            self.status[k] = -1
            return
        p = self.prev.reshape(-1).view(spec.bits_dtype)[s.start : s.stop]
        o = self.out.reshape(-1).view(spec.bits_dtype)[s.start : s.stop]
        self.status[k] = D.patch_quads(p, o, quads, esyms, s.bwords, s.nbits, spec.sign, spec.mask)

    def _quad_symbols(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``k``'s quads and escape symbols, from its frames (``ValueError`` if they do not decode to
        exactly one quad per four elements and one symbol per escape)."""
        s, (qframe, eframe) = self.streams[k], self.quad_frames[k]
        return zframes.unpack(qframe, (s.stop - s.start + 3) // 4), zframes.unpack(eframe, s.count)

    def _whole(self) -> None:
        h, payload = self.header, self.blob[self.header.payload_start : self.header.payload_end]
        ob = self.out.reshape(-1).view(np.uint8)
        if h.mode == RAW:
            if len(payload) != ob.shape[0]:
                raise CorruptDeltaError(f"delta blob of {self.name!r}: raw payload has the wrong size")
            ob[:] = np.frombuffer(payload, np.uint8)
        else:
            try:
                xor = zstandard.ZstdDecompressor().decompress(payload, max_output_size=ob.shape[0])
            except zstandard.ZstdError as e:
                raise CorruptDeltaError(f"delta blob of {self.name!r}: {e}") from None
            if len(xor) != ob.shape[0]:
                raise CorruptDeltaError(f"delta blob of {self.name!r}: xor payload has the wrong size")
            np.bitwise_xor(self.prev.reshape(-1).view(np.uint8), np.frombuffer(xor, np.uint8), out=ob)
        self.status = [0]

    def _check(self) -> None:
        if any(s != 0 for s in self.status):
            raise CorruptDeltaError(f"delta blob of {self.name!r} is inconsistent; refetch it")

    def finish(self) -> np.ndarray:
        """The new tensor (``prepare=False``)."""
        self._check()
        assert self.out is not None
        return self.out

    def patch(self) -> Patch:
        """The patch for ``Patch.apply`` (``prepare=True``)."""
        self._check()
        shape = self.header.shape
        if self.header.mode == IDENT:
            return Patch(self.name, shape)
        if self.sparse or self.header.mode == LIST:
            return Patch(self.name, shape, self._idx, self._vals)
        return Patch(self.name, shape, whole=self.out)


_UNIFORM_GAPS = Table(np.ones(1, np.int64) << 14)  # placeholder gap table of Golomb-coded gaps (never read)


_LITTLE = sys.byteorder == "little"
MAX_CHUNK_LOG2 = 40  # chunks the encoder writes are 2**CHUNK_LOG2 elements; a blob claiming more is corrupt


@njit(**NJIT)
def _read_chunk(
    buf: np.ndarray, pos: int, end: int, rows: int, counted: bool, size: int
) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray, int]:
    """One chunk's directory and streams at ``pos`` (layout in ``tandem.weights.codec._chunk_part``):
    (count, next offset, rANS words one row per stream zero-padded by at least one word, their lengths,
    the bit stream's words with three words of padding, its bit count). The offset is -1 when the chunk
    runs past ``end`` or its count exceeds ``size``."""
    count = 0
    lens = np.zeros(rows, np.int64)
    head = buf[:end]
    if counted:
        count, pos = get_varint(head, pos)
    for j in range(rows):
        lens[j], pos = get_varint(head, pos)
    nbits, pos = get_varint(head, pos)
    nbytes = (nbits + 7) // 8
    if count < 0 or nbits < 0 or lens.min() < 0 or count > size or pos + 2 * lens.sum() + nbytes > end:
        return -1, -1, np.zeros((rows, 1), np.uint16), lens, np.zeros(3, np.uint64), 0
    rwords = np.zeros((rows, lens.max() + 1), np.uint16)
    for j in range(rows):
        n = lens[j]
        if _LITTLE:  # the stream's little-endian words are the row's bytes: one vectorised copy
            rwords[j].view(np.uint8)[: 2 * n] = buf[pos : pos + 2 * n]
        else:
            for k in range(n):
                rwords[j, k] = np.uint16(buf[pos + 2 * k]) | (np.uint16(buf[pos + 2 * k + 1]) << np.uint16(8))
        pos += 2 * n
    bwords = np.zeros(nbytes // 8 + 3, np.uint64)
    bwords.view(np.uint8)[:nbytes] = buf[pos : pos + nbytes]
    return count, pos + nbytes, rwords, lens, bwords, nbits


def changed_positions(blob: bytes | memoryview, name: str, numel: int) -> np.ndarray | None:
    """The sorted flat indices of the elements ``blob`` changes, decoded without its base (see module
    invariants), or None when it rewrites the whole tensor (raw and XOR fallback modes). Raises
    ``CorruptDeltaError`` naming the tensor for a blob whose streams do not decode or that is not for a
    tensor of ``numel`` elements (what it decodes to is sized by that, never by the blob's own header: a
    40-byte blob claiming 2**40 elements had asked for terabytes)."""
    h = parse_header(blob, name)
    if h.numel != numel:
        raise CorruptDeltaError(f"delta blob of {name!r} is for {h.numel} elements, the tensor has {numel}")
    if h.mode == IDENT:
        return np.zeros(0, np.int64)
    if h.mode not in (SPARSE, DENSE, QUAD, LIST):
        return None
    width = np.float32 if h.dtype_tag == "float32" else np.uint16  # the key width is all positions need
    dec = TensorDecoder(name, np.empty(0, width), blob, positions_only=True)
    if h.mode == LIST:
        idx, _ = dec._list_changes(np.empty(0, dec.spec.bits_dtype))
        if dec.status[0] != 0:
            raise CorruptDeltaError(f"delta blob of {name!r} is inconsistent; refetch it")
        return idx
    found: list[np.ndarray] = []
    for s in dec.streams:
        t, n = getattr(dec, "table", None), s.stop - s.start
        if h.mode == SPARSE:
            g, (b, u) = dec.gap_table, golomb_params(dec.golomb_m)
            idx, z = np.empty(s.count, np.int64), np.empty(s.count, np.int64)
            status = D.decode_sparse_chunk(
                n, s.count, dec.gap_mode, g.lut, g.freq, g.cum, t.lut, t.freq, t.cum,
                dec.golomb_m, b, u, s.rwords, s.rlens, s.bwords, s.nbits, idx, z, _NO_BITS, 0, 0, 0, _NO_BITS,
            )  # fmt: skip
        elif h.mode == QUAD:  # four 2-bit classes per symbol; class 0 is "unchanged"
            try:
                quads = dec._quad_symbols(len(found))[0]
            except ValueError:
                quads = np.zeros(0, np.uint8)
            classes = ((quads[:, None] >> _QUAD_SHIFTS) & 3).reshape(-1)
            status = 0 if classes.shape[0] == 4 * ((n + 3) // 4) and not classes[n:].any() else -1
            status = status if status or K.escape_positions(quads)[1] == s.count else -1
            idx = np.flatnonzero(classes[:n])
        else:  # one diff symbol per element; symbol 0 is "unchanged"
            syms = np.empty(n, np.uint8)
            status = D.dense_symbols_from_streams(t.lut, t.fc, s.rwords, s.rlens, syms)
            idx = np.flatnonzero(syms)
        if status != 0:
            raise CorruptDeltaError(f"delta blob of {name!r} is inconsistent; refetch it")
        found.append(idx + s.start)
    return np.concatenate(found) if found else np.zeros(0, np.int64)


_QUAD_SHIFTS = np.arange(0, 8, 2, dtype=np.uint8)
_NO_Z = np.zeros(0, np.int64)
_NO_BITS = np.zeros(0, np.uint16)
_NO_WORDS = np.zeros((0, 1), np.uint16)  # a quad chunk's (unused) rANS rows
_NO_RAW_BITS = np.zeros(3, np.uint64)  # the padded bit words of a chunk without raw bits
_NO_RAW_BITS.flags.writeable = False
_NO_LENS = np.zeros(0, np.int64)


def _no_values(spec) -> np.ndarray:
    """The empty ``vals_out`` that asks ``decode_sparse_chunk`` for changes instead of new values."""
    return np.zeros(0, spec.bits_dtype)


def output_block(like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Uninitialised arrays shaped like ``like``'s, carved from one allocation (each 64-byte aligned). One
    block per version instead of one array per tensor: allocating and first touching 68 arrays of the
    shipped model's version took 3.9 ms against 0.3 ms for one block (fresh pages fault one by one, and
    glibc hands the small arrays' memory back to the kernel between versions). The block lives as long
    as any of its arrays."""
    sizes = {n: -(-a.nbytes // 64) * 64 for n, a in like.items()}
    block = np.empty(sum(sizes.values()) + 64, np.uint8)
    at = -block.ctypes.data % 64
    out = {}
    for n, a in like.items():
        out[n] = block[at : at + a.nbytes].view(a.dtype).reshape(a.shape)
        at += sizes[n]
    return out


def decode_tensor(prev: np.ndarray, blob: bytes, name: str = "tensor", threads: int = 1) -> np.ndarray:
    """The tensor ``blob`` was encoded to, given the ``prev`` it was encoded against (a new array)."""
    dec = TensorDecoder(name, prev, blob)
    run_tasks(dec.tasks(), threads)
    return dec.finish()
