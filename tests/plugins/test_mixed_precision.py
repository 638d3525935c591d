"""The ``mixed_precision`` plugin: bf16 really autocasts on CPU, fp16 runs on CPU with a real
``torch.amp.GradScaler("cpu")`` (skipped steps do not step the scheduler; the scaler survives save / load),
fp8 is a clear error without the hardware, and it composes with ``grad_accum`` and ``grad_clip``.

Cases C02 (with fp16), C08, C10 (the scaler part) and C18 of shared/cases/README.md, through `torchloom.Engine`.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from torchloom.testing import TinyTask, tiny_fit


def _run(plugins: list[Any], task: torchloom.TaskModule, tmp_path, **settings: Any) -> torchloom.Engine:
    settings.setdefault("output_dir", str(tmp_path / "run"))
    return tiny_fit(plugins, task=task, **settings)


class DtypeProbe:
    """Records the output dtype of every Linear during training steps, and the dtypes of the parameters and
    their gradients at every optimizer step."""

    name = "test.dtype_probe"

    def __init__(self) -> None:
        self.linear_outputs: list[torch.dtype] = []
        self.param_dtypes: set[torch.dtype] = set()
        self.grad_dtypes: set[torch.dtype] = set()

    @torchloom.hookimpl
    def on_fit_start(self, model) -> None:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda m, i, out: self.linear_outputs.append(out.dtype))

    @torchloom.hookimpl(trylast=True)
    def before_optimizer_step(self, model) -> None:
        for p in model.parameters():
            self.param_dtypes.add(p.dtype)
            self.grad_dtypes.add(p.grad.dtype)


class Classifier(torchloom.TaskModule):
    """C18: Linear(8, 8) -> ReLU -> Linear(8, 2), cross-entropy, SGD; 8 samples, batch 4."""

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)), batch_size=4
        )


# --------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"dtype": "fp32"}, r"plugin 'mixed_precision'.*'dtype' = 'fp32'.*'no', 'bf16', 'fp16', 'fp8'"),
        ({"dtype": "bf16", "init_scale": 1024.0}, r"'init_scale' = 1024.0 configures the fp16 loss scaler.*'bf16'"),
        ({"dtype": "fp16", "init_scale": 0.0}, r"'init_scale' = 0.0; expected a finite number > 0"),
        ({"dtype": "fp16", "growth_factor": 1.0}, r"'growth_factor' = 1.0; expected a finite number > 1"),
        ({"dtype": "fp16", "backoff_factor": 1.5}, r"'backoff_factor' = 1.5; expected a number between 0 and 1"),
        ({"dtype": "fp16", "growth_interval": 0}, r"'growth_interval' = 0; expected an integer >= 1"),
    ],
)
def test_bad_settings_are_one_clear_error(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(torchloom.ConfigError, match=match):
        torchloom.Engine(plugins={"mixed_precision": settings})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a CUDA device")
def test_fp8_without_the_hardware_stops_the_fit_at_start_up(tmp_path) -> None:
    engine = torchloom.Engine(plugins={"mixed_precision": {"dtype": "fp8"}}, output_dir=str(tmp_path / "run"))
    with pytest.raises(torchloom.ConfigError, match=r"dtype = 'fp8' needs an NVIDIA GPU of compute capability >= 8.9"):
        engine.fit(TinyTask())
    assert not list((tmp_path / "run").rglob("config.yaml"))  # nothing ran


class SetsPrecision:
    name = "test.sets_precision"

    @torchloom.hookimpl
    def configure_accelerator(self) -> dict[str, Any]:
        return {"mixed_precision": "fp16"}


def test_another_plugin_setting_another_precision_is_a_clash(tmp_path) -> None:
    with pytest.raises(torchloom.PluginError, match=r"'mixed_precision' and 'test.sets_precision'.*'bf16' vs 'fp16'"):
        _run([{"mixed_precision": {"dtype": "bf16"}}, SetsPrecision()], TinyTask(), tmp_path)


# ------------------------------------------------------------------------------------------------- C18


def test_c18_bf16_really_autocasts_on_cpu(tmp_path) -> None:
    probe = DtypeProbe()
    engine = _run([{"mixed_precision": {"dtype": "bf16"}}, probe], Classifier(), tmp_path)
    acc = engine._run.accelerator
    assert acc.device.type == "cpu" and acc.mixed_precision == "bf16"
    assert probe.linear_outputs and set(probe.linear_outputs) == {torch.bfloat16}
    assert probe.param_dtypes == probe.grad_dtypes == {torch.float32}
    assert all(math.isfinite(h["train/loss"]) for h in engine.history)
    assert acc.scaler is None  # bf16 needs no loss scaling

    probe_fp32 = DtypeProbe()  # the probe can tell: without the plugin the Linears compute in float32
    _run([probe_fp32], Classifier(), tmp_path / "fp32")
    assert set(probe_fp32.linear_outputs) == {torch.float32}


def test_fp16_on_cpu_autocasts_to_float16_with_a_cpu_grad_scaler(tmp_path) -> None:
    # Documented behaviour: fp16 on a CPU is real float16 autocast (not bf16, not silently float32) with
    # torch.amp.GradScaler("cpu"), configured from the plugin's scaler settings.
    probe = DtypeProbe()
    engine = _run(
        [{"mixed_precision": {"dtype": "fp16", "init_scale": 256.0, "growth_interval": 3}}, probe],
        Classifier(),
        tmp_path,
    )
    acc = engine._run.accelerator
    assert isinstance(acc.scaler, torch.amp.GradScaler) and acc.scaler._device == "cpu"
    assert acc.scaler.get_growth_interval() == 3
    assert acc.scaler.get_scale() == 256.0  # 2 steps: no growth yet
    assert set(probe.linear_outputs) == {torch.float16}
    assert probe.param_dtypes == probe.grad_dtypes == {torch.float32}
    assert all(math.isfinite(h["train/loss"]) for h in engine.history)


# ------------------------------------------------------------------------------------------------- C08


class OverflowTask(torchloom.TaskModule):
    """C08 / C10: Linear(2, 1), MSE, batch size 1. ``overflow(task, batch_idx)`` says when to multiply the
    loss by inf (an injected fp16 overflow)."""

    def __init__(self, scheduler: str, overflow: Any, samples: int = 8, start: int = 0, lr: float = 1.0) -> None:
        super().__init__()
        self.scheduler_kind, self.overflow, self.samples, self.start, self.lr = scheduler, overflow, samples, start, lr
        self.scheduler: Any = None

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        return loss * math.inf if self.overflow(self, batch_idx) else loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr)
        if self.scheduler_kind == "lambda":
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1 / (t + 1))
        else:
            self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return optimizer, self.scheduler

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(self.samples, 2, generator=g) * 0.1, torch.randn(self.samples, 1, generator=g) * 0.1
        return DataLoader(TensorDataset(x[self.start :], y[self.start :]), batch_size=1)


class ScalerProbe:
    """Records per optimizer step: the LR used, whether the scaler skipped it, the parameters after it, the
    scaler's state after it."""

    name = "test.scaler_probe"

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.skipped: list[bool] = []
        self.params: list[list[float]] = []
        self.scaler_states: list[dict[str, Any]] = []

    @torchloom.hookimpl
    def before_optimizer_step(self, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    @torchloom.hookimpl
    def after_optimizer_step(self, model, optimizer, accelerator) -> None:
        self.skipped.append(optimizer.step_was_skipped)
        self.params.append([x for p in model.parameters() for x in p.detach().flatten().tolist()])
        self.scaler_states.append(accelerator.scaler.state_dict())


def test_c08_a_skipped_fp16_step_does_not_advance_the_scheduler(tmp_path) -> None:
    task = OverflowTask("lambda", overflow=lambda task, i: i == 2, samples=5)
    probe = ScalerProbe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _run([{"mixed_precision": {"dtype": "fp16", "init_scale": 1024.0}}, probe], task, tmp_path)
    assert engine.progress.global_step == 5  # optimizer steps attempted (a skipped one counts, as in HF)
    assert probe.skipped == [False, False, True, False, False]  # the optimizer really stepped 4 times
    assert probe.params[2] == probe.params[1]  # step 3 changed nothing
    assert probe.params[3] != probe.params[2]
    assert [s["scale"] for s in probe.scaler_states] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert task.scheduler.last_epoch == 4
    real_lrs = [lr for lr, skipped in zip(probe.lrs, probe.skipped) if not skipped]
    assert real_lrs == pytest.approx([1, 1 / 2, 1 / 3, 1 / 4], abs=1e-15)  # a stepped scheduler gives 1/4, 1/5
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


class WeightedScalarTask(torchloom.TaskModule):
    """C02: Linear(1, 1, bias=False) with w = 0; micro-batch i's loss is ``w * c_i`` (c = 1..10); SGD lr 1."""

    def configure_model(self) -> torch.nn.Module:
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        return model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (c,) = batch
        return (self.model.weight * c).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=1.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(1.0, 11.0)), batch_size=1)


def test_fp16_with_accumulation_keeps_the_partial_window_exact(tmp_path) -> None:
    # C02 under loss scaling: grad_accum rescales the (scaled) gradients of the last, partial window, and the
    # scaler unscales once per step: w = -(2.5 + 6.5 + 9.5) exactly, with a scaler that never overflowed.
    plugins = [{"mixed_precision": {"dtype": "fp16", "init_scale": 1024.0}}, {"grad_accum": {"steps": 4}}]
    engine = _run(plugins, WeightedScalarTask(), tmp_path)
    assert engine.progress.global_step == 3
    assert engine._run.accelerator.scaler.get_scale() == 1024.0
    assert engine._run.model.weight.item() == -18.5


# ------------------------------------------------------------------------------------------------- C10


class SaveAt:
    """Saves a checkpoint (`torchloom.save_checkpoint`) right after optimizer step ``step``, then stops the fit as a
    crash would; records the loss scale it saved."""

    name = "test.save_at"

    class Stop(Exception):
        pass

    def __init__(self, step: int) -> None:
        self.step, self.path, self.scale = step, None, None

    @torchloom.hookimpl
    def on_train_step_end(self, accelerator, progress) -> None:
        if progress.global_step == self.step:
            self.scale = accelerator.scaler.get_scale()
            self.path = torchloom.save_checkpoint()
            raise SaveAt.Stop


class ScaleAtStart:
    name = "test.scale_at_start"

    @torchloom.hookimpl
    def on_fit_start(self, accelerator) -> None:
        self.scale = accelerator.scaler.get_scale()


def test_c10_the_loss_scaler_is_saved_and_restored_and_the_run_continues_identically(tmp_path) -> None:
    # The scale doubles every 2 good steps from 2**10; an injected overflow whenever it is above 2**11 makes a
    # wrong scale after resume visible as a different skip pattern.
    def overflow(task: torchloom.TaskModule, batch_idx: int) -> bool:
        return task.accelerator.scaler.get_scale() > 2**11

    amp = {"mixed_precision": {"dtype": "fp16", "init_scale": 1024.0, "growth_interval": 2}}
    probe_a = ScalerProbe()
    _run([amp, probe_a], OverflowTask("step", overflow, lr=0.1), tmp_path / "a")
    assert probe_a.skipped == [False, False, False, False, True, False, False, True]
    scales = [s["scale"] for s in probe_a.scaler_states]
    assert scales == [2.0**k for k in (10, 11, 11, 12, 11, 11, 12, 11)]

    saver, probe_b1 = SaveAt(4), ScalerProbe()
    with pytest.raises(SaveAt.Stop):
        _run([amp, probe_b1, saver], OverflowTask("step", overflow, lr=0.1), tmp_path / "b1")
    assert probe_b1.params == probe_a.params[:4]

    # A new engine resumes from the checkpoint (the engine's own, not a hand-made Accelerator state).
    start, probe_b2 = ScaleAtStart(), ScalerProbe()
    task_b2 = OverflowTask("step", overflow, lr=0.1)
    engine = torchloom.Engine(plugins=[amp, probe_b2, start], output_dir=str(tmp_path / "b2"), log_every_n_steps=1)
    engine.fit(task_b2, ckpt_path=saver.path)
    assert saver.scale == start.scale == 4096.0  # the scale right after load is the saved one, not 2**10
    assert probe_b2.skipped == probe_a.skipped[4:]
    assert probe_b2.lrs == probe_a.lrs[4:]
    assert probe_b2.scaler_states == probe_a.scaler_states[4:]
    assert probe_b2.params == probe_a.params[4:]  # bitwise
    assert task_b2.scheduler.last_epoch == 6  # 4 restored + 2 real steps among 5-8


# ------------------------------------------------------------------------------ all three plugins together


def test_grad_accum_grad_clip_and_bf16_together(tmp_path) -> None:
    # 9 micro-batches, 2 per window: 4 full windows and a partial one; max_norm 0.5 clips some steps.
    def fit(dtype: str, directory: str) -> tuple[torchloom.Engine, DtypeProbe, Any]:
        probe, clipped = DtypeProbe(), _ClippedProbe()
        plugins = [
            {"grad_clip": {"max_norm": 0.5}},
            {"mixed_precision": {"dtype": dtype}},
            {"grad_accum": {"steps": 2}},
            probe,
            clipped,
        ]
        return _run(plugins, WrappedTinyTask(n=36, batch_size=4, validate=False), tmp_path / directory), probe, clipped

    bf16, probe, clipped = fit("bf16", "bf16")
    fp32, _, _ = fit("no", "fp32")
    assert bf16.progress.global_step == fp32.progress.global_step == 5
    assert set(probe.linear_outputs) == {torch.bfloat16}
    assert probe.param_dtypes == probe.grad_dtypes == {torch.float32}
    norms = [h["grad_norm"] for h in bf16.history]
    norms_fp32 = [h["grad_norm"] for h in fp32.history]
    assert len(norms) == 5 and max(norms_fp32) > 0.5  # one norm per optimizer step; clipping was active
    assert norms == pytest.approx(norms_fp32, rel=5e-2)  # bf16 rounding only
    for norm, after in zip(norms, clipped.norms):
        assert after == pytest.approx(min(norm, 0.5), rel=1e-4)
    for p, q in zip(bf16._run.model.parameters(), fp32._run.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=5e-2)


class WrappedTinyTask(TinyTask):
    """TinyTask with its Linear inside a Sequential: Accelerate casts the *model's* outputs back to float32,
    so the probe looks at the inner Linear to see the autocast dtype."""

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(super().configure_model())


class _ClippedProbe:
    """The total 2-norm of the gradients the optimizer will apply (after clipping)."""

    name = "test.clipped_probe"

    def __init__(self) -> None:
        self.norms: list[float] = []

    @torchloom.hookimpl(trylast=True)
    def before_optimizer_step(self, model) -> None:
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        self.norms.append(torch.linalg.vector_norm(grads).item())
