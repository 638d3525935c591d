"""The ``early_stopping`` plugin on 2 processes: each rank logs its own ``val/loss`` per validation pass, and only
their mean is the scripted sequence. Rank 0's values alone keep improving; rank 1's alone would stop at step 8;
the means 1.0, 0.75 (best), 0.875, 0.8125, 0.9375 stop both ranks at step 10 with patience 3. Each rank reports
its step, stop reason, plugin state and the val/loss history."""

import json
import sys
from pathlib import Path

import torch

from torchloom.testing import TinyTask, tiny_fit
from torchloom_plugins.early_stopping import EarlyStopping

out = Path(sys.argv[1])

MEANS = [1.0, 0.75, 0.875, 0.8125, 0.9375, 0.5, 0.5, 0.5]
# rank 0 logs mean + d, rank 1 mean - d: rank 0 sees 1.0, 0.25, 0.125, 0.0625, -0.0625 (always better); rank 1
# sees 1.0, 1.25, 1.625, 1.5625, 1.9375 (best at the first pass: alone it would stop at the 4th, step 8).
OFFSETS = [0.0, -0.5, -0.75, -0.75, -1.0, 0.0, 0.0, 0.0]


class SplitTask(TinyTask):
    """TinyTask, 32 samples in batches of 4: 4 optimizer steps per epoch per rank on 2 processes."""

    def __init__(self) -> None:
        super().__init__()
        self.passes, self.local_values = 0, []

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            sign = 1.0 if self.accelerator.process_index == 0 else -1.0
            value = MEANS[self.passes] + sign * OFFSETS[self.passes]
            self.local_values.append(value)
            self.log("val/loss", value)
            self.passes += 1


task, stopper = SplitTask(), EarlyStopping(patience=3)
engine = tiny_fit(
    [stopper], task=task, output_dir=str(out / "run"), val_check_interval=2, max_epochs=4, num_sanity_val_steps=0
)
acc = engine.accelerator
result = {
    "rank": acc.process_index,
    "world_size": acc.num_processes,
    "global_step": engine.progress.global_step,
    "stop_reason": engine.stop_reason,
    "state": stopper.state_dict(),
    "local_values": task.local_values,
    "val_loss": [[r["step"], r["val/loss"]] for r in engine.history if "val/loss" in r],
}
(out / f"result-{acc.process_index}.json").write_text(json.dumps(result))
torch.distributed.barrier()
