"""zstd frames for the codec's byte streams (the quad mode's classes and escape symbols), one compressor and
one decompressor kept per thread.

Invariants:
- ``pack(data)`` is deterministic: the same bytes give the same frame on any thread (``PARAMS``: no
  content size, no checksum; the blob's crc32 covers the frame).
- ``unpack(frame, n)`` returns exactly ``n`` bytes or raises ``ValueError``: it never allocates more than
  ``n`` bytes, whatever the frame claims (frames carry no content size, and zstd stops at
  ``max_output_size``), and refuses a frame that decodes to fewer bytes, more, or has bytes after it.
- An empty input is the empty frame (zero bytes), and ``unpack(b"", 0)`` is empty.

Why zstd: its literal coder (Huffman, four interleaved streams, compiled C) codes a byte stream within 2%
of the order-0 entropy here, and decodes it 2-3x faster than the codec's rANS kernels did (the quads of a
version of the shipped model: 0.69 ms against 1.72 ms). The streams are close to memoryless, so
``PARAMS`` spend little on finding matches: level 1's fast strategy with the longest minimum match and a
256-entry hash table. On the quads and escape symbols of a version of the shipped model that gave 1.18 MB,
compressed in 1.57 ms and decompressed in 1.41 ms, against level 1's 1.19 MB, 2.59 ms and 1.63 ms.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17, hash_log=8, chain_log=6, search_log=1, min_match=7, target_length=0,
    strategy=zstandard.STRATEGY_FAST, write_content_size=False, write_checksum=False,
)  # fmt: skip
_LOCAL = threading.local()
_EMPTY = np.zeros(0, np.uint8)


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_LOCAL, "c", None)
    if c is None:  # instances are not thread-safe: one per thread
        c = _LOCAL.c = zstandard.ZstdCompressor(compression_params=PARAMS)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_LOCAL, "d", None)
    if d is None:
        d = _LOCAL.d = zstandard.ZstdDecompressor()
    return d


def pack(data: np.ndarray | bytes) -> bytes:
    """The zstd frame of ``data`` (a contiguous uint8 array or bytes); empty for empty data."""
    if len(data) == 0:
        return b""
    return _compressor().compress(data)


def unpack(frame: bytes | memoryview, n: int) -> np.ndarray:
    """The ``n`` bytes ``frame`` holds, as a read-only uint8 array; ``ValueError`` if it does not hold
    exactly that many."""
    if n == 0:
        if len(frame):
            raise ValueError(f"a zstd frame of {len(frame)} bytes where no bytes were expected")
        return _EMPTY
    if len(frame) == 0:
        raise ValueError(f"an empty zstd frame where {n} bytes were expected")
    try:
        out = _decompressor().decompress(frame, max_output_size=n, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame does not decode: {e}") from None
    if len(out) != n:
        raise ValueError(f"zstd frame holds {len(out)} bytes, expected {n}")
    return np.frombuffer(out, np.uint8)
