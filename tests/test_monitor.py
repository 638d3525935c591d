"""`torchloom.Monitor`, the one helper of every plugin that watches a logged value (``checkpoint``,
``early_stopping``, ``progress``'s best values, third-party plugins): how a name reads, the "best so far" rule,
freshness at a use, and its messages. The plugins' own tests check the warnings in real fits."""

from __future__ import annotations

import math
import warnings

import pytest

import torchloom

Monitor = torchloom.Monitor


@pytest.mark.parametrize(
    ("name", "reads", "best"),
    [
        ("val/loss", "min", "min"),
        ("val/nll_loss", "min", "min"),
        ("eval/logloss", "min", "min"),
        ("val/perplexity", "min", "min"),
        ("val/ppl", "min", "min"),
        ("val/RMSE", "min", "min"),
        ("val/error_rate", "min", "min"),
        ("val/accuracy", "max", "max"),
        ("val/acc", "max", "max"),
        ("val/MulticlassAccuracy", "max", "max"),
        ("val/f1", "max", "max"),
        ("val/BinaryF1Score", "max", "max"),
        ("val/auroc", "max", "max"),
        ("val/precision", "max", "max"),
        ("val/recall", "max", "max"),
        ("val/bleu", "max", "max"),
        ("val/power", None, "max"),  # reads as neither: the default
        ("val/score", None, "max"),
        ("lr", None, None),  # a state: no best under any default
        ("grad_norm", None, None),
        ("train/loss_scale", None, None),  # a state, although it names the loss
    ],
)
def test_direction_reads_the_name(name, reads, best):
    assert Monitor.direction(name, default=None) == reads  # what the mode check compares with
    assert Monitor.direction(name) == best  # what progress shows as the best


def test_is_better_is_strict_with_min_delta_and_nan_is_never_better():
    assert Monitor.is_better(1.0, None, "min") and not Monitor.is_better(math.nan, None, "min")
    assert Monitor.is_better(0.9, 1.0, "min") and not Monitor.is_better(1.0, 1.0, "min")
    assert Monitor.is_better(1.1, 1.0, "max") and not Monitor.is_better(0.9, 1.0, "max")
    assert not Monitor.is_better(0.75, 1.0, "min", min_delta=0.25)  # exactly min_delta: not an improvement
    assert Monitor.is_better(0.7, 1.0, "min", min_delta=0.25)
    assert Monitor.is_better(-math.inf, 1.0, "min") and not Monitor.is_better(math.nan, 1.0, "max")


def test_observe_use_update_and_start():
    monitor = Monitor("probe", "val/loss")
    assert monitor.observe({"train/loss": 2.0}, 1) is None and not monitor.use(1)
    assert monitor.observe({"val/loss": 1.5, "train/loss": 2.0}, 2) == 1.5 and monitor.use(2)
    assert not monitor.use(3)  # an older value: logged at step 2
    assert monitor.update(1.5, 2) and not monitor.update(math.nan, 3) and not monitor.update(1.5, 4)
    assert (monitor.best, monitor.best_step, monitor.steps) == (1.5, 2, [2])
    assert monitor.uses == [(1, False), (2, True), (3, False)] and monitor.logged == {"train/loss", "val/loss"}
    monitor.start(keep_best=True)
    assert (monitor.best, monitor.steps, monitor.uses, monitor.logged) == (1.5, [], [], set())
    monitor.start()
    assert (monitor.best, monitor.best_step) == (None, None)


def test_never_logged_names_the_logged_names_and_the_closest_one():
    monitor = Monitor("probe", "val/los")
    monitor.observe({"train/loss": 1.0, "val/loss": 2.0}, 4)
    with pytest.warns(UserWarning) as record:
        assert monitor.warn_if_never_logged("nothing was done")
    assert [str(w.message) for w in record] == [
        "probe: monitor 'val/los' was never logged during this fit, so nothing was done; did you mean 'val/loss'? "
        "Logged names: 'train/loss', 'val/loss'. Log it (self.log('val/los', ...) in validation_step) or set "
        "'monitor' to one of these"
    ]
    far = Monitor("probe", "accuracy", mode="max", setting="metric")
    with pytest.warns(
        UserWarning,
        match=r"probe: metric 'accuracy' was never logged during this fit, so x\. Logged "
        r"names: none\. .* or set 'metric' to one of these",
    ):
        far.warn_if_never_logged("x")
    seen = Monitor("probe", "val/loss")
    seen.observe({"val/loss": 1.0}, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not seen.warn_if_never_logged("x")


def test_bad_mode_and_min_delta_are_config_errors():
    with pytest.raises(torchloom.ConfigError, match=r"probe: setting 'mode' = 'best'; expected 'min' .* or 'max'"):
        Monitor("probe", "val/loss", mode="best")
    with pytest.raises(torchloom.ConfigError, match=r"probe: setting 'min_delta' = -1; expected a finite number >= 0"):
        Monitor("probe", "val/loss", min_delta=-1)


def test_describe_steps():
    assert Monitor.describe_steps([]) == "no step"
    assert Monitor.describe_steps([4]) == "step 4"
    assert Monitor.describe_steps([2, 4, 6]) == "steps 2, 4, 6"
    assert Monitor.describe_steps(range(2, 42, 2)) == "steps 2, 4, 6, ..., 40 (20 in all)"
