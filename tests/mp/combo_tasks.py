"""A task for combining every technique plugin: an MLP whose blocks can be checkpointed."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom

#: Settings used whenever a plugin takes part in a combination.
PLUGIN_SETTINGS = {
    "grad_accum": {"steps": 2},
    "grad_checkpoint": {"modules": ["blocks.*"]},
    "grad_clip": {"max_norm": 0.5},
    "local_sgd": {"sync_every": 2},
    "mixed_precision": {"dtype": "bf16"},
    "optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.01, "scheduler": "linear", "warmup_steps": 1},
}

#: Plugins that must not change the arithmetic of a 1-process fit: checkpointing recomputes the same values,
#: LocalSGD on one process is a documented no-op.
EXACT_NO_OPS_ON_ONE_PROCESS = {"grad_checkpoint", "local_sgd"}


class Blocks(torch.nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(depth)
        )
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


class ComboTask(torchloom.TaskModule):
    """Regression with SGD (unless the optimizer plugin answers); 32 samples, micro-batch 4."""

    def __init__(self, n: int = 32, batch_size: int = 4) -> None:
        super().__init__()
        self.n, self.batch_size = n, batch_size

    def configure_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return Blocks()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(self.n, 4, generator=g)
        return DataLoader(TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True))), batch_size=self.batch_size)


def final_parameters(engine: torchloom.Engine) -> list[list[float]]:
    model = engine.accelerator.unwrap_model(engine._run.model)
    return [p.detach().double().flatten().tolist() for p in model.parameters()]
