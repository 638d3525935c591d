"""The ``grad_clip`` plugin: clips once per optimizer step, on unscaled gradients (fp16), after
``grad_accum``'s window rescale whatever the plugin order, and logs the norm before clipping.

Case C09 of shared/cases/README.md, through `torchloom.Engine`.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from torchloom.testing import RecordingPlugin, TinyTask, tiny_fit


class ClipTask(torchloom.TaskModule):
    """C09: Linear(1, 1, bias=False) with w = 0; every sample is x = 1, y = 2.5, so the loss (w x - y)^2 is
    6.25 and the gradient -5 (norm 5); SGD lr 0.1; ``copies`` samples, batch size 1."""

    def __init__(self, copies: int = 1) -> None:
        super().__init__()
        self.copies = copies

    def configure_model(self) -> torch.nn.Module:
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        return model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.ones(self.copies, 1), torch.full((self.copies, 1), 2.5)), batch_size=1)


class Scalar(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.0))


class WeightedScalarTask(torchloom.TaskModule):
    """C02's scalar: micro-batch i's loss is ``w * c_i`` (gradient c_i), c = 1..10; SGD lr 1."""

    def configure_model(self) -> torch.nn.Module:
        return Scalar()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (c,) = batch
        return (self.model.w * c).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=1.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(1.0, 11.0)), batch_size=1)


class GradNormProbe:
    """Records, after every other ``before_optimizer_step`` (trylast), the gradients the optimizer will
    use, and the parameters after the step."""

    name = "test.grad_norm_probe"

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []
        self.params: list[list[float]] = []

    @torchloom.hookimpl(trylast=True)
    def before_optimizer_step(self, model) -> None:
        self.grads.append(torch.cat([p.grad.detach().flatten().clone() for p in model.parameters()]))

    @torchloom.hookimpl
    def after_optimizer_step(self, model) -> None:
        self.params.append([x for p in model.parameters() for x in p.detach().flatten().tolist()])


def _run(plugins: list[Any], task: torchloom.TaskModule, tmp_path, **settings: Any) -> torchloom.Engine:
    settings.setdefault("output_dir", str(tmp_path / "run"))
    return tiny_fit(plugins, task=task, **settings)


def _norms(engine: torchloom.Engine) -> list[float]:
    return [h["grad_norm"] for h in engine.history if "grad_norm" in h]


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"max_norm": 0}, r"plugin 'grad_clip'.*'max_norm' = 0.0.*> 0"),
        ({"max_norm": -1.0}, r"'max_norm' = -1.0"),
        ({"max_norm": float("nan")}, r"'max_norm' = nan"),
        ({"max_norm": "1"}, r"'max_norm' = '1'.*expected float"),
        ({"norm_type": 0.0}, r"'norm_type' = 0.0.*> 0 or inf"),
        ({"clip_value": 0.0}, r"'clip_value' = 0.0; expected a finite number > 0 \(or null: clip by norm\)"),
        ({"clip_value": float("inf")}, r"'clip_value' = inf"),
    ],
)
def test_bad_settings_are_one_clear_error(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(torchloom.ConfigError, match=match):
        torchloom.Engine(plugins={"grad_clip": settings})


def test_c09_clips_to_max_norm_and_reports_the_norm_before_clipping(tmp_path) -> None:
    probe = GradNormProbe()
    engine = _run([{"grad_clip": {"max_norm": 1.0}}, probe], ClipTask(), tmp_path)
    assert _norms(engine) == [5.0]
    # torch divides by (norm + 1e-6): the applied gradient is -5 / 5.000001 and w = 0.1 up to that 1e-6.
    assert probe.grads[0].tolist() == pytest.approx([-1.0], abs=1e-6)
    assert probe.params == [[pytest.approx(0.1, abs=1e-7)]]


@pytest.mark.parametrize("fp16", [False, True])
def test_clip_value_clamps_each_unscaled_gradient_element_and_logs_no_norm(tmp_path, fp16) -> None:
    """C09 by value: the gradient -5 becomes -0.5 (by norm, max_norm's default 1.0 would give -1), so w = 0.05; under
    fp16 the clamp acts on the unscaled gradient (clamping the scaled -5120 would leave -0.5 / 1024)."""
    probe = GradNormProbe()
    plugins: list[Any] = [{"grad_clip": {"clip_value": 0.5}}, probe]
    if fp16:
        plugins.insert(0, {"mixed_precision": {"dtype": "fp16", "init_scale": 1024.0}})
    engine = _run(plugins, ClipTask(), tmp_path)
    assert probe.grads[0].tolist() == [-0.5]
    assert probe.params == [[pytest.approx(0.05, abs=1e-7)]]
    assert _norms(engine) == []


def test_c09_fp16_clips_unscaled_gradients(tmp_path) -> None:
    probe = GradNormProbe()
    plugins = [{"mixed_precision": {"dtype": "fp16", "init_scale": 1024.0}}, {"grad_clip": {"max_norm": 1.0}}, probe]
    engine = _run(plugins, ClipTask(), tmp_path)
    assert engine._run.accelerator.scaler.get_scale() == 1024.0  # no overflow, no growth
    assert _norms(engine) == [5.0]  # clipping the scaled gradient would report 5120
    assert probe.params == [[pytest.approx(0.1, abs=1e-7)]]  # ... and give w = 0.1 / 1024


def test_c09_with_accumulation_unscales_and_clips_once_on_the_sync_micro_batch(tmp_path) -> None:
    probe, recorder = GradNormProbe(), RecordingPlugin()
    plugins = [
        {"mixed_precision": {"dtype": "fp16", "init_scale": 1024.0}},
        {"grad_clip": {"max_norm": 1.0}},
        {"grad_accum": {"steps": 2}},
        probe,
        recorder,
    ]
    engine = _run(plugins, ClipTask(copies=2), tmp_path)  # a second unscale_ in one step would raise
    assert engine.progress.global_step == 1
    clip_at = [p.batch_idx for name, p in recorder.records if name == "before_optimizer_step"]
    assert clip_at == [1]
    assert _norms(engine) == [5.0]
    assert probe.params == [[pytest.approx(0.1, abs=1e-7)]]


@pytest.mark.parametrize("order", ["clip_first", "accum_first"])
def test_clipping_sees_the_rescaled_partial_window_whatever_the_plugin_order(tmp_path, order) -> None:
    accum = {"grad_accum": {"steps": 4}}
    clip_loose, clip_tight = {"grad_clip": {"max_norm": 100.0}}, {"grad_clip": {"max_norm": 3.0}}
    loose = [clip_loose, accum] if order == "clip_first" else [accum, clip_loose]
    engine = _run(loose, WeightedScalarTask(), tmp_path / "loose")
    # Window norms 2.5, 6.5 and (9+10)/2 = 9.5: the partial window is rescaled before the norm is taken
    # (clipping first would see (9+10)/4 = 4.75).
    assert _norms(engine) == [2.5, 6.5, 9.5]

    probe = GradNormProbe()
    tight = [clip_tight, accum, probe] if order == "clip_first" else [accum, clip_tight, probe]
    engine = _run(tight, WeightedScalarTask(), tmp_path / "tight")
    assert _norms(engine) == [2.5, 6.5, 9.5]
    # Updates -2.5 (under max_norm), then -3 and -3 (clipped): w = -8.5. Clipping before the rescale of the
    # last window would apply -3 * 2 and give w = -11.5.
    assert probe.params[-1] == [pytest.approx(-8.5, abs=1e-5)]


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_the_logged_norm_is_the_total_p_norm_and_clipped_gradients_have_max_norm(tmp_path, norm_type) -> None:
    task = TinyTask(n=16, batch_size=4, validate=False)
    probe = GradNormProbe()
    engine = _run([{"grad_clip": {"max_norm": 1e6, "norm_type": norm_type}}, probe], task, tmp_path / "loose")
    expected = [torch.linalg.vector_norm(g, norm_type).item() for g in probe.grads]  # nothing was clipped
    assert _norms(engine) == pytest.approx(expected, rel=1e-6)
    assert min(expected) > 0.05

    probe = GradNormProbe()
    engine = _run([{"grad_clip": {"max_norm": 0.05, "norm_type": norm_type}}, probe], task, tmp_path / "tight")
    assert engine.progress.global_step == 4
    for g in probe.grads:
        assert torch.linalg.vector_norm(g, norm_type).item() == pytest.approx(0.05, rel=1e-4)
