"""Every reduction of logged values on 2 processes (tests/test_log_reductions.py): ``torchrun --nproc_per_node 2
log_reductions_mp.py OUT``. In micro-batch k (1-based, one per optimizer step) rank r logs k + 100 r under each
reduction, as a tensor and as a Python float; each rank writes the records of its ``engine.history``."""

import json
import sys
from pathlib import Path

import torch

import torchloom
from torchloom.testing import TinyTask


class RankLogs(TinyTask):
    def __init__(self) -> None:
        super().__init__(n=32, batch_size=4, validate=False)  # 4 steps per epoch on each of 2 processes
        self.count = 0

    def training_step(self, batch, batch_idx):
        self.count += 1
        value = self.count + 100 * self.accelerator.process_index
        for reduce in ("mean", "sum", "max", "min", "last"):
            self.log(f"t/{reduce}", torch.tensor(float(value)), reduce=reduce)
            self.log(f"f/{reduce}", float(value), reduce=reduce)
        return super().training_step(batch, batch_idx)


out = Path(sys.argv[1])
task = RankLogs()
engine = torchloom.Engine(max_epochs=1, log_every_n_steps=2, output_dir=str(out / "run"))
engine.fit(task)
records = [{k: v for k, v in r.items() if k[:2] in ("t/", "f/") or k == "step"} for r in engine.history]
(out / f"result-{task.accelerator.process_index}.json").write_text(json.dumps(records))
