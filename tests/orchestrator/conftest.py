"""Helpers shared by the run tests."""

from __future__ import annotations

import tempfile
from pathlib import Path


def tandem_debris() -> set[str]:
    """What tandem processes keep in the temp dir and /dev/shm, and the mounts they hold."""
    places = (Path(tempfile.gettempdir()), Path("/dev/shm"))
    found = {str(p) for place in places for p in place.glob("tandem-*")}
    with open("/proc/self/mountinfo") as f:
        found |= {f"mount {line.split()[4]}" for line in f if "tandem-" in line.split()[4]}
    return found
