"""The checkpoint plugin on 2 processes: rank 1 alone receives SIGTERM in optimizer step 3. Both processes agree one
step later, save the same checkpoint, and stop with TrainingInterrupted; a resumed fit then ends with the parameters
of an uninterrupted fit, bitwise."""

import json
import os
import signal
import sys
from pathlib import Path

import torch

import torchloom
from torchloom.testing import TinyTask

out = Path(sys.argv[1])


class Preempted(TinyTask):
    def __init__(self, at: int = 0):
        super().__init__(n=64, batch_size=4, lr=0.05)
        self.at, self.steps = at, 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        if self.steps == self.at and self.accelerator.process_index == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def fit(task, output_dir, **kwargs):
    engine = torchloom.Engine(
        output_dir=str(output_dir), max_epochs=2, plugins={"checkpoint": {"every_n_epochs": None}}
    )
    engine.fit(task, **kwargs)
    return [p.detach().clone() for p in task.accelerator.unwrap_model(task.model).parameters()]


uninterrupted = fit(Preempted(), out / "whole")
try:
    fit(Preempted(at=3), out / "cut")
    raise AssertionError("not interrupted")
except torchloom.TrainingInterrupted as exc:
    interrupted = exc
resumed_task = Preempted()
resumed = fit(resumed_task, out / "cut", ckpt_path=interrupted.checkpoint)
rank = resumed_task.accelerator.process_index
result = {
    "interrupted_at": interrupted.global_step,
    "checkpoint": interrupted.checkpoint,
    "signal": interrupted.signal_number,
    "resumed_equals_uninterrupted": all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed)),
    "params": [x for p in resumed for x in p.flatten().tolist()],
}
(out / f"result-{rank}.json").write_text(json.dumps(result))
