"""The codec's zstd frames (``tandem.weights.zframes``): exact sizes both ways, deterministic frames."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.weights import zframes


def test_zstd_frames_hold_exactly_what_they_claim():
    """``zframes.unpack`` returns exactly the expected bytes or raises: never more bytes than asked for (a
    frame of a million bytes asked for ten), never fewer, never with bytes after the frame."""
    data = np.random.default_rng(0).integers(0, 4, 1_000_000).astype(np.uint8)
    frame = zframes.pack(data)
    assert len(frame) < data.size // 3 and zframes.pack(data) == frame
    assert zframes.unpack(frame, data.size).tobytes() == data.tobytes()
    for bad, n in ((frame, 10), (frame, data.size + 1), (frame + b"x", data.size), (b"", 5), (frame, 0)):
        with pytest.raises(ValueError):
            zframes.unpack(bad, n)
    assert zframes.pack(b"") == b"" and zframes.unpack(b"", 0).size == 0


def test_a_frame_is_the_same_on_any_thread():
    """Each thread keeps its own compressor; the frames they make of the same bytes are identical."""
    from concurrent.futures import ThreadPoolExecutor

    data = np.random.default_rng(1).integers(0, 8, 300_000).astype(np.uint8)
    with ThreadPoolExecutor(3) as ex:
        frames = list(ex.map(lambda _: zframes.pack(data), range(6)))
    assert len(set(frames)) == 1 and frames[0] == zframes.pack(data)
    assert zframes.unpack(frames[0], data.size).tobytes() == data.tobytes()
