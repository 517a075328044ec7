"""`tandem.core.pseudofs`: the kernel pseudo file systems a path given as data must not be on."""

from __future__ import annotations

import os
from pathlib import Path

from tandem.core.pseudofs import pseudo_filesystems


def test_proc_and_sys_are_pseudo_and_an_ordinary_directory_is_not(tmp_path: Path) -> None:
    found = pseudo_filesystems()
    assert found[os.stat("/proc").st_dev] == "proc"
    assert found[os.stat("/proc/self/status").st_dev] == "proc"
    if os.path.isdir("/sys/kernel"):
        assert found[os.stat("/sys/kernel").st_dev] == "sysfs"
    assert os.stat(tmp_path).st_dev not in found
