"""`FitState`: every counter of a fit that a resume needs, in one object that the loop alone writes.

This state is one entry of a checkpoint's mapping (`torchloom.checkpoint.entries.Part`, next to the data position
and the plugins' states): `FitState.state_dict` gives the main process's part (saved once),
`FitState.process_state_dict` each process's own part (saved by every process), both in the no-pickle format of
`torchloom.checkpoint.plugin_state` (ints, floats, strings, ``None``, tensors). A new resumable counter is one field
here: it is saved, loaded and reset with the others. Where the training data stands is
`torchloom.checkpoint.data_position.DataPosition`'s. Hooks never see this object: they
get the frozen `torchloom.Progress` that `progress` builds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchloom.progress import Progress

__all__ = ["FitState"]

#: Field metadata: a value of each process's own (saved per process), not the main process's. No counter is one
#: today (the data generators' states, which were, belong to `torchloom.checkpoint.data_position.DataPosition`).
PER_PROCESS = {"per_process": True}


@dataclass
class FitState:
    """The state of the fit in progress.

    Attributes:
        epoch (`int`), global_step (`int`), batch_idx (`int`), micro_step (`int`): the loop counters (`Progress`).
        validated_at (`int`): the ``global_step`` of the latest validation of this fit (-1: none yet).
        checked_step (`int`): the optimizer steps whose logged training values were checked (`check_training`).
        checked_scaler_skips (`int`): the fp16 loss-scaler skips up to ``checked_step``.
        skipped_steps (`int`): optimizer steps skipped for a non-finite loss (``nonfinite_loss="skip"``).
        scaler_skipped_steps (`int`): optimizer steps the fp16 loss scaler skipped (an overflow).
        stop_reason (`str` or ``None``): why the fit stopped early, agreed over the processes.
    """

    epoch: int = 0
    global_step: int = 0
    batch_idx: int = 0
    micro_step: int = 0
    validated_at: int = -1
    checked_step: int = 0
    checked_scaler_skips: int = 0
    skipped_steps: int = 0
    scaler_skipped_steps: int = 0
    stop_reason: str | None = None

    def progress(self) -> Progress:
        """The frozen record of the counters that hooks receive."""
        return Progress(self.epoch, self.global_step, self.batch_idx, self.micro_step)

    def state_dict(self) -> dict[str, Any]:
        """The main process's part: every field but the per-process ones."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("per_process")}

    def process_state_dict(self) -> dict[str, Any]:
        """This process's own part: the per-process fields."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("per_process")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what `state_dict` and `process_state_dict` returned (either or both, merged); other keys of
        ``state`` are ignored.

        Raises:
            KeyError: a field's value is missing from ``state``.
        """
        for f in dataclasses.fields(self):
            setattr(self, f.name, state[f.name])
