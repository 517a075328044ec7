"""Process helpers shared by the layers that own OS resources (sandboxes, store locks).

Invariant: ``pid_alive`` never signals the process (signal 0 only checks existence and permission).
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists on this host (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
