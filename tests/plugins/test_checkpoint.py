"""The ``checkpoint`` plugin: its schedules (steps, epochs), what it keeps (the last K, the best by a monitored value),
its settings errors, and preemption: SIGTERM saves at the next optimizer step and exits 143, ``--resume`` continues
to the same result as an uninterrupted run, on one process and on two (the flag is agreed over the processes).

The exactness of resume itself (parameters, optimizer, data order, random states) is tested in ``tests/test_resume.py``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import torchloom
from torchloom.checkpoint.store import list_checkpoints, read_manifest
from torchloom.testing import TinyTask
from torchloom_plugins.checkpoint import Checkpoint
from torchrun_util import torchrun


def _names(run_dir: str | Path) -> list[str]:
    return sorted(os.listdir(Path(run_dir) / "checkpoints"))


def test_step_and_epoch_schedules_save_where_they_say(tmp_path):
    # 32 samples / batch 4 = 8 steps per epoch, 2 epochs: every 3 steps -> 3, 6, 9, 12, 15; every epoch -> 8, 16.
    engine = torchloom.Engine(
        output_dir=str(tmp_path),
        max_epochs=2,
        plugins={"checkpoint": {"every_n_steps": 3, "every_n_epochs": 1, "keep_last": None}},
    )
    engine.fit(TinyTask())
    assert _names(engine.run_dir) == [
        "step-00000003",
        "step-00000006",
        "step-00000008-epoch-end",
        "step-00000009",
        "step-00000012",
        "step-00000015",
        "step-00000016-epoch-end",
    ]
    manifest = read_manifest(Path(engine.run_dir) / "checkpoints" / "step-00000009")
    assert (manifest["global_step"], manifest["epoch"]) == (9, 1)
    position = {k: manifest["position"][k] for k in ("epoch", "batches_done", "samples_done", "epoch_finished")}
    assert position == {"epoch": 1, "batches_done": 1, "samples_done": 4, "epoch_finished": False}
    epoch_end = read_manifest(Path(engine.run_dir) / "checkpoints" / "step-00000008-epoch-end")
    position = {k: epoch_end["position"][k] for k in ("epoch", "batches_done", "samples_done", "epoch_finished")}
    assert position == {"epoch": 0, "batches_done": 8, "samples_done": 32, "epoch_finished": True}


def test_keep_last_deletes_older_checkpoints_completely(tmp_path):
    engine = torchloom.Engine(
        output_dir=str(tmp_path), max_epochs=1, plugins={"checkpoint": {"every_n_steps": 1, "keep_last": 2}}
    )
    engine.fit(TinyTask())
    # Steps 7 and 8, and the end-of-epoch save at step 8; nothing half-deleted is left behind.
    assert _names(engine.run_dir) == ["step-00000008", "step-00000008-epoch-end"]
    plugin = engine.plugins[0]  # the defaults (progress) come after the plugins a run names
    assert plugin.saved == [str(Path(engine.run_dir) / "checkpoints" / n) for n in _names(engine.run_dir)]


class ScriptedValidation(TinyTask):
    """Logs a scripted val/score per validation pass."""

    def __init__(self, scores):
        super().__init__()
        self.scores = iter(scores)

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.log("val/score", next(self.scores))


@pytest.mark.parametrize(("mode", "best"), [("max", "step-00000004"), ("min", "step-00000006")])
def test_keep_best_keeps_the_best_scoring_checkpoint_next_to_the_last(tmp_path, mode, best):
    settings = {"every_n_steps": 2, "every_n_epochs": None, "keep_last": 1, "monitor": "val/score", "mode": mode}
    engine = torchloom.Engine(
        output_dir=str(tmp_path), val_check_interval=2, num_sanity_val_steps=0, plugins={"checkpoint": settings}
    )
    engine.fit(ScriptedValidation([0.5, 0.9, 0.1, 0.3]))  # validations at steps 2, 4, 6, 8
    assert _names(engine.run_dir) == sorted({best, "step-00000008"})
    plugin = engine.plugins[0]  # the defaults (progress) come after the plugins a run names
    assert plugin.scores[str(Path(engine.run_dir) / "checkpoints" / best)] == {"max": 0.9, "min": 0.1}[mode]


@pytest.mark.parametrize(
    ("mode", "scores", "best"),
    [("min", [math.nan, 0.5, 0.2, 0.9], "step-00000006"), ("max", [math.nan, 0.5, 0.9, 0.2], "step-00000006")],
)
def test_a_nan_score_is_never_the_best_and_the_real_best_survives(tmp_path, mode, scores, best):
    """The first validation gives NaN (a diverged metric): its checkpoint is never ranked, so it goes once it is not
    among the last; the best real score's checkpoint stays next to the last one."""
    settings = {"every_n_steps": 2, "every_n_epochs": None, "keep_last": 1, "monitor": "val/score", "mode": mode}
    engine = torchloom.Engine(
        output_dir=str(tmp_path), val_check_interval=2, num_sanity_val_steps=0, plugins={"checkpoint": settings}
    )
    engine.fit(ScriptedValidation(scores))  # validations at steps 2, 4, 6, 8
    assert _names(engine.run_dir) == [best, "step-00000008"]
    plugin = engine.plugins[0]  # the defaults (progress) come after the plugins a run names
    assert all(not math.isnan(v) for v in plugin.scores.values())


def test_every_n_epochs_2_over_3_epochs_saves_at_the_end_of_the_second_only(tmp_path):
    engine = torchloom.Engine(
        output_dir=str(tmp_path),
        max_epochs=3,
        plugins={"checkpoint": {"every_n_epochs": 2, "keep_last": None, "save_on_interrupt": False}},
    )
    engine.fit(TinyTask())  # 8 steps per epoch
    assert _names(engine.run_dir) == ["step-00000016-epoch-end"]


def test_resume_from_a_run_directory_takes_the_epoch_end_checkpoint_of_a_shared_step(tmp_path):
    """Steps 8 and 16 end epochs: the step schedule and the epoch schedule both save there; the epoch-end one comes
    later in the fit (after the epoch's validation), so it is the run's latest."""
    engine = torchloom.Engine(
        output_dir=str(tmp_path), max_epochs=2, plugins={"checkpoint": {"every_n_steps": 8, "keep_last": None}}
    )
    engine.fit(TinyTask())
    assert _names(engine.run_dir) == [
        "step-00000008",
        "step-00000008-epoch-end",
        "step-00000016",
        "step-00000016-epoch-end",
    ]
    checkpoints = Path(engine.run_dir) / "checkpoints"
    assert torchloom.checkpoint.store.find_checkpoint(engine.run_dir) == str(checkpoints / "step-00000016-epoch-end")
    assert list_checkpoints(engine.run_dir) == [str(checkpoints / n) for n in _names(engine.run_dir)]


@pytest.mark.parametrize("stop", ["max_steps", "request_stop"])
def test_an_epoch_cut_short_at_a_saved_step_keeps_that_checkpoint_once_and_resumes_from_it(tmp_path, stop):
    """max_steps 4 (or a stop request at step 4) inside an 8-step epoch, saving every 2 steps: the epoch's end is
    the position of step 4's checkpoint; it was saved once (it was a CheckpointError: "already exists"), counted
    once by keep_last, and the resume from it ends where an uninterrupted fit ends."""

    class StopAt4:
        name = "test.stop_at_4"

        @torchloom.hookimpl
        def on_train_step_end(self, progress) -> None:
            if progress.global_step == 4:
                torchloom.request_stop("enough")

    plugins: list = [{"checkpoint": {"every_n_steps": 2, "keep_last": 2}}]
    settings = {"max_steps": 4} if stop == "max_steps" else {"log_every_n_steps": 2}  # a stop is checked at a log
    if stop == "request_stop":
        plugins.append(StopAt4())
    engine = torchloom.Engine(output_dir=str(tmp_path / "cut"), max_epochs=1, plugins=plugins, **settings)
    engine.fit(TinyTask())
    assert engine.progress.global_step == 4
    assert _names(engine.run_dir) == ["step-00000002", "step-00000004"]
    assert engine.plugins[0].saved == [str(Path(engine.run_dir) / "checkpoints" / n) for n in _names(engine.run_dir)]
    resumed = torchloom.Engine(output_dir=str(tmp_path / "cut"), max_epochs=1, plugins={"checkpoint": {}})
    resumed.fit(task := TinyTask(), ckpt_path=engine.run_dir)
    whole = torchloom.Engine(output_dir=str(tmp_path / "whole"), max_epochs=1, plugins={"checkpoint": {}})
    whole.fit(reference := TinyTask())
    assert resumed.progress.global_step == whole.progress.global_step == 8
    for a, b in zip(task.model.parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resume_from_an_output_dir_takes_the_latest_run_by_number(tmp_path):
    """version_10 is later than version_2 (by number, not by name), and a run without checkpoints is skipped."""
    for version, steps in ((2, 3), (10, 1), (11, None)):
        run = tmp_path / f"version_{version}"
        run.mkdir()
        if steps is not None:
            engine = torchloom.Engine(
                output_dir=str(tmp_path / "scratch" / str(version)),
                max_steps=steps,
                plugins={"checkpoint": {"every_n_steps": 1, "keep_last": 1, "every_n_epochs": None}},
            )
            engine.fit(TinyTask())
            os.rename(Path(engine.run_dir) / "checkpoints", run / "checkpoints")
    assert torchloom.checkpoint.store.find_checkpoint(tmp_path) == str(
        tmp_path / "version_10" / "checkpoints" / "step-00000001"
    )
    assert [Path(p).parent.parent.name for p in list_checkpoints(tmp_path)] == ["version_2", "version_10"]


def test_the_next_run_directory_follows_the_highest_version(tmp_path):
    (tmp_path / "version_5").mkdir()
    (tmp_path / "version_x").mkdir()  # not a version
    engine = torchloom.Engine(output_dir=str(tmp_path), max_steps=1)
    engine.fit(TinyTask())
    assert Path(engine.run_dir).name == "version_6"
    (tmp_path / "version_10").mkdir()
    engine.fit(TinyTask())
    assert Path(engine.run_dir).name == "version_11"


# ------------------------------------------------------------------------------------- monitors never checked


def _monitored_fit(tmp_path, settings, scores, **engine_settings):
    """A fit with the checkpoint plugin's ``settings`` and ``ScriptedValidation(scores)``; returns the engine and the
    checkpoint plugin's own warnings (the texts)."""
    engine_settings = {"val_check_interval": 2, "num_sanity_val_steps": 0, **engine_settings}
    engine = torchloom.Engine(output_dir=str(tmp_path), plugins={"checkpoint": settings}, **engine_settings)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # also a second time in this process: warnings are not deduplicated here
        engine.fit(ScriptedValidation(scores))
    return engine, [str(w.message) for w in record if str(w.message).startswith("checkpoint:")]


def test_a_monitor_that_is_never_logged_warns_once_with_the_closest_name(tmp_path):
    """val/scor is never logged: no checkpoint gets a score (none is kept as the best), and one warning at the end
    names the logged names and the closest one; the same fit with the right name says nothing."""
    settings = {"every_n_steps": 2, "every_n_epochs": None, "keep_last": 1, "monitor": "val/scor"}
    engine, said = _monitored_fit(tmp_path / "typo", settings, [0.5, 0.9, 0.1, 0.3])
    plugin = engine.plugins[0]  # the defaults (progress) come after the plugins a run names
    assert plugin.scores == {} and _names(engine.run_dir) == ["step-00000008"]
    assert said == [
        "checkpoint: monitor 'val/scor' was never logged during this fit, so no checkpoint was ranked by it and none "
        "was kept as the best; did you mean 'val/score'? Logged names: 'train/loss', 'val/score'. Log it "
        "(self.log('val/scor', ...) in validation_step) or set 'monitor' to one of these"
    ]
    _, said = _monitored_fit(tmp_path / "right", {**settings, "monitor": "val/score"}, [0.5, 0.9, 0.1, 0.3])
    assert said == []


def test_saves_that_never_see_a_fresh_value_warn(tmp_path):
    """Saves at steps 3, 6 of a value validated at steps 2, 4, 6, 8: the save at step 6 has a fresh value, no warning.
    Saves at 3, 6 of a value validated at 4, 8 never have one (each score is the previous validation's): one warning
    naming both. So do saves at 2, 4 of a fit of 5 steps that validates only at the end of training (step 5)."""
    settings = {"every_n_steps": 3, "every_n_epochs": None, "keep_last": None, "monitor": "val/score", "mode": "max"}
    _, said = _monitored_fit(tmp_path / "aligned", settings, [0.5, 0.9, 0.1, 0.3])
    assert said == []
    engine, said = _monitored_fit(tmp_path / "stale", settings, [0.5, 0.9], val_check_interval=4)
    plugin = engine.plugins[0]  # the defaults (progress) come after the plugins a run names
    assert sorted(plugin.scores.values()) == [0.5]  # as before: the latest value at each save (none at step 3)
    assert said == [
        "checkpoint: monitor 'val/score' was logged at steps 4, 8, but none of the 2 checkpoints of this fit (at "
        "steps 3, 6) was saved at a step where it was logged: each one's score is a value of earlier weights, or "
        "none, and keep_best ranks them by it. Save where 'val/score' is logged: every_n_steps a multiple of "
        "val_check_interval (or of log_every_n_steps for a training value), or every_n_epochs with validation at "
        "the end of each epoch"
    ]
    late = {**settings, "every_n_steps": 2}
    _, said = _monitored_fit(tmp_path / "late", late, [0.5], val_check_interval=None, max_steps=5)
    assert len(said) == 1
    assert said[0].startswith(
        "checkpoint: monitor 'val/score' was logged at step 5, but none of the 2 checkpoints of this fit (at steps "
        "2, 4) was saved at a step where it was logged"
    )


@pytest.mark.parametrize(
    ("monitor", "mode", "expected"),
    [
        ("val/loss", "max", "min"),
        ("val/perplexity", "max", "min"),
        ("train/mse", "max", "min"),
        ("val/MulticlassAccuracy", "min", "max"),
        ("val/f1", "min", "max"),
        ("val/auroc", "min", "max"),
    ],
)
def test_a_mode_against_the_name_warns_once_when_the_plugin_is_made(monitor, mode, expected):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        Checkpoint(monitor=monitor, mode=mode)
    reads, worst, better = {
        "min": ("lower-is-better (a loss or an error)", "highest", "higher"),
        "max": ("higher-is-better (a score)", "lowest", "lower"),
    }[expected]
    assert [str(w.message) for w in record] == [
        f"checkpoint: mode {mode!r} with monitor {monitor!r}, a name that reads as {reads}: the {worst} value will "
        f"count as the best. Set mode to {expected!r}, or keep {mode!r} if {better} is better for this value"
    ]


@pytest.mark.parametrize(
    ("monitor", "mode"),
    [("val/loss", "min"), ("val/accuracy", "max"), ("val/score", "max"), ("val/score", "min"), ("lr", "max")],
)
def test_a_mode_that_fits_the_name_or_a_name_that_says_nothing_does_not_warn(monitor, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Checkpoint(monitor=monitor, mode=mode)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"every_n_steps": 0}, r"'every_n_steps' = 0; expected an integer >= 1 or null"),
        ({"keep_last": 0}, r"'keep_last' = 0"),
        ({"every_n_steps": None, "every_n_epochs": None, "save_on_interrupt": False}, r"would never save"),
        ({"mode": "best"}, r"'mode' = 'best'; expected one of min, max"),
        ({"keep_best": 0}, r"'keep_best' = 0"),
        ({"monitor": ""}, r"'monitor' = ''"),
        ({"requeue": True, "save_on_interrupt": False}, r"'requeue' = true needs save_on_interrupt = true"),
    ],
)
def test_bad_settings_are_one_config_error_each(settings, message):
    with pytest.raises(torchloom.ConfigError, match=message):
        Checkpoint(**settings)


# ------------------------------------------------------------------------------------------------- preemption

TASK_MODULE = '''
import os
import signal

from torchloom.testing import TinyTask


class Preempted(TinyTask):
    """Sends itself SIGTERM in the micro-batch of optimizer step `at` (0: never), as a scheduler would."""

    def __init__(self, at: int = 0, lr: float = 0.05):
        super().__init__(lr=lr)
        self.at, self.steps = at, 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        if self.steps == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)
'''


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchloom.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_sigterm_saves_exits_143_and_resume_ends_where_an_uninterrupted_fit_ends(tmp_path):
    (tmp_path / "preempted.py").write_text(TASK_MODULE)
    config = {
        "engine": {"max_epochs": 2, "log_every_n_steps": 1, "output_dir": str(tmp_path / "run")},
        "task": {"class_path": "preempted.Preempted", "init_args": {"at": 0}},
        "plugins": {"checkpoint": {"every_n_epochs": None}},  # saves only when interrupted
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    whole = _cli("fit", "--config", "config.yaml", "--engine.output_dir=whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr

    cut = _cli("fit", "--config", "config.yaml", "--task.init_args.at=11", cwd=tmp_path)
    # SIGTERM arrives during step 11's micro-batch; the step completes, the checkpoint is saved after it.
    assert cut.returncode == 143, cut.stderr
    assert "interrupted by SIGTERM after optimizer step 11" in cut.stderr
    (saved,) = list_checkpoints(tmp_path / "run")
    assert saved.endswith("version_0/checkpoints/step-00000011")

    resumed = _cli("fit", "--config", "config.yaml", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"torchloom fit: resumed from {saved} (step 11)" in resumed.stdout

    def records(run_dir: Path) -> list[dict]:
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    uninterrupted = records(tmp_path / "whole" / "version_0")
    # Steps 1..11 (and the validation at the end of epoch 0, step 8), then 12..16 and the last validation: identical.
    # The resumed run's file is complete: the first run's records, carried over (marked), then its own.
    assert records(tmp_path / "run" / "version_0") == [r for r in uninterrupted if r["step"] <= 11]
    resumed_records = records(tmp_path / "run" / "version_1")
    carried = [r.pop("carried_over_from") for r in resumed_records if "carried_over_from" in r]
    assert carried == [str(tmp_path / "run" / "version_0")] * len([r for r in uninterrupted if r["step"] <= 11])
    assert resumed_records == uninterrupted


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    plugin = Checkpoint()

    class Task(TinyTask):
        def training_step(self, batch, batch_idx):
            os.kill(os.getpid(), signal.SIGINT)  # the first asks for a checkpoint at the end of the step ...
            os.kill(os.getpid(), signal.SIGINT)  # ... the second, before that, stops the fit at once
            return super().training_step(batch, batch_idx)

    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(KeyboardInterrupt):
        torchloom.Engine(output_dir=str(tmp_path), plugins=[plugin]).fit(Task())
    # teardown put back the handlers the fit found (pytest's default_int_handler; SIG_DFL, or a test runner's own)
    assert {number: signal.getsignal(number) for number in before} == before


@pytest.mark.multiprocess
def test_a_signal_on_one_process_stops_both_after_the_same_step(tmp_path):
    results = torchrun("checkpoint_sigterm.py", tmp_path, nproc=2)
    # Rank 1 alone gets SIGTERM during step 3; the processes agree one step later and both save step 4.
    assert [r["interrupted_at"] for r in results] == [4, 4]
    assert results[0]["checkpoint"] == results[1]["checkpoint"]
    assert results[0]["checkpoint"].endswith("checkpoints/step-00000004")
    assert [r["signal"] for r in results] == [signal.SIGTERM, signal.SIGTERM]
    # The resumed fit on both processes ends with the parameters of an uninterrupted 2-process fit, bitwise.
    assert all(r["resumed_equals_uninterrupted"] for r in results)
    assert torch.tensor(results[0]["params"]).equal(torch.tensor(results[1]["params"]))
