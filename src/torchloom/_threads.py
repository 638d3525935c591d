"""Torch's intra-op CPU thread count for one ``fit`` / ``validate`` / ``predict`` call (`EngineConfig.num_threads`).

One setting, applied when a call starts and undone when it ends, so that the count is a property of the run
rather than of whichever task class happened to call `torch.set_num_threads`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

__all__ = ["apply_num_threads", "resolve_num_threads"]


def resolve_num_threads(setting: int | None, environ: Mapping[str, str] = os.environ) -> int | None:
    """The thread count a call runs with, or ``None`` to keep torch's current one.

    Args:
        setting (`int` or ``None``): `EngineConfig.num_threads`.
        environ (`Mapping[str, str]`): the process environment (``OMP_NUM_THREADS``, ``LOCAL_WORLD_SIZE``).

    Returns:
        ``setting`` when given. Otherwise ``None`` when ``OMP_NUM_THREADS`` is set (torch read it at start-up: the
        user's or the launcher's choice) or when this is the only process of the run on this machine; else
        torch's current count divided among the ``LOCAL_WORLD_SIZE`` processes of this machine, at least 1 (they
        would otherwise each start a thread per core and oversubscribe the CPUs).
    """
    if setting is not None:
        return setting
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None
    try:
        local_world_size = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return None  # not set by a launcher we know: leave torch alone
    if local_world_size <= 1:
        return None
    return max(1, torch.get_num_threads() // local_world_size)


def apply_num_threads(setting: int | None) -> int:
    """Set torch's intra-op thread count for a call (`resolve_num_threads`) and return the count before it, for
    `torch.set_num_threads` to restore when the call ends."""
    before = torch.get_num_threads()
    threads = resolve_num_threads(setting)
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    return before
