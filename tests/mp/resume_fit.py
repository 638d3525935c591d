"""Exact resume: the tasks, the probe and the run helpers of tests/test_resume.py, and its torchrun script.

Every scenario compares an uninterrupted run A with a run B that saves a checkpoint
(`torchloom.save_checkpoint`, from ``on_train_step_end`` or ``on_train_epoch_end``) and stops right after it
(`Crash`), continued by a run C: a new `torchloom.Engine` and a new task, ``fit(task, ckpt_path=...)``. B and C
together must be A: the same sample ids in the same order, the same record per optimizer step (LR used,
skipped or not, scaler state, parameters after it), the same ``history``, and at the end bitwise the same
parameters, optimizer state, scheduler, scaler and counters (`snapshot`).

As a script (``torchrun --nproc_per_node 2 resume_fit.py OUT``): the 2-process scenarios, one after another
in one launch; each rank writes ``result-<rank>.json``. ``python resume_fit.py OUT pause_save``: one process
that saves at step 2, then pauses inside the save of step 4 (right before the rename) until it is killed.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import torchloom


class Crash(Exception):
    """Raised right after a checkpoint was saved: the process "dies" there (B stops)."""


# --------------------------------------------------------------------------------------------------- tasks


def id_data(n: int, seed: int = 0) -> TensorDataset:
    """``(id, x, y)`` for ids ``0..n-1``: x of shape 2, y of shape 1, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.arange(n), torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g))


class ShuffleTask(torchloom.TaskModule):
    """C11: ids ``0..n-1`` in batches of ``batch_size``, shuffled by a DataLoader generator seeded to 1 (or,
    ``generator=False``, by none: what the DataLoader draws as it starts then comes from the global generator).

    Linear(2, hidden) -> Dropout(0.5) -> Linear(hidden, 1) (dropout draws from the global torch generator
    every micro-batch), AdamW + StepLR(2, 0.5) (``optimizer="sgd"``: plain SGD, no state and no scheduler;
    ``"sgd+steplr"``: SGD with momentum + StepLR), MSE; logs two more values
    (a max and a sum) so that a checkpoint between two logging steps holds partial sums of three reductions;
    validation on 4 other samples.
    """

    def __init__(
        self,
        n: int = 10,
        batch_size: int = 2,
        optimizer: str = "adamw",
        hidden: int = 8,
        lr: float = 0.05,
        generator: bool = True,
    ) -> None:
        super().__init__()
        self.n, self.batch_size, self.optimizer, self.hidden, self.lr = n, batch_size, optimizer, hidden, lr
        self.generator = generator

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(2, self.hidden), torch.nn.Dropout(0.5), torch.nn.Linear(self.hidden, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        torch.rand(self.accelerator.process_index)  # the ranks' random streams drift apart: each has its own
        out = self.model(x)
        self.log("train/out_max", out.detach().max(), reduce="max")
        self.log("train/ids", batch[0].sum().to(torch.float32), reduce="sum")
        return torch.nn.functional.mse_loss(out, y)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.log("val/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":  # no state, no scheduler
            return torch.optim.SGD(self.model.parameters(), lr=self.lr)
        if self.optimizer == "sgd+steplr":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)
        else:
            optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    def train_dataloader(self) -> DataLoader:
        # Without a generator the DataLoader draws its base seed from the global torch generator as it starts.
        generator = torch.Generator().manual_seed(1) if self.generator else None
        return DataLoader(id_data(self.n), batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(id_data(4, seed=7), batch_size=2)


class GlobalNoise(Dataset):
    """``(id, x, y)`` of `id_data`, x plus noise from the global torch, numpy and Python generators (``draw``)."""

    def __init__(self, n: int, draw: str = "all") -> None:
        self.ids, self.x, self.y = id_data(n).tensors
        self.draw = draw

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        noise = torch.zeros(2)
        if self.draw in ("all", "torch"):
            noise += 0.1 * torch.randn(2)
        if self.draw in ("all", "numpy"):
            noise += torch.from_numpy(np.random.normal(size=2).astype(np.float32))
        if self.draw in ("all", "python"):
            noise += random.random()
        return self.ids[i], self.x[i] + noise, self.y[i]


class AugmentTask(ShuffleTask):
    """`ShuffleTask` (dropout, AdamW + StepLR, shuffled by a seeded generator, 5 steps per epoch) on `GlobalNoise`."""

    def __init__(self, draw: str = "all", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.draw = draw

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1) if self.generator else None
        return DataLoader(GlobalNoise(self.n, self.draw), batch_size=self.batch_size, shuffle=True, generator=generator)


class OverflowTask(torchloom.TaskModule):
    """C10: Linear(2, 1), MSE, batch size 1, 8 samples, SGD(lr 0.1) + StepLR(2, 0.5). Whenever the fp16 loss
    scale is above 2**11 the loss is multiplied by inf: an injected overflow, which the scaler skips."""

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        return loss * math.inf if self.accelerator.scaler.get_scale() > 2**11 else loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    def train_dataloader(self) -> DataLoader:
        ids, x, y = id_data(8).tensors
        return DataLoader(TensorDataset(ids, x * 0.1, y * 0.1), batch_size=1)


# --------------------------------------------------------------------------------------------------- probe


class Probe:
    """Records a fit, and saves checkpoints (then raises `Crash`, unless ``crash=False``).

    ``ids``: the sample ids of every micro-batch this process trained on, in order. ``steps``: one record per
    optimizer step (``on_train_step_end``): the counters, the LR the step used, whether the fp16 scaler skipped
    it, the scaler's state and the parameters after it. ``scale_at_start``: the loss scale when the fit
    starts (after a resume: right after the checkpoint was loaded). ``saved``: the checkpoints written.
    """

    name = "test.resume_probe"

    def __init__(self, save_at: Iterable[int] = (), save_epoch_end: Iterable[int] = (), crash: bool = True) -> None:
        self.save_at, self.save_epoch_end, self.crash = set(save_at), set(save_epoch_end), crash
        self.ids: list[int] = []
        self.steps: list[dict[str, Any]] = []
        self.saved: list[str] = []
        self.scale_at_start: float | None = None
        self.optimizer_at_start: dict[str, Any] | None = None
        self._model: Any = None
        self._lr: float | None = None
        self._skipped = False

    @torchloom.hookimpl
    def on_fit_start(self, accelerator: Any, model: Any, optimizer: Any) -> None:
        self._model = model
        if accelerator.scaler is not None:
            self.scale_at_start = accelerator.scaler.get_scale()
        inner = getattr(optimizer, "optimizer", optimizer)
        self.optimizer_at_start = {
            "state": len(inner.state),
            "lr": [g["lr"] for g in inner.param_groups],
            "class": type(inner).__name__,
        }

    @torchloom.hookimpl
    def on_train_batch_start(self, batch: Any) -> None:
        self.ids += batch[0].tolist()

    @torchloom.hookimpl
    def before_optimizer_step(self, optimizer: Any) -> None:
        self._lr = optimizer.param_groups[0]["lr"]

    @torchloom.hookimpl
    def after_optimizer_step(self, optimizer: Any) -> None:
        self._skipped = bool(optimizer.step_was_skipped)

    @torchloom.hookimpl
    def on_train_step_end(self, accelerator: Any, progress: Any) -> None:
        scaler = accelerator.scaler
        self.steps.append(
            {
                "step": progress.global_step,
                "epoch": progress.epoch,
                "batch_idx": progress.batch_idx,
                "micro_step": progress.micro_step,
                "lr": self._lr,
                "skipped": self._skipped,
                "scaler": None if scaler is None else scaler.state_dict(),
                "params": [p.detach().flatten().tolist() for p in self._model.parameters()],
            }
        )
        if progress.global_step in self.save_at:
            self._save()

    @torchloom.hookimpl
    def on_train_epoch_end(self, progress: Any) -> None:
        if progress.epoch in self.save_epoch_end:
            self._save()

    def _save(self) -> None:
        self.saved.append(torchloom.save_checkpoint())
        if self.crash:
            raise Crash


class DiesAt:
    """Kills the fit (`Crash`) at the end of optimizer step ``step``."""

    name = "test.dies_at"

    def __init__(self, step: int) -> None:
        self.step = step

    @torchloom.hookimpl
    def on_train_step_end(self, progress: Any) -> None:
        if progress.global_step == self.step:
            raise Crash


# ---------------------------------------------------------------------------------------------- running


class Run:
    """One fit: the engine, the task and the probe, and whether it stopped with `Crash`."""

    def __init__(self, engine: torchloom.Engine, task: torchloom.TaskModule, probe: Probe, crashed: bool) -> None:
        self.engine, self.task, self.probe, self.crashed = engine, task, probe, crashed

    @property
    def checkpoint(self) -> str:
        return self.probe.saved[-1]


def fit(
    make_task: Callable[[], torchloom.TaskModule],
    output_dir: str | Path,
    plugins: Sequence[Any] = (),
    *,
    save_at: Iterable[int] = (),
    save_epoch_end: Iterable[int] = (),
    crash: bool = True,
    ckpt_path: str | None = None,
    reset_optimizer: bool = False,
    **settings: Any,
) -> Run:
    """Fit a new ``make_task()`` with a new Engine (``max_epochs=3, log_every_n_steps=3,
    val_check_interval=4`` unless given) and a `Probe`; a `Crash` ends the fit quietly."""
    settings = {"max_epochs": 3, "log_every_n_steps": 3, "val_check_interval": 4, **settings}
    probe = Probe(save_at, save_epoch_end, crash)
    engine = torchloom.Engine(plugins=[*plugins, probe], output_dir=str(output_dir), **settings)
    task = make_task()
    if settings.get("seed", 0) is None:
        torch.manual_seed(0)  # the same initial model in every run (the engine leaves the random state alone)
    try:
        engine.fit(task, ckpt_path=ckpt_path, reset_optimizer=reset_optimizer)
        crashed = False
    except Crash:
        crashed = True
    return Run(engine, task, probe, crashed)


def stop_and_resume(
    make_task: Callable[[], torchloom.TaskModule],
    output_dir: str | Path,
    plugins: Sequence[Any] = (),
    *,
    save_at: Iterable[int] = (),
    save_epoch_end: Iterable[int] = (),
    **settings: Any,
) -> tuple[Run, Run]:
    """Run B (stops right after saving) and run C (resumes B's checkpoint in a new Engine), in one output_dir."""
    b = fit(make_task, output_dir, plugins, save_at=save_at, save_epoch_end=save_epoch_end, **settings)
    assert b.crashed, "run B never saved"
    c = fit(make_task, output_dir, plugins, ckpt_path=b.checkpoint, **settings)
    assert not c.crashed and c.engine.resumed_from == b.checkpoint
    return b, c


def _plain(value: Any) -> Any:
    """Tensors -> ``["tensor", dtype, shape, values]``, recursively: comparable with ``==`` (exact for floats)
    and writable as JSON (floats round-trip exactly)."""
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), list(value.shape), value.detach().cpu().flatten().tolist()]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def snapshot(engine: torchloom.Engine) -> dict[str, Any]:
    """Everything that must be bitwise the same at the end of A and of C."""
    run = engine._run
    assert run is not None
    acc = run.accelerator
    model = acc.unwrap_model(run.model)
    inner = getattr(run.optimizer, "optimizer", run.optimizer)
    optimizer = inner.state_dict()
    scheduler = run.scheduler
    return {
        "params": {name: _plain(p) for name, p in model.named_parameters()},
        "optimizer_class": type(inner).__name__,
        "optimizer_state": _plain(optimizer["state"]),
        "param_groups": _plain([{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]]),
        "scheduler": None
        if scheduler is None
        else {"last_lr": list(scheduler.get_last_lr()), "state": _plain(scheduler.state_dict())},
        "scaler": None if acc.scaler is None else _plain(acc.scaler.state_dict()),
        "global_step": engine.progress.global_step,
        "micro_step": engine.progress.micro_step,
        "epoch": engine.progress.epoch,
        "accelerate_step": acc.step,
        # the fit's counts as logged (train/skipped_steps with nonfinite_loss="skip", the scaler's with fp16)
        "skipped_steps": [
            engine.logged_metrics.get("train/skipped_steps", 0),
            engine.logged_metrics.get("train/scaler_skipped_steps", 0),
        ],
    }


def metrics_file(engine: torchloom.Engine) -> list[dict[str, Any]]:
    """The records of the engine's last run's ``metrics.jsonl`` (the main process wrote it; every process reads)."""
    assert engine.run_dir is not None
    return [json.loads(line) for line in (Path(engine.run_dir) / "metrics.jsonl").read_text().splitlines()]


def record(a: Run, b: Run, c: Run) -> dict[str, Any]:
    """What a test compares, as JSON: A's and B+C's ids, step records and history, A's and C's snapshots, and A's
    and C's ``metrics.jsonl`` (C's starts with B's records, carried over: ``c_carried`` counts those marked)."""
    c_file = metrics_file(c.engine)
    return {
        "a_ids": a.probe.ids,
        "bc_ids": b.probe.ids + c.probe.ids,
        "a_steps": a.probe.steps,
        "bc_steps": b.probe.steps + c.probe.steps,
        "a_history": _plain(list(a.engine.history)),
        "bc_history": _plain(list(b.engine.history) + list(c.engine.history)),
        "a": snapshot(a.engine),
        "c": snapshot(c.engine),
        "b_global_step": b.engine.progress.global_step,
        "checkpoint": b.checkpoint,
        "a_file": metrics_file(a.engine),
        "b_file": metrics_file(b.engine),
        "c_file": [{k: v for k, v in r.items() if k != "carried_over_from"} for r in c_file],
        "c_carried": [r.get("carried_over_from") for r in c_file],
        "b_run_dir": b.engine.run_dir,
    }


# ------------------------------------------------------------------------------------ torchrun scenarios


MP_SCENARIOS: dict[str, dict[str, Any]] = {
    # 16 ids, 2 per process and step: 4 steps per epoch, 12 in all. Mid-epoch 1, the end of epoch 1 (a step
    # checkpoint) and the end of epoch 0 (an epoch-end checkpoint).
    "ddp": {"task": {"n": 16}, "plugins": [], "stops": [{"save_at": [6]}, {"save_at": [8]}, {"save_epoch_end": [0]}]},
    # The same with seed=None: the DataLoader's generator shuffles (rank 0's, synchronised to every rank).
    "ddp_unseeded": {"task": {"n": 16}, "plugins": [], "settings": {"seed": None}, "stops": [{"save_at": [6]}]},
    # 20 ids: 5 micro-batches per process and epoch, windows 2, 2, 1: 3 steps per epoch. The end of epoch 0
    # (after its partial window), the window before it, and mid-epoch 1.
    "grad_accum": {
        "task": {"n": 20},
        "plugins": [{"grad_accum": {"steps": 2}}],
        "stops": [{"save_at": [2]}, {"save_at": [3]}, {"save_at": [4]}],
    },
    # K = 2, SGD: right after the averages of steps 4 and 6 (between two averages: MID_INTERVAL_SCENARIOS).
    "local_sgd": {
        "task": {"n": 16, "optimizer": "sgd"},
        "plugins": [{"local_sgd": {"sync_every": 2}}],
        "stops": [{"save_at": [4]}, {"save_at": [6]}],
    },
}

#: LocalSGD and DiLoCo stopped between two averages (tests/plugins/test_local_sgd_resume.py), with AdamW: the
#: processes' parameters and Adam moments differ there. 16 ids, 4 steps per epoch, 12 in all.
MID_INTERVAL_SCENARIOS: dict[str, dict[str, Any]] = {
    # K = 2: step 5 is one step after the average of step 4 (and mid-epoch 1).
    "lsgd_k2": {"task": {"n": 16}, "plugins": [{"local_sgd": {"sync_every": 2}}], "stops": [{"save_at": [5]}]},
    # K = 3: one and two steps after the average of step 3; SGD with momentum (a momentum buffer per process).
    "lsgd_k3": {
        "task": {"n": 16, "optimizer": "sgd+steplr"},
        "plugins": [{"local_sgd": {"sync_every": 3}}],
        "stops": [{"save_at": [4]}, {"save_at": [5]}],
    },
    # K = 3 on data augmented with the global generators (`AugmentTask`): step 5 is two steps after the average
    # of step 3 and the first batch of epoch 1 (whose look-ahead fetch was in the loader's first call).
    "lsgd_k3_augment": {
        "task": {"n": 16},
        "task_class": "augment",
        "plugins": [{"local_sgd": {"sync_every": 3}}],
        "stops": [{"save_at": [5]}],
    },
    # DiLoCo (Nesterov), K = 3: two steps after the outer step of step 3; the global parameters and the outer
    # momentum are the plugin's, the inner AdamW moments each process's own.
    "diloco_k3": {
        "task": {"n": 16},
        "plugins": [{"local_sgd": {"sync_every": 3, "outer_optimizer": "nesterov"}}],
        "stops": [{"save_at": [5]}],
    },
}


def run_mp_scenarios(out: Path, names: Sequence[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in names:
        spec = {**MP_SCENARIOS, **MID_INTERVAL_SCENARIOS}[name]

        def make(spec: dict[str, Any] = spec) -> torchloom.TaskModule:
            return (AugmentTask if spec.get("task_class") == "augment" else ShuffleTask)(**spec["task"])

        settings = spec.get("settings", {})
        a = fit(make, out / name / "a", spec["plugins"], **settings)
        results[name] = []
        for i, stop in enumerate(spec["stops"]):
            b, c = stop_and_resume(make, out / name / f"bc{i}", spec["plugins"], **stop, **settings)
            results[name].append({"stop": stop, **record(a, b, c)})
    return results


def pause_save(out: Path) -> None:
    """Save at step 2 (complete), then pause inside the save of step 4, right before its rename."""
    from torchloom.checkpoint import manifest as _manifest

    original = _manifest._fsync_tree

    def paused(root: Path) -> None:
        original(root)
        if "step-00000004" in root.name:
            (out / "paused").write_text(str(root))
            time.sleep(600)

    _manifest._fsync_tree = paused
    fit(ShuffleTask, out / "run", save_at=[2, 4], crash=False)


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    if argv[1:] == ["pause_save"]:
        pause_save(out)
        return
    results = run_mp_scenarios(out, argv[1:] or list(MP_SCENARIOS))
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_initialized() else 0
    results["rank"], results["world_size"] = rank, dist.get_world_size() if dist.is_initialized() else 1
    (out / f"result-{rank}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
