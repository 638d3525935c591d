"""No host-device sync per step anywhere on the hot path: over a fit with every built-in plugin enabled and
logging every 20 optimizer steps, torchloom's code (core and built-in plugins) reads a tensor's value on the host
(``.item()``, ``.tolist()``, ``float()`` / ``int()`` / ``bool()`` of a tensor) only at logging, checkpoint and
validation steps, never on the micro-batches in between.

On CPU such a read is no sync, but it is the same call that would wait for a GPU: counting the calls made from
torchloom's own frames finds them on any device (torch's own internals, e.g. the CPU Adam's step counter, are not
counted)."""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom

ROOTS = tuple(
    os.path.dirname(m.__file__)
    for m in (sys.modules["torchloom"], __import__("torchloom_plugins"))
    if m.__file__ is not None
)
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
LOG_EVERY = 20


class Task(torchloom.TaskModule):
    def configure_model(self):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        self.log("val/loss", torch.nn.functional.cross_entropy(logits, y))
        return {"preds": logits.softmax(-1)[:, 1], "target": y}


class Where:
    """Where the loop is: the micro-batch being trained or just trained (its logging, checkpoint, validation)."""

    name = "where"

    def __init__(self) -> None:
        self.batch: tuple[int, int] | None = None  # (global_step before the micro-batch, micro_step)

    @torchloom.hookimpl
    def on_train_batch_start(self, progress) -> None:
        self.batch = (progress.global_step, progress.micro_step)

    @torchloom.hookimpl
    def on_train_end(self) -> None:
        self.batch = None


@pytest.fixture
def reads(monkeypatch):
    where = Where()
    found: Counter = Counter()
    for method in READS:
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _method=method, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if where.batch is not None and caller.startswith(ROOTS):
                found[(where.batch, _method, f"{os.path.basename(caller)}:{sys._getframe(1).f_lineno}")] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    return where, found


#: 8 samples per optimizer step: grad_accum's 2 batches of 4, or auto_batch's batch of 8 in 4 pieces of 2 (with its
#: out-of-memory agreement after each piece and in the optimizer step).
ACCUMULATION = {
    "grad_accum": (4, {"grad_accum": {"steps": 2}}),
    "auto_batch": (8, {"auto_batch": {"micro_batch_size": 2}}),
}


@pytest.mark.parametrize(
    "accumulation",
    ["grad_accum", pytest.param("auto_batch", marks=pytest.mark.slow)],  # 25 s each on a CPU core
)
def test_no_plugin_reads_a_tensor_on_the_host_between_logging_steps(tmp_path, reads, accumulation):
    where, found = reads
    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 8, generator=g)
    batch_size, accumulating = ACCUMULATION[accumulation]
    data = DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=batch_size)
    val = DataLoader(TensorDataset(x[:32], (x[:32].sum(1) > 0).long()), batch_size=8)
    plugins = {
        **accumulating,
        "grad_checkpoint": {"modules": ["0", "2"]},
        "grad_clip": {"max_norm": 1.0},
        "mixed_precision": {"dtype": "bf16"},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "local_sgd": {"sync_every": 4},
        "eval_metrics": {"metrics": {"auroc": {"task": "binary"}, "accuracy": {"task": "binary"}}},
        "early_stopping": {"monitor": "val/loss", "patience": 100},
        "checkpoint": {"every_n_steps": LOG_EVERY, "keep_last": 1},
        "progress": {"terminal": False},
        "trackers": {"log_with": ["tensorboard"]},
        "compile": {"backend": "eager"},
    }
    engine = torchloom.Engine(
        max_epochs=1,
        output_dir=str(tmp_path),
        log_every_n_steps=LOG_EVERY,
        val_check_interval=LOG_EVERY * 2,
        num_sanity_val_steps=0,
        plugins=[*({k: v} for k, v in plugins.items()), where],
    )
    engine.fit(Task(), train_dataloader=data, val_dataloader=val)
    assert engine.progress.global_step == 40
    # A logging (or checkpoint / validation) step ends the micro-batch that makes global_step a multiple of LOG_EVERY.
    boundary = {(step, micro) for (step, micro), _, _ in found if (step + 1) % LOG_EVERY == 0}
    between = {key: n for key, n in found.items() if key[0] not in boundary}
    assert not between, f"host reads of tensors between logging steps: {sorted(between.items())[:10]}"
    assert found, "the counter saw no read at all: it would not catch one either"
