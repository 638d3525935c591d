"""Did you mean: the closest known name to a misspelt one (difflib's ratio, as pytest and argparse suggest)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest_name"]


def closest_name(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like ``name``, for a "did you mean" in an error message, or ``None`` when none is close.

    Uses `difflib.get_close_matches` (similarity ratio >= 0.6, as argparse and pytest suggest). Every "did you
    mean" of torchloom comes from here (settings, plugin names, monitored values, metric and optimizer names).

    Args:
        name (`str`): the misspelt name.
        candidates (`Iterable[str]`): the valid names.

    Returns:
        `str` or ``None``: the closest valid name.

    Example: ``closest_name("val/los", ["train/loss", "val/loss"]) == "val/loss"``;
    ``closest_name("x", ["lr"]) is None``.
    """
    matches = difflib.get_close_matches(str(name), list(candidates), n=1)
    return matches[0] if matches else None
