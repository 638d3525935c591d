"""Tests of the example_ema plugin, written with torchloom.testing (run: pytest examples/torchloom-ema/tests)."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from torchloom_ema import EMA

import torchloom
from torchloom.testing import RecordingPlugin, TinyTask, tiny_fit

# TinyTask: 32 samples in micro-batches of 4, so 8 optimizer steps per epoch.
STEPS_PER_EPOCH = 8


class Trajectory(torchloom.Plugin):
    """Records the weights right after every optimizer step (float64 copies)."""

    name = "trajectory"

    def __init__(self) -> None:
        super().__init__()
        self.start: list[torch.Tensor] = []
        self.after_step: list[list[torch.Tensor]] = []

    @torchloom.hookimpl
    def on_fit_start(self, model):
        self.start = [p.detach().double().clone() for p in model.parameters()]

    @torchloom.hookimpl
    def after_optimizer_step(self, model):
        self.after_step.append([p.detach().double().clone() for p in model.parameters()])


def expected_average(trajectory: Trajectory, decay: float, every: int) -> list[torch.Tensor]:
    """The recurrence by hand, in float64: start from the initial weights, update every ``every`` steps."""
    ema = [t.clone() for t in trajectory.start]
    for step, weights in enumerate(trajectory.after_step, start=1):
        if step % every == 0:
            ema = [decay * e + (1 - decay) * w for e, w in zip(ema, weights)]
    return ema


def val_loss(weights: list[torch.Tensor]) -> float:
    """TinyTask's validation loss (mean over its 16 samples) for the given weights, in float64."""
    x, y = TinyTask().val_dataloader().dataset.tensors
    w, b = (t.double() for t in weights)
    return torch.nn.functional.mse_loss(x.double() @ w.T + b, y.double()).item()


def test_is_installed_under_the_name_example_ema():
    (ep,) = [e for e in importlib.metadata.entry_points(group="torchloom.plugins") if e.name == "example_ema"]
    assert ep.load() is EMA
    (plugin,) = torchloom.enable_plugins({"example_ema": {"decay": 0.5, "every": 2}})
    assert isinstance(plugin, EMA)
    assert (plugin.config.decay, plugin.config.every) == (0.5, 2)


@pytest.mark.parametrize(("decay", "every"), [(0.9, 1), (0.75, 3)])
def test_average_matches_the_recurrence(tmp_path, decay, every):
    ema, trajectory = EMA(decay=decay, every=every), Trajectory()
    tiny_fit([ema, trajectory], max_epochs=2, output_dir=str(tmp_path))

    assert len(trajectory.after_step) == 2 * STEPS_PER_EPOCH
    assert ema.steps == 2 * STEPS_PER_EPOCH
    assert ema.updates == 2 * STEPS_PER_EPOCH // every
    for got, want in zip(ema.averaged_parameters, expected_average(trajectory, decay, every), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_updates_once_per_accumulation_window(tmp_path):
    """With 4 micro-batches per optimizer step, after_optimizer_step (and the average) runs 2x per epoch."""

    class Accumulate(torchloom.Plugin):
        name = "accumulate"

        @torchloom.hookimpl
        def configure_accelerator(self):
            return {"gradient_accumulation_steps": 4}

        @torchloom.hookimpl(wrapper=True)
        def run_train_step(self, accelerator, model):
            with accelerator.accumulate(model):
                return (yield)

    ema, trajectory = EMA(decay=0.5), Trajectory()
    engine = tiny_fit([Accumulate(), ema, trajectory], max_epochs=1, output_dir=str(tmp_path))
    assert engine.progress.global_step == ema.steps == ema.updates == STEPS_PER_EPOCH // 4
    for got, want in zip(ema.averaged_parameters, expected_average(trajectory, 0.5, 1), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_validation_uses_the_average_and_training_weights_come_back_exactly(tmp_path):
    reference, plain_task = Trajectory(), TinyTask()
    tiny_fit([reference], task=plain_task, max_epochs=2, output_dir=str(tmp_path / "plain"))

    ema, trajectory, task = EMA(decay=0.8), Trajectory(), TinyTask()
    engine = tiny_fit([ema, trajectory], task=task, max_epochs=2, output_dir=str(tmp_path / "ema"))

    # Swapping the average in and out for validation leaves training bit-for-bit unchanged.
    for a, b in zip(plain_task.model.parameters(), task.model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(reference.after_step, trajectory.after_step, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b))

    # Each epoch's val/loss is the loss of the average at that point, not of the training weights.
    val = [record["val/loss"] for record in engine.history if "val/loss" in record]
    assert len(val) == 2
    for epoch, logged in enumerate(val):
        partial = Trajectory()
        partial.start = trajectory.start
        partial.after_step = trajectory.after_step[: (epoch + 1) * STEPS_PER_EPOCH]
        assert logged == pytest.approx(val_loss(expected_average(partial, 0.8, 1)), rel=1e-5)
        assert logged != pytest.approx(val_loss(partial.after_step[-1]), rel=1e-3)


def test_validate_with_ema_false_validates_the_training_weights(tmp_path):
    plain = tiny_fit(None, max_epochs=1, output_dir=str(tmp_path / "plain"))
    engine = tiny_fit([EMA(decay=0.8, validate_with_ema=False)], max_epochs=1, output_dir=str(tmp_path / "e"))
    assert engine.logged_metrics["val/loss"] == plain.logged_metrics["val/loss"]


def test_a_validation_pass_that_raises_still_gets_the_training_weights_back(tmp_path):
    class FailingValidation(TinyTask):
        def validation_step(self, batch, batch_idx):
            raise RuntimeError("validation failed")

    ema, trajectory, task = EMA(decay=0.5), Trajectory(), FailingValidation()
    with pytest.raises(RuntimeError, match="validation failed"):  # the epoch's validation, after 8 steps
        tiny_fit([ema, trajectory], task=task, max_epochs=1, num_sanity_val_steps=0, output_dir=str(tmp_path))
    # teardown restored the weights of the last optimizer step, not the average swapped in for validation.
    for param, last in zip(task.model.parameters(), trajectory.after_step[-1], strict=True):
        assert torch.equal(param.double(), last)
    assert not torch.equal(ema.averaged_parameters[0].double(), trajectory.after_step[-1][0])


def test_hooks_fire_in_the_documented_places(tmp_path):
    recorder = RecordingPlugin()
    ema = EMA()
    tiny_fit([ema, recorder], max_epochs=1, output_dir=str(tmp_path))
    assert recorder.calls.count("after_optimizer_step") == ema.steps == STEPS_PER_EPOCH
    # on_validation_end runs in reverse plugin order: the recorder (listed after ema) sees the average
    # still in place, and ema restores the training weights last.
    start, end = recorder.calls.index("on_validation_start"), recorder.calls.index("on_validation_end")
    assert start < end


def same_state(a: dict, b: dict) -> bool:
    """Equal counters (ints) and bitwise-equal averages (dtype, shape and device too)."""
    return (
        a.keys() == b.keys() == {"steps", "updates", "shadow"}
        and (type(a["steps"]), type(a["updates"])) == (type(b["steps"]), type(b["updates"])) == (int, int)
        and (a["steps"], a["updates"]) == (b["steps"], b["updates"])
        and len(a["shadow"]) == len(b["shadow"])
        and all(
            x.dtype == y.dtype and x.device == y.device and x.shape == y.shape and torch.equal(x, y)
            for x, y in zip(a["shadow"], b["shadow"], strict=True)
        )
    )


def test_state_round_trips_bitwise_through_safetensors_and_json(tmp_path):
    ema = EMA(decay=0.9, every=2)
    tiny_fit([ema], max_epochs=1, output_dir=str(tmp_path / "run"))
    before = ema.state_dict()
    assert (before["steps"], before["updates"]) == (STEPS_PER_EPOCH, STEPS_PER_EPOCH // 2)

    assert torchloom.save_plugin_state([ema], tmp_path / "state") == ["example_ema"]
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["example_ema.json", "example_ema.safetensors"]
    fresh = EMA(decay=0.9, every=2)
    assert torchloom.load_plugin_state([fresh], tmp_path / "state") == ["example_ema"]
    assert same_state(fresh.state_dict(), before)  # loaded outside a fit: kept as loaded until the next one
    assert same_state(ema.state_dict(), before)  # saving changed nothing


def test_a_loaded_state_continues_the_recurrence(tmp_path):
    """Loaded before a fit, the state replaces the fresh copy of the weights when the fit starts, and the step
    counter carries over: 8 + k is a multiple of 2 exactly when k is."""
    ema = EMA(decay=0.9, every=2)
    tiny_fit([ema], max_epochs=1, output_dir=str(tmp_path / "run"))
    torchloom.save_plugin_state([ema], tmp_path / "state")
    saved = [t.clone() for t in ema.averaged_parameters]

    resumed, trajectory = EMA(decay=0.9, every=2), Trajectory()
    torchloom.load_plugin_state([resumed], tmp_path / "state")
    tiny_fit([resumed, trajectory], max_epochs=1, output_dir=str(tmp_path / "resumed"))
    assert resumed.steps == 2 * STEPS_PER_EPOCH
    trajectory.start = [t.double() for t in saved]
    want = expected_average(trajectory, 0.9, 2)
    for got, expected in zip(resumed.averaged_parameters, want, strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)


class LoadAtFitStart(torchloom.Plugin):
    """Loads plugin state from a hook, during the fit (listed after ema, so ema's on_fit_start ran first)."""

    name = "load_at_fit_start"

    def __init__(self, plugins: list, directory) -> None:
        super().__init__()
        self.plugins, self.directory = plugins, directory

    @torchloom.hookimpl
    def on_fit_start(self):
        torchloom.load_plugin_state(self.plugins, self.directory)


@pytest.mark.parametrize("when", ["before the fit", "during the fit"])
def test_a_resumed_fit_ends_where_the_uninterrupted_fit_ends(tmp_path, when):
    """Two epochs in one fit, or one epoch, a checkpoint (the weights, and ema's state through
    save_plugin_state), and one more epoch in a new fit with a new plugin: the same average, bit for bit, and
    the same counters. every=3 does not divide the 8 steps of an epoch, so a lost step counter would show."""
    whole = EMA(decay=0.9, every=3)
    tiny_fit([whole], max_epochs=2, output_dir=str(tmp_path / "whole"))

    first, task = EMA(decay=0.9, every=3), TinyTask()
    tiny_fit([first], task=task, max_epochs=1, output_dir=str(tmp_path / "first"))
    torchloom.save_plugin_state([first], tmp_path / "ckpt")
    weights = {k: v.clone() for k, v in task.model.state_dict().items()}

    class Resumed(TinyTask):
        def configure_model(self):
            model = super().configure_model()
            model.load_state_dict(weights)
            return model

    second = EMA(decay=0.9, every=3)
    if when == "before the fit":
        torchloom.load_plugin_state([second], tmp_path / "ckpt")
        plugins = [second]
    else:
        plugins = [second, LoadAtFitStart([second], tmp_path / "ckpt")]
    tiny_fit(plugins, task=Resumed(), max_epochs=1, output_dir=str(tmp_path / "second"))
    assert (second.steps, second.updates) == (whole.steps, whole.updates) == (16, 5)
    assert same_state(second.state_dict(), whole.state_dict())


def test_copy_to_puts_the_average_in_a_model(tmp_path):
    ema = EMA(decay=0.5)
    tiny_fit([ema], max_epochs=1, output_dir=str(tmp_path))
    model = TinyTask().configure_model()
    ema.copy_to(model)
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), ema.averaged_parameters, strict=True))
    with pytest.raises(ValueError, match="different model"):
        ema.copy_to(torch.nn.Linear(3, 1))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"decay": 1.0}, "setting 'decay' = 1.0; expected a float strictly between 0 and 1"),
        ({"decay": 0}, "setting 'decay' = 0.0; expected a float strictly between 0 and 1"),
        ({"decay": "0.9"}, "setting 'decay' = '0.9' \\(str\\); expected float"),
        ({"every": 0}, "setting 'every' = 0; expected a positive integer"),
        ({"evry": 2}, "unknown setting 'evry'; did you mean 'every'\\?"),
    ],
)
def test_bad_settings_are_one_clear_error(settings, message):
    with pytest.raises(torchloom.ConfigError, match=f"plugin 'example_ema': {message}"):
        torchloom.enable_plugins({"example_ema": settings})
