"""`torchloom.estimate_optimizer_memory`: the bytes predicted before training equal the optimizer state the
``optimizer`` plugin really holds (and logs as ``optimizer/state_bytes``) after the first step."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
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


# ------------------------------------------------------------------- the core asks the plugins, knows none

CORE_MEMORY = Path(__file__).resolve().parents[1] / "src" / "torchloom" / "tools" / "optimizer_memory.py"


def test_core_holds_no_optimizer_names_or_settings():
    """Which optimizers exist and what their state weighs is the optimizer plugin's knowledge, not the core's."""
    text = CORE_MEMORY.read_text().lower()
    for word in ("adamw", "adafactor", "8bit", "sgd", "bitsandbytes", "momentum", "min_8bit_size", "embedding"):
        assert word not in text, f"src/torchloom/tools/optimizer_memory.py mentions {word!r}"


class Lion:
    """A third-party optimizer plugin (not installed): two names, state = one moment (``n * s``) per parameter,
    plus ``extra`` bytes from its own setting."""

    name = "lion_plugin"
    optimizer_names = ("lion", "lion_fused")
    calls: list[tuple[str, dict[str, Any]]] = []

    @classmethod
    def estimate_optimizer_memory(cls, model, name, settings):
        cls.calls.append((name, dict(settings)))
        unknown = set(settings) - {"extra"}
        if unknown:
            raise torchloom.ConfigError(f"plugin 'lion_plugin': unknown setting {sorted(unknown)[0]!r}")
        return sum(p.numel() * p.element_size() for p in model.parameters()) + settings.get("extra", 0)


def test_a_third_party_plugin_answers_for_its_own_optimizer():
    model = torch.nn.Linear(10, 4)  # 44 float32 elements
    assert torchloom.estimate_optimizer_memory(model, "lion", plugin=Lion) == 44 * 4
    assert torchloom.estimate_optimizer_memory(model, "lion_fused", plugin=Lion(), extra=8) == 44 * 4 + 8
    assert torchloom.estimate_optimizer_memory(model, plugin=Lion) == 44 * 4  # its first name is its default
    assert Lion.calls[-2:] == [("lion_fused", {"extra": 8}), ("lion", {})]
    with pytest.raises(torchloom.ConfigError, match=r"unknown optimizer 'lino'; did you mean 'lion'\? Valid: lion"):
        torchloom.estimate_optimizer_memory(model, "lino", plugin=Lion)
    with pytest.raises(torchloom.ConfigError, match=r"estimate_optimizer_memory\('lion'\): .*unknown setting 'x'"):
        torchloom.estimate_optimizer_memory(model, "lion", plugin=Lion, x=1)


@pytest.fixture
def lion_installed(monkeypatch):
    """Lion registered under the entry-point group, as an installed distribution would register it."""
    real = importlib.metadata.entry_points

    def entry_points(**params: Any) -> Any:
        found = list(real(**params))
        if params.get("group") == "torchloom.plugins":
            found.append(importlib.metadata.EntryPoint("lion_plugin", f"{__name__}:Lion", "torchloom.plugins"))
        return found

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_installed_plugins_are_found_by_entry_point_discovery(lion_installed):
    model = torch.nn.Linear(10, 4)
    assert torchloom.estimate_optimizer_memory(model, "lion") == 44 * 4
    assert torchloom.estimate_optimizer_memory(model, "adamw") == 2 * 44 * 4 + 2 * 4  # the built-in still answers
    with pytest.raises(torchloom.ConfigError, match=r"unknown optimizer 'lamb'\. Valid: lion, lion_fused"):
        torchloom.estimate_optimizer_memory(model, "lamb")
    with pytest.raises(torchloom.ConfigError, match="several plugins estimate optimizer memory; name the optimizer"):
        torchloom.estimate_optimizer_memory(model)


def test_two_plugins_knowing_one_name_must_be_chosen_between(lion_installed, monkeypatch):
    monkeypatch.setattr(Lion, "optimizer_names", ("lion", "adamw"))
    model = torch.nn.Linear(10, 4)
    with pytest.raises(
        torchloom.ConfigError, match=r"'adamw' is known by plugins 'lion_plugin' and '\w+'; pass plugin="
    ):
        torchloom.estimate_optimizer_memory(model, "adamw")
    assert torchloom.estimate_optimizer_memory(model, "adamw", plugin="lion_plugin") == 44 * 4


def test_allow_list_limits_the_plugins_asked(lion_installed, monkeypatch):
    monkeypatch.setenv("TORCHLOOM_PLUGINS", "lion_plugin")
    with pytest.raises(torchloom.ConfigError, match=r"unknown optimizer 'adamw'\. Valid: lion, lion_fused"):
        torchloom.estimate_optimizer_memory(torch.nn.Linear(2, 2), "adamw")


def test_a_plugin_that_does_not_estimate_is_a_plugin_error():
    class NoEstimate(torchloom.Plugin):
        name = "no_estimate"

    class BadAnswer(Lion):
        @classmethod
        def estimate_optimizer_memory(cls, model, name, settings):
            return 1.5

    with pytest.raises(torchloom.PluginError, match="'no_estimate' does not estimate optimizer memory"):
        torchloom.estimate_optimizer_memory(torch.nn.Linear(2, 2), "lion", plugin=NoEstimate)
    with pytest.raises(torchloom.PluginError, match=r"returned 1\.5; expected a number of bytes"):
        torchloom.estimate_optimizer_memory(torch.nn.Linear(2, 2), "lion", plugin=BadAnswer)
