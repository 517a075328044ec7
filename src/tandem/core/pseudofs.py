"""Kernel pseudo file systems (``/proc``, ``/sys``, ...): where a path given as data must not be read.

Invariant: :func:`pseudo_filesystems` maps the device number (``st_dev``) of every such file system mounted
in this process's view to its type, read from ``/proc/self/mountinfo``; an empty map when that cannot be
read. Commands that read files a user names (a config, a workspace, a solution) refuse those on one, with
the type in the message, before reading anything.
"""

from __future__ import annotations

import os
from pathlib import Path

PSEUDO_FILESYSTEMS = frozenset(
    "proc sysfs devtmpfs devpts debugfs tracefs securityfs cgroup cgroup2 pstore bpf configfs fusectl "
    "efivarfs binfmt_misc mqueue autofs hugetlbfs rpc_pipefs nsfs".split()
)
"""Kernel file systems, whose files are not data: reading one can block for ever or act (``/proc/kmsg``: a
``tandem sandbox run --workspace /proc`` never started its command, and a read takes the kernel's log
messages from whoever else reads them) or never end (``/proc/kcore``)."""


def pseudo_filesystems() -> dict[int, str]:
    """Device number -> type of every mounted ``PSEUDO_FILESYSTEMS`` file system (from mountinfo)."""
    found: dict[int, str] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()[:1]
        if len(fields) > 2 and kind and kind[0] in PSEUDO_FILESYSTEMS:
            major, _, minor = fields[2].partition(":")
            try:
                found[os.makedev(int(major), int(minor))] = kind[0]
            except ValueError:
                continue
    return found
