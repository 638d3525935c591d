"""`warn`: a warning that points at the user's code, whichever torchloom or plugin frame raises it."""

from __future__ import annotations

import inspect
import warnings

__all__ = ["warn"]

#: Top-level packages whose frames a warning skips: torchloom, its built-in plugins, and what hooks run through.
_SKIPPED = frozenset({"torchloom", "torchloom_plugins", "pluggy", "contextlib", "jsonargparse"})


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn` ``message``, attributed to the first frame outside torchloom: the user's line.

    Frames skipped, from the caller outwards: the caller's own (consecutive frames of its file: a third-party
    plugin's hook and its helpers), then those of torchloom, its built-in plugins and the packages hooks and
    commands run through (pluggy, contextlib, jsonargparse). The warning then names the line of the user's script
    that called ``Engine.fit`` (or built the engine), as the filters and ``-W error`` of the user's code expect,
    however deep in the loop or in a plugin it was raised, and however many frames a decorator adds.

    Args:
        message (`str`): the warning.
        category (`type[Warning]`, defaults to `UserWarning`): its class.
    """
    frame = inspect.currentframe()
    current = frame.f_back if frame is not None else None
    level = 2  # the caller of this function
    caller_file = current.f_code.co_filename if current is not None else None
    while current is not None and current.f_code.co_filename == caller_file:  # the caller's own frames
        current, level = current.f_back, level + 1
    while current is not None and str(current.f_globals.get("__name__", "")).split(".", 1)[0] in _SKIPPED:
        current, level = current.f_back, level + 1
    del frame, current  # no reference cycle through the frames
    warnings.warn(message, category, stacklevel=level)
