"""`torchloom.estimate_optimizer_memory`: the bytes predicted before training equal the optimizer state the
``optimizer`` plugin really holds (and logs as ``optimizer/state_bytes``) after the first step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from torchloom.testing import tiny_fit


class SmallNet(torch.nn.Module):
    """Embedding(300, 32) (9,600 elements) -> Linear(32, 160) (5,120) -> LayerNorm(160) -> Linear(160, 3),
    plus a frozen Linear(32, 32) that gets no optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 32)
        self.frozen = torch.nn.Linear(32, 32).requires_grad_(False)
        self.hidden = torch.nn.Linear(32, 160)
        self.norm = torch.nn.LayerNorm(160)
        self.out = torch.nn.Linear(160, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.hidden(self.frozen(self.embed(ids).mean(1))))))


class SmallTask(torchloom.TaskModule):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dtype = dtype

    def configure_model(self) -> torch.nn.Module:
        return SmallNet().to(self.dtype)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return torch.nn.functional.cross_entropy(self.model(ids).float(), labels)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randint(0, 300, (8, 6), generator=g), torch.randint(0, 3, (8,), generator=g)),
            batch_size=4,
        )


@pytest.mark.parametrize(
    "settings",
    [
        {"name": "adamw", "weight_decay": 0.01},
        {"name": "adafactor", "lr": None},
        {"name": "adamw8bit", "weight_decay": 0.01},
        {"name": "adamw8bit", "embedding_32bit": False, "min_8bit_size": 1000},
        {"name": "adam8bit"},
        {"name": "sgd", "momentum": 0.9},
        {"name": "sgd"},
    ],
    ids=["adamw", "adafactor", "adamw8bit", "adamw8bit-no-override", "adam8bit", "sgd-momentum", "sgd"],
)
def test_estimate_equals_logged_state_bytes(tmp_path, settings):
    """Estimated before training == logged after the first optimizer step, exactly (bytes)."""
    estimate = torchloom.estimate_optimizer_memory(SmallNet(), **settings)
    engine = tiny_fit({"optimizer": settings}, task=SmallTask(), max_steps=2, output_dir=str(tmp_path))
    assert engine.history[0]["optimizer/state_bytes"] == estimate
    if settings == {"name": "sgd"}:
        assert estimate == 0  # plain SGD keeps no state


def test_estimate_adafactor_half_precision_parameters(tmp_path):
    """Adafactor keeps float32 state for bf16 parameters: the estimate follows."""
    estimate = torchloom.estimate_optimizer_memory(SmallNet().to(torch.bfloat16), "adafactor", lr=None)
    engine = tiny_fit(
        {"optimizer": {"name": "adafactor", "lr": None}},
        task=SmallTask(torch.bfloat16),
        max_steps=1,
        output_dir=str(tmp_path),
    )
    assert engine.history[0]["optimizer/state_bytes"] == estimate


def test_estimate_by_hand():
    """The formulas, on sizes computed by hand (trainable: embed 9600, hidden 5120 + 160, norm 160 + 160,
    out 480 + 3; 7 tensors, 15,683 elements)."""
    model = SmallNet()
    n, tensors = 15683, 7
    assert torchloom.estimate_optimizer_memory(model, "adamw") == 2 * 4 * n + 4 * tensors
    assert torchloom.estimate_optimizer_memory(model, "sgd", momentum=0.5) == 4 * n
    # adafactor: embed 300 + 32, hidden 160 + 32, out 3 + 160 (factored), vectors 160 + 160 + 160 + 3; + 7 RMS
    assert torchloom.estimate_optimizer_memory(model, "adafactor") == 4 * (332 + 192 + 163 + 483 + 7)
    # 8-bit: embed 32-bit (override), hidden.weight 8-bit (5120 >= 4096: 2 * 5120 + 2 * 20 blocks * 4), rest
    # 32-bit, + the two shared 256-entry float32 quantization maps
    eight = 2 * 5120 + 2 * 20 * 4
    assert torchloom.estimate_optimizer_memory(model, "adamw8bit") == 8 * (n - 5120) + eight + 2048
    assert torchloom.estimate_optimizer_memory(model, "adamw8bit", embedding_32bit=False) == (
        8 * (n - 5120 - 9600) + eight + 2 * 9600 + 2 * 38 * 4 + 2048
    )


def test_estimate_on_meta_device_allocates_nothing():
    with torch.device("meta"):
        model = torch.nn.Linear(100_000, 10_000)  # 1e9 elements: 4 GB of weights if it were real
    assert torchloom.estimate_optimizer_memory(model, "adamw") == 2 * 4 * (10**9 + 10_000) + 2 * 4


def test_float64_default_dtype_step_tensor():
    """torch.optim's step counter is float64 when the default dtype is float64."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = torch.nn.Linear(3, 2)
        estimate = torchloom.estimate_optimizer_memory(model, "adamw")
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
    finally:
        torch.set_default_dtype(previous)
    real = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    assert estimate == real == 2 * 8 * 8 + 2 * 8


def test_bad_input_is_a_config_error():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(torchloom.ConfigError, match=r"unknown optimizer 'adamw8bitt'; did you mean 'adamw8bit'\?"):
        torchloom.estimate_optimizer_memory(model, "adamw8bitt")
    with pytest.raises(torchloom.ConfigError, match=r"unknown setting 'momentun'"):
        torchloom.estimate_optimizer_memory(model, "sgd", momentun=0.9)
