"""Tasks shared by the grad_checkpoint tests and their torchrun scripts (C06, C07)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom


class Block(torch.nn.Module):
    """``Linear(d, d) -> [Dropout(p)] -> Tanh``: the block the tests checkpoint by class name."""

    def __init__(self, d: int = 8, p: float = 0.0) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(d, d)
        self.dropout = torch.nn.Dropout(p) if p else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dropout(self.linear(x)))


class FrozenEmbeddingClassifier(torch.nn.Module):
    """C06: frozen ``Embedding(16, 8)`` -> ``Block(8, dropout 0.5)`` -> mean over the sequence -> ``Linear(8, 2)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.embed.weight.requires_grad_(False)
        self.block = Block(8, p=0.5)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)).mean(dim=1))


class FrozenEmbeddingTask(torchloom.TaskModule):
    """C06: 4 sequences of 5 token ids with class labels, float64, one SGD step (lr 0.1) on one batch of 4."""

    def configure_model(self) -> torch.nn.Module:
        return FrozenEmbeddingClassifier().double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return torch.nn.functional.cross_entropy(self.model(ids), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 16, (4, 5), generator=g)
        labels = torch.tensor([0, 1, 1, 0])
        return DataLoader(TensorDataset(ids, labels), batch_size=4)


class SharedBlockNet(torch.nn.Module):
    """C07: ``Linear(4, 8)`` -> the same ``Block(8)`` applied twice (weight sharing) -> ``Linear(8, 1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.block = Block(8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.block(self.inp(x))))


class SharedBlockTask(torchloom.TaskModule):
    """C07: 8 samples, MSE, SGD lr 0.1; ``batch_size`` samples per process per step."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def configure_model(self) -> torch.nn.Module:
        return SharedBlockNet()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(8, 4, generator=g)
        y = torch.randn(8, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size)


class StepSnapshots:
    """Records the parameters at the start and after every optimizer step (float64 lists), and the gradients
    right before every optimizer step (``name -> tensor or None``)."""

    name = "test.step_snapshots"

    def __init__(self) -> None:
        self.params: list[list[list[float]]] = []
        self.grads: list[dict[str, torch.Tensor | None]] = []

    @torchloom.hookimpl
    def before_optimizer_step(self, model: torch.nn.Module) -> None:
        self.grads.append(
            {n: None if p.grad is None else p.grad.detach().clone() for n, p in _unwrap(model).named_parameters()}
        )

    @torchloom.hookimpl
    def on_fit_start(self, model: torch.nn.Module) -> None:
        self._model = model
        self.params = [self._flat(model)]

    @torchloom.hookimpl
    def on_train_batch_end(self, accelerator: Any) -> None:
        if accelerator.sync_gradients:  # an optimizer step just happened (test helper: a host copy is fine)
            self.params.append(self._flat(self._model))

    @staticmethod
    def _flat(model: torch.nn.Module) -> list[list[float]]:
        return [p.detach().double().flatten().tolist() for p in _unwrap(model).parameters()]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)
