"""Names the core reserves, in one place, for the core and for plugins (which use them through ``torchloom``)."""

from __future__ import annotations

__all__ = ["INTERNAL_PREFIX"]

INTERNAL_PREFIX = "torchloom/"
"""The prefix of the logged names that are the engine's own checks (``torchloom/weight/train/loss``, the items
a training loss is a mean over; ``torchloom/negative_num_items``). They are reduced with the other values at each
logging step and never reach ``on_log``, ``metrics.jsonl`` or ``engine.history``, so a plugin that watches a
logged name refuses one under it: ``if monitor.startswith(torchloom.utils.INTERNAL_PREFIX): raise ConfigError(...)``.
"""
