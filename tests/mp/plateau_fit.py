"""ReduceLROnPlateau on 2 processes: each process logs a value of its own (its shard's loss plus its rank, as
``val/score``), and the scheduler of every process gets the value reduced over both (the logged one), so they step
alike. Each rank writes the values its scheduler got, the logged values, its own values and its learning rate."""

import json
import sys
from pathlib import Path

import torch

from torchloom.testing import TinyTask, tiny_fit

out = Path(sys.argv[1])


class Plateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.calls = []

    def step(self, metrics, epoch=None):
        self.calls.append(float(metrics))
        super().step(metrics)


class PlateauTask(TinyTask):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.scheduler = Plateau(optimizer, mode="max", patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler, "monitor": "val/score"}}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        score = ((self.model(x) - y) ** 2).mean() + self.accelerator.process_index  # differs between processes
        self.log("val/score", score)
        self.own = [*getattr(self, "own", []), float(score)]
        return super().validation_step(batch, batch_idx)


task = PlateauTask()
engine = tiny_fit([], task=task, val_check_interval=2, max_epochs=1, num_sanity_val_steps=0, output_dir=str(out))
result = {
    "calls": task.scheduler.calls,
    "logged": [r["val/score"] for r in engine.history if "val/score" in r],
    "own": task.own,
    "lr": task.scheduler.optimizer.param_groups[0]["lr"],
}
rank = task.accelerator.process_index
(out / f"result-{rank}.json").write_text(json.dumps(result))
torch.distributed.barrier()
