"""The engine loop: hook order and counts, plugin ordering, run files, logged values and clear errors.

The expected hook sequences are built by `expected_fit` from the firing order documented in
``torchloom/hookspecs.py``; a few short cases are also spelled out literally.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import yaml
from torch.utils.data import DataLoader

import torchloom
from torchloom.testing import RecordingPlugin, TinyTask, tiny_dataset

# ----------------------------------------------------------------------------------------------- helpers


def fit(tmp_path, plugins=None, task=None, **settings) -> torchloom.Engine:
    settings.setdefault("log_every_n_steps", 1)
    settings.setdefault("output_dir", str(tmp_path / "run"))
    engine = torchloom.Engine(plugins=plugins, **settings)
    engine.fit(task if task is not None else TinyTask(n=16, batch_size=4))
    return engine


def expected_fit(
    epochs: int,
    batches: int,
    val_batches: int = 0,
    *,
    val_check_interval: int | None = None,
    max_steps: int | None = None,
    log_every: int = 1,
    accum: int = 1,
) -> list[str]:
    """The documented firing order of ``Engine.fit`` for a task that logs on every validation pass.

    ``sync``: Accelerate syncs every ``accum`` micro-batches and on the last micro-batch of the epoch.
    """
    calls = ["setup", "configure_accelerator", "configure_model", "configure_optimizers", "on_run_start"]
    calls.append("on_fit_start")
    step = 0
    validated_at = -1
    buffered = False  # the training loss is logged on every micro-batch

    def validate() -> None:
        nonlocal validated_at
        validated_at = step
        if val_batches:
            calls.extend(["on_validation_start", *["on_validation_batch_end"] * val_batches, "on_validation_end"])
            calls.append("on_log")  # the task logs val/loss, reduced right after the pass (validation values only)

    done = False
    for _ in range(epochs):
        calls.append("on_train_epoch_start")
        window = 0
        for b in range(batches):
            calls.extend(["on_train_batch_start", "run_train_step", "before_backward"])
            window += 1
            sync = window == accum or b == batches - 1
            if sync:
                window = 0
                calls.extend(["before_optimizer_step", "after_optimizer_step"])
            calls.append("on_train_batch_end")
            buffered = True
            if not sync:
                continue
            step += 1
            if step % log_every == 0:
                calls.append("on_log")
                buffered = False
            if val_check_interval and step % val_check_interval == 0:
                validate()
            calls.append("on_train_step_end")  # the step counted, logged and validated: a checkpoint may be saved
            if max_steps is not None and step >= max_steps:
                done = True
                break
        if val_check_interval is None:
            validate()
        calls.append("on_train_epoch_end")
        if done:
            break
    if buffered:  # the training values since the last logging step
        calls.append("on_log")
    calls.append("on_train_end")
    if validated_at != step:  # a final validation: the returned metrics describe the saved model
        validate()
    calls.extend(["on_fit_end", "teardown"])
    return calls


class Accumulate:
    """A small gradient-accumulation plugin: an Accelerator setting plus a wrapper of ``run_train_step``."""

    name = "test_accumulate"

    def __init__(self, steps: int) -> None:
        self.steps = steps

    @torchloom.hookimpl
    def configure_accelerator(self):
        return {"gradient_accumulation_steps": self.steps}

    @torchloom.hookimpl(wrapper=True)
    def run_train_step(self, accelerator, model):
        with accelerator.accumulate(model):
            return (yield)


class LossRecorder:
    """Keeps the loss that ``on_train_batch_end`` sees for every micro-batch."""

    name = "test_loss_recorder"

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    @torchloom.hookimpl
    def on_train_batch_end(self, outputs):
        self.losses.append(outputs["loss"])


def params(task: torchloom.TaskModule) -> list[torch.Tensor]:
    model = task.accelerator.unwrap_model(task.model)
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------------------------------ hook order


def test_hook_order_literal_small_fit(tmp_path):
    """One epoch of 2 micro-batches and 1 validation batch, spelled out."""
    rec = RecordingPlugin()
    fit(tmp_path, [rec], task=TinyTask(n=8, batch_size=4))
    assert rec.calls == [
        "setup",
        "configure_accelerator",
        "configure_model",
        "configure_optimizers",
        "on_run_start",
        "on_fit_start",
        "on_train_epoch_start",
        *["on_train_batch_start", "run_train_step", "before_backward", "before_optimizer_step"],
        *["after_optimizer_step", "on_train_batch_end", "on_log", "on_train_step_end"],
        *["on_train_batch_start", "run_train_step", "before_backward", "before_optimizer_step"],
        *["after_optimizer_step", "on_train_batch_end", "on_log", "on_train_step_end"],
        *["on_validation_start", "on_validation_batch_end", "on_validation_end", "on_log"],
        "on_train_epoch_end",
        "on_train_end",
        "on_fit_end",
        "teardown",
    ]


@pytest.mark.parametrize("epochs,batches", [(1, 4), (3, 2)])
def test_hook_order_with_validation(tmp_path, epochs, batches):
    rec = RecordingPlugin()
    engine = fit(tmp_path, [rec], task=TinyTask(n=4 * batches, batch_size=4), max_epochs=epochs)
    val_batches = batches // 2
    assert rec.calls == expected_fit(epochs, batches, val_batches)
    assert rec.calls.count("on_train_batch_start") == epochs * batches
    assert rec.calls.count("before_optimizer_step") == epochs * batches
    assert rec.calls.count("on_validation_start") == epochs
    assert rec.calls.count("on_validation_batch_end") == epochs * val_batches
    assert engine.progress.global_step == epochs * batches


def test_hook_order_without_validation(tmp_path):
    rec = RecordingPlugin()
    fit(tmp_path, [rec], task=TinyTask(n=12, batch_size=4, validate=False), max_epochs=2, log_every_n_steps=4)
    assert rec.calls == expected_fit(2, 3, 0, log_every=4)
    assert not {"on_validation_start", "on_validation_batch_end", "on_validation_end"} & set(rec.calls)
    # steps 4 and the final flush of the 2 remaining micro-batches
    assert rec.calls.count("on_log") == 2


def test_hook_order_with_val_check_interval(tmp_path):
    """Validation every 3 optimizer steps over 2 epochs of 4: after steps 3 and 6, never at epoch end; the
    last step (8) is not a multiple of 3, so a final validation after on_train_end describes the saved model."""
    rec = RecordingPlugin()
    engine = fit(tmp_path, [rec], task=TinyTask(n=16, batch_size=4), max_epochs=2, val_check_interval=3)
    assert rec.calls == expected_fit(2, 4, 2, val_check_interval=3)
    starts = [p for hook, p in rec.records if hook == "on_validation_start"]
    assert [(p.epoch, p.global_step) for p in starts] == [(0, 3), (1, 6), (1, 8)]
    assert rec.calls.index("on_train_end") < rec.calls.index("on_validation_start", rec.calls.index("on_train_end"))
    final = [r for r in engine.history if "val/loss" in r][-1]
    assert final["step"] == 8 and engine.logged_metrics["val/loss"] == final["val/loss"]


def test_no_final_validation_when_the_last_step_was_validated(tmp_path):
    rec = RecordingPlugin()
    fit(tmp_path, [rec], task=TinyTask(n=16, batch_size=4), max_epochs=2, val_check_interval=4)
    starts = [p.global_step for hook, p in rec.records if hook == "on_validation_start"]
    assert starts == [4, 8]


@pytest.mark.parametrize(("interval", "starts"), [(8, [8]), (9, None)])
def test_a_val_check_interval_equal_to_the_fit_s_steps_validates_once_at_the_end(tmp_path, interval, starts):
    """8 optimizer steps: val_check_interval 8 validates after step 8 only (it is reached, and the final validation
    is not repeated); 9 is never reached, a ConfigError before training."""
    rec = RecordingPlugin()
    if starts is None:
        with pytest.raises(torchloom.ConfigError, match=r"got 9, but this fit takes only 8 optimizer steps"):
            fit(tmp_path, [rec], task=TinyTask(n=16, batch_size=4), max_epochs=2, val_check_interval=interval)
        return
    fit(tmp_path, [rec], task=TinyTask(n=16, batch_size=4), max_epochs=2, val_check_interval=interval)
    assert [p.global_step for hook, p in rec.records if hook == "on_validation_start"] == starts


def test_hook_order_max_steps_stops_mid_epoch(tmp_path):
    """max_steps=6 with 4 batches per epoch: epoch 1 stops after its second batch; epoch 2 never starts."""
    rec = RecordingPlugin()
    engine = fit(tmp_path, [rec], task=TinyTask(n=16, batch_size=4), max_epochs=5, max_steps=6)
    assert rec.calls == expected_fit(5, 4, 2, max_steps=6)
    assert engine.progress.global_step == 6
    assert rec.calls.count("on_train_epoch_start") == 2
    assert rec.calls.count("on_train_epoch_end") == 2  # also for the epoch cut short
    assert rec.calls.count("run_train_step") == 6
    last = [p for hook, p in rec.records if hook == "on_train_batch_start"][-1]
    assert (last.epoch, last.batch_idx) == (1, 1)


def test_hook_order_and_counts_under_accumulation(tmp_path):
    """With 2 micro-batches per window, optimizer-step hooks fire once per window; batch hooks per micro-batch."""
    rec = RecordingPlugin()
    engine = fit(tmp_path, [Accumulate(2), rec], task=TinyTask(n=16, batch_size=4), max_epochs=2)
    assert rec.calls == expected_fit(2, 4, 2, accum=2)
    assert rec.calls.count("on_train_batch_start") == 8
    assert rec.calls.count("before_optimizer_step") == rec.calls.count("after_optimizer_step") == 4
    assert engine.progress.global_step == 4
    assert engine.progress.micro_step == 8


def test_progress_counters_seen_by_hooks(tmp_path):
    rec = RecordingPlugin()
    fit(tmp_path, [rec], task=TinyTask(n=12, batch_size=4), max_epochs=2)
    by_hook: dict[str, list[Any]] = {}
    for hook, p in rec.records:
        by_hook.setdefault(hook, []).append(p)
    assert by_hook["on_fit_start"] == [torchloom.Progress(0, 0, 0, 0)]
    starts = [(p.epoch, p.global_step, p.batch_idx, p.micro_step) for p in by_hook["on_train_batch_start"]]
    assert starts == [(0, 0, 0, 0), (0, 1, 1, 1), (0, 2, 2, 2), (1, 3, 0, 3), (1, 4, 1, 4), (1, 5, 2, 5)]
    # after_optimizer_step: global_step does not yet count the step just taken; on_log: it does.
    assert [p.global_step for p in by_hook["after_optimizer_step"]] == [0, 1, 2, 3, 4, 5]
    train_logs = [p.global_step for p in by_hook["on_log"]]
    assert train_logs == [1, 2, 3, 3, 4, 5, 6, 6]  # each step, plus one after each validation pass
    assert by_hook["on_fit_end"][0].global_step == 6
    assert [p.epoch for p in by_hook["on_train_epoch_end"]] == [0, 1]


def test_training_step_raises_on_exception_then_fit_end_then_teardown(tmp_path):
    class Boom(RuntimeError):
        pass

    class FailingTask(TinyTask):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise Boom("bad batch")
            return super().training_step(batch, batch_idx)

    seen: list[BaseException] = []

    class Catcher:
        name = "catcher"

        @torchloom.hookimpl
        def on_exception(self, exception):
            seen.append(exception)

    rec = RecordingPlugin()
    engine = torchloom.Engine(plugins=[rec, Catcher()], log_every_n_steps=50, output_dir=str(tmp_path))
    with pytest.raises(Boom, match="bad batch") as info:
        engine.fit(FailingTask(n=16, batch_size=4))
    batch = ["on_train_batch_start", "run_train_step", "before_backward", "before_optimizer_step"]
    batch += ["after_optimizer_step", "on_train_batch_end", "on_train_step_end"]
    assert rec.calls == [
        *["setup", "configure_accelerator", "configure_model", "configure_optimizers", "on_run_start", "on_fit_start"],
        "on_train_epoch_start",
        *batch,
        *batch,
        *["on_train_batch_start", "run_train_step", "on_exception", "on_fit_end", "teardown"],
    ]
    assert seen == [info.value]
    assert [p for hook, p in rec.records if hook == "teardown"] == ["fit"]


def test_validate_hook_sequence(tmp_path):
    rec = RecordingPlugin()
    engine = torchloom.Engine(plugins=[rec], output_dir=str(tmp_path))
    task = TinyTask(n=24, batch_size=4)  # 12 validation samples: 3 batches
    metrics = engine.validate(task)
    assert rec.calls == [
        *["setup", "configure_accelerator", "configure_model", "on_run_start", "on_validation_start"],
        *["on_validation_batch_end"] * 3,
        *["on_validation_end", "on_log", "teardown"],
    ]
    assert [p for hook, p in rec.records if hook == "teardown"] == ["validate"]
    x, y = tiny_dataset(12, 4, 1).tensors
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(task.model(x), y).item()
    assert metrics == pytest.approx({"val/loss": expected}, rel=1e-6)


def test_predict_hook_sequence(tmp_path):
    rec = RecordingPlugin()
    engine = torchloom.Engine(plugins=[rec], output_dir=str(tmp_path))
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(3))
    predictions = engine.predict(TinyTask(), DataLoader(x, batch_size=4))
    assert rec.calls == [
        *["setup", "configure_accelerator", "configure_model", "on_run_start", "on_predict_start"],
        *["run_predict_step", "on_predict_batch_end"] * 3,
        *["on_predict_end", "teardown"],
    ]
    assert [p for hook, p in rec.records if hook == "teardown"] == ["predict"]
    assert [tuple(p.shape) for p in predictions] == [(4, 1), (4, 1), (2, 1)]


def test_validate_and_predict_after_fit_reuse_the_trained_model(tmp_path):
    rec = RecordingPlugin()
    engine = torchloom.Engine(plugins=[rec], log_every_n_steps=1, output_dir=str(tmp_path))
    task = TinyTask(n=16, batch_size=4)
    engine.fit(task)
    fitted = task.model
    n_fit = len(rec.calls)
    engine.validate(task)
    assert rec.calls[n_fit:] == [
        *["setup", "on_run_start", "on_validation_start", "on_validation_batch_end", "on_validation_batch_end"],
        *["on_validation_end", "on_log", "teardown"],
    ]
    n_val = len(rec.calls)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    predictions = engine.predict(task, DataLoader(x, batch_size=4))
    assert rec.calls[n_val:] == [
        "setup",
        "on_run_start",
        "on_predict_start",
        *["run_predict_step", "on_predict_batch_end"] * 2,
        "on_predict_end",
        "teardown",
    ]
    assert task.model is fitted
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(predictions), fitted(x))


# ------------------------------------------------------------------------------------------- ordering

REVERSED = {
    "after_optimizer_step",
    "on_train_batch_end",
    "on_train_step_end",
    "on_train_epoch_end",
    "on_validation_batch_end",
    "on_validation_end",
    "on_predict_batch_end",
    "on_predict_end",
    "on_train_end",
    "on_fit_end",
    "teardown",
}


def _orderer(name: str, events: list[tuple[str, str]], hooks: list[str]) -> Any:
    """A plugin implementing every hook in ``hooks`` (except run_train_step) by recording (name, hook)."""
    namespace: dict[str, Any] = {"name": name}
    for hook in hooks:
        if hook == "run_train_step":
            continue

        def impl(self, _hook=hook):
            events.append((name, _hook))

        impl.__name__ = hook
        namespace[hook] = torchloom.hookimpl(impl)
    return type(f"Orderer_{name}", (), namespace)()


def test_forward_hooks_run_in_list_order_after_and_end_hooks_reversed(tmp_path):
    import pluggy

    from torchloom import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    hooks = [n for n in dir(pm.hook) if not n.startswith("_")]
    events: list[tuple[str, str]] = []
    plugins = [_orderer("a", events, hooks), _orderer("b", events, hooks)]
    engine = torchloom.Engine(plugins=plugins, log_every_n_steps=1, output_dir=str(tmp_path))
    task = TinyTask(n=8, batch_size=4)
    engine.fit(task)
    engine.validate(task)
    engine.predict(task, DataLoader(torch.zeros(4, 4), batch_size=2))

    order: dict[str, list[str]] = {}
    for plugin, hook in events:
        order.setdefault(hook, []).append(plugin)
    checked_forward, checked_reversed = set(), set()
    for hook, names in order.items():
        want = ["b", "a"] if hook in REVERSED else ["a", "b"]
        assert names == want * (len(names) // 2), f"{hook}: {names}"
        (checked_reversed if hook in REVERSED else checked_forward).add(hook)
    assert checked_reversed == REVERSED
    assert {"configure_accelerator", "configure_model", "on_fit_start", "before_optimizer_step", "on_log"} <= (
        checked_forward
    )


def test_wrapper_listed_first_is_outermost(tmp_path):
    events: list[str] = []

    def wrapper(label: str) -> Any:
        class Wrap:
            name = f"wrap_{label}"

            @torchloom.hookimpl(wrapper=True)
            def run_train_step(self):
                events.append(f"enter {label}")
                outputs = yield
                events.append(f"exit {label}")
                return outputs

        return Wrap()

    class Inner:
        name = "inner"

        @torchloom.hookimpl
        def before_backward(self):
            events.append("default step")

    fit(tmp_path, [wrapper("a"), wrapper("b"), Inner()], task=TinyTask(n=4, batch_size=4, validate=False))
    assert events == ["enter a", "enter b", "default step", "exit b", "exit a"]


# ------------------------------------------------------------------------------------ files and logging


def test_config_yaml_and_metrics_jsonl_written(tmp_path):
    from dataclasses import dataclass

    class Configured(torchloom.Plugin):
        name = "configured"

        @dataclass
        class Config:
            alpha: float = 0.5  # a setting
            tags: tuple[str, ...] = ("x",)  # another

    out = tmp_path / "run"
    engine = fit(tmp_path, [Configured(alpha=2)], max_epochs=2, output_dir=str(out))
    assert engine.run_dir == str(out / "version_0")
    out = out / "version_0"
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["engine"]["max_epochs"] == 2
    assert config["engine"]["log_every_n_steps"] == 1
    assert config["engine"]["output_dir"] == str(out.parent)
    progress = {"enabled": True, "refresh_per_second": 4.0, "plain_every_n_seconds": 0.0, "terminal": None}
    assert config["plugins"] == {"configured": {"alpha": 2.0, "tags": ["x"]}, "progress": progress}  # + the default

    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert all(isinstance(r, dict) for r in records)
    assert records == engine.history
    assert len(records) == 2 * (4 + 1)  # one per optimizer step plus one per validation pass
    for r in records:
        assert isinstance(r["step"], int) and isinstance(r["epoch"], int)
        assert set(r) - {"step", "epoch"} in ({"train/loss"}, {"val/loss"})
        assert all(math.isfinite(v) for k, v in r.items())
    assert [r["step"] for r in records] == [1, 2, 3, 4, 4, 5, 6, 7, 8, 8]
    assert [r["epoch"] for r in records] == [0] * 5 + [1] * 5


def test_logged_train_loss_is_mean_of_micro_batch_losses(tmp_path):
    rec = LossRecorder()
    engine = fit(tmp_path, [rec], task=TinyTask(n=32, batch_size=4, validate=False), log_every_n_steps=3)
    losses = [float(loss) for loss in rec.losses]
    assert len(losses) == 8
    assert all(not loss.requires_grad and loss.ndim == 0 for loss in rec.losses)
    logged = [(r["step"], r["train/loss"]) for r in engine.history]
    expected = [(3, sum(losses[0:3]) / 3), (6, sum(losses[3:6]) / 3), (8, sum(losses[6:8]) / 2)]
    assert [s for s, _ in logged] == [s for s, _ in expected]
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_logged_train_loss_weighted_by_num_items(tmp_path):
    """A step returning num_items weights its loss: 10 samples in batches of 4, 4, 2."""

    class Counted(TinyTask):
        def training_step(self, batch, batch_idx):
            x, _ = batch
            return {"loss": super().training_step(batch, batch_idx), "num_items": len(x)}

    rec = LossRecorder()
    engine = fit(tmp_path, [rec], task=Counted(n=10, batch_size=4, validate=False), log_every_n_steps=50)
    losses = [float(loss) for loss in rec.losses]
    expected = (4 * losses[0] + 4 * losses[1] + 2 * losses[2]) / 10
    assert [r["train/loss"] for r in engine.history] == pytest.approx([expected], rel=1e-6)
    assert expected != pytest.approx(sum(losses) / 3, rel=1e-6)  # the weighting is observable here


def test_logged_loss_is_raw_under_accumulation(tmp_path):
    """Accumulation divides the loss for backward only; hooks and the log see the raw micro-batch loss."""
    plain, accum = LossRecorder(), LossRecorder()
    task_kwargs = dict(n=16, batch_size=4, validate=False, lr=0.0)  # lr 0: the losses do not move
    e1 = fit(tmp_path / "1", [plain], task=TinyTask(**task_kwargs), log_every_n_steps=50)
    e2 = fit(tmp_path / "2", [Accumulate(2), accum], task=TinyTask(**task_kwargs), log_every_n_steps=50)
    assert [float(v) for v in accum.losses] == pytest.approx([float(v) for v in plain.losses], rel=1e-6)
    assert e2.history[-1]["train/loss"] == pytest.approx(e1.history[-1]["train/loss"], rel=1e-6)


def test_accumulation_wrapper_matches_one_big_batch(tmp_path):
    """2 micro-batches of 4 per optimizer step give the parameters of 1 batch of 8 (the loop steps only on sync)."""
    accum, big, small = (TinyTask(n=32, batch_size=b, validate=False) for b in (4, 8, 4))
    e_accum = fit(tmp_path / "a", [Accumulate(2)], task=accum, max_epochs=2)
    e_big = fit(tmp_path / "b", None, task=big, max_epochs=2)
    assert e_accum.progress.global_step == e_big.progress.global_step == 8
    for pa, pb in zip(params(accum), params(big), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-6)
    fit(tmp_path / "c", None, task=small, max_epochs=2)
    assert not torch.allclose(params(small)[0], params(big)[0], atol=1e-4)  # the comparison can fail


# ------------------------------------------------------------------------------------------------ errors


def test_loss_not_a_scalar_is_a_clear_error(tmp_path):
    class PerSample(TinyTask):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.model(x) - y) ** 2).squeeze(1)  # shape (4,)

    with pytest.raises(ValueError, match=r"training_step returned a loss of shape \(4,\); expected a scalar"):
        fit(tmp_path, task=PerSample(n=8, batch_size=4))


def test_loss_not_a_tensor_is_a_clear_error(tmp_path):
    class NoLoss(TinyTask):
        def training_step(self, batch, batch_idx):
            return {"logits": self.model(batch[0])}

    with pytest.raises(TypeError, match="training_step must return a loss tensor or a dict with a 'loss' tensor"):
        fit(tmp_path, task=NoLoss(n=8, batch_size=4))


@pytest.mark.parametrize("garbage", ["sgd", None, (1, 2, 3), {"optimiser": 1}])
def test_configure_optimizers_returning_garbage_is_a_clear_error(tmp_path, garbage):
    class Garbage(TinyTask):
        def configure_optimizers(self):
            return garbage

    out = tmp_path / "run"
    with pytest.raises(torchloom.TaskError, match=r"configure_optimizers\(\) returned .*; expected an optimizer"):
        fit(tmp_path, task=Garbage(), output_dir=str(out))
    assert not list((out).rglob("config.yaml"))


def test_no_training_data_is_a_clear_error(tmp_path):
    class NoData(TinyTask):
        def train_dataloader(self):
            return None

    out = tmp_path / "run"
    with pytest.raises(torchloom.ConfigError, match="fit: no training data"):
        fit(tmp_path, task=NoData(), output_dir=str(out))
    assert not list((out).rglob("config.yaml"))


def test_validate_without_data_is_a_clear_error(tmp_path):
    with pytest.raises(torchloom.ConfigError, match="validate: no validation data"):
        torchloom.Engine(output_dir=str(tmp_path)).validate(TinyTask(validate=False))


def test_unknown_engine_setting_is_a_clear_error():
    with pytest.raises(
        torchloom.ConfigError,
        match=r"^engine: unknown setting 'max_epoch'; did you mean 'max_epochs'\? Valid settings: max_epochs, ",
    ):
        torchloom.Engine(max_epoch=2)


# ------------------------------------------------------------------------------------ several fits


def test_several_fits_in_one_process(tmp_path):
    """An accumulating fit leaves nothing behind: the next engine steps on every micro-batch again, and the
    same engine fitted twice gives the same history both times."""
    first = fit(tmp_path / "1", [Accumulate(4)], task=TinyTask(n=16, batch_size=4, validate=False))
    assert first.progress.global_step == 1
    assert first.accelerator.gradient_accumulation_steps == 4

    engine = torchloom.Engine(log_every_n_steps=1, output_dir=str(tmp_path / "2"))
    task1, task2 = TinyTask(n=16, batch_size=4), TinyTask(n=16, batch_size=4)
    engine.fit(task1)
    history = list(engine.history)
    assert engine.accelerator.gradient_accumulation_steps == 1
    assert engine.progress.global_step == 4
    engine.fit(task2)
    assert engine.history == history  # reset per fit, and deterministic (seed 0)
    for a, b in zip(params(task1), params(task2), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    lines = (tmp_path / "2" / "version_1" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == history


def test_teardown_runs_when_set_up_fails(tmp_path):
    class FailingModelHook(torchloom.Plugin):
        name = "failing_model_hook"

        @torchloom.hookimpl
        def configure_model(self):
            raise RuntimeError("cannot transform this model")

    recorder = RecordingPlugin()
    engine = torchloom.Engine(plugins=[recorder, FailingModelHook()], output_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="cannot transform"):
        engine.fit(TinyTask())
    assert recorder.calls[-1] == "teardown"
    assert "on_fit_end" not in recorder.calls
    assert not list((tmp_path).rglob("config.yaml"))


def test_each_call_writes_its_own_run_directory(tmp_path):
    engine = torchloom.Engine(max_epochs=1, log_every_n_steps=1, output_dir=str(tmp_path))
    engine.fit(TinyTask())
    first = (tmp_path / "version_0" / "metrics.jsonl").read_text()
    engine.fit(TinyTask())
    second = (tmp_path / "version_1" / "metrics.jsonl").read_text().splitlines()
    assert len(second) == len(first.splitlines()) == len(engine.history)
    engine.validate(TinyTask())  # a standalone validation writes its record into a directory of its own
    assert len((tmp_path / "version_2" / "metrics.jsonl").read_text().splitlines()) == 1
    assert (tmp_path / "version_0" / "metrics.jsonl").read_text() == first  # no run touched another's files


def test_list_valued_accelerator_settings_from_two_plugins_are_concatenated(tmp_path):
    from accelerate.utils import DistributedDataParallelKwargs, GradScalerKwargs

    class Handler(torchloom.Plugin):
        def __init__(self, name, handler):
            super().__init__()
            self.name, self.handler = name, handler

        @torchloom.hookimpl
        def configure_accelerator(self):
            return {"kwargs_handlers": [self.handler]}

    ddp, scaler = DistributedDataParallelKwargs(bucket_cap_mb=5), GradScalerKwargs(init_scale=8.0)
    engine = torchloom.Engine(plugins=[Handler("a", ddp), Handler("b", scaler)], output_dir=str(tmp_path))
    engine.fit(TinyTask(n=8))
    assert engine.accelerator.ddp_handler is ddp
    assert engine.accelerator.scaler_handler is scaler
