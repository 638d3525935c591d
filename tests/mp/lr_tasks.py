"""The learning-rate finder's regression, whose stable range is known by hand (tests/test_tune_lr.py,
tests/mp/tune_lr_fit.py)."""

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom

#: The learning rates the suggestion must lie in: stable (|1 - 2 lr| < 1 is lr < 1) and not uselessly slow (each
#: step removes at least 2 % of the error: 1 - 2 lr <= 0.98 is lr >= 0.01).
GOOD_RANGE = (0.01, 1.0)


class ScalarRegression(torchloom.TaskModule):
    """``w x`` with x = 1, w0 = 0, targets 2 + 0.1 noise (64 samples, batches of 8); MSE. A step of SGD with rate lr
    multiplies the error ``w - mean(y)`` by ``1 - 2 lr``: stable iff 0 < lr < 1, in one step at lr = 0.5."""

    def configure_model(self) -> torch.nn.Module:
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        return model

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        # A schedule the sweep must override: it would drive the rate to 0 after one step.
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0 if step else 1.0)

    def train_dataloader(self) -> DataLoader:
        y = 2.0 + 0.1 * torch.randn(64, 1, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(torch.ones(64, 1), y), batch_size=8)
