"""Two ranks fit TinyTask under DDP and save a checkpoint at step 2 (tests/test_inspect_predict.py predicts from it
on one process); each rank reports the weights it trained at that step."""

import json
import sys
from pathlib import Path

import torch

import torchloom
from torchloom.testing import TinyTask, tiny_fit

out = Path(sys.argv[1])


class SaveAt:
    name = "save_at"

    def __init__(self, task) -> None:
        self.task, self.path, self.weights = task, None, None

    @torchloom.hookimpl
    def on_train_step_end(self, accelerator, progress):
        if progress.global_step == 2:
            self.path = torchloom.save_checkpoint()
            trained = accelerator.unwrap_model(self.task.model).state_dict()
            self.weights = {k: v.tolist() for k, v in trained.items()}


task = TinyTask()
save_at = SaveAt(task)
tiny_fit([save_at], task=task, max_epochs=1, output_dir=str(out / "run"))
acc = task.accelerator
result = {
    "rank": acc.process_index,
    "wrapped": type(task.model).__name__,
    "checkpoint": save_at.path,
    "weights": save_at.weights,
}
(out / f"result-{acc.process_index}.json").write_text(json.dumps(result))
torch.distributed.barrier()
