"""The host share (``tandem.weights.hostshare``) against what else happens on the host: temporary files of a
writer killed mid-write, names that are not patches, a directory other users may write, a full /dev/shm."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from tandem.weights.client import WeightClient
from tandem.weights.follow import WeightFollower
from tandem.weights.hostlead import lead_step
from tandem.weights.hostshadow import HostShadow
from tandem.weights.hostshare import HostShare
from tandem.weights.publish import WeightPublisher
from tandem.weights.store import WeightStore
from tandem.weights.transport import serve_store


def _patch(v: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {"w": (np.array([0, 3], np.int64), np.array([v, v + 1], np.float32))}


def test_temporary_files_of_a_killed_writer_never_displace_the_newest_patches(tmp_path):
    share = HostShare(tmp_path, keep=2)
    # What ``write`` leaves when its process is killed between ``mkstemp`` and the rename: the same name
    # pattern (these random suffixes sort after the digits of a patch name).
    stale = [tmp_path / f".tmp-{s}.patch" for s in ("zzzzzzzz", "qwertyui", "k2j3h4ab")]
    for p in stale:
        p.write_bytes(b"half a patch")
    for v in range(1, 5):
        share.write(v - 1, v, _patch(v))
    # The newest ``keep`` patches stay readable; the dead writer's leftovers are gone.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "lock") == [
        "00000002-00000003.patch",
        "00000003-00000004.patch",
    ]
    got = share.read(3, 4)
    assert got is not None and got[0] == 4
    assert got[1]["w"][1].tolist() == [4.0, 5.0]


def test_files_that_are_not_patches_are_ignored_and_kept(tmp_path):
    share = HostShare(tmp_path, keep=1)
    other = tmp_path / "00000001-latest.patch"  # matches a glob for patches from version 1, is not one
    other.write_bytes(b"not a patch")
    share.write(1, 2, _patch(2))
    assert share.find(1, 5) == 2
    assert share.read(1, 5) is not None
    share.write(2, 3, _patch(3))
    assert other.exists() and share.find(2, 5) == 3 and share.find(1, 5) is None


def test_a_share_directory_others_may_write_or_own_is_refused(tmp_path):
    # A patch's digest detects damage, not forgery: whoever can write the directory could plant patches.
    fresh = tmp_path / "new" / "share"
    HostShare(fresh)
    assert fresh.stat().st_mode & 0o777 == 0o700
    for mode in (0o777, 0o770, 0o1777):
        shared = tmp_path / f"mode-{mode:o}"
        shared.mkdir()
        os.chmod(shared, mode)
        want = f"host share directory {re.escape(repr(str(shared)))} .* mode {mode & 0o777:o};"
        with pytest.raises(PermissionError, match=want):
            HostShare(shared)
    if os.geteuid() == 0:  # root can hand a directory to another user
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        with pytest.raises(PermissionError, match="owned by uid 65534"):
            HostShare(foreign)


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounts a small tmpfs (a full /dev/shm)")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_patch_that_does_not_fit_the_share_never_fails_the_step(tmp_path, small_tmpfs):
    """A full ``/dev/shm`` when the leader writes a step's patch: before, ``lead_step`` raised ENOSPC (an
    engine's sync, and the run waiting on it, failed) although the host shadow was verified at the step."""
    store = WeightStore.open(tmp_path / "store", create=True)
    publisher = WeightPublisher(store)
    w0 = {"w": np.arange(1 << 20, dtype=np.uint16)}  # a 2 MiB shadow fits the 3 MiB share
    w1 = {"w": w0["w"] + np.uint16(1)}  # every element changes: a 10 MiB patch does not
    publisher.publish(0, w0)
    publisher.publish(1, w1)
    with serve_store(store) as server, WeightClient([server.url]) as client:
        share = HostShare(small_tmpfs / "share")
        shadow = HostShadow(share.path)
        follower = WeightFollower(client)
        with share.lock():
            assert lead_step(share, shadow, follower, 0).written is None  # a full load: no patch
            led = lead_step(share, shadow, follower, 1)
        assert led.version == 1 and led.base == 0 and led.written is None
        assert share.find(0, 1) is None and not list(share.path.glob(".tmp-*"))  # nothing half-written
        with share.lock(shared=True):
            version, tensors = HostShadow(share.path).load()  # what the engines reload from
            assert version == 1 and np.array_equal(tensors["w"], w1["w"])
    store.close()
