"""The core's seams (issue 7): a lifecycle with both ends, a step contract that survives replacement, logging
that does not live on the user's task. The 2-process halves are in test_multiprocess.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import torchloom
from torchloom.hookspecs import HOOK_NAMES
from torchloom.testing import TinyTask, tiny_fit


class Lifecycle(torchloom.Plugin):
    """Implements every hook; records whether each call came between ``setup`` and ``teardown`` of its call."""

    name = "test_lifecycle"

    def __init__(self) -> None:
        super().__init__()
        self.open_stage: str | None = None
        self.outside: list[str] = []
        self.stages: list[tuple[str, str]] = []


def _recorder(hook: str) -> Any:
    def impl(self, **kwargs: Any) -> None:
        if self.open_stage is None:
            self.outside.append(hook)

    return impl


for _hook in HOOK_NAMES:
    if _hook in ("setup", "teardown", "run_train_step", "configure_optimizers", "configure_accelerator"):
        continue
    setattr(Lifecycle, _hook, torchloom.hookimpl(_recorder(_hook)))


@torchloom.hookimpl
def _setup(self, stage):
    assert self.open_stage is None, f"setup({stage!r}) while {self.open_stage!r} is open"
    self.open_stage = stage
    self.stages.append(("setup", stage))


@torchloom.hookimpl
def _teardown(self, stage):
    assert self.open_stage == stage
    self.open_stage = None
    self.stages.append(("teardown", stage))


@torchloom.hookimpl
def _configure_accelerator(self):
    if self.open_stage is None:
        self.outside.append("configure_accelerator")


Lifecycle.setup, Lifecycle.teardown, Lifecycle.configure_accelerator = _setup, _teardown, _configure_accelerator


def test_every_hook_of_every_call_fires_between_setup_and_teardown(tmp_path):
    plugin = Lifecycle()
    engine = torchloom.Engine(plugins=[plugin], output_dir=str(tmp_path), log_every_n_steps=1)
    task = TinyTask(n=8, batch_size=4)
    engine.fit(task)
    engine.validate(task)  # reuses the fitted model: no set-up hooks, but setup / teardown all the same
    engine.predict(task, DataLoader(torch.zeros(3, 4), batch_size=2))
    engine.validate(TinyTask(n=8, batch_size=4))  # a new task: set up from scratch
    assert plugin.outside == []
    assert plugin.stages == [
        *[("setup", "fit"), ("teardown", "fit")],
        *[("setup", "validate"), ("teardown", "validate")],
        *[("setup", "predict"), ("teardown", "predict")],
        *[("setup", "validate"), ("teardown", "validate")],
    ]


def test_teardown_closes_what_setup_opened_when_the_set_up_fails(tmp_path):
    plugin = Lifecycle()

    class NoModel(TinyTask):
        def configure_model(self):
            return None

    with pytest.raises(torchloom.TaskError):
        torchloom.Engine(plugins=[plugin], output_dir=str(tmp_path)).fit(NoModel())
    assert plugin.stages == [("setup", "fit"), ("teardown", "fit")]


class SAMLikeStep(torchloom.Plugin):
    """Replaces the step with two forward/backward passes (the shape of SAM) and fires the step hooks."""

    name = "test_two_pass"

    @torchloom.hookimpl
    def run_train_step(self, task, model, optimizer, scheduler, accelerator, batch, progress, hooks):
        for _ in range(2):
            outputs = {"loss": task.training_step(batch, progress.batch_idx)}
            hooks.before_backward(outputs, accelerator, progress)
            accelerator.backward(outputs["loss"])
        hooks.before_optimizer_step(model, optimizer, accelerator, progress)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        hooks.after_optimizer_step(model, optimizer, scheduler, accelerator, progress)
        return {"loss": outputs["loss"].detach()}


def test_a_replacing_step_keeps_clipping_and_learning_rate_logging(tmp_path):
    plugins = [
        SAMLikeStep(),
        {"grad_clip": {"max_norm": 1e-3}},
        {"optimizer": {"name": "sgd", "lr": 0.1, "scheduler": "linear"}},
    ]
    engine = tiny_fit(plugins, output_dir=str(tmp_path))
    assert engine.progress.global_step == 8
    assert all("grad_norm" in record and "lr" in record for record in engine.history if "train/loss" in record)
    lrs = [record["lr"] for record in engine.history if "lr" in record]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] > lrs[-1]  # the schedule ran through the replaced step


def test_the_engine_writes_nothing_private_onto_the_task(tmp_path):
    task = TinyTask(n=8, batch_size=4)
    before = dict(vars(task))
    tiny_fit(task=task, output_dir=str(tmp_path))
    changed = {k for k, v in vars(task).items() if k not in before or before[k] is not v}
    assert changed == {"model", "accelerator", "num_training_steps"}  # the documented, public attributes


# ------------------------------------------------------------------- a replaced step keeps the engine's settings


class DocstringStep:
    """A step that replaces the default one, written exactly as the `torchloom.StepHooks` docstring shows."""

    name = "test.docstring_step"

    @torchloom.hookimpl
    def run_train_step(self, task, model, optimizer, scheduler, accelerator, batch, progress, hooks):
        outputs = {"loss": task.training_step(batch, progress.batch_idx)}
        hooks.before_backward(outputs, accelerator, progress)
        accelerator.backward(outputs["loss"])
        if accelerator.sync_gradients:
            hooks.optimizer_step(model, optimizer, scheduler, accelerator, progress)  # clipping, skips, LR
        outputs["loss"] = outputs["loss"].detach()
        return outputs


def test_the_replacement_step_is_the_docstrings_example():
    import inspect
    import textwrap

    from torchloom.step import StepHooks

    example = textwrap.dedent(inspect.getdoc(StepHooks).split(".. code-block:: python", 1)[1]).strip()
    assert textwrap.dedent(inspect.getsource(DocstringStep.run_train_step)).strip() == example


class NaNAt(TinyTask):
    """TinyTask (8 steps per epoch) whose loss is NaN in micro-batch ``at`` (0-based, in epoch 0)."""

    def __init__(self, at: int = 2) -> None:
        super().__init__(validate=False)
        self.at = at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == self.at and self.model.training else loss


def _metrics(run_dir: str) -> list[dict[str, Any]]:
    import json
    from pathlib import Path

    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("precision", [None, "fp16"])
def test_a_replaced_step_keeps_the_nonfinite_skip(tmp_path, precision):
    """nonfinite_loss='skip' with a NaN loss in one micro-batch: the replaced step skips that optimizer step as
    the default one does (finite weights), and train/skipped_steps counts it in metrics.jsonl."""
    plugins: list[Any] = [DocstringStep()]
    if precision:
        plugins.append({"mixed_precision": {"dtype": precision, "init_scale": 1024.0}})
    with pytest.warns(UserWarning, match=r"nonfinite_loss='skip': skipped optimizer step 3 \(epoch 0\)"):
        engine = tiny_fit(
            plugins, task=NaNAt(2), output_dir=str(tmp_path), nonfinite_loss="skip", log_every_n_steps=4, max_epochs=1
        )
    model = engine.accelerator.unwrap_model(engine._run.model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    records = [r for r in _metrics(engine.run_dir) if "train/loss" in r]
    assert [(r["step"], r["train/skipped_steps"]) for r in records] == [(4, 1.0), (8, 1.0)]
    if precision:  # the scaler never saw the NaN: the step was skipped before it
        assert [r["train/scaler_skipped_steps"] for r in records] == [0.0, 0.0]


def test_a_replaced_step_keeps_the_loss_scalers_tolerated_overflow(tmp_path):
    """fp16 with nonfinite_loss='error': a NaN loss makes the gradients non-finite, the loss scaler skips the step
    and lowers its scale: an overflow it handles, not an error, also through a replaced step; the skip is counted
    (train/scaler_skipped_steps) and the weights stay finite."""
    plugins = [DocstringStep(), {"mixed_precision": {"dtype": "fp16", "init_scale": 1024.0}}]
    engine = tiny_fit(plugins, task=NaNAt(2), output_dir=str(tmp_path), log_every_n_steps=4, max_epochs=1)
    assert engine.progress.global_step == 8
    model = engine.accelerator.unwrap_model(engine._run.model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert engine.accelerator.scaler.get_scale() == 512.0
    records = [r for r in _metrics(engine.run_dir) if "train/loss" in r]
    assert [(r["step"], r["train/scaler_skipped_steps"]) for r in records] == [(4, 1.0), (8, 1.0)]
    assert "train/skipped_steps" not in records[0]  # only with nonfinite_loss='skip'
