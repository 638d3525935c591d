"""The built-in ``ema`` plugin: the average against the recurrence by hand (with and without warm-up), validation
with the average while training stays bitwise the same, the swap before the final save, a checkpoint resume that
ends bitwise where the uninterrupted fit ends, only trainable parameters averaged (peft: the adapter), and 2
processes (DDP: equal on both; local_sgd: the average of the mean weights)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import torchloom
from torchloom.checkpoint.store import list_checkpoints
from torchloom.testing import TinyTask, tiny_fit
from torchloom_plugins.ema import ExponentialMovingAverage, ema_decay
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))

from ema_tasks import Trajectory, expected_average

STEPS_PER_EPOCH = 8  # TinyTask: 32 samples in micro-batches of 4


def _val_loss(weights: list[torch.Tensor]) -> float:
    x, y = TinyTask().val_dataloader().dataset.tensors
    w, b = (t.double() for t in weights)
    return torch.nn.functional.mse_loss(x.double() @ w.T + b, y.double()).item()


def test_the_warmup_decay_follows_the_formula():
    assert ema_decay(0.9, 5) == 0.9  # no warm-up: constant
    assert ema_decay(0.999, 0, 0.75) == 0.0  # the first update copies the weights
    assert ema_decay(0.999, 1, 0.75) == pytest.approx(1 - 2**-0.75)
    assert ema_decay(0.5, 10, 0.75) == 0.5  # capped at decay


@pytest.mark.parametrize(("decay", "every", "power"), [(0.9, 1, 0.0), (0.75, 3, 0.0), (0.99, 2, 0.75)])
def test_the_average_matches_the_recurrence_by_hand(tmp_path, decay, every, power):
    ema, trajectory = ExponentialMovingAverage(decay=decay, every=every, warmup_power=power), Trajectory()
    tiny_fit([ema, trajectory], max_epochs=2, output_dir=str(tmp_path))
    assert (ema.steps, ema.updates) == (16, 16 // every)
    want = expected_average(trajectory.start, trajectory.after_step, decay, every, power)
    for got, expected in zip(ema.averaged_parameters, want, strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)
    if power:  # with the warm-up the average is far from the one without: the warm-up is applied
        plain = expected_average(trajectory.start, trajectory.after_step, decay, every, 0.0)
        assert not torch.allclose(plain[0], want[0], atol=1e-3)


def test_validation_sees_the_average_and_training_is_bitwise_unchanged(tmp_path):
    reference, plain_task = Trajectory(), TinyTask()
    tiny_fit([reference], task=plain_task, max_epochs=2, output_dir=str(tmp_path / "plain"))
    ema, trajectory = ExponentialMovingAverage(decay=0.8, swap_at_end=False), Trajectory()
    engine = tiny_fit([ema, trajectory], task=(task := TinyTask()), max_epochs=2, output_dir=str(tmp_path / "ema"))
    for a, b in zip(plain_task.model.parameters(), task.model.parameters(), strict=True):
        assert torch.equal(a, b)  # swap_at_end false: the training weights, as without the plugin
    val = [r["val/loss"] for r in engine.history if "val/loss" in r]
    assert len(val) == 2
    for epoch, logged in enumerate(val):
        steps = trajectory.after_step[: (epoch + 1) * STEPS_PER_EPOCH]
        assert logged == pytest.approx(_val_loss(expected_average(trajectory.start, steps, 0.8, 1)), rel=1e-5)
        assert logged != pytest.approx(_val_loss(steps[-1]), rel=1e-3)


def test_validate_with_ema_false_validates_the_training_weights(tmp_path):
    plain = tiny_fit(None, max_epochs=1, output_dir=str(tmp_path / "plain"))
    ema = ExponentialMovingAverage(decay=0.8, validate_with_ema=False, swap_at_end=False)
    engine = tiny_fit([ema], max_epochs=1, output_dir=str(tmp_path / "ema"))
    assert engine.logged_metrics["val/loss"] == plain.logged_metrics["val/loss"]


def test_the_average_is_swapped_in_before_the_final_save(tmp_path):
    ema, task = ExponentialMovingAverage(decay=0.8), TinyTask()
    engine = torchloom.Engine(max_epochs=1, output_dir=str(tmp_path), plugins=[ema], save_model=True)
    engine.fit(task)
    assert all(torch.equal(p, a) for p, a in zip(task.model.parameters(), ema.averaged_parameters, strict=True))
    saved = TinyTask.load_model(TinyTask().configure_model(), Path(engine.run_dir) / torchloom.utils.MODEL_DIR)
    assert all(torch.equal(p, a) for p, a in zip(saved.parameters(), ema.averaged_parameters, strict=True))


@pytest.mark.parametrize("power", [0.0, 0.75])
def test_a_resumed_fit_ends_bitwise_where_the_uninterrupted_fit_ends(tmp_path, power):
    """Checkpoints every 3 steps; resume from step 6 (every=3 is not a divisor of the epoch's 8 steps, and the
    warm-up depends on the update count, so a lost counter shows); the average, counters and weights agree."""
    settings = {"decay": 0.9, "every": 3, "warmup_power": power}
    plugins = lambda: [ExponentialMovingAverage(**settings), {"checkpoint": {"every_n_steps": 3, "keep_last": None}}]  # noqa: E731
    whole = torchloom.Engine(max_epochs=2, output_dir=str(tmp_path / "whole"), plugins=plugins())
    whole.fit(whole_task := TinyTask())
    step6 = next(c for c in list_checkpoints(whole.run_dir) if c.endswith("step-00000006"))
    resumed = torchloom.Engine(max_epochs=2, output_dir=str(tmp_path / "resumed"), plugins=plugins())
    resumed.fit(task := TinyTask(), ckpt_path=step6)
    a, b = whole.plugins[0], resumed.plugins[0]
    assert isinstance(a, ExponentialMovingAverage) and isinstance(b, ExponentialMovingAverage)
    assert (b.steps, b.updates) == (a.steps, a.updates) == (16, 5)
    assert all(torch.equal(x, y) for x, y in zip(a.averaged_parameters, b.averaged_parameters, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(whole_task.model.parameters(), task.model.parameters(), strict=True))


class FrozenBias(TinyTask):
    def configure_model(self) -> torch.nn.Module:
        model = super().configure_model()
        model.bias.requires_grad_(False)
        return model


def test_only_trainable_parameters_are_averaged(tmp_path):
    ema = ExponentialMovingAverage(decay=0.5)
    tiny_fit([ema], task=(task := FrozenBias()), max_epochs=1, output_dir=str(tmp_path))
    assert [t.shape for t in ema.averaged_parameters] == [task.model.weight.shape]


@pytest.mark.slow
@pytest.mark.slow
def test_with_peft_the_average_is_the_adapter_only(tmp_path):
    pytest.importorskip("peft")
    from peft_fit import LORA, LoraTask

    ema = ExponentialMovingAverage(decay=0.9)
    engine = torchloom.Engine(max_epochs=1, output_dir=str(tmp_path), plugins=[{"peft": LORA}, ema])
    engine.fit(LoraTask())
    model = engine.accelerator.unwrap_model(engine._run.model)
    trainable = [p for n, p in model.named_parameters() if p.requires_grad]
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert len(ema.averaged_parameters) == len(trainable) == 8  # 2 layers x (q, v) x (A, B)
    assert all(torch.equal(p, a) for p, a in zip(trainable, ema.averaged_parameters, strict=True))  # swapped in


def test_state_round_trips_through_plugin_state_files(tmp_path):
    ema = ExponentialMovingAverage(decay=0.9, every=2)
    tiny_fit([ema], max_epochs=1, output_dir=str(tmp_path / "run"))
    assert torchloom.save_plugin_state([ema], tmp_path / "state") == ["ema"]
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["ema.json", "ema.safetensors"]
    fresh = ExponentialMovingAverage(decay=0.9, every=2)
    torchloom.load_plugin_state([fresh], tmp_path / "state")
    state = fresh.state_dict()
    assert (state["steps"], state["updates"]) == (8, 4)
    assert all(torch.equal(x, y) for x, y in zip(state["shadow"], ema.averaged_parameters, strict=True))
    with pytest.raises(torchloom.PluginError, match="ema: cannot load the state"):
        fresh.load_state_dict({"steps": 1})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"decay": 1.0}, "setting 'decay' = 1.0; expected a number strictly between 0 and 1"),
        ({"every": 0}, "setting 'every' = 0; expected an integer >= 1"),
        ({"warmup_power": -1}, "setting 'warmup_power' = -1.0; expected a number >= 0"),
    ],
)
def test_bad_settings_are_one_clear_error(settings, message):
    with pytest.raises(torchloom.ConfigError, match=f"plugin 'ema': {message}"):
        torchloom.enable_plugins({"ema": settings})


def test_the_builtin_and_the_example_distribution_have_their_own_names():
    (builtin,) = torchloom.enable_plugins({"ema": {}})
    assert isinstance(builtin, ExponentialMovingAverage)
    installed = torchloom.installed_plugins()
    assert [info.value for info in installed["ema"]] == ["torchloom_plugins.ema:ExponentialMovingAverage"]
    if "example_ema" in installed:  # installed in CI (noxfile) next to the built-in: no clash
        (example,) = torchloom.enable_plugins({"example_ema": {}})
        assert type(example).__module__ == "torchloom_ema"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_ddp_equal_and_local_sgd_the_average_of_the_mean(tmp_path):
    ranks = torchrun("ema_fit.py", tmp_path)
    for label in ("ddp", "lsgd"):
        a, b = ranks[0][label], ranks[1][label]
        assert a["shadow"] == b["shadow"]  # one average on every process (bitwise: the lists of floats)
        assert a["final"] == b["final"] == a["shadow"]  # swapped in before the save, on both
    assert ranks[0]["ddp"]["max_error"] < 1e-6  # the recurrence by hand over the (equal) DDP weights
    # local_sgd: each process's weights differ between averagings; the average is the mean of the processes' own
    assert ranks[0]["lsgd"]["weights_differed"]
    assert ranks[0]["lsgd"]["max_error"] < 1e-6
