"""The disk cap (src/tandem/sandbox/disk.py): what a sandbox on disk scratch writes stays within disk_mb."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.core.config import SandboxConfig
from tandem.core.errors import SandboxError
from tandem.sandbox import bwrap_available, create_sandbox
from tandem.sandbox.disk import disk_cap_unavailable_reason

pytestmark = [
    pytest.mark.skipif(not bwrap_available(), reason="bubblewrap is not usable on this machine"),
    pytest.mark.skipif(
        os.geteuid() != 0 or disk_cap_unavailable_reason() is not None,
        reason=f"no capped disks here: {os.geteuid() == 0 and disk_cap_unavailable_reason()}",
    ),
]
MIB = 1 << 20
CAP_MB = 8
# 1 MiB files, each far under file_mb, until the cap stops them (64 would be 8 times the cap)
MANY_FILES = "for i in $(seq 64); do head -c 1048576 /dev/zero > f$i || exit 7; done"


def _host_bytes(root: Path) -> int:
    """Bytes allocated on the host filesystem under ``root``, not counting what is inside mounts (du -x)."""
    dev, total = os.lstat(root).st_dev, os.lstat(root).st_blocks * 512
    for dirpath, dirnames, filenames in os.walk(root):
        keep = [d for d in dirnames if os.lstat(os.path.join(dirpath, d)).st_dev == dev]
        dirnames[:] = keep
        for name in keep + filenames:
            total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_many_small_files_cannot_fill_the_host_disk(mode: str) -> None:
    cfg = SandboxConfig(scratch="disk", disk_mb=CAP_MB, workspace_mode=mode, timeout_s=120.0)
    with create_sandbox({"a.py": "x = 1\n"}, cfg) as sb:
        root = sb._root
        with pytest.raises(SandboxError, match=f"disk is full.*sandbox.disk_mb = {CAP_MB} MiB") as caught:
            sb.exec(["sh", "-c", MANY_FILES])
        result = caught.value.result  # the command's own result travels with the error
        assert result.exit_code == 7 and "No space left on device" in result.stderr
        # the host holds the sandbox's image file (sparse, CAP_MB long) and a few directories: nothing more
        assert _host_bytes(root) <= CAP_MB * MIB + 64 * 1024
        assert sb.exec(["ls"]).exit_code == 0  # a command that writes nothing is not blamed for a full disk
        with pytest.raises(SandboxError, match="disk is full"):
            sb.write("more.txt", "y" * MIB)
        # removing files makes room again: the sandbox stays usable
        assert sb.exec(["sh", "-c", "rm f*; echo ok > b.txt; cat a.py b.txt"]).stdout == "x = 1\nok\n"


def test_files_a_command_unlinked_but_keeps_open_count_against_the_cap() -> None:
    code = (
        "import os\nfiles = []\ntry:\n    for i in range(64):\n"
        "        f = open(f't{i}', 'wb'); os.unlink(f't{i}'); files.append(f)\n"
        "        f.write(b'x' * (1 << 20)); f.flush(); os.fsync(f.fileno())\n"
        "except OSError as e:\n    print(len(files), e.errno)\n"
    )
    with create_sandbox({}, SandboxConfig(scratch="disk", disk_mb=CAP_MB, timeout_s=120.0)) as sb:
        written, err = sb.exec(["python3", "-c", code]).stdout.split()
        assert int(written) <= CAP_MB and err == "28"  # ENOSPC, invisible files or not


def test_a_copy_workspace_larger_than_the_cap_is_refused_clearly() -> None:
    files = {f"f{i}.txt": "z" * MIB for i in range(2 * CAP_MB)}
    cfg = SandboxConfig(scratch="disk", disk_mb=CAP_MB, workspace_mode="copy")
    with pytest.raises(SandboxError, match=f"workspace does not fit.*disk_mb = {CAP_MB} "):
        create_sandbox(files, cfg)


def test_a_cap_larger_than_the_free_disk_is_refused_before_anything_is_written() -> None:
    import tempfile

    st = os.statvfs(tempfile.gettempdir())
    too_big = st.f_bavail * st.f_frsize // MIB + 1
    with pytest.raises(SandboxError, match="not enough free disk.*lower sandbox.disk_mb"):
        create_sandbox({"a": "1"}, SandboxConfig(scratch="disk", disk_mb=too_big))
