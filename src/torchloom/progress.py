"""The small frozen record of loop counters that hooks receive instead of the engine."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Progress"]


@dataclass(frozen=True, slots=True)
class Progress:
    """Where the loop is. A new instance is made for every micro-batch; hooks may keep it but never mutate it.

    Attributes:
        epoch (`int`): 0-based index of the current epoch.
        global_step (`int`): optimizer steps (accumulation windows) completed so far in this fit. A step the
            fp16 loss scaler skipped still counts, as in the HF Trainer; micro-batches never count.
        batch_idx (`int`): 0-based index of the current micro-batch within the epoch.
        micro_step (`int`): micro-batches completed so far in this fit, over all epochs.
    """

    epoch: int = 0
    global_step: int = 0
    batch_idx: int = 0
    micro_step: int = 0
