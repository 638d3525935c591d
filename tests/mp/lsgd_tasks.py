"""The C17 task and probe, shared by the local_sgd tests and tests/mp/lsgd_fit.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom


class TwoGroupTask(torchloom.TaskModule):
    """C17: Linear(2, 1) with the weight in param group A (lr 0.1) and the bias in group B (lr 0.01), plain
    SGD, MSE on ``n`` samples in micro-batches of 2 (each process gets different batches)."""

    def __init__(self, n: int = 24) -> None:
        super().__init__()
        self.n = n

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": [self.model.weight], "lr": 0.1}, {"params": [self.model.bias], "lr": 0.01}])

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(11)
        x = torch.randn(self.n, 2, generator=g)
        y = torch.randn(self.n, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=2)


class LocalSGDProbe:
    """Snapshots the parameters right after ``optimizer.step()`` (``pre``: its ``after_optimizer_step`` runs
    before that of ``local_sgd`` when listed after it, as ``after_*`` hooks run in reverse order) and after the
    whole optimizer step (``post``: in ``on_train_batch_end``); counts DDP gradient all-reduces (a comm hook).
    Optionally saves the state of the plugins in ``stateful`` to ``save_to`` (``on_fit_end``, main process only,
    then a barrier) or loads it from ``load_from`` (``on_fit_start``, which runs after that of the plugins
    listed before the probe), with `torchloom.save_plugin_state` / `torchloom.load_plugin_state`."""

    name = "test.local_sgd_probe"

    def __init__(self, save_to: str | None = None, load_from: str | None = None, stateful: Sequence[Any] = ()) -> None:
        self.pre: list[list[float]] = []
        self.post: list[list[float]] = []
        self.grad_allreduces = 0
        self.save_to, self.load_from, self.stateful = save_to, load_from, list(stateful)

    @torchloom.hookimpl
    def on_fit_start(self, accelerator: Any, model: torch.nn.Module) -> None:
        self._model = model
        if self.load_from:
            torchloom.load_plugin_state(self.stateful, self.load_from)
        if accelerator.num_processes > 1:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
                self.grad_allreduces += 1
                return allreduce_hook(state, bucket)

            model.register_comm_hook(state=None, hook=counting_hook)

    @torchloom.hookimpl
    def after_optimizer_step(self) -> None:
        self.pre.append(self._flat())

    @torchloom.hookimpl
    def on_train_batch_end(self, accelerator: Any) -> None:
        if accelerator.sync_gradients:
            self.post.append(self._flat())

    @torchloom.hookimpl
    def on_fit_end(self, accelerator: Any) -> None:
        if self.save_to:
            torchloom.save_plugin_state(self.stateful, self.save_to, is_main_process=accelerator.is_main_process)
            accelerator.wait_for_everyone()  # the other processes read the files in the next fit

    def _flat(self) -> list[float]:
        module = getattr(self._model, "module", self._model)
        return [v for p in module.parameters() for v in p.detach().flatten().tolist()]
