"""Counters and timings in records and summaries, as a kind (issue 39): accumulated vs last value, training time
without validation, per-second rates.

The clock of the loop, the ``progress`` and the ``throughput`` plugins (their ``time.perf_counter``) is one
injected clock that moves only when the test moves it: each training micro-batch takes exactly 1 s, each
validation batch exactly 100 s. Every time and rate is then known by construction: TinyTask, 32 samples in
batches of 4, 2 epochs = 16 steps of 4 samples, a validation pass (4 batches) at the end of each epoch and a
sanity pass (2 batches) before training.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

import torchloom
import torchloom._loop as loop_module
from cli_util import run_cli  # the torchloom command, in this process
from torchloom.testing import TinyTask
from torchloom_plugins import progress as progress_module
from torchloom_plugins import throughput as throughput_module

STEPS, SAMPLES, BATCH = 16, 64, 4
TRAIN_S, VAL_S = 1.0, 100.0


class Clock:
    """``time`` for the modules under test: ``perf_counter`` reads ``now``, which only `advance` moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Ticks:
    """A plugin: every training micro-batch takes `TRAIN_S` on the clock."""

    name = "test.ticks"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    @torchloom.hookimpl
    def on_train_batch_start(self) -> None:
        self.clock.advance(TRAIN_S)


class SlowValidation(TinyTask):
    """TinyTask whose every validation batch takes `VAL_S` on the clock."""

    def __init__(self, clock: Clock, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clock, self.val_batches = clock, 0

    def validation_step(self, batch, batch_idx):
        self.clock.advance(VAL_S)
        self.val_batches += 1
        return super().validation_step(batch, batch_idx)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    for module in (loop_module, progress_module, throughput_module):
        monkeypatch.setattr(module, "time", clock)
    return clock


def fit(tmp_path: Path, clock: Clock, **settings: Any) -> tuple[torchloom.Engine, SlowValidation]:
    settings = {"max_epochs": 2, "log_every_n_steps": 4, **settings}
    engine = torchloom.Engine(
        plugins=[{"progress": {}}, {"throughput": {}}, Ticks(clock)], output_dir=str(tmp_path / "runs"), **settings
    )
    task = SlowValidation(clock, n=32, batch_size=BATCH)
    engine.fit(task)
    return engine, task


def test_summary_training_time_excludes_validation_and_rates_are_over_it(tmp_path, clock, capsys) -> None:
    engine, task = fit(tmp_path, clock)
    summary = json.loads((Path(engine.run_dir) / torchloom.utils.SUMMARY_FILE).read_text())
    assert (summary["optimizer_steps"], summary["samples"], summary["epochs"]) == (STEPS, SAMPLES, 2)
    assert summary["train_time_s"] == STEPS * TRAIN_S  # the 2 validation passes (800 s) excluded
    assert summary["samples_per_s"] == SAMPLES / (STEPS * TRAIN_S) == 4.0
    assert summary["steps_per_s"] == 1.0
    assert task.val_batches == 2 + 2 * 4  # the sanity pass and one pass per epoch
    assert summary["wall_time_s"] == STEPS * TRAIN_S + task.val_batches * VAL_S  # the wall time includes them
    assert summary["this_run"] == {k: summary[k] for k in summary["this_run"]}  # not resumed: this run is the whole
    out = capsys.readouterr().out
    assert "training time 16.0 s (validation excluded): 4 samples/s, 1 steps/s" in out


def test_throughput_rates_exclude_validation_and_totals_accumulate_every_interval(tmp_path, clock) -> None:
    engine, _ = fit(tmp_path, clock)
    records = [r for r in engine.history if "throughput/samples" in r]
    assert [r["step"] for r in records] == [4, 8, 12, 16]
    for r in records:  # each interval: 4 steps of 4 samples, 1 s each, validation after step 8 not counted
        assert r["throughput/samples"] == 4 * BATCH
        assert r["throughput/samples_per_s"] == BATCH / TRAIN_S
        assert r["throughput/samples_per_s"] == r["throughput/samples"] / (4 * TRAIN_S)
    plugin = next(p for p in engine.plugins if getattr(p, "name", None) == "throughput")
    assert plugin.totals["samples"] == SAMPLES == sum(r["throughput/samples"] for r in records)  # summed, not last
    # metrics.jsonl holds exactly the history's records (the interval's values, not running totals)
    lines = [json.loads(line) for line in (Path(engine.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in lines if "throughput/samples" in r] == records
    # inspect shows each name's last value (the last interval's count), and the fit's last step
    info = torchloom.inspect_path(engine.run_dir)
    assert info["metrics"]["throughput/samples"] == 4 * BATCH
    assert info["global_step"] == STEPS
    text = run_cli("inspect", engine.run_dir, cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    rows = [line.split() for line in text.stdout.splitlines()]
    assert ["throughput/samples", "=", "16"] in rows and ["throughput/samples_per_s", "=", "4"] in rows
    assert ["step", "16", "(epoch", "1)"] in rows


def test_a_checkpoint_records_the_training_time_without_validation(tmp_path, clock) -> None:
    """The manifest's ``training`` record (what a resume adds its own time to) by the same clock: after 8 steps
    and the sanity pass, before the epoch's validation, 8 s of training."""
    saved: list[str] = []

    class SaveAt:
        name = "test.save_at"

        @torchloom.hookimpl
        def on_train_step_end(self, progress) -> None:
            if progress.global_step in (6, 12):
                saved.append(torchloom.save_checkpoint())

    engine = torchloom.Engine(
        plugins=[Ticks(clock), SaveAt()], output_dir=str(tmp_path / "runs"), max_epochs=2, log_every_n_steps=4
    )
    engine.fit(SlowValidation(clock, n=32, batch_size=BATCH))
    trained = [json.loads((Path(p) / "manifest.json").read_text())["training"]["train_time_s"] for p in saved]
    assert trained == [6 * TRAIN_S, 12 * TRAIN_S]  # step 12 comes after the validation at step 8: not counted


# --------------------------------------------------------------------------------- accumulated across a resume


class NanAt(TinyTask):
    """TinyTask whose loss is NaN at the given optimizer steps (1-based; one micro-batch per step; a resumed fit
    starts counting at ``done``), each validation batch taking `VAL_S` on the clock."""

    def __init__(self, clock: Clock, nan_at: tuple[int, ...], done: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clock, self.nan_at, self.step = clock, nan_at, done

    def training_step(self, batch, batch_idx):
        self.step += 1
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.step in self.nan_at else loss

    def validation_step(self, batch, batch_idx):
        self.clock.advance(VAL_S)
        return super().validation_step(batch, batch_idx)


class StopAt:
    """Saves a checkpoint after step ``step`` and stops the fit there (raises `Stop`)."""

    name = "test.stop_at"

    def __init__(self, step: int) -> None:
        self.step, self.path = step, None

    @torchloom.hookimpl
    def on_train_step_end(self, progress) -> None:
        if progress.global_step == self.step:
            self.path = torchloom.save_checkpoint()
            raise Stop


class Stop(Exception):
    pass


def _fit(tmp_path: Path, clock: Clock, plugins: list[Any], ckpt_path: str | None = None, done: int = 0):
    engine = torchloom.Engine(
        plugins=[{"progress": {}}, {"throughput": {}}, Ticks(clock), *plugins],
        output_dir=str(tmp_path / "runs"), max_epochs=2, log_every_n_steps=4, nonfinite_loss="skip",
    )  # fmt: skip
    task = NanAt(clock, (2, 6, 14), done, n=32, batch_size=BATCH)
    with contextlib.suppress(Stop):
        engine.fit(task, ckpt_path=ckpt_path)
    return engine


def test_fit_counts_are_accumulated_over_the_fit_and_continued_by_a_resume(tmp_path, clock, capsys) -> None:
    """``train/skipped_steps`` is the fit's count so far (not the interval's), the throughput totals and the
    summary's samples and times are the whole training's: the same after a stop at step 6 and a resume."""
    whole = _fit(tmp_path / "a", clock, [])
    skipped = [(r["step"], r["train/skipped_steps"]) for r in whole.history if "train/skipped_steps" in r]
    assert skipped == [(4, 1.0), (8, 2.0), (12, 2.0), (16, 3.0)]

    stop = StopAt(6)
    _fit(tmp_path / "b", clock, [stop])
    resumed = _fit(tmp_path / "b", clock, [], ckpt_path=stop.path, done=6)
    skipped_after = [(r["step"], r["train/skipped_steps"]) for r in resumed.history if "train/skipped_steps" in r]
    assert skipped_after == [(8, 2.0), (12, 2.0), (16, 3.0)]

    def plugin(engine: torchloom.Engine) -> Any:
        return next(p for p in engine.plugins if getattr(p, "name", None) == "throughput")

    assert plugin(resumed).totals == plugin(whole).totals
    assert plugin(whole).totals["samples"] == SAMPLES
    a, b = (json.loads((Path(e.run_dir) / torchloom.utils.SUMMARY_FILE).read_text()) for e in (whole, resumed))
    for key in ("optimizer_steps", "samples", "train_time_s", "samples_per_s", "steps_per_s"):
        assert b[key] == a[key], key
    assert (a["train_time_s"], a["samples"]) == (STEPS * TRAIN_S, SAMPLES)
    assert b["this_run"]["train_time_s"] == (STEPS - 6) * TRAIN_S  # its own part: steps 7 to 16
    assert b["this_run"]["samples"] == SAMPLES - 6 * BATCH
    assert b["runs"] == 2
