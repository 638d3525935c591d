"""The ``grad_accum`` plugin: exact window normalisation (mean and token counts, partial windows), scheduler
and global_step once per window, no DDP all-reduce inside a window, GA-independent logged loss.

Cases C01, C02, C04 and C20 of shared/cases/README.md, each run through `torchloom.Engine`.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from torchloom.testing import RecordingPlugin, TinyTask, tiny_fit
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))  # the tasks shared with the torchrun scripts
from ga_tasks import GradProbe, TokenLM, make_sequence, reference_gradients

# ------------------------------------------------------------------------------------------------ helpers


class Scalar(torch.nn.Module):
    """A single scalar parameter ``w`` (float64)."""

    def __init__(self, value: float = 0.0) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(value, dtype=torch.float64))

    def forward(self) -> torch.Tensor:
        return self.w


class WeightedScalarTask(torchloom.TaskModule):
    """C02: micro-batch i holds the number c_i and its loss is ``w * c_i`` (gradient c_i); SGD lr 1 and a
    constant LambdaLR (to count scheduler steps). With ``items=True`` it also returns ``num_items = 1``."""

    def __init__(self, cs: list[float], items: bool = False) -> None:
        super().__init__()
        self.cs, self.items = cs, items
        self.scheduler: Any = None

    def configure_model(self) -> torch.nn.Module:
        return Scalar(0.0)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (c,) = batch
        loss = (self.model() * c).sum()
        return {"loss": loss, "num_items": 1} if self.items else loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.model.parameters(), lr=1.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0)
        return optimizer, self.scheduler

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.tensor(self.cs, dtype=torch.float64)), batch_size=1)


class StepProbe:
    """Records the LR in use at each optimizer step, the parameters after it, the scheduler's last_epoch,
    and the raw loss every on_train_batch_end sees."""

    name = "test.step_probe"

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.params: list[list[float]] = []
        self.last_epoch: int | None = None
        self.batch_losses: list[float] = []

    @torchloom.hookimpl
    def before_optimizer_step(self, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    @torchloom.hookimpl
    def after_optimizer_step(self, model, scheduler) -> None:
        self.params.append([x for p in model.parameters() for x in p.detach().flatten().tolist()])
        if scheduler is not None:
            self.last_epoch = scheduler.last_epoch

    @torchloom.hookimpl
    def on_train_batch_end(self, outputs) -> None:
        self.batch_losses.append(outputs["loss"].item())


def _flat(grads: dict[str, Any]) -> torch.Tensor:
    return torch.cat([torch.tensor(g, dtype=torch.float64).flatten() for _, g in sorted(grads.items())])


def _run(plugins: list[Any], task: torchloom.TaskModule, tmp_path, **settings: Any) -> torchloom.Engine:
    settings.setdefault("output_dir", str(tmp_path / "run"))
    return tiny_fit(plugins, task=task, **settings)


# --------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"steps": 0}, r"plugin 'grad_accum'.*'steps' = 0.*>= 1"),
        ({"steps": "4"}, r"plugin 'grad_accum'.*'steps' = '4'.*expected int"),
        ({"normalization": "sum"}, r"plugin 'grad_accum'.*'normalization' = 'sum'.*'mean', 'tokens', 'items'"),
        ({"step": 4}, r"unknown setting 'step'; did you mean 'steps'"),
    ],
)
def test_bad_settings_are_one_clear_error(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(torchloom.ConfigError, match=match):
        torchloom.Engine(plugins={"grad_accum": settings})


def test_hooks_fire_once_per_window_and_the_accelerator_gets_the_steps(tmp_path) -> None:
    recorder = RecordingPlugin()
    engine = _run([{"grad_accum": {"steps": 4}}, recorder], TinyTask(n=32, batch_size=4, validate=False), tmp_path)
    assert engine._run.accelerator.gradient_accumulation_steps == 4
    assert engine.progress.micro_step == 8
    assert engine.progress.global_step == 2
    assert recorder.calls.count("run_train_step") == 8
    assert recorder.calls.count("before_backward") == 8
    assert recorder.calls.count("before_optimizer_step") == 2
    steps_at = [p.batch_idx for name, p in recorder.records if name == "before_optimizer_step"]
    assert steps_at == [3, 7]


@pytest.mark.parametrize(("steps", "max_steps"), [(2, 3), (3, 2), (4, 5)])
def test_max_steps_counts_optimizer_steps_not_micro_batches(tmp_path, steps, max_steps) -> None:
    """max_steps=3 with 2 micro-batches per step stops after 6 micro-batches (not 3), with a task whose epochs hold 8
    (max_steps=5 with steps 4 ends after the first window of the third epoch)."""
    recorder = RecordingPlugin()
    engine = tiny_fit(
        [{"grad_accum": {"steps": steps}}, recorder],
        task=TinyTask(n=32, batch_size=4, validate=False),
        output_dir=str(tmp_path),
        max_epochs=5,
        max_steps=max_steps,
    )
    assert engine.progress.global_step == max_steps
    assert recorder.calls.count("before_optimizer_step") == max_steps
    assert engine.progress.micro_step == recorder.calls.count("run_train_step") == steps * max_steps


# --------------------------------------------------------------------------- N x b micro-batches == 1 x N*b


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.float64, 1e-10)])
def test_n_micro_batches_give_the_gradients_and_parameters_of_one_big_batch(tmp_path, dtype, tol) -> None:
    probe_ga, probe_big = GradProbe(), GradProbe()
    ga = _run(
        [{"grad_accum": {"steps": 4}}, probe_ga],
        TinyTask(n=32, batch_size=2, dtype=dtype, validate=False),
        tmp_path / "ga",
        max_epochs=2,
    )
    big = _run([probe_big], TinyTask(n=32, batch_size=8, dtype=dtype, validate=False), tmp_path / "big", max_epochs=2)
    assert ga.progress.global_step == big.progress.global_step == 8
    assert len(probe_ga.grads) == len(probe_big.grads) == 8
    for g_ga, g_big in zip(probe_ga.grads, probe_big.grads):
        torch.testing.assert_close(_flat(g_ga), _flat(g_big), rtol=0, atol=tol)
    for p_ga, p_big in zip(ga._run.model.parameters(), big._run.model.parameters()):
        assert p_ga.dtype == dtype
        torch.testing.assert_close(p_ga.double(), p_big.double(), rtol=0, atol=tol)


# ------------------------------------------------------------------------------------------------- C01


def test_c01_token_losses_are_normalised_by_the_window_token_count(tmp_path) -> None:
    # Micro-batch A: length 4, 3 labelled tokens; micro-batch B: length 10, 9 labelled tokens.
    sequences = [make_sequence(3, seed=0, length=4), make_sequence(9, seed=1, length=10)]
    ref_grads, ref_loss = reference_gradients(sequences)
    probe = GradProbe()
    engine = _run([{"grad_accum": {"steps": 2, "normalization": "tokens"}}, probe], TokenLM(sequences), tmp_path)
    assert engine.progress.global_step == 1
    # Every labelled token has weight 1/12 in the gradient, as in one batch of both sequences.
    torch.testing.assert_close(_flat(probe.grads[0]), _flat(ref_grads), rtol=0, atol=1e-10)
    # The logged loss of that optimizer step is the reference loss (the mean over all 12 tokens).
    assert engine.history[0]["train/loss"] == pytest.approx(ref_loss, abs=1e-12)

    # The per-micro-batch mean (what "mean" normalisation assumes) weights A's tokens 1/6 and B's 1/18.
    probe_mean = GradProbe()
    _run([{"grad_accum": {"steps": 2}}, probe_mean], TokenLM(sequences), tmp_path / "mean")
    assert (_flat(probe_mean.grads[0]) - _flat(ref_grads)).abs().max() > 1e-3


def test_tokens_normalisation_needs_num_items(tmp_path) -> None:
    with pytest.raises(torchloom.PluginError, match=r"normalization='tokens' needs training_step.*'num_items'"):
        _run([{"grad_accum": {"steps": 2, "normalization": "tokens"}}], TinyTask(validate=False), tmp_path)


@pytest.mark.multiprocess
def test_c01_two_processes_normalise_by_the_global_token_count(tmp_path) -> None:
    results = torchrun("ga_tokens.py", tmp_path)
    cases = {"c01": [3, 1, 5, 7], "uneven": [3, 1, 5, 2]}  # must match tests/mp/ga_tokens.py
    for case, counts in cases.items():
        sequences = [make_sequence(n, seed=i, length=n + 1 + i) for i, n in enumerate(counts)]
        ref_grads, ref_loss = reference_gradients(sequences)  # 1 process: sum of CE over all tokens / count
        for rank in results:
            r = rank[case]
            assert r["world_size"] == 2
            assert r["global_step"] == 1
            torch.testing.assert_close(_flat(r["grads"][0]), _flat(ref_grads), rtol=0, atol=1e-10)
            assert r["history"][0]["train/loss"] == pytest.approx(ref_loss, abs=1e-12)
        assert results[0][case]["grads"] == results[1][case]["grads"]


# ------------------------------------------------------------------------------------------------- C02


@pytest.mark.parametrize("normalization", ["mean", "items"])
def test_c02_the_last_partial_window_is_applied_and_scaled_by_its_size(tmp_path, normalization) -> None:
    task = WeightedScalarTask([float(c) for c in range(1, 11)], items=normalization == "items")
    probe = StepProbe()
    engine = _run([{"grad_accum": {"steps": 4, "normalization": normalization}}, probe], task, tmp_path)
    assert engine.progress.global_step == 3
    # Updates -(1+2+3+4)/4, -(5+6+7+8)/4, -(9+10)/2 (dividing the last by 4 gives -13.75; dropping it, -9).
    assert probe.params == [[-2.5], [-9.0], [-18.5]]
    assert task.scheduler.last_epoch == 3


def test_c02_an_epoch_shorter_than_steps_is_flushed_with_a_warning(tmp_path) -> None:
    # Documented policy: each epoch's window is flushed at the epoch's end, scaled by its real size, and a
    # UserWarning says that every step accumulates 3 micro-batches, not 4.
    task = WeightedScalarTask([1.0, 2.0, 3.0])
    probe = StepProbe()
    with pytest.warns(UserWarning, match=r"only 3 micro-batches, fewer than steps=4") as caught:
        engine = _run([{"grad_accum": {"steps": 4}}, probe], task, tmp_path, max_epochs=2)
    assert sum("fewer than steps" in str(w.message) for w in caught) == 1  # once per fit
    assert engine.progress.global_step == 2
    assert probe.params == [[-2.0], [-4.0]]  # -(1+2+3)/3 per epoch
    assert task.scheduler.last_epoch == 2


def test_no_warning_when_the_epoch_holds_a_full_window(tmp_path, recwarn) -> None:
    _run([{"grad_accum": {"steps": 4}}], WeightedScalarTask([float(c) for c in range(1, 11)]), tmp_path)
    assert not [w for w in recwarn if "grad_accum" in str(w.message)]


# ------------------------------------------------------------------------------------------------- C04


class LinearTask(torchloom.TaskModule):
    """C04: Linear(2, 1), MSE, SGD lr 1.0 with LambdaLR factor(t) = max(0, 1 - t/4); 8 micro-batches."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler: Any = None

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.model.parameters(), lr=1.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: max(0.0, 1 - t / 4))
        return optimizer, self.scheduler

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g)), batch_size=1)


def test_c04_the_scheduler_and_global_step_advance_once_per_window(tmp_path) -> None:
    task, probe = LinearTask(), StepProbe()
    engine = _run([{"grad_accum": {"steps": 2}}, probe], task, tmp_path)
    assert engine.progress.global_step == 4
    assert probe.lrs == [1.0, 0.75, 0.5, 0.25]  # stepping per micro-batch gives [0.75, 0.25, 0.0, 0.0]
    assert task.scheduler.last_epoch == 4
    assert [h["step"] for h in engine.history if "train/loss" in h] == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------------- C20


class Bias(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b.expand(len(x), 1)


class ConstantLossTask(torchloom.TaskModule):
    """C20: a bias b = 0 trained with lr 0; micro-batch i (1..8, 2 samples each) has targets sqrt(i), so
    its MSE loss is i."""

    def configure_model(self) -> torch.nn.Module:
        return Bias()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        y = torch.tensor([math.sqrt(i) for i in range(1, 9) for _ in range(2)], dtype=torch.float64)[:, None]
        return DataLoader(TensorDataset(torch.zeros(16, 1, dtype=torch.float64), y), batch_size=2)


@pytest.mark.parametrize(("steps", "logged"), [(4, [2.5, 6.5]), (1, [1, 2, 3, 4, 5, 6, 7, 8])])
def test_c20_the_logged_loss_does_not_depend_on_the_accumulation_steps(tmp_path, steps, logged) -> None:
    probe = StepProbe()
    engine = _run([{"grad_accum": {"steps": steps}}, probe], ConstantLossTask(), tmp_path)
    losses = [h["train/loss"] for h in engine.history]
    assert losses == pytest.approx(logged, abs=1e-12)  # divided by GA: [0.625, 1.625]; summed: [10, 26]
    assert sum(losses) / len(losses) == pytest.approx(4.5, abs=1e-12)
    # on_train_batch_end sees each raw micro-batch loss, not the loss divided by the accumulation steps.
    assert probe.batch_losses == pytest.approx([1, 2, 3, 4, 5, 6, 7, 8], abs=1e-12)


# -------------------------------------------------------------------------------------------------- DDP


@pytest.mark.multiprocess
def test_no_gradient_all_reduce_inside_a_window_under_ddp(tmp_path) -> None:
    results = torchrun("ga_nosync.py", tmp_path)
    r0, r1 = results
    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["micro_step"] == r1["micro_step"] == 16
    assert r0["global_step"] == r1["global_step"] == 4
    # One bucket: DDP's all-reduce ran once per optimizer step, never on the 12 other micro-batches.
    assert r0["allreduce_calls"] == r1["allreduce_calls"] == 4
    # Inside a window each rank's .grad is its own local sum: the ranks differ.
    assert len(r0["local_grads"]) == len(r1["local_grads"]) == 12
    for g0, g1 in zip(r0["local_grads"], r1["local_grads"]):
        assert max(abs(a - b) for a, b in zip(g0, g1)) > 1e-4
    # At the step they agree, and equal one process's gradients on the 16-sample global batch.
    assert r0["synced_grads"] == r1["synced_grads"]
    assert r0["params"] == r1["params"]
    probe = GradProbe()
    ref = _run([probe], TinyTask(n=32, batch_size=16, validate=False), tmp_path / "ref", max_epochs=2)
    for g_ddp, g_ref in zip(r0["synced_grads"], probe.grads, strict=True):
        torch.testing.assert_close(_flat(g_ddp), _flat(g_ref), rtol=0, atol=1e-6)
    ref_params = [x for p in ref._run.model.parameters() for x in p.detach().double().flatten().tolist()]
    torch.testing.assert_close(
        torch.tensor([x for p in r0["params"] for x in p], dtype=torch.float64),
        torch.tensor(ref_params, dtype=torch.float64),
        rtol=0,
        atol=1e-6,
    )


# ------------------------------------------------------------------------------------------------ clash


class SetsAccumulation:
    name = "test.sets_accumulation"

    def __init__(self, steps: int) -> None:
        self.steps = steps

    @torchloom.hookimpl
    def configure_accelerator(self) -> dict[str, Any]:
        return {"gradient_accumulation_steps": self.steps}


def test_another_plugin_setting_other_accumulation_steps_is_a_clash(tmp_path) -> None:
    with pytest.raises(torchloom.PluginError, match=r"'grad_accum' and 'test.sets_accumulation'.*4 vs 2"):
        _run([{"grad_accum": {"steps": 4}}, SetsAccumulation(2)], TinyTask(validate=False), tmp_path)
    engine = _run([{"grad_accum": {"steps": 4}}, SetsAccumulation(4)], TinyTask(validate=False), tmp_path / "ok")
    assert engine.progress.global_step == 2
