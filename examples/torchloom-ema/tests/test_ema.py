"""Tests of the ema plugin, written with torchloom.testing (run: pytest examples/torchloom-ema/tests)."""

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


def test_is_installed_under_the_name_ema():
    (ep,) = [e for e in importlib.metadata.entry_points(group="torchloom.plugins") if e.name == "ema"]
    assert ep.load() is EMA
    (plugin,) = torchloom.enable_plugins({"ema": {"decay": 0.5, "every": 2}})
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
    with pytest.raises(RuntimeError, match="validation failed"):
        tiny_fit([ema, trajectory], task=task, max_epochs=1, output_dir=str(tmp_path))
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


def test_state_dict_round_trip_and_weights_only_load(tmp_path):
    ema = EMA(decay=0.9, every=2)
    tiny_fit([ema], max_epochs=1, output_dir=str(tmp_path))
    path = tmp_path / "ema.pt"
    torch.save(ema.state_dict(), path)
    state = torch.load(path, weights_only=True)  # plain ints and tensors: no pickled objects
    assert (state["steps"], state["updates"]) == (STEPS_PER_EPOCH, STEPS_PER_EPOCH // 2)

    # Loaded before a fit, the state replaces the fresh copy of the weights when the fit starts.
    resumed, trajectory = EMA(decay=0.9, every=2), Trajectory()
    resumed.load_state_dict(state)
    tiny_fit([resumed, trajectory], max_epochs=1, output_dir=str(tmp_path / "resumed"))
    assert resumed.steps == 2 * STEPS_PER_EPOCH
    trajectory.start = [t.double() for t in state["shadow"]]
    want = expected_average(trajectory, 0.9, 2)
    # The step counter carries over: 8 + k is a multiple of 2 exactly when k is.
    for got, expected in zip(resumed.averaged_parameters, want, strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)


def test_accelerator_save_state_carries_the_average(tmp_path):
    ema = EMA(decay=0.9)
    engine = tiny_fit([ema], max_epochs=1, output_dir=str(tmp_path / "run"))
    engine.accelerator.save_state(str(tmp_path / "ckpt"))
    saved = [t.clone() for t in ema.averaged_parameters]

    # A second run of the same task registers its own ema; load_state hands it the saved average.
    other = EMA(decay=0.9)
    engine2 = tiny_fit([other], max_epochs=1, max_steps=1, output_dir=str(tmp_path / "run2"))
    assert other.steps == 1
    engine2.accelerator.load_state(str(tmp_path / "ckpt"))
    state = other.state_dict()  # outside a fit: kept for the next fit's start
    assert state["steps"] == STEPS_PER_EPOCH
    assert all(torch.equal(a, b) for a, b in zip(state["shadow"], saved, strict=True))


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
    with pytest.raises(torchloom.ConfigError, match=f"plugin 'ema': {message}"):
        torchloom.enable_plugins({"ema": settings})
