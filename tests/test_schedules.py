"""Schedulers stepped per epoch, every N, or on a monitored value (Lightning's lr_scheduler dict, ReduceLROnPlateau):
they step at the right points, with the logged value, and a resumed fit steps as the uninterrupted one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchloom
from torchloom.checkpoint.store import list_checkpoints
from torchloom.testing import TinyTask, tiny_fit

STEPS_PER_EPOCH = 8  # TinyTask


class Plateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """Records the value of every step() call."""

    def __init__(self, optimizer, **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)
        self.calls: list[float] = []

    def step(self, metrics, epoch=None):  # type: ignore[override]
        self.calls.append(float(metrics))
        super().step(metrics)


class ScheduledTask(TinyTask):
    """TinyTask with SGD lr 0.05 and the scheduler ``make(optimizer)`` returned in Lightning's dict with ``when``."""

    def __init__(self, make, when: dict[str, Any] | None = None, plain: bool = False) -> None:
        super().__init__()
        self.make, self.when, self.plain = make, when or {}, plain

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.scheduler = self.make(optimizer)
        if self.plain:
            return optimizer, self.scheduler
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler, **self.when}}


class LearningRates(torchloom.Plugin):
    """The learning rate at the start of every epoch."""

    name = "test.learning_rates"

    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[float] = []

    @torchloom.hookimpl
    def on_fit_start(self, optimizer) -> None:
        self._optimizer = optimizer

    @torchloom.hookimpl
    def on_train_batch_start(self, progress) -> None:
        if progress.batch_idx == 0:
            self.epochs.append(self._optimizer.param_groups[0]["lr"])


def _val_losses(engine) -> list[tuple[int, float]]:
    return [(r["step"], r["val/loss"]) for r in engine.history if "val/loss" in r]


@pytest.mark.parametrize("frequency", [1, 2])
def test_reduce_on_plateau_steps_at_every_frequency_th_validation_with_the_logged_value(tmp_path, frequency):
    """Validation every 2 steps over 8: passes at 2, 4, 6, 8 (none in the sanity pass); the scheduler gets the
    val/loss logged at each pass it steps at, and halves the lr when mode 'max' sees a decreasing loss."""
    task = ScheduledTask(lambda o: Plateau(o, mode="max", patience=0, factor=0.5), {"frequency": frequency})
    engine = tiny_fit([], task=task, val_check_interval=2, max_epochs=1, output_dir=str(tmp_path))
    logged = _val_losses(engine)
    assert [step for step, _ in logged] == [2, 4, 6, 8]
    assert task.scheduler.calls == [value for _, value in logged][frequency - 1 :: frequency]
    assert task.scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(
        0.05 * 0.5 ** (len(task.scheduler.calls) - 1)
    )  # the first call sets the best


def test_a_bare_reduce_on_plateau_monitors_val_loss(tmp_path):
    task = ScheduledTask(lambda o: Plateau(o), plain=True)
    engine = tiny_fit([], task=task, max_epochs=2, output_dir=str(tmp_path))
    assert task.scheduler.calls == [value for _, value in _val_losses(engine)]
    assert len(task.scheduler.calls) == 2


def test_a_monitor_that_is_not_logged_is_one_error_with_the_logged_names(tmp_path):
    task = ScheduledTask(lambda o: Plateau(o), {"monitor": "val/los"})
    with pytest.raises(torchloom.TaskError, match=r"monitors 'val/los'.*did you mean 'val/loss'\?.*'train/loss'"):
        tiny_fit([], task=task, max_epochs=1, num_sanity_val_steps=0, output_dir=str(tmp_path))


@pytest.mark.parametrize(("frequency", "want"), [(1, [0.05, 0.025, 0.0125]), (2, [0.05, 0.05, 0.025])])
def test_an_epoch_interval_steps_once_per_frequency_epochs(tmp_path, frequency, want):
    rates = LearningRates()
    task = ScheduledTask(
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        {"interval": "epoch", "frequency": frequency},
    )
    tiny_fit([rates], task=task, max_epochs=3, output_dir=str(tmp_path))
    assert rates.epochs == pytest.approx(want)
    assert task.scheduler.last_epoch == 3 // frequency


def test_a_step_interval_with_a_frequency_steps_every_n_optimizer_steps(tmp_path):
    task = ScheduledTask(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5), {"frequency": 3})
    tiny_fit([], task=task, max_epochs=1, output_dir=str(tmp_path))
    assert task.scheduler.last_epoch == STEPS_PER_EPOCH // 3


SCHEDULES = {
    "plateau": (lambda o: Plateau(o, mode="max", patience=0, factor=0.5), {"frequency": 1}),
    "epoch": (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5), {"interval": "epoch"}),
}


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
@pytest.mark.parametrize("checkpoint", ["step-00000006", "step-00000008", "step-00000008-epoch-end"])
def test_a_resumed_fit_steps_the_schedule_as_the_uninterrupted_fit(tmp_path, kind, checkpoint):
    """Validation and checkpoints every 2 steps and at each epoch's end, 3 epochs; resumed from step 6 (mid-epoch,
    after its validation), from step 8 (the epoch's last step, before the epoch's end: the resumed fit takes the
    epoch step) and from the epoch-end checkpoint of step 8 (after it), the fit ends with the same weights and
    scheduler state as the uninterrupted one, bitwise."""
    make, when = SCHEDULES[kind]
    settings = {"max_epochs": 3, "val_check_interval": 2, "log_every_n_steps": 2}
    plugins = lambda: {"checkpoint": {"every_n_steps": 2, "every_n_epochs": 1, "keep_last": None}}  # noqa: E731
    whole = torchloom.Engine(output_dir=str(tmp_path / "whole"), plugins=plugins(), **settings)
    whole.fit(reference := ScheduledTask(make, when))
    (path,) = [c for c in list_checkpoints(whole.run_dir) if c.rsplit("/", 1)[-1] == checkpoint]
    resumed = torchloom.Engine(output_dir=str(tmp_path / "resumed"), plugins=plugins(), **settings)
    resumed.fit(task := ScheduledTask(make, when), ckpt_path=path)
    assert all(torch.equal(a, b) for a, b in zip(reference.model.parameters(), task.model.parameters(), strict=True))
    a, b = reference.scheduler.state_dict(), task.scheduler.state_dict()
    a.pop("calls", None), b.pop("calls", None)
    assert a == b
    lr = [t.scheduler.optimizer.param_groups[0]["lr"] for t in (reference, task)]
    assert lr[0] == lr[1] < 0.05


@pytest.mark.parametrize(
    ("when", "match"),
    [
        ({"interval": "batch"}, r"lr_scheduler interval 'batch'; expected one of step, epoch"),
        ({"frequency": 0}, r"lr_scheduler frequency 0; expected an integer >= 1"),
        ({"monitor": 1}, r"lr_scheduler monitor 1; expected a logged name"),
        ({"intervall": "epoch"}, r"unknown lr_scheduler key 'intervall'; valid keys: scheduler, interval"),
    ],
)
def test_a_bad_scheduler_dict_is_one_config_error(tmp_path, when, match):
    task = ScheduledTask(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1), when)
    with pytest.raises(torchloom.ConfigError, match=match):
        tiny_fit([], task=task, output_dir=str(tmp_path))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_on_two_processes_every_scheduler_steps_on_the_value_reduced_over_both(tmp_path):
    from torchrun_util import torchrun

    a, b = torchrun("plateau_fit.py", tmp_path)
    assert all(x != y for x, y in zip(a["own"], b["own"], strict=True))  # each process logs values of its own
    assert len(a["calls"]) == 2  # 4 optimizer steps per process, validation every 2
    assert a["calls"] == b["calls"] == a["logged"] == b["logged"]  # the reduced value, on both
    assert a["lr"] == b["lr"] < 0.05
