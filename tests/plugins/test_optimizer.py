"""The ``optimizer`` plugin: hyperparameters reach the optimizer exactly, weight decay skips biases and norms,
schedules span the run's real length, Adafactor's relative step logs the lr it used, 8-bit Adam keeps
32-bit state where it must, and the state size is logged once.

Cases C15 and C16 of shared/cases/README.md, run through `torchloom.Engine` on CPU (bitsandbytes 0.50 runs
its 8-bit blockwise Adam on CPU, so C16's state dtypes are checked here, not skipped).
"""

from __future__ import annotations

import copy
import re
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import torchloom
from torchloom.testing import TinyTask, tiny_fit
from torchloom_plugins.optimizer import (
    OptimizerConfig,
    OptimizerSwap,
    adamw_kernel,
    create_optimizer,
    decay_split,
    estimate_state_bytes,
    optimizer_state_bytes,
)

# ------------------------------------------------------------------------------------------------ helpers


class OptimizerProbe:
    """Keeps the prepared optimizer; records group 0's lr after every step and the parameters at each step."""

    name = "test.optimizer_probe"

    def __init__(self) -> None:
        self.optimizer: Any = None
        self.group_lrs: list[list[Any]] = []
        self.params: list[dict[str, torch.Tensor]] = []
        self.num_training_steps: Any = "not called"

    @torchloom.hookimpl
    def configure_optimizers(self, num_training_steps) -> None:
        self.num_training_steps = num_training_steps  # returns None: the next implementation answers

    @torchloom.hookimpl
    def on_fit_start(self, optimizer, model) -> None:
        self.optimizer, self._model = optimizer, model
        self.params = [self._snapshot()]

    @torchloom.hookimpl
    def after_optimizer_step(self, optimizer) -> None:
        self.group_lrs.append([g["lr"] for g in optimizer.param_groups])
        self.params.append(self._snapshot())

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self._model.named_parameters()}


class RMSNorm(torch.nn.Module):
    """A norm layer that is not a torch class (matched by its class name, like LlamaRMSNorm)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class EmbedNet(torch.nn.Module):
    """C16's model: Embedding(vocab, 64) -> mean pool -> Linear(64, 64) -> [norm] -> ReLU -> Linear(64, 2)."""

    def __init__(self, vocab: int = 1000, norm: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 64)
        self.hidden = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64) if norm else torch.nn.Identity()
        self.rms = RMSNorm(64) if norm else torch.nn.Identity()
        self.out = torch.nn.Linear(64, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.rms(self.norm(self.hidden(self.embed(ids).mean(1))))))


class EmbedTask(torchloom.TaskModule):
    """Classification of 16 sequences of 5 token ids, batch 4 (4 optimizer steps per epoch)."""

    def __init__(self, vocab: int = 1000, norm: bool = False) -> None:
        super().__init__()
        self.vocab, self.norm = vocab, norm

    def configure_model(self) -> torch.nn.Module:
        return EmbedNet(self.vocab, self.norm)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return torch.nn.functional.cross_entropy(self.model(ids), labels)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab, (16, 5), generator=g)
        return DataLoader(TensorDataset(ids, torch.randint(0, 2, (16,), generator=g)), batch_size=4)


def _fit(settings: dict[str, Any], task: Any = None, tmp_path: Any = None, **engine: Any) -> tuple[Any, OptimizerProbe]:
    probe = OptimizerProbe()
    engine.setdefault("max_steps", 1)
    e = tiny_fit([probe, {"optimizer": settings}], task=task or EmbedTask(), output_dir=str(tmp_path), **engine)
    return e, probe


def _logged(engine: Any, name: str) -> list[float]:
    return [h[name] for h in engine.history if name in h]


# --------------------------------------------------------------------------------- hyperparameters exactly


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            {"name": "adamw", "lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.05},
            {"lr": 3e-4, "betas": (0.8, 0.95), "eps": 1e-6},
        ),
        (
            {"name": "adamw", "lr": 2e-3, "weight_decay": 0.05},  # library defaults where unset
            {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8},
        ),
        ({"name": "sgd", "lr": 0.3, "momentum": 0.9, "weight_decay": 0.05}, {"lr": 0.3, "momentum": 0.9}),
        (
            {"name": "adafactor", "lr": 1e-2, "eps": 1e-20, "weight_decay": 0.05, "scale_parameter": False},
            {"lr": 1e-2, "eps": (1e-20, 1e-3), "relative_step": False, "scale_parameter": False, "warmup_init": False},
        ),
        (
            {"name": "adamw8bit", "lr": 5e-4, "betas": [0.85, 0.98], "eps": 1e-7, "weight_decay": 0.05},
            {"lr": 5e-4, "betas": (0.85, 0.98), "eps": 1e-7},
        ),
        ({"name": "adam8bit", "lr": 5e-4, "weight_decay": 0.05}, {"lr": 5e-4, "betas": (0.9, 0.999), "eps": 1e-8}),
    ],
    ids=["adamw", "adamw-defaults", "sgd", "adafactor", "adamw8bit", "adam8bit"],
)
def test_hyperparameters_reach_param_groups(tmp_path, settings, expected):
    """Every configured value (and no other library's default, e.g. AdamW8bit's weight_decay 1e-2) is in
    ``param_groups``; group 0 decays with ``weight_decay``, group 1 (biases, norms) has 0."""
    _, probe = _fit(settings, EmbedTask(norm=True), tmp_path)
    groups = probe.optimizer.param_groups
    assert len(groups) == 2
    assert groups[0]["weight_decay"] == 0.05 and groups[1]["weight_decay"] == 0.0
    for group in groups:
        for key, value in expected.items():
            assert group[key] == value, (key, group[key])
    inner = type(probe.optimizer.optimizer).__name__
    assert (
        inner
        == {"adamw": "AdamW", "sgd": "SGD", "adafactor": "Adafactor", "adamw8bit": "AdamW8bit", "adam8bit": "Adam8bit"}[
            settings["name"]
        ]
    )


def test_no_decay_skips_biases_and_norm_weights():
    """Default ``no_decay`` (bias, norm): biases, LayerNorm and a custom RMSNorm class are not decayed;
    embeddings and Linear weights are; frozen parameters are in no group."""
    model = EmbedNet(norm=True)
    model.out.weight.requires_grad_(False)
    decay, skip = decay_split(model, ["bias", "norm"])
    assert decay == ["embed.weight", "hidden.weight"]
    assert skip == ["hidden.bias", "norm.weight", "norm.bias", "rms.weight", "out.bias"]
    assert decay_split(model, []) == (
        ["embed.weight", "hidden.weight", "hidden.bias", "norm.weight", "norm.bias", "rms.weight", "out.bias"],
        [],
    )
    assert decay_split(model, ["embed"])[1] == ["embed.weight"]


def test_no_decay_groups_hold_the_right_parameters(tmp_path):
    _, probe = _fit({"name": "adamw", "weight_decay": 0.1}, EmbedTask(norm=True), tmp_path)
    names = {id(p): n for n, p in probe._model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in probe.optimizer.param_groups]
    assert groups == [
        ["embed.weight", "hidden.weight", "out.weight"],
        ["hidden.bias", "norm.weight", "norm.bias", "rms.weight", "out.bias"],
    ]


def test_no_weight_decay_means_one_group(tmp_path):
    _, probe = _fit({"name": "adamw"}, EmbedTask(norm=True), tmp_path)
    (group,) = probe.optimizer.param_groups
    assert group["weight_decay"] == 0.0 and len(group["params"]) == 8


def test_weight_decay_really_applies_only_to_group_0(tmp_path):
    """With zero gradients (lr 1, SGD) the only change is decay: decayed weights shrink by lr*wd, biases stay."""

    class ZeroGradTask(TinyTask):
        def training_step(self, batch, batch_idx):
            return self.model(batch[0]).sum() * 0.0

    _, probe = _fit({"name": "sgd", "lr": 1.0, "weight_decay": 0.5}, ZeroGradTask(), tmp_path)
    before, after = probe.params[0], probe.params[1]
    torch.testing.assert_close(after["weight"], before["weight"] * 0.5, rtol=0, atol=0)
    torch.testing.assert_close(after["bias"], before["bias"], rtol=0, atol=0)


# --------------------------------------------------------------------------------------- schedules, lr log


def test_schedule_spans_the_runs_optimizer_steps(tmp_path):
    """linear with 4 warm-up steps over 2 epochs of 8 batches: the run has 16 optimizer steps, and the lr
    logged for step k (the lr that step used) is lr * t/4 during warm-up, then lr * (16 - t) / 12, with
    t = k - 1 the scheduler steps taken before it (transformers' schedules start warm-up at 0)."""
    engine, probe = _fit(
        {"name": "sgd", "lr": 0.1, "scheduler": "linear", "warmup_steps": 4},
        TinyTask(),
        tmp_path,
        max_steps=None,
        max_epochs=2,
    )
    assert probe.num_training_steps == 16
    used = [0.1 * (t / 4 if t < 4 else (16 - t) / 12) for t in range(16)]
    assert _logged(engine, "lr") == pytest.approx(used, abs=1e-12)
    after_step = [*used[1:], 0.0]  # the probe reads the group's lr after the scheduler stepped
    assert [lrs[0] for lrs in probe.group_lrs] == pytest.approx(after_step, abs=1e-12)


def test_warmup_ratio_uses_the_run_length(tmp_path):
    """warmup_ratio 0.3 of 8 steps = ceil(2.4) = 3 warm-up steps (constant_with_warmup)."""
    engine, _ = _fit(
        {"name": "sgd", "lr": 0.1, "scheduler": "constant_with_warmup", "warmup_ratio": 0.3},
        TinyTask(),
        tmp_path,
        max_steps=None,
    )
    assert _logged(engine, "lr") == pytest.approx([0.0, 0.1 / 3, 0.2 / 3, 0.1, 0.1, 0.1, 0.1, 0.1], abs=1e-12)


def test_num_training_steps_counts_accumulation_windows_and_max_steps(tmp_path):
    """The configure_optimizers hook's num_training_steps: 8 micro-batches with 3 per window are 3 optimizer
    steps per epoch (the last window is partial), times 2 epochs; max_steps caps it."""
    probe = OptimizerProbe()
    tiny_fit([probe, {"grad_accum": {"steps": 3}}], max_epochs=2, output_dir=str(tmp_path / "a"))
    assert probe.num_training_steps == 6
    probe = OptimizerProbe()
    tiny_fit([probe], max_epochs=3, max_steps=5, output_dir=str(tmp_path / "b"))
    assert probe.num_training_steps == 5


def test_schedule_needing_the_length_of_an_unsized_dataloader_is_a_config_error(tmp_path):
    class Stream(IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for _ in range(8):
                yield torch.randn(4, generator=g), torch.randn(1, generator=g)

    class StreamTask(TinyTask):
        def train_dataloader(self):
            return DataLoader(Stream(), batch_size=4)

    with pytest.raises(torchloom.ConfigError, match=r"scheduler 'cosine' needs the run's number of optimizer steps"):
        _fit({"name": "sgd", "scheduler": "cosine"}, StreamTask(validate=False), tmp_path, max_steps=None)
    engine, probe = _fit({"name": "sgd", "scheduler": "cosine"}, StreamTask(validate=False), tmp_path, max_steps=2)
    # cosine over 2 steps: step 1 uses the full lr (1e-3), step 2 half of it: 1e-3 * (1 + cos(pi / 2)) / 2
    assert probe.num_training_steps == 2 and _logged(engine, "lr") == pytest.approx([1e-3, 5e-4], abs=1e-12)


def test_c15a_adafactor_relative_step_logs_the_lr_it_used(tmp_path):
    """C15 A: Adafactor(lr=None, relative_step, warmup_init, scale_parameter) on one Linear(4, 4) weight of
    RMS 0.5: construction and the step succeed (no LambdaLR over a None lr) and the lr logged for step 1 is
    max(1e-3, 0.5) * min(1e-6 * 1, 1 / sqrt(1)) = 5e-7, the step size Adafactor really used."""

    class OneWeight(TinyTask):
        def configure_model(self):
            model = torch.nn.Linear(4, 4, bias=False)
            torch.nn.init.constant_(model.weight, 0.5)
            return model

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.model(x).sum(-1, keepdim=True).sub(y).pow(2).mean()

    for scheduler in (None, "constant"):
        engine, probe = _fit(
            {"name": "adafactor", "lr": None, "warmup_init": True, "scale_parameter": True, "scheduler": scheduler},
            OneWeight(validate=False),
            tmp_path / str(scheduler),
            max_steps=2,
        )
        lrs = _logged(engine, "lr")
        assert lrs[0] == pytest.approx(5e-7, rel=1e-6)
        assert lrs[1] == pytest.approx(2 * 1e-6 * float(probe.params[1]["weight"].pow(2).mean().sqrt()), rel=1e-6)
        assert not torch.equal(probe.params[0]["weight"], probe.params[1]["weight"])  # the step ran
        group = probe.optimizer.param_groups[0]
        assert group["relative_step"] is True and group["warmup_init"] is True and group["scale_parameter"] is True


def test_c15b_adafactor_fixed_lr_is_never_rewritten(tmp_path):
    """C15 B: Adafactor(lr=1e-2, relative_step=False, scale_parameter=True) over two parameters in one group
    filled with 0.5 and 2.0: param_groups[0]["lr"] is 1e-2 exactly after steps 1 and 2, and the first update
    of each parameter has the effective lr 1e-2 * RMS: 5e-3 and 2e-2 (elementwise |delta|, since Adafactor's
    first update is lr * sign(grad) after its RMS clipping)."""

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.full((4,), 0.5))
            self.b = torch.nn.Parameter(torch.full((4,), 2.0))

        def forward(self, x):
            return (x * self.a).sum(-1, keepdim=True) + (x * self.b).sum(-1, keepdim=True)

    class TwoTask(TinyTask):
        def configure_model(self):
            return Two()

    engine, probe = _fit({"name": "adafactor", "lr": 1e-2, "scale_parameter": True}, TwoTask(), tmp_path, max_steps=2)
    assert len(probe.optimizer.param_groups) == 1
    assert [lrs[0] for lrs in probe.group_lrs] == [1e-2, 1e-2]  # exactly
    assert _logged(engine, "lr") == [1e-2, 1e-2]
    for name, effective in (("a", 5e-3), ("b", 2e-2)):
        delta = (probe.params[1][name] - probe.params[0][name]).abs()
        torch.testing.assert_close(delta, torch.full((4,), effective), rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------ 8-bit (C16)


def _state(probe: OptimizerProbe, module: str) -> dict[str, Any]:
    params = dict(probe._model.named_parameters())
    return probe.optimizer.state[params[module]]


def test_c16_adamw8bit_32bit_state_for_embeddings_and_small_tensors(tmp_path):
    """C16, on CPU: Embedding(1000, 64) -> Linear(64, 64) -> ReLU -> Linear(64, 2), AdamW8bit lr 1e-3,
    weight_decay 0.05, 32-bit embeddings on, 1 step: the embedding weight's state is float32 (module
    override), Linear(64, 64).weight's is uint8 (4096 is not < 4096), Linear(64, 2).weight's and the biases'
    are float32 (< min_8bit_size); 32-bit state is 8 bytes per element; group 0's weight_decay is 0.05."""
    _, probe = _fit({"name": "adamw8bit", "lr": 1e-3, "weight_decay": 0.05, "embedding_32bit": True}, tmp_path=tmp_path)
    dtypes = {n: _state(probe, n)["state1"].dtype for n, _ in probe._model.named_parameters()}
    assert dtypes == {
        "embed.weight": torch.float32,
        "hidden.weight": torch.uint8,
        "hidden.bias": torch.float32,
        "out.weight": torch.float32,
        "out.bias": torch.float32,
    }
    for n, p in probe._model.named_parameters():
        state = _state(probe, n)
        assert state["state2"].dtype == dtypes[n]
        if dtypes[n] == torch.float32:
            assert state["state1"].nbytes + state["state2"].nbytes == 8 * p.numel()
            assert "absmax1" not in state
    assert probe.optimizer.param_groups[0]["weight_decay"] == 0.05


def test_8bit_embedding_override_can_be_turned_off_and_does_not_leak(tmp_path):
    """embedding_32bit false: the embedding (64,000 elements) gets uint8 state. The override registered by an
    earlier run is released at teardown: it does not reach this run's parameter at the same position."""
    _fit({"name": "adamw8bit", "weight_decay": 0.05}, tmp_path=tmp_path / "first")
    _, probe = _fit({"name": "adamw8bit", "weight_decay": 0.05, "embedding_32bit": False}, tmp_path=tmp_path / "2")
    # Without the release, bitsandbytes' (group 0, param 0) -> 32-bit entry of the first run would apply here.
    assert _state(probe, "embed.weight")["state1"].dtype == torch.uint8


def test_8bit_adam_really_updates_on_cpu(tmp_path):
    """The uint8-state parameter's first update matches torch AdamW's (lr * sign(grad)) to 8-bit precision."""
    _, bnb_probe = _fit({"name": "adamw8bit", "lr": 1e-3}, tmp_path=tmp_path / "bnb")
    _, ref_probe = _fit({"name": "adamw", "lr": 1e-3}, tmp_path=tmp_path / "ref")
    assert _state(bnb_probe, "hidden.weight")["state1"].dtype == torch.uint8
    got = bnb_probe.params[1]["hidden.weight"] - bnb_probe.params[0]["hidden.weight"]
    ref = ref_probe.params[1]["hidden.weight"] - ref_probe.params[0]["hidden.weight"]
    assert got.abs().max() > 0
    torch.testing.assert_close(got, ref, rtol=0.05, atol=2e-5)


def test_paged_adamw8bit_on_cpu_is_a_config_error(tmp_path):
    with pytest.raises(torchloom.ConfigError, match=r"'paged_adamw8bit'.*CUDA.*'cpu'.*adamw8bit"):
        _fit({"name": "paged_adamw8bit"}, tmp_path=tmp_path)


# ----------------------------------------------------------------------------------------- state size log


def test_state_bytes_logged_once_after_the_first_step(tmp_path):
    """optimizer/state_bytes appears in the first log record only and equals the nbytes of the state (AdamW:
    two moments of each parameter's size plus a 4-byte step per parameter)."""
    engine, probe = _fit({"name": "adamw"}, TinyTask(validate=False), tmp_path, max_steps=3)
    assert [("optimizer/state_bytes" in h) for h in engine.history] == [True, False, False]
    assert engine.history[0]["optimizer/state_bytes"] == (2 * 5 * 4 + 2 * 4) == optimizer_state_bytes(probe.optimizer)


# --------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"name": "adam"}, r"'name' = 'adam'.*expected one of 'adamw'"),
        ({"name": "adamw", "lr": None}, r"'lr' = None.*only 'adafactor'"),
        ({"lr": -1.0}, r"'lr' = -1.0.*> 0"),
        ({"name": "sgd", "betas": [0.9, 0.99]}, r"'betas'.*does not apply to optimizer 'sgd'"),
        ({"name": "adamw", "momentum": 0.9}, r"'momentum'.*does not apply to optimizer 'adamw'.*sgd"),
        ({"name": "adamw", "min_8bit_size": 10}, r"'min_8bit_size'.*adamw8bit"),
        ({"betas": [0.9, 1.5]}, r"'betas'.*\[0, 1\)"),
        ({"weight_decay": -0.1}, r"'weight_decay' = -0.1"),
        ({"scheduler": "cosine", "warmup_steps": 2, "warmup_ratio": 0.1}, "both set"),
        ({"scheduler": "cosin"}, r"'scheduler' = 'cosin' \(did you mean 'cosine'\?\)"),
        ({"scheduler": "reduce_lr_on_plateau"}, r"'scheduler' = 'reduce_lr_on_plateau'.*expected one of"),
        ({"warmup_steps": 3}, r"warm-up is set but setting 'scheduler' = None"),
        ({"name": "adafactor", "lr": None, "scheduler": "linear"}, "relative step"),
        ({"name": "adafactor", "warmup_init": True}, r"'warmup_init' = True needs.*lr to null"),
        ({"nme": "sgd"}, r"unknown setting 'nme'; did you mean 'name'"),
        ({"name": "sgd", "implementation": "fused"}, r"'implementation' = 'fused' does not apply to optimizer 'sgd'"),
        ({"implementation": "fast"}, r"'implementation' = 'fast'.*'fused', 'foreach', 'for_loop'"),
    ],
)
def test_bad_settings_are_one_clear_config_error(settings, match):
    with pytest.raises(torchloom.ConfigError, match=match):
        torchloom.enable_plugins({"optimizer": settings})


def test_adamw_is_fused_where_the_device_has_the_kernel_and_every_implementation_gives_the_same_update():
    """The default (as the HF Trainer's adamw_torch_fused) is torch's fused kernel on this CPU; fused, foreach and
    for_loop take the same 20 steps to within a few ulp (measured: 6.0e-8 of parameters of size ~0.1-1)."""
    assert adamw_kernel(None, "cpu") == {"fused": True} and adamw_kernel(None, "cuda") == {"fused": True}
    assert adamw_kernel(None, "xla") == {"foreach": True}  # no fused kernel there: the next fastest
    assert adamw_kernel("for_loop", "cpu") == {"foreach": False} and adamw_kernel("foreach", "cpu") == {"foreach": True}
    with pytest.raises(
        torchloom.ConfigError, match=r"'implementation' = 'fused': torch has no fused AdamW for device 'xla'"
    ):
        adamw_kernel("fused", "xla")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    after: dict[Any, torch.Tensor] = {}
    for implementation in (None, "fused", "foreach", "for_loop"):
        model = copy.deepcopy(base)
        settings = OptimizerConfig(lr=1e-2, weight_decay=0.1, implementation=implementation)
        optimizer = create_optimizer(model, settings)
        expected = {"fused": True, "foreach": None} if implementation in (None, "fused") else {"fused": None}
        assert {k: optimizer.defaults[k] for k in expected} == expected
        generator = torch.Generator().manual_seed(1)
        for _ in range(20):
            model(torch.randn(16, 32, generator=generator)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        after[implementation] = torch.cat([p.detach().flatten() for p in model.parameters()])
    moved = (after["for_loop"] - torch.cat([p.flatten() for p in base.parameters()])).abs().max().item()
    assert moved > 0.1  # the steps changed the parameters: the comparison below is not of untouched weights
    for implementation, parameters in after.items():
        assert (parameters - after["for_loop"]).abs().max().item() <= 1e-6, implementation
    assert torch.equal(after[None], after["fused"])


def test_plugin_without_settings_is_adamw_1e_3():
    (plugin,) = torchloom.enable_plugins(["optimizer"])
    assert isinstance(plugin, OptimizerSwap)
    assert (plugin.config.name, plugin.config.lr, plugin.config.scheduler) == ("adamw", 1e-3, None)


def test_frozen_model_is_one_clear_error(tmp_path):
    """A fit stops before any optimizer is built (the engine's check, for the task's optimizer and the plugin's
    alike); building the plugin's optimizer directly on a frozen model is the plugin's ConfigError."""

    class Frozen(TinyTask):
        def configure_model(self):
            return super().configure_model().requires_grad_(False)

    with pytest.raises(
        torchloom.TaskError, match=r"fit: the model of Frozen.configure_model\(\) \(Linear\) has nothing"
    ):
        _fit({"name": "adamw"}, Frozen(), tmp_path)
    with pytest.raises(torchloom.ConfigError, match="no trainable parameters"):
        create_optimizer(Frozen().configure_model(), OptimizerConfig(name="adamw"))


# ------------------------------------------------------------------------------------- memory estimate


def test_the_plugin_answers_the_memory_estimate_for_every_name_it_builds(tmp_path):
    """`OptimizerSwap.optimizer_names` are exactly the names its config takes (the first is its default), and its
    classmethod `estimate_optimizer_memory` (the interface `torchloom.estimate_optimizer_memory` calls) equals the
    state a real optimizer holds after one step."""
    assert OptimizerSwap.optimizer_names == typing.get_args(typing.get_type_hints(OptimizerConfig)["name"])
    assert OptimizerSwap.optimizer_names[0] == OptimizerConfig().name
    model = TinyTask().configure_model()
    model(torch.randn(3, 4)).sum().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.step()
    estimate = OptimizerSwap.estimate_optimizer_memory(model, "sgd", {"momentum": 0.9})
    assert (
        estimate
        == optimizer_state_bytes(optimizer)
        == estimate_state_bytes(model, OptimizerConfig("sgd", momentum=0.9))
    )
    with pytest.raises(torchloom.ConfigError, match=r"'momentum'.*does not apply to optimizer 'adamw'"):
        OptimizerSwap.estimate_optimizer_memory(model, "adamw", {"momentum": 0.9})


def test_an_8bit_optimizer_without_bitsandbytes_names_the_extra(monkeypatch):
    """The hint is the README's install line with the extra that carries bitsandbytes."""
    from torchloom_plugins.optimizer import INSTALL_8BIT

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # find_spec answers None: not installed
    with pytest.raises(torchloom.ConfigError, match=r"optimizer 'adamw8bit' needs bitsandbytes") as raised:
        torchloom.Engine(plugins={"optimizer": {"name": "adamw8bit"}})
    torchloom.Engine(plugins={"optimizer": {"name": "adamw"}})  # the others do not need it
    assert INSTALL_8BIT in str(raised.value)
    root = Path(__file__).resolve().parents[2]
    assert re.search(r'^8bit = \["bitsandbytes', (root / "pyproject.toml").read_text(), re.MULTILINE)
    readme_line = INSTALL_8BIT.replace('".[8bit]"', '".[examples]"')
    assert readme_line in (root / "README.md").read_text(), "the README installs torchloom another way now"
