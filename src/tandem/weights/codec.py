"""Lossless delta codec, encoder side: ``encode_tensor(prev, cur) -> bytes`` (decoding is in ``decoder``).

Invariants:
- ``decode_tensor(prev, encode_tensor(prev, cur))`` is bit-identical to ``cur`` for every dtype and value
  (NaN payloads, infinities, -0.0, empty and 0-d tensors included).
- ``prev`` and ``cur`` must have the same dtype and shape; a mismatch is a ``ValueError`` naming the tensor,
  both dtypes and both shapes.
- The mode (see ``tandem.weights.blob``) is chosen per tensor by the exact estimated size of each candidate:
  sparse gaps (rANS table or Golomb) + diffs, a list of a few changes (exact size), dense per-element
  symbols, quads of element classes + escapes (the fast dense mode, available when every chunk has at
  least ``DENSE_FROM`` changes; its chunks are coded in the scan, so its size is the real one), or the
  raw new bytes.
- Work is split into chunks of ``2**CHUNK_LOG2`` elements; chunk kernels release the GIL, so the
  ``*_tasks`` lists run in parallel on a thread pool (see ``run_tasks``: each calling thread keeps its own)
  with identical output for any number of threads.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial

import numpy as np
import zstandard
from numba import njit

from tandem.weights import kernels as K
from tandem.weights import zframes
from tandem.weights.blob import (
    DENSE,
    IDENT,
    LIST,
    QUAD,
    RAW,
    SPARSE,
    XOR_ZSTD,
    key_spec,
    seal,
    write_header,
)
from tandem.weights.entropy import NEXTRA, NJIT, golomb_parameter, golomb_params
from tandem.weights.tables import Table, plan_table, write_varint

CHUNK_LOG2 = 20
SPARSE_CHUNK_BITS = 8 * 12  # per chunk: directory varints and up to two rANS final states
DENSE_CHUNK_BITS = 8 * 24  # per chunk: directory varints and four rANS final states
ZSTD_LEVEL = 3
DENSE_FROM = 0.2  # density from which the dense decoder (per element) beats the sparse one (per change)
SPEED_BIAS = 1.03  # the slower mode must be this much smaller to be chosen
LIST_ALWAYS = 4096  # chunks of at most this many elements always list their changes
DENSE_BIAS = 1.10  # the dense mode decodes ~3x slower than the quad mode: it must be this much smaller

QUAD_DIRECTORY = struct.Struct("<IIII")  # a quad chunk's directory: one unpack instead of four varints
Task = Callable[[], None]


_POOLS = threading.local()


def _pool(threads: int) -> ThreadPoolExecutor:
    """The calling thread's own pool of ``threads`` workers, kept across calls: starting threads for every
    call cost more than the parallel work saved (a version of the shipped model encoded in 13-14 ms on
    two fresh threads against 12 ms on kept ones, and 14 ms on one). Workers inherit their creator's
    scheduling priority, so a pool belongs to one thread and one priority (a new pool after the thread's
    nice value or policy changes, or after a fork, whose child has none of the parent's threads)."""
    key = (threads, os.getpid(), os.getpriority(os.PRIO_PROCESS, 0), _policy())
    pool = getattr(_POOLS, "pool", None)
    if pool is None or _POOLS.key != key:
        if pool is not None and _POOLS.key[1] == key[1]:
            pool.shutdown(wait=False)
        _POOLS.pool = pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tandem-codec")
        _POOLS.key = key
    return pool


def _policy() -> int:
    return os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else 0


def run_tasks(tasks: list[Task], threads: int) -> None:
    """Run independent tasks, on ``threads`` threads when > 1 (kernels release the GIL), on the calling
    thread's kept pool (``_pool``). Each worker takes the next task from the list as it finishes one, so
    a call costs ``threads`` hand-offs, not one per task: a version of the shipped model has 68 tensors,
    most of them small, and a future per task had made a two-thread decode slower than one thread (2.5
    against 2.7 GB/s). Returns once every task has finished, then raises the first task's exception (in
    list order) if any did (no task is left running behind an error)."""
    if threads <= 1 or len(tasks) <= 1:
        for t in tasks:
            t()
        return
    queue = iter(enumerate(tasks))
    lock = threading.Lock()
    errors: list[tuple[int, BaseException]] = []

    def worker() -> None:
        while True:
            with lock:
                item = next(queue, None)
            if item is None:
                return
            try:
                item[1]()
            except BaseException as e:  # re-raised by the caller once every task has ended
                errors.append((item[0], e))

    futures = [_pool(threads).submit(worker) for _ in range(min(threads, len(tasks)))]
    wait(futures)
    for f in futures:
        f.result()
    if errors:
        raise min(errors, key=lambda err: err[0])[1]


def check_pair(name: str, prev: np.ndarray, cur: np.ndarray) -> None:
    if prev.dtype != cur.dtype or prev.shape != cur.shape:
        raise ValueError(
            f"tensor {name!r}: old is dtype {prev.dtype} shape {list(prev.shape)}, new is dtype {cur.dtype} "
            f"shape {list(cur.shape)}; a delta needs the same dtype and shape on both sides"
        )


def chunk_ranges(n: int) -> list[tuple[int, int]]:
    step = 1 << CHUNK_LOG2
    return [(a, min(a + step, n)) for a in range(0, n, step)]


@njit(**NJIT)
def _sampled_density(p: np.ndarray, c: np.ndarray) -> float:
    """Fraction of changed elements in a sample of about 4096: 64 evenly spaced runs of 64 contiguous
    elements (two cache lines per run and array, where single strided elements cost one each)."""
    n = p.shape[0]
    if n <= 4096:
        changed = 0
        for i in range(n):
            changed += p[i] != c[i]
        return changed / max(1, n)
    step = n // 64
    changed = 0
    for r in range(64):
        a = r * step
        for i in range(a, a + 64):
            changed += p[i] != c[i]
    return changed / 4096


_NO_EXTRA = np.zeros(0, np.float64)
_NEXTRA_F = NEXTRA.astype(np.float64)


def _table_bits(counts: np.ndarray, raw_bits: bool = True) -> tuple[float, np.ndarray, bytes]:
    """Coded bits of symbols with these counts (table included; with ``raw_bits`` the symbols are diff
    buckets and their raw low bits count too), the frequencies, the serialized table."""
    bits, freq, ser = plan_table(
        np.ascontiguousarray(counts, np.float64), _NEXTRA_F if raw_bits else _NO_EXTRA
    )
    return bits, freq, ser.tobytes()


def _total(arrays: list[np.ndarray]) -> np.ndarray:
    """Elementwise sum of same-shaped arrays (the only one itself, not a copy: callers only read it)."""
    return arrays[0] if len(arrays) == 1 else np.sum(arrays, axis=0)


@dataclass
class _Scan:
    count: int
    idx: np.ndarray | None  # None when the chunk had more changes than the sparse capacity
    z: np.ndarray | None
    hist: np.ndarray
    quad_part: bytes | None = None  # the chunk coded in the quad mode, when it is dense enough for it


class TensorEncoder:
    """Two phases of parallel tasks: ``scan_tasks``, ``plan()``, ``encode_tasks``, then ``blob()``."""

    def __init__(self, name: str, prev: np.ndarray, cur: np.ndarray) -> None:
        check_pair(name, prev, cur)
        self.name = name
        self.prev = np.require(prev, requirements="C")
        self.cur = np.require(cur, requirements="C")
        self.spec = key_spec(prev.dtype)
        self.n = int(prev.size)
        self.chunks = chunk_ranges(self.n)
        self.scans: list[_Scan | None] = [None] * len(self.chunks)
        self.parts: list[bytes | bytearray | memoryview] = [b""] * len(self.chunks)
        self.mode = IDENT
        self.changed = 0
        self._fallback: bytes | None = None
        if self.spec is not None:
            self.p = self.prev.reshape(-1).view(self.spec.bits_dtype)
            self.c = self.cur.reshape(-1).view(self.spec.bits_dtype)

    # -------------------------------------------------------------- phase 1
    def scan_tasks(self) -> list[Task]:
        if self.spec is None:
            return [self._encode_fallback]
        return [partial(self._scan, k) for k in range(len(self.chunks))]

    def _scan(self, k: int) -> None:
        a, b = self.chunks[k]
        p, c = self.p[a:b], self.c[a:b]
        spec = self.spec
        hist = K.new_hist()
        count = -1
        # A dense chunk skips listing its changes; a short one is listed whatever its density, since a mode
        # needs every chunk (a tensor of 2**20 + 5 elements with 3 changes, one in its 5-element last
        # chunk, had no sparse or list option and took the per-element dense mode).
        if b - a <= LIST_ALWAYS or _sampled_density(p, c) < DENSE_FROM:
            p64, c64 = K.aligned_words(p, c, spec.lanes)
            cap = (b - a) // 4 + 24
            idx, z = np.empty(cap, np.uint32), np.empty(cap, np.uint64)
            count = K.scan_chunk(p, c, p64, c64, 64 // spec.lanes, spec.sign, spec.mask, idx, z)
        n = b - a
        if count >= 0:
            idx, z = idx[:count].copy(), z[:count].copy()
            K.change_hist(idx, z, n, hist)
            self.scans[k] = _Scan(count, idx, z, hist)
            if count < DENSE_FROM * n:
                return
        # Too dense to list, or dense enough that the sparse mode may lose: the quad mode is an option too
        # (it codes exactly the dense model with a quarter of the symbols, so it beats the dense mode). Its
        # part is made now, while the chunk is in cache: zstd's frames have no size to estimate beforehand.
        listed = count >= 0  # then ``hist`` already holds the listed changes' histogram
        quads, _, _, changed, esyms, ebits, enbits = K.quad_scan_chunk(
            p, c, spec.sign, spec.mask, K.new_hist() if listed else hist
        )
        if not listed:
            self.scans[k] = _Scan(changed, None, None, hist)
        self.scans[k].quad_part = quad_part(quads, esyms, ebits, enbits)

    def _encode_fallback(self) -> None:
        pb = self.prev.reshape(-1).view(np.uint8)
        cb = self.cur.reshape(-1).view(np.uint8)
        if np.array_equal(pb, cb):
            self._fallback = b""
            return
        itemsize = max(self.prev.dtype.itemsize, 1)
        diff = (pb != cb).reshape(-1, itemsize).any(axis=1) if self.n else np.zeros(0, bool)
        self.changed = int(diff.sum())
        self.mode = XOR_ZSTD
        self._fallback = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(np.bitwise_xor(pb, cb).tobytes())

    # -------------------------------------------------------------- planning
    def plan(self) -> None:
        """Choose the mode with the smallest exact estimated size and build its tables."""
        if self.spec is None:
            return
        scans = [s for s in self.scans if s is not None]
        self.changed = sum(s.count for s in scans)
        if self.changed == 0:
            self.mode = IDENT
            return
        hist = _total([s.hist for s in scans])
        chunks = len(self.chunks)
        # Sizes decide, with a small bias for the faster decoder: sparse below DENSE_FROM, dense above.
        sparse_first = self.changed < DENSE_FROM * self.n
        options: list[tuple[float, int]] = [(8.0 * self.prev.nbytes, RAW)]
        quad_ok = len(scans) == chunks and all(s.quad_part is not None for s in scans)
        dense_bits, self.dense_freq, self.dense_table = _table_bits(hist[1])
        dense_bits += DENSE_CHUNK_BITS * chunks
        options.append((dense_bits * (DENSE_BIAS if quad_ok else SPEED_BIAS if sparse_first else 1), DENSE))
        if quad_ok:
            quad_bits = 8.0 * (1 + sum(len(s.quad_part) for s in scans))
            options.append((quad_bits * (SPEED_BIAS if sparse_first else 1), QUAD))
        if all(s.idx is not None for s in scans):
            sparse_bits = self._plan_sparse(hist) + SPARSE_CHUNK_BITS * chunks
            options.append((sparse_bits * (1 if sparse_first else SPEED_BIAS), SPARSE))
            if self.changed <= K.LIST_MAX and self.n < 1 << 32:  # gaps and z then fit get_varint's 35 bits
                at = [a for a, _ in self.chunks]
                idx = np.concatenate([s.idx.astype(np.int64) + a for s, a in zip(scans, at, strict=True)])
                self._list = K.encode_list(idx, np.concatenate([s.z for s in scans]).astype(np.int64))
                options.append((8.0 * self._list.shape[0], LIST))
        self.mode = min(options)[1]
        if self.mode == SPARSE:
            self._gap_t = Table.encoding(self.gap_freq)
            self._diff_t = Table.encoding(self.diff_freq)
        elif self.mode == DENSE:
            self._dense_t = Table.encoding(self.dense_freq)
        elif self.mode == QUAD:
            self.parts = [s.quad_part for s in scans]
        for s in scans:
            s.quad_part = None  # the chosen parts are in ``parts``; the others are no longer needed

    def _plan_sparse(self, hist: np.ndarray) -> float:
        diff_counts = hist[1].copy()
        diff_counts[0] = 0  # "unchanged" never occurs in a sparse stream
        diff_bits, self.diff_freq, self.diff_table = _table_bits(diff_counts)
        gap_bits, self.gap_freq, self.gap_table = _table_bits(hist[0])
        self.golomb_m = golomb_parameter(self.changed / self.n)
        b, u = golomb_params(self.golomb_m)
        golomb_bits = sum(K.golomb_total_bits(s.idx, self.golomb_m, b, u) for s in self.scans) + 24
        self.gap_mode = K.GAP_GOLOMB if golomb_bits < gap_bits else K.GAP_TABLE
        return diff_bits + min(gap_bits, golomb_bits)

    # -------------------------------------------------------------- phase 2
    def encode_tasks(self) -> list[Task]:
        if self.mode == SPARSE:
            return [partial(self._encode_sparse, k) for k in range(len(self.chunks))]
        if self.mode == DENSE:
            return [partial(self._encode_dense, k) for k in range(len(self.chunks))]
        return []  # the quad mode's parts were made in the scan

    def _encode_sparse(self, k: int) -> None:
        s = self.scans[k]
        n = s.count
        gt, dt = self._gap_t, self._diff_t
        m = self.golomb_m
        b, u = golomb_params(m)
        if self.gap_mode == K.GAP_GOLOMB:
            bit_cap = K.golomb_total_bits(s.idx, m, b, u) + 40 * n
        else:
            bit_cap = 80 * n
        rbuf = np.empty((2, n + 3), np.uint16)
        bbuf = np.empty(bit_cap // 64 + 3, np.uint64)
        gm = self.gap_mode
        rg, rd, w, nbits = K.encode_sparse_chunk(s.idx, s.z, gm, gt.enc, dt.enc, m, b, u, rbuf, bbuf)
        self.parts[k] = _chunk_part([n], [rbuf[0, rg:], rbuf[1, rd:]], bbuf[:w], nbits)

    def _encode_dense(self, k: int) -> None:
        a, b = self.chunks[k]
        dt = self._dense_t
        n = b - a
        extra = int((self.scans[k].hist[1] * NEXTRA).sum())
        rbuf = np.empty((K.LANES, n // K.LANES + 4), np.uint16)
        bbuf = np.empty(extra // 64 + 3, np.uint64)
        starts = np.zeros(K.LANES, np.int64)
        p, c, spec = self.p[a:b], self.c[a:b], self.spec
        syms = np.empty(n, np.uint8)
        K.dense_symbols(p, c, spec.sign, spec.mask, syms)
        w, nbits = K.encode_dense_chunk(p, c, syms, spec.sign, spec.mask, dt.enc, rbuf, bbuf, starts)
        streams = [rbuf[j, starts[j] :] for j in range(K.LANES)]
        self.parts[k] = _chunk_part([], streams, bbuf[:w], nbits)

    def blob(self) -> bytes:
        out = bytearray()
        write_header(out, self.mode, self.prev.dtype, self.prev.shape, self.changed)
        if self.mode == XOR_ZSTD:
            out += self._fallback
        elif self.mode == RAW:
            out += memoryview(self.cur.reshape(-1).view(np.uint8))
        elif self.mode == LIST:
            out += memoryview(self._list)
        elif self.mode in (SPARSE, DENSE, QUAD):
            if self.mode == SPARSE:
                out.append(self.gap_mode)
                if self.gap_mode == K.GAP_TABLE:
                    out += self.gap_table
                else:
                    write_varint(out, self.golomb_m)
                out += self.diff_table
            elif self.mode == DENSE:
                out += self.dense_table
            out.append(CHUNK_LOG2)
            for part in self.parts:
                out += part
        return seal(out)


def _chunk_part(counts: list[int], streams: list[np.ndarray], bwords: np.ndarray, nbits: int) -> bytearray:
    """One chunk: [change count], each rANS stream's word count, the bit count, then the streams' words
    and the bit bytes (little-endian; each copied once, straight into the part)."""
    out = bytearray()
    for c in counts:
        write_varint(out, c)
    for st in streams:
        write_varint(out, int(st.shape[0]))
    write_varint(out, int(nbits))
    for st in streams:
        out += memoryview(np.ascontiguousarray(st, "<u2"))  # no copy of a little-endian row slice
    out += memoryview(np.ascontiguousarray(bwords, "<u8")).cast("B")[: (nbits + 7) // 8]
    return out


def quad_part(quads: np.ndarray, esyms: np.ndarray, ebits: np.ndarray, enbits: int) -> bytes:
    """One quad chunk (layout in ``tandem.weights.kernels``): ``QUAD_DIRECTORY`` (the escape count, the byte
    lengths of the quads' and the escapes' zstd frames and the raw bit count), then the two frames and the
    raw bits' bytes (little-endian words)."""
    qframe, eframe = zframes.pack(quads), zframes.pack(esyms)
    out = bytearray(QUAD_DIRECTORY.pack(esyms.shape[0], len(qframe), len(eframe), enbits))
    out += qframe
    out += eframe
    out += memoryview(np.ascontiguousarray(ebits, "<u8")).cast("B")[: (enbits + 7) // 8]
    return bytes(out)


def encode_tensor(prev: np.ndarray, cur: np.ndarray, name: str = "tensor", threads: int = 1) -> bytes:
    """The delta blob that turns ``prev`` into ``cur`` (same dtype and shape), bit-exactly."""
    enc = TensorEncoder(name, prev, cur)
    run_tasks(enc.scan_tasks(), threads)
    enc.plan()
    run_tasks(enc.encode_tasks(), threads)
    return enc.blob()
