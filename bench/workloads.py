"""The workloads, the work settings and the runners that the overhead benchmarks time, all in one place.

Every runner trains the same model on the same in-memory batches and computes the loss with the same function
(`Workload.loss`), which first ticks a `Clock`. The clock is the one timer of every runner: it reads
``time.perf_counter()`` at the start of micro-batch ``warmup`` (before its forward) and again at the start of
micro-batch ``warmup + steps``, then raises `Done` to end the run there. So the timed span is exactly ``steps``
whole micro-steps (forward, backward, optimizer step at each window's end, hooks, logging, data loading of the
next batch) in every runner, and nothing of the set-up (building the Accelerator, the model, ``prepare``, the
Trainer) nor of the first ``warmup`` micro-steps (lazy optimizer state, allocator growth, first kernel calls).

Runners:

- ``hand``: the loop a user writes with Accelerate (`hand_loop`), doing exactly the work of the `Work` settings.
- ``torchloom``: `torchloom.Engine` with the plugins that give that work (public API only).
- ``fabric``: a Lightning Fabric loop; ``trainer``: a lean `lightning.Trainer` (no logger, no checkpointing, no
  progress bar, no model summary). Both need the ``lightning`` package (installed by ``nox -s bench`` only).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from torchloom_plugins.optimizer import release_overrides

LR = 1e-3


class Done(Exception):
    """Raised by `Clock.tick` at the end of the timed span: ends a run of any runner at the same point."""


class Clock:
    """Times ``steps`` micro-steps after ``warmup`` micro-steps; see the module docstring."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.start, self.stop = warmup, warmup + steps
        self.count = 0
        self.t0 = self.t1 = None

    def tick(self) -> None:
        i = self.count
        self.count = i + 1
        if i == self.start:
            self.t0 = time.perf_counter()
        elif i == self.stop:
            self.t1 = time.perf_counter()
            raise Done

    def seconds(self) -> float:
        if self.t0 is None or self.t1 is None:
            raise RuntimeError(f"the run ended after {self.count} micro-steps, before the timed span ended")
        return self.t1 - self.t0


# ------------------------------------------------------------------------------------------------ workloads


@dataclass(frozen=True)
class Workload:
    """A model, its batches and its loss."""

    name: str
    label: str
    batch_size: int
    build_model: Callable[[], torch.nn.Module]
    make_data: Callable[[int], TensorDataset]
    forward: Callable[[torch.nn.Module, Any], torch.Tensor]

    def loss(self, model: torch.nn.Module, batch: Any, clock: Clock) -> torch.Tensor:
        clock.tick()
        return self.forward(model, batch)

    def loader(self, micro_steps: int) -> DataLoader:
        return DataLoader(self.make_data(micro_steps * self.batch_size), batch_size=self.batch_size)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))


def _mlp_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 2, (n,), generator=g))


def _mlp_forward(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


BERT_SEQ = 128


def _bert() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, num_labels=2
    )
    return transformers.BertForSequenceClassification(config)


def _bert_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 30522, (n, BERT_SEQ), generator=g), torch.randint(0, 2, (n,), generator=g))


def _bert_forward(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


W1 = Workload("W1", "W1 overhead-bound (MLP 32→64→2, batch 32, AdamW)", 32, _mlp, _mlp_data, _mlp_forward)
W2 = Workload(
    "W2",
    f"W2 compute-bound (BERT hidden 256 x 4 layers, seq {BERT_SEQ}, batch 16, AdamW)",
    16,
    _bert,
    _bert_data,
    _bert_forward,
)
WORKLOADS = {"W1": W1, "W2": W2}


# ------------------------------------------------------------------------------------------------- the work


@dataclass(frozen=True)
class Work:
    """What a run does besides forward and backward; every runner does exactly this."""

    name: str
    accum: int = 1  # micro-batches per optimizer step (the loss is divided by it: Accelerate's backward does)
    precision: str = "no"  # "no" (fp32) or "bf16" (autocast of the forward)
    clip: float | None = None  # clip the total gradient 2-norm to this before each optimizer step
    optimizer: str = "adamw"  # "adamw" (torch) or "adamw8bit" (bitsandbytes; its CPU kernels on a CPU)

    def describe(self) -> str:
        parts = [f"grad_accum {self.accum}"] if self.accum > 1 else []
        parts += [self.precision] if self.precision != "no" else []
        parts += [f"grad_clip {self.clip:g}"] if self.clip is not None else []
        parts += [self.optimizer] if self.optimizer != "adamw" else []
        return " + ".join(parts) or "fp32, AdamW, no accumulation, no clipping"


PLAIN = Work("plain")
REALISTIC = Work("realistic", accum=2, precision="bf16", clip=1.0, optimizer="adamw8bit")
BF16 = Work("bf16", precision="bf16")

#: torchloom plugins that give each work (settings as in a config file); the optimizer's settings are the ones
#: `make_optimizer` uses: lr 1e-3, weight decay 0, betas (0.9, 0.999), eps 1e-8, min_8bit_size 4096, embeddings
#: with 32-bit state.
TORCHLOOM_PLUGINS: dict[str, dict[str, dict[str, Any]]] = {
    "plain": {},
    "bf16": {"mixed_precision": {"dtype": "bf16"}},
    "realistic": {
        "grad_accum": {"steps": 2},
        "mixed_precision": {"dtype": "bf16"},
        "grad_clip": {"max_norm": 1.0},
        "optimizer": {"name": "adamw8bit", "lr": LR},
    },
}

#: Every built-in plugin with settings that make it a no-op on one process without validation data: the work of a
#: run with all of them is PLAIN. A built-in not listed here has no such setting (see `NO_NOOP`).
NOOP_SETTINGS: dict[str, dict[str, Any]] = {
    "grad_accum": {"steps": 1},
    "mixed_precision": {"dtype": "no"},
    # the same AdamW as the task's own (weight decay 0: one group; torch's default on a CPU, the for-loop)
    "optimizer": {"name": "adamw", "lr": LR, "implementation": "for_loop"},
    "local_sgd": {"sync_every": 8},  # one process: LocalSGD does nothing (and warns once)
    "checkpoint": {"every_n_steps": None, "every_n_epochs": 1000, "save_on_interrupt": False},  # never saves
    "early_stopping": {"monitor": "train/loss", "patience": 1_000_000},  # never stops
    "eval_metrics": {"metrics": {"accuracy": {"task": "binary"}}},  # no validation data: never updated
    "progress": {"enabled": False},
}
#: Built-ins whose every setting does work, so they are not in the no-op set: why.
NO_NOOP = {
    "grad_clip": "max_norm must be finite, so it always computes and logs the norm; it is in the realistic set",
    "grad_checkpoint": "a 'modules' entry that matches nothing is an error",
    "trackers": "always writes to a tracker at the logging interval",
    "compile": "always compiles the model",
}


def builtin_plugin_names() -> list[str]:
    """The plugins that the torchloom distribution itself registers (the built-ins), by name."""
    return sorted(
        name
        for name, infos in torchloom.installed_plugins().items()
        if any(i.distribution == "torchloom" for i in infos)
    )


def noop_plugins() -> tuple[dict[str, dict[str, Any]], list[str]]:
    """``(plugins, notes)``: `NOOP_SETTINGS` for the installed built-ins, and a note per built-in left out."""
    builtins = builtin_plugin_names()
    plugins = {name: settings for name, settings in NOOP_SETTINGS.items() if name in builtins}
    notes = [
        f"{name}: not in the no-op set ({NO_NOOP.get(name, 'no no-op setting known to the benchmark')})"
        for name in builtins
        if name not in plugins
    ]
    return plugins, notes


# ------------------------------------------------------------------------------------------------ optimizers


def make_optimizer(model: torch.nn.Module, work: Work) -> torch.optim.Optimizer:
    """The optimizer the hand loop, Fabric and the Trainer use: what torchloom's ``optimizer`` plugin builds for
    the same settings (one group, weight decay 0; for 8-bit AdamW, 32-bit state for embeddings as the HF
    Trainer does)."""
    group = [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": 0.0}]
    if work.optimizer == "adamw":
        return torch.optim.AdamW(group, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    import bitsandbytes as bnb

    optimizer = bnb.optim.AdamW8bit(group, lr=LR, betas=(0.9, 0.999), eps=1e-8, min_8bit_size=4096)
    manager = bnb.optim.GlobalOptimManager.get_instance()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


def release_optimizer(model: torch.nn.Module, optimizer: Any) -> None:
    """Drop the process-wide bitsandbytes overrides `make_optimizer` registered (so that the next run in this
    process starts clean), with the optimizer plugin's own `release_overrides`, as its teardown does."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # unwrap AcceleratedOptimizer / Fabric's wrapper
    if "bitsandbytes" in type(optimizer).__module__:
        release_overrides(model, optimizer)


# --------------------------------------------------------------------------------------------------- runners


def hand_loop(workload: Workload, work: Work, clock: Clock, micro_steps: int) -> None:
    """The loop a user writes with Accelerate for ``work``: ``accumulate`` only when accumulating, the mixed
    precision and accumulation given to the Accelerator, clipping with ``clip_grad_norm_``, and the optimizer
    stepped (and zeroed) only when ``sync_gradients`` is true, as torchloom's default step does."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()  # as torchloom's engine does before each run
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision=work.precision, gradient_accumulation_steps=work.accum)
    model = workload.build_model()
    optimizer = make_optimizer(model, work)
    model, optimizer, loader = accelerator.prepare(model, optimizer, workload.loader(micro_steps))
    model.train()
    accumulate = accelerator.accumulate if work.accum > 1 else _no_context
    try:
        for batch in loader:
            with accumulate(model):
                loss = workload.loss(model, batch, clock)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    if work.clip is not None:
                        accelerator.clip_grad_norm_(model.parameters(), work.clip)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
    except Done:
        pass
    finally:
        release_optimizer(model, optimizer)


@contextlib.contextmanager
def _no_context(model: Any):
    yield


class BenchTask(torchloom.TaskModule):
    """The workload as a torchloom task (its own optimizer: the plain AdamW of `make_optimizer`)."""

    def __init__(self, workload: Workload, clock: Clock, loader: DataLoader) -> None:
        super().__init__()
        self.workload, self.clock, self.loader = workload, clock, loader

    def configure_model(self) -> torch.nn.Module:
        return self.workload.build_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.workload.loss(self.model, batch, self.clock)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.model, PLAIN)

    def train_dataloader(self) -> DataLoader:
        return self.loader


def torchloom_run(
    workload: Workload, plugins: dict[str, dict[str, Any]], clock: Clock, micro_steps: int, **engine: Any
) -> torchloom.Engine:
    """``Engine(plugins=...).fit`` of the workload; the run ends at the clock's end (`Done`)."""
    with tempfile.TemporaryDirectory() as out:
        settings = {"max_epochs": 1, "log_every_n_steps": 50, "output_dir": out, "num_sanity_val_steps": 0, **engine}
        # default_plugins=False: the run does what the hand loop does, no progress display
        e = torchloom.Engine(plugins=plugins or None, default_plugins=False, **settings)
        with contextlib.suppress(Done):
            e.fit(BenchTask(workload, clock, workload.loader(micro_steps)))
    return e


def fabric_loop(workload: Workload, work: Work, clock: Clock, micro_steps: int) -> None:
    """The same loop with Lightning Fabric: ``no_backward_sync`` inside a window, the loss divided by the
    accumulation steps, ``clip_gradients`` before the step."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed" if work.precision == "bf16" else "32-true")
    model = workload.build_model()
    optimizer = make_optimizer(model, work)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(workload.loader(micro_steps))
    model.train()
    try:
        for i, batch in enumerate(loader):
            sync = (i + 1) % work.accum == 0
            with fabric.no_backward_sync(model, enabled=not sync):
                loss = workload.loss(model, batch, clock)
                fabric.backward(loss / work.accum if work.accum > 1 else loss)
            if sync:
                if work.clip is not None:
                    fabric.clip_gradients(model, optimizer, max_norm=work.clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    except Done:
        pass
    finally:
        release_optimizer(model, optimizer)


def trainer_run(workload: Workload, work: Work, clock: Clock, micro_steps: int) -> None:
    """A lean `lightning.Trainer` fit: no logger, checkpointing, progress bar or model summary."""
    import lightning as L

    class LitTask(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = workload.build_model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return workload.loss(self.model, batch, clock)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            self.opt = make_optimizer(self.model, work)
            return self.opt

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        precision="bf16-mixed" if work.precision == "bf16" else "32-true",
        accumulate_grad_batches=work.accum,
        gradient_clip_val=work.clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    task = LitTask()
    try:
        trainer.fit(task, train_dataloaders=workload.loader(micro_steps))
    except Done:
        pass
    finally:
        if hasattr(task, "opt"):
            release_optimizer(task.model, task.opt)


def lightning_available() -> bool:
    try:
        import lightning  # noqa: F401
    except ImportError:
        return False
    return True


def bitsandbytes_available() -> str | None:
    """``None`` when bitsandbytes' 8-bit AdamW runs here, else why not."""
    try:
        import bitsandbytes as bnb

        p = torch.nn.Parameter(torch.zeros(8192))
        p.grad = torch.ones(8192)
        bnb.optim.AdamW8bit([p], lr=LR).step()
    except Exception as exc:  # ImportError, or no kernel for this device
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass
class Variant:
    """One runner doing one work; ``baseline`` is the key of the variant its ratio is taken against."""

    key: str
    label: str
    runner: str  # hand | torchloom | fabric | trainer
    work: Work
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)
    baseline: str | None = None

    def run(self, workload: Workload, clock: Clock, micro_steps: int) -> None:
        if self.runner == "hand":
            hand_loop(workload, self.work, clock, micro_steps)
        elif self.runner == "torchloom":
            torchloom_run(workload, self.plugins, clock, micro_steps)
        elif self.runner == "fabric":
            fabric_loop(workload, self.work, clock, micro_steps)
        elif self.runner == "trainer":
            trainer_run(workload, self.work, clock, micro_steps)
        else:
            raise ValueError(self.runner)


def quiet() -> contextlib.ExitStack:
    """Silence what the runners print while they run (Lightning's info lines, LocalSGD's one-process warning,
    the engine's output): the same for every runner."""
    stack = contextlib.ExitStack()
    devnull = stack.enter_context(open(os.devnull, "w"))  # noqa: SIM115 (closed by the stack)
    stack.enter_context(contextlib.redirect_stdout(devnull))
    stack.enter_context(contextlib.redirect_stderr(devnull))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return stack


def timed_run(variant: Variant, workload: Workload, warmup: int, steps: int) -> float:
    """Seconds per micro-step of one run of ``variant`` (set-up and warm-up not timed)."""
    gc.collect()
    clock = Clock(warmup, steps)
    with quiet():
        variant.run(workload, clock, warmup + steps + 1)
    if torch.get_num_threads() != 1:
        raise RuntimeError(f"{variant.label} changed the number of torch threads to {torch.get_num_threads()}")
    return clock.seconds() / steps
