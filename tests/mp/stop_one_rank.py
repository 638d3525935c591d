"""A stop requested on one rank only (tests/test_log_reductions.py): ``torchrun --nproc_per_node 2 stop_one_rank.py
OUT RANK``. Rank RANK calls ``request_stop`` in its 5th micro-batch; both ranks must stop after the same optimizer
step (the next logging check, step 6 with ``log_every_n_steps=2``) and end the fit as a success. Each rank writes
``result-<rank>.json``: its final step, stop reason and whether the fit completed."""

import json
import sys
from pathlib import Path

import torchloom
from torchloom.testing import TinyTask


class StopOnOneRank(TinyTask):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.steps = rank, 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        if self.steps == 5 and self.accelerator.process_index == self.rank:
            self.request_stop(f"rank {self.rank} asked")
        return super().training_step(batch, batch_idx)


out, rank = Path(sys.argv[1]), int(sys.argv[2])
task = StopOnOneRank(rank)
engine = torchloom.Engine(max_epochs=3, log_every_n_steps=2, output_dir=str(out / "run"))
metrics = engine.fit(task)  # n=32, batch 4, 2 processes: 4 steps per epoch
result = {"step": engine.progress.global_step, "reason": engine.stop_reason, "val_loss": metrics["val/loss"]}
(out / f"result-{task.accelerator.process_index}.json").write_text(json.dumps(result))
