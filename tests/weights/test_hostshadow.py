"""The host's one shadow (``tandem.weights.hostshadow``) and the share lock that guards it: what one process
commits another loads bit for bit; an update in progress is never loaded as a version; a new layout moves
to a new file that every process re-maps; readers share the lock, a writer has it alone."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import pytest

from tandem.weights.hostshadow import HostShadow
from tandem.weights.hostshare import HostShare


def _tensors(seed: int, extra: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {
        "a.weight": rng.integers(0, 2**16, (33, 7), dtype=np.uint16),
        "b.bias": rng.standard_normal(5).astype(np.float32),
    }
    if extra:
        out["c.weight"] = rng.integers(0, 2**16, 100, dtype=np.uint16)
    return out


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert got[name].tobytes() == t.tobytes(), name


def test_a_committed_shadow_is_loaded_elsewhere_and_an_unfinished_update_never_is(tmp_path):
    writer, reader = HostShadow(tmp_path), HostShadow(tmp_path)
    assert reader.load() == (None, None)  # nothing committed yet
    first = _tensors(0)
    views = writer.commit(3, first)
    assert views is not first["a.weight"] and all(v.flags.writeable for v in views.values())
    version, got = reader.load()
    assert version == 3
    _same(got, first)
    # In place: the writer marks the update, writes through its views, then commits the same views.
    writer.begin()
    assert HostShadow(tmp_path).load() == (None, None)  # mid-update: no version to take
    views["a.weight"][0, :3] ^= 0x00FF
    assert writer.commit(4, views) is views  # kept in place, no copy
    version, got = reader.load()
    assert version == 4 and got["a.weight"][0, 0] == views["a.weight"][0, 0]  # the same shared pages
    writer.drop()
    assert reader.load() == (None, None)


def test_a_new_layout_moves_to_a_new_file_that_other_processes_remap(tmp_path):
    writer, reader = HostShadow(tmp_path), HostShadow(tmp_path)
    writer.commit(1, _tensors(1))
    assert reader.load()[0] == 1
    (old,) = tmp_path.glob("shadow-*.bin")
    bigger = _tensors(2, extra=True)
    writer.commit(2, bigger)
    (new,) = tmp_path.glob("shadow-*.bin")  # the old file is gone
    assert new != old
    version, got = reader.load()
    assert version == 2
    _same(got, bigger)


def test_readers_share_the_lock_and_a_writer_waits_for_them(tmp_path):
    share = HostShare(tmp_path)
    inside, release = threading.Barrier(3), threading.Event()

    def reader() -> None:
        with share.lock(shared=True):
            inside.wait(timeout=30)  # both readers hold the lock at once, or this times out
            release.wait(timeout=60)

    def writer() -> str:
        with share.lock():
            return "written"

    with ThreadPoolExecutor(3) as pool:
        readers = [pool.submit(reader) for _ in range(2)]
        inside.wait(timeout=30)
        waiting = pool.submit(writer)
        with pytest.raises(FutureTimeout):
            waiting.result(timeout=0.5)  # held back while the readers are inside
        release.set()
        for r in readers:
            r.result(timeout=30)
        assert waiting.result(timeout=30) == "written"


_COMMIT_TOO_BIG = """
import sys
import numpy as np
from tandem.weights.hostshadow import HostShadow
shadow = HostShadow(sys.argv[1])
shadow.commit(1, {"w": np.ones(100_000, np.float32)})  # fits
try:
    shadow.commit(2, {"w": np.ones(1_000_000, np.float32), "x": np.ones(3, np.float32)})  # 4 MB: does not
except OSError as e:
    print("OSError", e.errno, e)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounts a small tmpfs")
def test_a_full_dev_shm_is_an_error_not_a_bus_error(tmp_path):
    """A shadow file bigger than the free memory of its tmpfs: before, its pages were first touched through
    the shared mapping, and the process (an engine) died of SIGBUS, leaving the partial file behind."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        share = mnt / "share"
        r = subprocess.run(
            [sys.executable, "-c", _COMMIT_TOO_BIG, str(share)], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
        assert r.stdout.startswith(f"OSError {errno.ENOSPC} "), r.stdout
        assert "free space in" in r.stdout
        assert len(list(share.glob("shadow-*.bin"))) == 1  # the failed file is gone, the old one stays
        version, tensors = HostShadow(share).load()  # the committed shadow is untouched
        assert version == 1 and tensors["w"].tolist() == [1.0] * 100_000
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
