"""Rank 1 logs a name rank 0 does not: both ranks must get one clear error at the logging step (not a hang)."""

import json
import sys
from pathlib import Path

import torchloom
from torchloom.testing import TinyTask


class RankDependentLogging(TinyTask):
    def training_step(self, batch, batch_idx):
        if self.accelerator.process_index == 1:
            self.log("only/rank1", 1.0)
        return super().training_step(batch, batch_idx)


out = Path(sys.argv[1])
task = RankDependentLogging(validate=False)
engine = torchloom.Engine(log_every_n_steps=2, output_dir=str(out / "run"))
try:
    engine.fit(task)
    error = None
except torchloom.TaskError as exc:
    error = str(exc)
rank = task.accelerator.process_index
(out / f"result-{rank}.json").write_text(json.dumps({"error": error, "step": engine.progress.global_step}))
