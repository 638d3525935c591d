"""The ``early_stopping`` plugin: the fit stops at exactly the optimizer step of the ``patience``-th check in a row
without improvement (mode min and max, the ``min_delta`` boundary, NaN with ``check_finite``, the thresholds),
with a reason in `Engine.stop_reason`; its state goes through `torchloom.save_plugin_state` unchanged and a
loaded state is resumed; bad settings are one `torchloom.ConfigError` each; on 2 processes the decision is taken
on the reduced value and both ranks stop at the same step.

The task logs a scripted ``val/loss`` per validation pass, so each expected step is known exactly: with
``val_check_interval=2`` the n-th check is at optimizer step 2n.
"""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

import pytest

import torchloom
from torchloom.testing import TinyTask, tiny_fit
from torchloom_plugins.early_stopping import EarlyStopping, EarlyStoppingConfig
from torchrun_util import torchrun

NAN, INF = math.nan, math.inf


class ScriptedTask(TinyTask):
    """TinyTask (8 optimizer steps per epoch on one process) whose validation pass number i logs
    ``values[i]`` as ``name``, once per pass, so the reduced value is exactly that number."""

    def __init__(self, values: list[float], name: str = "val/loss") -> None:
        super().__init__()
        self.values, self.name, self.passes = list(values), name, 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            assert self.passes < len(self.values), f"validation pass {self.passes + 1}: the script has no value left"
            self.log(self.name, self.values[self.passes])
            self.passes += 1


def fit(plugin: EarlyStopping, values: list[float], tmp_path, **settings: Any) -> torchloom.Engine:
    """Fit ``ScriptedTask(values)`` with ``plugin``: validation every 2 steps, 24 steps at most, no sanity pass."""
    settings = {"val_check_interval": 2, "max_epochs": 3, "num_sanity_val_steps": 0, **settings}
    return tiny_fit([plugin], task=ScriptedTask(values), output_dir=str(tmp_path), **settings)


def checked_steps(engine: torchloom.Engine, name: str = "val/loss") -> list[int]:
    return [record["step"] for record in engine.history if name in record]


# ------------------------------------------------------------------------------------------------ patience


@pytest.mark.parametrize(("patience", "stop_step"), [(1, 6), (2, 8), (3, 10)])
def test_stops_at_the_patience_th_check_without_improvement(tmp_path, patience, stop_step):
    """Checks at steps 2, 4, 6, ... see 1.0, 0.8 (best), 0.9, 0.85, 0.95, 0.7: the fit stops at the
    ``patience``-th check after the best, not one before or after, and 0.7 is never seen."""
    stopper = EarlyStopping(patience=patience)
    engine = fit(stopper, [1.0, 0.8, 0.9, 0.85, 0.95, 0.7, 0.6], tmp_path)
    assert engine.progress.global_step == stop_step
    assert checked_steps(engine) == list(range(2, stop_step + 1, 2))  # no final validation: the stop step was
    assert (stopper.best, stopper.best_step, stopper.wait, stopper.stopped_step) == (0.8, 4, patience, stop_step)
    reason = engine.stop_reason
    assert reason is not None and reason.startswith("early_stopping: 'val/loss' did not improve")
    assert f"for {patience} checks in a row (patience {patience}, mode 'min')" in reason
    assert "best 0.8 at step 4" in reason


def test_an_improvement_resets_the_count(tmp_path):
    """Patience 2: 1.0, 0.9 (best), 0.95, 0.8 (best: the count restarts), 0.85, 0.9 -> stop at the 6th check."""
    stopper = EarlyStopping(patience=2)
    engine = fit(stopper, [1.0, 0.9, 0.95, 0.8, 0.85, 0.9, 0.1], tmp_path)
    assert engine.progress.global_step == 12
    assert (stopper.best, stopper.best_step, stopper.wait) == (0.8, 8, 2)


def test_an_equal_value_is_not_an_improvement(tmp_path):
    stopper = EarlyStopping(patience=2)
    engine = fit(stopper, [1.0, 1.0, 1.0, 0.5], tmp_path)
    assert engine.progress.global_step == 6
    assert (stopper.best, stopper.best_step) == (1.0, 2)


def test_no_stop_when_the_value_keeps_improving(tmp_path):
    """12 checks, each better than the last: the fit runs its 24 steps, no stop reason, nothing recorded."""
    stopper = EarlyStopping(patience=1)
    engine = fit(stopper, [1.0 - i / 16 for i in range(12)], tmp_path)
    assert engine.progress.global_step == 24 and engine.stop_reason is None
    assert (stopper.best, stopper.best_step, stopper.wait, stopper.stopped_step) == (1.0 - 11 / 16, 24, 0, None)


def test_stops_at_the_end_of_the_epoch_with_validation_per_epoch(tmp_path):
    """Without val_check_interval the check is the validation at the end of each epoch (8 steps): patience 2 on
    1.0, 1.0, 1.0 stops after the third epoch, at step 24, instead of running all 5."""
    stopper = EarlyStopping(patience=2)
    engine = fit(stopper, [1.0, 1.0, 1.0, 0.5, 0.5], tmp_path, val_check_interval=None, max_epochs=5)
    assert (engine.progress.global_step, engine.progress.epoch) == (24, 2)
    assert checked_steps(engine) == [8, 16, 24]
    assert stopper.stopped_step == 24 and "best 1 at step 8" in engine.stop_reason


# ----------------------------------------------------------------------------------------- min_delta, mode


@pytest.mark.parametrize(
    ("values", "stop_step", "best", "best_step"),
    [
        # 0.75 is exactly min_delta below 1.0: not an improvement; then 0.875 -> second check without one.
        ([1.0, 0.75, 0.875, 0.1], 6, 1.0, 2),
        # 0.625 beats 1.0 by 0.375: the best. 0.5 beats it by 0.125 only: not an improvement, and not the best.
        ([1.0, 0.625, 0.5, 0.5, 0.1], 8, 0.625, 4),
    ],
)
def test_min_delta_an_improvement_of_exactly_min_delta_does_not_count(tmp_path, values, stop_step, best, best_step):
    stopper = EarlyStopping(patience=2, min_delta=0.25)
    engine = fit(stopper, values, tmp_path)
    assert engine.progress.global_step == stop_step
    assert (stopper.best, stopper.best_step) == (best, best_step)
    assert "did not improve by more than min_delta 0.25 for 2 checks" in engine.stop_reason


def test_mode_max(tmp_path):
    """Higher is better: 0.5, 0.75 (best), 0.625, 0.75 (equal), 0.5 -> stop at the 5th check (mode min would stop
    at the 4th: 0.75, 0.625, 0.75 all above 0.5)."""
    stopper = EarlyStopping(monitor="val/acc", mode="max", patience=3)
    task = ScriptedTask([0.5, 0.75, 0.625, 0.75, 0.5, 0.9], name="val/acc")
    engine = tiny_fit(
        [stopper], task=task, output_dir=str(tmp_path), val_check_interval=2, num_sanity_val_steps=0, max_epochs=3
    )
    assert engine.progress.global_step == 10
    assert (stopper.best, stopper.best_step, stopper.wait) == (0.75, 4, 3)
    assert "'val/acc' did not improve for 3 checks in a row (patience 3, mode 'max')" in engine.stop_reason


@pytest.mark.parametrize(
    ("values", "stop_step", "best", "best_step"),
    [
        # 0.75 is exactly min_delta above 0.5: not an improvement; 0.625 neither -> stop at the third check.
        ([0.5, 0.75, 0.625, 0.9], 6, 0.5, 2),
        # 0.875 beats 0.5 by 0.375: the best; 1.0 beats it by 0.125 only: not an improvement, and not the best.
        ([0.5, 0.875, 1.0, 1.0, 0.1], 8, 0.875, 4),
        # min_delta applies upwards: 0.4 is far below 0.5, which in mode min would be an improvement.
        ([0.5, 0.4, 0.3, 0.9], 6, 0.5, 2),
    ],
)
def test_mode_max_with_min_delta(tmp_path, values, stop_step, best, best_step):
    stopper = EarlyStopping(monitor="val/acc", mode="max", patience=2, min_delta=0.25)
    task = ScriptedTask(values, name="val/acc")
    engine = tiny_fit(
        [stopper], task=task, output_dir=str(tmp_path), val_check_interval=2, num_sanity_val_steps=0, max_epochs=3
    )
    assert engine.progress.global_step == stop_step
    assert (stopper.best, stopper.best_step) == (best, best_step)
    assert "did not improve by more than min_delta 0.25 for 2 checks" in engine.stop_reason


# -------------------------------------------------------------------------------------- non-finite values


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_a_non_finite_value_stops_at_once_with_check_finite(tmp_path, bad):
    stopper = EarlyStopping(patience=5)
    engine = fit(stopper, [1.0, bad, 0.5], tmp_path)
    assert engine.progress.global_step == 4
    assert f"'val/loss' = {bad} at step 4 is not finite (check_finite); best 1 at step 2" in engine.stop_reason
    assert (stopper.best, stopper.best_step, stopper.wait, stopper.stopped_step) == (1.0, 2, 0, 4)


def test_without_check_finite_nan_is_a_check_without_improvement(tmp_path):
    """A NaN is never an improvement, nor the first best: NaN, 1.0 (best), NaN, 0.5 (best), NaN, NaN -> patience
    2 stops at the 6th check."""
    stopper = EarlyStopping(patience=2, check_finite=False)
    engine = fit(stopper, [NAN, 1.0, NAN, 0.5, NAN, NAN, 0.1], tmp_path)
    assert engine.progress.global_step == 12
    assert (stopper.best, stopper.best_step) == (0.5, 8)


# -------------------------------------------------------------------------------------------- thresholds


@pytest.mark.parametrize(
    ("settings", "values", "stop_step", "message"),
    [
        # mode min: 0.5 is not strictly below 0.5; 0.25 is.
        (
            {"stopping_threshold": 0.5},
            [1.0, 0.75, 0.5, 0.25, 0.1],
            8,
            "= 0.25 at step 8 is below stopping_threshold 0.5",
        ),
        # mode min: 2.0 is not strictly above 2.0; 2.5 is.
        ({"divergence_threshold": 2.0}, [1.0, 2.0, 2.5, 0.1], 6, "= 2.5 at step 6 is above divergence_threshold 2"),
        ({"mode": "max", "stopping_threshold": 0.9}, [0.5, 0.9, 0.95, 1.0], 6, "is above stopping_threshold 0.9"),
        ({"mode": "max", "divergence_threshold": 0.1}, [0.5, 0.1, 0.0, 1.0], 6, "is below divergence_threshold 0.1"),
    ],
)
def test_thresholds_stop_at_once(tmp_path, settings, values, stop_step, message):
    stopper = EarlyStopping(patience=10, **settings)
    engine = fit(stopper, values, tmp_path)
    assert engine.progress.global_step == stop_step
    assert message in engine.stop_reason and stopper.stopped_step == stop_step


def test_the_stopping_threshold_value_is_recorded_as_the_best(tmp_path):
    stopper = EarlyStopping(stopping_threshold=0.5)
    fit(stopper, [1.0, 0.25, 0.1], tmp_path)
    assert (stopper.best, stopper.best_step) == (0.25, 4)


# ---------------------------------------------------------------------------------- when it acts, warnings


def test_the_monitor_never_logged_warns_once_and_never_stops(tmp_path):
    stopper = EarlyStopping(monitor="val/los", patience=1)
    with pytest.warns(UserWarning, match=r"early_stopping: monitor 'val/los' was never logged") as record:
        engine = fit(stopper, [1.0] * 13, tmp_path)
    ours = [w for w in record if "early_stopping" in str(w.message)]
    assert len(ours) == 1
    assert "did you mean 'val/loss'?" in str(ours[0].message) and "'train/loss'" in str(ours[0].message)
    assert engine.progress.global_step == 24 and engine.stop_reason is None
    assert (stopper.best, stopper.wait, stopper.stopped_step) == (None, 0, None)


def test_no_warning_when_the_monitor_is_logged(tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(EarlyStopping(), [1.0, 0.5, 0.25] + [0.1] * 10, tmp_path)
    assert not [w for w in record if "early_stopping" in str(w.message)]


def _our_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("early_stopping:")]


def test_patience_the_fit_can_never_reach_warns_at_the_end(tmp_path):
    """Validation every 8 steps of a 16-step fit: checks at steps 8 and 16, and patience 2 needs 3 (the best, then 2
    without improvement): one warning naming the checks. Patience 1 needs 2: none."""
    settings = {"val_check_interval": 8, "max_epochs": 2}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(EarlyStopping(patience=2), [1.0, 2.0, 3.0], tmp_path / "short", **settings)
    assert _our_warnings(record) == [
        "early_stopping: monitor 'val/loss' was checked 2 times while training, at steps 8, 16; with patience 2 a stop "
        "needs 3 checks while training, so patience could never stop this fit. Log 'val/loss' more often (engine "
        "settings val_check_interval, log_every_n_steps) or lower patience"
    ]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine = fit(EarlyStopping(patience=1), [1.0, 2.0, 3.0], tmp_path / "enough", **settings)
    assert _our_warnings(record) == [] and engine.progress.global_step == 16


def test_a_value_logged_less_often_than_the_fit_is_long_warns(tmp_path):
    """A fit of 5 steps (max_steps) that validates only at the end of each epoch logs val/loss once, at step 5: logged,
    so no "never logged" warning, but patience 1 needs 2 checks. So does train/loss with log_every_n_steps 50 in a
    fit of 8 steps: checked once, at the end."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine = fit(EarlyStopping(patience=1), [1.0], tmp_path / "val", val_check_interval=None, max_steps=5)
    assert checked_steps(engine) == [5]
    assert _our_warnings(record) == [
        "early_stopping: monitor 'val/loss' was checked 1 time while training, at step 5; with patience 1 a stop "
        "needs 2 checks while training, so patience could never stop this fit. Log 'val/loss' more often (engine "
        "settings val_check_interval, log_every_n_steps) or lower patience"
    ]
    stopper = EarlyStopping(monitor="train/loss", patience=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine = tiny_fit([stopper], task=TinyTask(validate=False), output_dir=str(tmp_path), log_every_n_steps=50)
    assert checked_steps(engine, "train/loss") == [8]
    (said,) = _our_warnings(record)
    assert said.startswith(
        "early_stopping: monitor 'train/loss' was checked 1 time while training, at step 8; with patience 1 a stop "
        "needs 2 checks while training"
    )


def test_a_resumed_state_needs_only_the_checks_left(tmp_path):
    """Loaded best 0.5 and wait 2 with patience 3: one check without improvement stops the fit, so a fit with two
    checks gets no warning (it stops at the first)."""
    stopper = EarlyStopping(patience=3)
    stopper.load_state_dict({"best": 0.5, "best_step": 4, "wait": 2, "stopped_step": None})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine = fit(stopper, [1.0, 1.0], tmp_path, val_check_interval=4, max_epochs=1)
    assert engine.progress.global_step == 4 and _our_warnings(record) == []


@pytest.mark.parametrize(
    ("monitor", "mode", "expected"),
    [("val/loss", "max", "min"), ("val/acc", "min", "max"), ("val/accuracy", "min", "max")],
)
def test_a_mode_against_the_name_warns_when_the_plugin_is_made(monitor, mode, expected):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        EarlyStopping(monitor=monitor, mode=mode)
    (said,) = _our_warnings(record)
    assert said.startswith(f"early_stopping: mode {mode!r} with monitor {monitor!r}, a name that reads as ")
    assert f"Set mode to {expected!r}, or keep {mode!r}" in said


def test_validate_outside_a_fit_changes_nothing(tmp_path):
    stopper = EarlyStopping(patience=1)
    task = ScriptedTask([1.0, 2.0, 0.1])
    engine = tiny_fit([stopper], task=task, output_dir=str(tmp_path), val_check_interval=2, num_sanity_val_steps=0)
    assert engine.progress.global_step == 4 and stopper.state_dict() == {
        "best": 1.0,
        "best_step": 2,
        "wait": 1,
        "stopped_step": 4,
    }
    assert engine.validate(task) == {"val/loss": 0.1}  # better than the best, at step 4: not a check
    assert stopper.state_dict() == {"best": 1.0, "best_step": 2, "wait": 1, "stopped_step": 4}


def test_the_final_validation_is_tracked_but_requests_no_stop(tmp_path):
    """max_steps 5: checks at steps 2 and 4, then the engine's final validation at step 5, after on_train_end.
    Its value counts (wait 2 = patience), but nothing is left to stop: no request, no stopped_step."""
    stopper = EarlyStopping(patience=2)
    engine = fit(stopper, [1.0, 1.5, 2.0], tmp_path, max_steps=5)
    assert checked_steps(engine) == [2, 4, 5]
    assert engine.progress.global_step == 5 and engine.stop_reason is None
    assert (stopper.best, stopper.best_step, stopper.wait, stopper.stopped_step) == (1.0, 2, 2, None)


def test_a_second_fit_starts_afresh(tmp_path):
    """The same plugin object in a second fit: best, wait and stopped_step are reset at on_fit_start."""
    stopper = EarlyStopping(patience=3)
    assert fit(stopper, [1.0, 0.8, 0.9, 0.85, 0.95, 0.1], tmp_path / "a").progress.global_step == 10
    engine = fit(stopper, [2.0, 1.5, 1.75, 1.625, 1.875, 0.1], tmp_path / "b")
    assert engine.progress.global_step == 10  # a leftover wait (3) would stop at step 4; a leftover best at step 6
    assert (stopper.best, stopper.best_step, stopper.stopped_step) == (1.5, 4, 10)


# ----------------------------------------------------------------------------------------- state, resume


def test_state_round_trips_through_save_and_load_plugin_state(tmp_path):
    stopper = EarlyStopping(patience=3)
    fit(stopper, [1.0, 0.8, 0.9, 0.85, 0.95, 0.7], tmp_path / "run")
    state = stopper.state_dict()
    assert state == {"best": 0.8, "best_step": 4, "wait": 3, "stopped_step": 10}
    assert torchloom.save_plugin_state([stopper], tmp_path / "ckpt") == ["early_stopping"]
    saved = json.loads((tmp_path / "ckpt" / "early_stopping.json").read_text())
    assert saved["state"] == state  # plain JSON numbers: no pickle, no tensors
    fresh = EarlyStopping(patience=3)
    assert torchloom.load_plugin_state([fresh], tmp_path / "ckpt") == ["early_stopping"]
    assert fresh.state_dict() == state
    assert (fresh.best, fresh.best_step, fresh.wait, fresh.stopped_step) == (0.8, 4, 3, 10)


@pytest.mark.parametrize(
    "state",
    [
        {"best": None, "best_step": None, "wait": 0, "stopped_step": None},
        {"best": -INF, "best_step": 7, "wait": 2, "stopped_step": None},
        {"best": 2**-40, "best_step": 2**40, "wait": 0, "stopped_step": 2**40 + 1},
    ],
)
def test_every_kind_of_state_round_trips_exactly(tmp_path, state):
    stopper = EarlyStopping()
    stopper.load_state_dict(state)
    torchloom.save_plugin_state([stopper], tmp_path)
    fresh = EarlyStopping()
    torchloom.load_plugin_state([fresh], tmp_path)
    assert fresh.state_dict() == state
    assert [type(v) for v in fresh.state_dict().values()] == [type(v) for v in state.values()]


def test_a_loaded_state_is_resumed_by_the_next_fit(tmp_path):
    """Saved: best 0.875 at step 40, wait 2 (patience 3). The resumed fit's first value, 1.0, is not better than
    0.875: the third check without improvement, so it stops at step 2 (a fresh plugin runs to step 10)."""
    values = [1.0, 0.9, 0.95, 0.97, 0.99, 0.1]
    assert fit(EarlyStopping(patience=3), values, tmp_path / "fresh").progress.global_step == 10
    saved = EarlyStopping(patience=3)
    saved.load_state_dict({"best": 0.875, "best_step": 40, "wait": 2, "stopped_step": None})
    torchloom.save_plugin_state([saved], tmp_path / "ckpt")
    resumed = EarlyStopping(patience=3)
    torchloom.load_plugin_state([resumed], tmp_path / "ckpt")
    engine = fit(resumed, values, tmp_path / "resumed")
    assert engine.progress.global_step == 2
    assert (resumed.best, resumed.best_step, resumed.wait, resumed.stopped_step) == (0.875, 40, 3, 2)
    assert "best 0.875 at step 40; last 1 at step 2" in engine.stop_reason


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ([0.5, 1, 0, None], "cannot load state"),
        ({"best": 0.5, "best_step": 1, "wait": 0}, "cannot load state"),  # a key missing
        ({"best": 0.5, "best_step": 1, "wait": 0, "stopped_step": None, "x": 1}, "cannot load state"),
        ({"best": "0.5", "best_step": 1, "wait": 0, "stopped_step": None}, "best = '0.5' is not a number"),
        ({"best": NAN, "best_step": 1, "wait": 0, "stopped_step": None}, "best = nan is not a number"),
        ({"best": 0.5, "best_step": 1, "wait": -1, "stopped_step": None}, "wait = -1 is not an integer >= 0"),
        ({"best": 0.5, "best_step": 1, "wait": True, "stopped_step": None}, "wait = True is not an integer"),
        ({"best": 0.5, "best_step": 1.0, "wait": 0, "stopped_step": None}, "best_step = 1.0 is not an integer"),
        ({"best": 0.5, "best_step": 1, "wait": 0, "stopped_step": "3"}, "stopped_step = '3' is not an integer"),
        ({"best": None, "best_step": 3, "wait": 0, "stopped_step": None}, "both are set or both are None"),
    ],
)
def test_a_bad_state_is_a_plugin_error_and_changes_nothing(state, problem):
    stopper = EarlyStopping()
    before = stopper.state_dict()
    with pytest.raises(torchloom.PluginError, match=r"early_stopping: cannot load state") as info:
        stopper.load_state_dict(state)
    assert problem in str(info.value)
    assert stopper.state_dict() == before


# -------------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mode": "avg"}, r"setting 'mode' = 'avg': expected 'min' .* or 'max'"),
        ({"patience": 0}, r"setting 'patience' = 0: expected an integer >= 1"),
        ({"patience": -2}, r"setting 'patience' = -2: expected an integer >= 1"),
        ({"patience": True}, r"setting 'patience' = True \(bool\); expected int"),
        ({"min_delta": -0.1}, r"setting 'min_delta' = -0.1: expected a finite number >= 0"),
        ({"min_delta": NAN}, r"setting 'min_delta' = nan: expected a finite number >= 0"),
        ({"monitor": ""}, r"setting 'monitor' = '': expected a logged name"),
        ({"monitor": "torchloom/negative_items"}, r"setting 'monitor' = 'torchloom/negative_items': names under"),
        ({"check_finite": "yes"}, r"setting 'check_finite' = 'yes' \(str\); expected bool"),
        ({"stopping_threshold": INF}, r"setting 'stopping_threshold' = inf: expected a finite number"),
        (
            {"stopping_threshold": 2.0, "divergence_threshold": 1.0},
            r"setting 'stopping_threshold' = 2.0 with 'divergence_threshold' = 1.0: with mode 'min' .* must be below",
        ),
        (
            {"mode": "max", "stopping_threshold": 0.5, "divergence_threshold": 0.5},
            r"setting 'stopping_threshold' = 0.5 with 'divergence_threshold' = 0.5: with mode 'max' .* above",
        ),
    ],
)
def test_bad_settings_are_one_config_error_naming_the_setting(settings, message):
    with pytest.raises(torchloom.ConfigError, match=r"plugin 'early_stopping': " + message):
        torchloom.Engine(plugins={"early_stopping": settings})


def test_config_checks_also_guard_direct_construction():
    with pytest.raises(torchloom.ConfigError, match=r"setting 'patience' = 0"):
        EarlyStoppingConfig(patience=0)
    config = EarlyStoppingConfig(min_delta=1, stopping_threshold=0)  # ints become floats
    assert (type(config.min_delta), type(config.stopping_threshold)) == (float, float)
    assert EarlyStopping(config).config is config


def test_enabled_by_name_with_defaults():
    (plugin,) = torchloom.enable_plugins(["early_stopping"])
    assert isinstance(plugin, EarlyStopping)
    assert plugin.config == EarlyStoppingConfig(
        monitor="val/loss", mode="min", patience=3, min_delta=0.0, check_finite=True
    )
    assert plugin.state_dict() == {"best": None, "best_step": None, "wait": 0, "stopped_step": None}


# ------------------------------------------------------------------------------------------------- processes


@pytest.mark.multiprocess
def test_two_processes_decide_on_the_reduced_value_and_stop_together(tmp_path):
    """2 processes whose own values differ (rank 1's alone would stop at step 8, rank 0's never): the reduced
    means are 1.0, 0.75 (best), 0.875, 0.8125, 0.9375, so with patience 3 both ranks stop at step 10 with the same
    reason, the same history and the same state."""
    r0, r1 = torchrun("early_stop_fit.py", tmp_path, nproc=2)
    assert (r0["world_size"], r0["rank"], r1["rank"]) == (2, 0, 1)
    assert r0["local_values"] != r1["local_values"]
    for r in (r0, r1):
        assert r["global_step"] == 10
        assert r["val_loss"] == [[2, 1.0], [4, 0.75], [6, 0.875], [8, 0.8125], [10, 0.9375]]
        assert r["state"] == {"best": 0.75, "best_step": 4, "wait": 3, "stopped_step": 10}
    assert r0["stop_reason"] == r1["stop_reason"]
    assert "'val/loss' did not improve for 3 checks in a row" in r0["stop_reason"]
    assert "best 0.75 at step 4; last 0.9375 at step 10" in r0["stop_reason"]
