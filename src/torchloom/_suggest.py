"""Did you mean: the closest known name to a misspelt one (difflib's ratio, as pytest and argparse suggest)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest"]


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like ``name`` (`difflib.get_close_matches`, similarity >= 0.6), or ``None``.

    Example: ``closest("val/los", ["train/loss", "val/loss"]) == "val/loss"``; ``closest("x", ["lr"]) is None``.
    """
    matches = difflib.get_close_matches(str(name), list(candidates), n=1)
    return matches[0] if matches else None
