"""A non-finite state on one process only (tests/test_finite_checkpoints.py): ``torchrun --nproc_per_node 2
finite_ckpt.py OUT``. Two fits, one after the other (TinyTask with AdamW, n=32, batch 4: 4 steps per epoch on
2 processes, 2 epochs; a checkpoint every step):

- ``state``: process 1 puts a NaN into its own AdamW state after optimizer step 3 (process 0 writes the optimizer
  file, so no file would show it): the save of step 3 must stop both processes alike, nothing of it written;
- ``batch``: micro-batch 5 of process 1 has a NaN input (DDP averages its NaN gradient into both), with EMA: the save
  of step 5 stops both, between two logging checks (every 4 steps).

Each rank writes ``result-<rank>.json``: each fit's error and the steps of the checkpoints left."""

import json
import sys
from pathlib import Path

import torch

import torchloom
from torchloom.checkpoint.store import list_checkpoints, read_manifest
from torchloom.testing import TinyTask


class Task(TinyTask):
    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        self.nan_at, self.calls = nan_at, 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        x, y = batch
        if self.calls == self.nan_at and self.accelerator.process_index == 1:
            x = x * float("nan")
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=0.01)


class SpoilState:
    """After optimizer step 3, process 1 puts a NaN into its AdamW state."""

    name = "test.spoil_state"

    @torchloom.hookimpl
    def after_optimizer_step(self, optimizer, accelerator, progress) -> None:
        if progress.global_step == 2 and accelerator.process_index == 1:  # counted as step 3 right after
            inner = getattr(optimizer, "optimizer", optimizer)
            next(iter(inner.state.values()))["exp_avg"].view(-1)[0] = float("nan")


def fit(out: Path, task: TinyTask, plugins: list, keep_last: int) -> dict:
    checkpoint = {"every_n_steps": 1, "every_n_epochs": None, "keep_last": keep_last}
    engine = torchloom.Engine(
        output_dir=str(out),
        max_epochs=2,
        log_every_n_steps=4,
        num_sanity_val_steps=0,
        default_plugins=False,
        plugins=[*plugins, {"checkpoint": checkpoint}],
    )
    try:
        engine.fit(task)
        error = None
    except torchloom.TaskError as exc:
        error = str(exc)
    return {"error": error, "steps": [read_manifest(p)["global_step"] for p in list_checkpoints(out)]}


out = Path(sys.argv[1])
state = fit(out / "state", Task(), [SpoilState()], keep_last=1)
batch = fit(out / "batch", Task(nan_at=5), ["ema"], keep_last=2)
rank = int(torch.distributed.get_rank()) if torch.distributed.is_initialized() else 0
hidden = [p.name for p in out.rglob(".*") if not p.name.startswith(".in-use")]
result = {
    "state_error": state["error"],
    "state_steps": state["steps"],
    "batch_error": batch["error"],
    "batch_steps": batch["steps"],
    "hidden": hidden,
}
(out / f"result-{rank}.json").write_text(json.dumps(result))
