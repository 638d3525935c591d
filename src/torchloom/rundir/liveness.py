"""Whether a process runs: what tells a temporary file of a killed save (its writer is gone) from one being written
(`torchloom.rundir.atomic.remove_orphans`)."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (signal 0: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    except OverflowError:  # not a pid at all
        return False
    return True
