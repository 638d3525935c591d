"""The ``progress`` plugin: plain lines when stdout is not a terminal (pytest's captured stdout is not), a live bar
when it is (``terminal: true`` forces rich's Console to see one), and at the end of a completed fit or a validate a
table and ``summary.json`` whose last / best values, step and sample counts are exact; nothing when disabled or on a
process other than the main one; the command enables it unless the config names it."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch.utils.data import DataLoader, IterableDataset

import cli_util
import torchloom
from torchloom.testing import TinyTask, tiny_dataset
from torchloom_plugins.progress import ProgressBar, batch_size, metric_direction
from torchrun_util import require_multiprocess_marker

ROOT = Path(__file__).resolve().parents[2]
SOURCE_PATHS = [str(ROOT / "src"), str(ROOT / "plugins")]
ANSI = "\x1b["
#: TinyTask(n=10, batch_size=4): batches of 4, 4 and 2 samples, so 3 optimizer steps per epoch.
STEPS_PER_EPOCH, SAMPLES_PER_EPOCH = 3, 10


class ScriptedMetrics:
    """Logs ``val/acc`` = 0.5, 0.9, 0.7 at validation passes 1, 2, 3 (best 0.9, not the last) and a constant ``lr``
    at every micro-batch (a state: no best)."""

    name = "test.scripted_metrics"
    ACCURACY = (0.5, 0.9, 0.7)

    def __init__(self) -> None:
        self.passes = 0

    @torchloom.hookimpl
    def on_validation_end(self, log) -> None:
        log("val/acc", self.ACCURACY[self.passes % len(self.ACCURACY)])
        self.passes += 1

    @torchloom.hookimpl
    def on_train_batch_end(self, log) -> None:
        log("lr", 0.25)


def fit(tmp_path: Path, progress: dict[str, Any] | None = None, *extra: Any, task=None, **settings: Any):
    """A fit with the progress plugin (plus ``extra`` plugins); returns the engine and the plugin."""
    plugin = ProgressBar(**(progress or {}))
    settings = {"max_epochs": 3, "log_every_n_steps": 1, "output_dir": str(tmp_path / "runs"), **settings}
    engine = torchloom.Engine(plugins=[plugin, *extra], **settings)
    engine.fit(task if task is not None else TinyTask(n=10))
    return engine, plugin


def table_row(out: str, name: str) -> list[str]:
    """The cells of the summary table's row for ``name``."""
    (line,) = [line for line in out.splitlines() if re.match(rf"^│ {re.escape(name)} +│", line)]
    return [cell.strip() for cell in line.strip()[1:-1].split("│")]


def history(engine: torchloom.Engine, name: str) -> list[tuple[int, float]]:
    return [(h["step"], h[name]) for h in engine.history if name in h]


# -------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"refresh_per_second": 0}, r"plugin 'progress'.*'refresh_per_second' = 0.0; expected a finite number > 0"),
        ({"refresh_per_second": -2.0}, r"'refresh_per_second' = -2.0"),
        ({"refresh_per_second": float("inf")}, r"'refresh_per_second' = inf; expected a finite number > 0"),
        ({"refresh_per_second": "4"}, r"'refresh_per_second' = '4' \(str\); expected float"),
        ({"plain_every_n_seconds": -1}, r"'plain_every_n_seconds' = -1.0; expected a finite number >= 0"),
        ({"plain_every_n_seconds": float("nan")}, r"'plain_every_n_seconds' = nan"),
        ({"enabled": "no"}, r"setting 'enabled' = 'no' \(str\); expected bool"),
        ({"terminal": "auto"}, r"setting 'terminal' = 'auto' \(str\); expected bool \| None"),
        ({"refresh_per_sec": 4}, r"unknown setting 'refresh_per_sec'; did you mean 'refresh_per_second'\?"),
    ],
)
def test_bad_settings_are_one_clear_error(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(torchloom.ConfigError, match=match):
        torchloom.Engine(plugins={"progress": settings})


def test_the_settings_class_checks_values_given_in_python_too() -> None:
    with pytest.raises(torchloom.ConfigError, match=r"'refresh_per_second' = True; expected a finite number > 0"):
        ProgressBar.Config(refresh_per_second=True)
    with pytest.raises(torchloom.ConfigError, match=r"setting 'enabled' = 1; expected true or false"):
        ProgressBar.Config(enabled=1)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- functional


@pytest.mark.parametrize(
    ("name", "direction"),
    [
        ("val/loss", "min"),
        ("train/loss", "min"),
        ("val/nll_loss", "min"),
        ("eval/logloss", "min"),
        ("val/mse", "min"),
        ("val/RMSE", "min"),
        ("test.wer", "min"),
        ("val/cer", "min"),
        ("val/error_rate", "min"),
        ("val/perplexity", "min"),
        ("val/accuracy", "max"),
        ("val/f1", "max"),
        ("val/precision", "max"),  # "cer" is no part of it
        ("val/power", "max"),  # nor is "wer"
        ("lr", None),
        ("train/lr", None),
        ("lr-AdamW", None),
        ("optimizer/learning_rate", None),
        ("grad_norm", None),
        ("train/loss_scale", None),  # a state, although it names the loss
        ("train/skipped_steps", None),
    ],
)
def test_metric_direction(name: str, direction: str | None) -> None:
    assert metric_direction(name) == direction


def test_batch_size_reads_the_first_tensor_and_gives_up_without_one() -> None:
    x = torch.zeros(5, 3)
    assert batch_size((x, torch.zeros(5))) == 5
    assert batch_size({"input_ids": torch.zeros(7, 2, dtype=torch.long), "labels": torch.zeros(7)}) == 7
    assert batch_size([[x]]) == 5
    assert batch_size(["some", "text"]) is None
    assert batch_size({}) is None
    assert batch_size(torch.tensor(1.0)) is None  # 0-dim: no batch dimension


# ----------------------------------------------------------------------------------------------- fit


def test_summary_has_the_last_and_best_value_of_every_metric_and_exact_counts(tmp_path, capsys) -> None:
    engine, plugin = fit(tmp_path, None, ScriptedMetrics())
    out = capsys.readouterr().out
    summary = json.loads((Path(engine.run_dir) / "summary.json").read_text())
    assert summary == plugin.summary
    assert summary["stage"] == "fit"
    assert summary["optimizer_steps"] == engine.progress.global_step == 3 * STEPS_PER_EPOCH
    assert summary["epochs"] == 3
    assert summary["samples"] == 3 * SAMPLES_PER_EPOCH  # 4 + 4 + 2 per epoch, counted from the batches' shapes
    assert summary["run_dir"] == engine.run_dir and summary["model_dir"] is None
    assert summary["wall_time_s"] >= summary["train_time_s"] > 0
    assert summary["samples_per_s"] == pytest.approx(summary["samples"] / summary["train_time_s"])
    assert summary["steps_per_s"] == pytest.approx(summary["optimizer_steps"] / summary["train_time_s"])

    expected_best = {"val/loss": min, "train/loss": min, "val/acc": max}
    for name, pick in expected_best.items():
        values = history(engine, name)
        best_step, best = pick(values, key=lambda sv: sv[1])
        metric = summary["metrics"][name]
        assert metric["last"] == values[-1][1] and metric["last_step"] == values[-1][0]
        assert metric["best"] == best and metric["best_step"] == best_step
        assert metric["direction"] == ("min" if pick is min else "max")
        assert table_row(out, name) == [name, f"{values[-1][1]:.6g}", f"{best:.6g}", str(best_step)]
    acc = summary["metrics"]["val/acc"]
    assert acc["best"] != acc["last"]  # 0.9 at the second pass, 0.7 at the last: last and best really differ
    assert acc["best_step"] == 2 * STEPS_PER_EPOCH
    assert summary["metrics"]["lr"] == {
        "last": 0.25,
        "last_step": 3 * STEPS_PER_EPOCH,
        "best": None,
        "best_step": None,
        "direction": None,
    }
    assert table_row(out, "lr") == ["lr", "0.25", "-", ""]
    assert "9 optimizer steps, 3 epochs, 30 samples\n" in out
    assert f"run directory: {engine.run_dir}\n" in out
    assert "model: not saved (engine setting save_model: false)" in out


def summary_times(out: str) -> tuple[float, float, float, float]:
    """The printed training time, samples/s and steps/s beside it, and the wall time."""
    training = re.search(
        r"^ *training time ([\d.]+) s \(validation excluded\): ([\d.]+) samples/s, ([\d.]+) steps/s$", out, re.M
    )
    wall = re.search(
        r"^ *wall time ([\d.]+) s \(the whole fit call: set-up, validation and saving included\)$", out, re.M
    )
    assert training and wall, out
    return (*(float(v) for v in training.groups()), float(wall.group(1)))


class SlowValidation:
    """Makes every validation pass take 0.2 s: the wall time is then far from the training time."""

    name = "test.slow_validation"

    @torchloom.hookimpl
    def on_validation_end(self) -> None:
        time.sleep(0.2)


def test_each_rate_is_printed_beside_the_time_it_is_measured_over(tmp_path, capsys) -> None:
    """Fault: "1152 samples (6295 samples/s), wall time 1.0 s" put a rate over the training time beside the wall
    time, which it does not divide. Now (the HF Trainer's train_runtime / train_samples_per_second) the rates sit
    beside the training time they divide, and the wall time is on a line of its own that says what it includes."""
    _, plugin = fit(tmp_path, None, SlowValidation())
    out = capsys.readouterr().out
    summary = plugin.summary
    train_time, samples_per_s, steps_per_s, wall = summary_times(out)
    assert train_time == pytest.approx(summary["train_time_s"], rel=5e-3)
    assert wall == pytest.approx(summary["wall_time_s"], rel=5e-3)
    assert wall > 0.6 > summary["train_time_s"] * 2  # 3 slow validations: the two times really differ
    # What a reader can check: each printed rate is the printed count over the printed training time.
    assert samples_per_s == pytest.approx(3 * SAMPLES_PER_EPOCH / train_time, rel=1e-2)
    assert steps_per_s == pytest.approx(3 * STEPS_PER_EPOCH / train_time, rel=1e-2)
    assert samples_per_s != pytest.approx(3 * SAMPLES_PER_EPOCH / wall, rel=0.5)  # not over the wall time
    assert "samples/s), wall time" not in out


class ConstantsAndSizes:
    """Logs a result that never changes (``val/majority_rate``), a byte count, and a result logged once."""

    name = "test.constants"

    def __init__(self) -> None:
        self.passes = 0

    @torchloom.hookimpl
    def on_validation_end(self, log) -> None:
        log("val/majority_rate", 0.625)
        log("val/cache_bytes", 1000.0 * (self.passes + 1))  # grows: still a size, not a result
        if self.passes == 0:
            log("val/once_accuracy", 0.75)
        self.passes += 1


def test_no_best_for_a_value_that_never_changed_nor_for_a_byte_count(tmp_path, capsys) -> None:
    """A best says something only for a result that varied: a constant, a value logged once and a size in bytes
    get ``-`` in the table and ``best: null`` in summary.json; a result that changed keeps its best."""
    engine, _ = fit(tmp_path, None, ConstantsAndSizes())
    out = capsys.readouterr().out
    metrics = json.loads((Path(engine.run_dir) / "summary.json").read_text())["metrics"]
    assert metric_direction("val/cache_bytes") is None and metric_direction("optimizer/state_bytes") is None
    for name in ("val/majority_rate", "val/cache_bytes", "val/once_accuracy"):
        assert (metrics[name]["best"], metrics[name]["best_step"]) == (None, None), name
        assert table_row(out, name)[2:] == ["-", ""], name
    assert metrics["val/majority_rate"]["direction"] == "max"  # a result: only its constant value has no best
    assert metrics["val/cache_bytes"]["last"] == 3000.0
    assert metrics["val/loss"]["best"] is not None  # a result that changed


def test_plain_lines_when_stdout_is_not_a_terminal(tmp_path, capsys) -> None:
    engine, _ = fit(tmp_path)
    out = capsys.readouterr().out
    assert ANSI not in out  # no bar, no cursor movement, no colour
    lines = [line for line in out.splitlines() if line.startswith(("epoch ", "validation "))]
    expected = []
    for record in engine.history:  # every on_log in order: training values, then each pass's validation values
        where = f"epoch {record['epoch']}/2  step {record['step']}/9"  # the epoch numbered as in the history
        if "train/loss" in record:
            expected.append(rf"{where}  loss {re.escape(format(record['train/loss'], '.4g'))}  [\d.]+ steps/s  ETA ")
        else:
            expected.append(rf"validation  {where}  val/loss {re.escape(format(record['val/loss'], '.4g'))}$")
    assert len(lines) == len(expected) == 3 * STEPS_PER_EPOCH + 3
    for line, pattern in zip(lines, expected, strict=True):
        assert re.match(pattern, line), (line, pattern)
    assert lines[-2].endswith("ETA 0:00:00")  # the last step: nothing left
    assert out.index("fit summary") > out.index(lines[-1])


@pytest.mark.parametrize(
    ("settings", "validated_at"),
    [
        ({"max_epochs": 2, "log_every_n_steps": 2}, [3, 6]),  # at each epoch's end: step 3 is not a logging step
        ({"max_epochs": 1, "max_steps": 3, "val_check_interval": 3, "log_every_n_steps": 2}, [3]),  # the last step
    ],
)
def test_the_training_line_of_a_step_comes_before_its_validation_line(tmp_path, capsys, settings, validated_at) -> None:
    """A validation at a step that is not a logging step: the training values of the steps since the last logging
    interval are printed first (a line for step N, then the validation at step N), with their own values."""
    engine, _ = fit(tmp_path, None, task=TinyTask(n=10), **settings)  # 3 optimizer steps per epoch
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("epoch ", "validation "))]
    steps = [int(re.search(r"  step (\d+)/", line).group(1)) for line in lines]
    validations = [i for i, line in enumerate(lines) if line.startswith("validation ")]
    assert [steps[i] for i in validations] == validated_at
    for i in validations:  # the line just before: the training line of the same step, with that step's loss
        assert i > 0 and lines[i - 1].startswith("epoch ") and steps[i - 1] == steps[i], lines
        (loss,) = [loss for step, loss in history(engine, "train/loss") if step == steps[i]]
        assert f"  loss {loss:.4g}  " in lines[i - 1]
    assert steps == sorted(steps)  # no training line after a validation of a later or the same step
    records = [(r["step"], "val/loss" in r) for r in engine.history]
    assert records == sorted(records)  # metrics.jsonl / history in the same order: training, then validation


def test_plain_every_n_seconds_holds_lines_back_until_the_next_validation(tmp_path, capsys) -> None:
    engine, _ = fit(tmp_path, {"plain_every_n_seconds": 3600})
    steps = [int(m) for m in re.findall(r"^epoch \d/2  step (\d+)/9  loss", capsys.readouterr().out, re.MULTILINE)]
    # The first line; then each validation line comes after the latest training line that was held back.
    assert steps == [1, 3, 6, 9]
    assert len(history(engine, "train/loss")) == 9


def test_a_validation_that_logs_nothing_does_not_turn_training_lines_into_validation_lines(tmp_path, capsys) -> None:
    class Silent(TinyTask):
        def validation_step(self, batch, batch_idx):
            return None

    _, plugin = fit(tmp_path, None, task=Silent(n=10))
    out = capsys.readouterr().out
    assert not re.search(r"^validation ", out, re.MULTILINE)  # no validation line (the summary says "validation")
    assert len(re.findall(r"^epoch \d/2  step \d/9  loss ", out, re.MULTILINE)) == 9
    assert set(plugin.summary["metrics"]) == {"train/loss"}


def test_a_fit_of_unknown_length_shows_no_total_and_no_eta(tmp_path, capsys) -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(tiny_dataset(8))

    class StreamTask(TinyTask):
        def train_dataloader(self):
            return DataLoader(Stream(), batch_size=4)

    _, plugin = fit(tmp_path, task=StreamTask(validate=False), max_epochs=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")]
    assert [line.split("  loss")[0] for line in lines] == ["epoch 0/0  step 1", "epoch 0/0  step 2"]
    assert not any("ETA" in line for line in lines)
    assert plugin.summary["samples"] == 8 and plugin.summary["optimizer_steps"] == 2


def test_save_model_names_the_model_directory(tmp_path, capsys) -> None:
    engine, plugin = fit(tmp_path, save_model=True, max_epochs=1)
    model_dir = os.path.join(engine.run_dir, "model")
    assert plugin.summary["model_dir"] == model_dir and os.path.isdir(model_dir)
    assert f"model: {model_dir}\n" in capsys.readouterr().out


def test_grad_accum_counts_optimizer_steps_and_every_sample(tmp_path, capsys) -> None:
    _, plugin = fit(tmp_path, None, {"grad_accum": {"steps": 2}}, task=TinyTask(n=12, batch_size=2), max_epochs=2)
    # 6 micro-batches of 2 per epoch, 3 optimizer steps per epoch.
    assert plugin.summary["optimizer_steps"] == 6 and plugin.summary["samples"] == 24
    assert "step 6/6  loss" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ terminal


@pytest.fixture
def a_terminal(monkeypatch):
    """What rich needs to draw in place: a terminal type that is not "dumb", and colours allowed."""
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "160")  # the whole bar on one line
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("TTY_INTERACTIVE", raising=False)


def test_a_terminal_gets_a_live_bar_and_the_table(tmp_path, capsys, a_terminal) -> None:
    stdout = sys.stdout
    engine, plugin = fit(tmp_path, {"terminal": True})
    out = capsys.readouterr().out
    assert sys.stdout is stdout  # the bar gave stdout back
    assert "\x1b[?25l" in out and "\x1b[?25h" in out  # the cursor hidden while the bar is drawn, then shown
    assert "\x1b[2K" in out  # the bar redrawn in place
    final = out[out.rindex("epoch 2/2") : out.index("fit summary")]
    assert re.search(r"9/9.*loss .*steps/s.*ETA", final), final  # the last frame: every step done
    last_loss = [h["train/loss"] for h in engine.history if "train/loss" in h][-1]
    assert f"loss {last_loss:.4g}" in final  # the last training loss logged
    assert not re.search(r"step \d/9  loss", out)  # no plain lines
    assert out.count("validation  epoch") == 3  # printed above the bar
    assert plugin.summary["optimizer_steps"] == 9 and "\x1b[32m" in out  # coloured


def test_no_color_keeps_the_bar_but_drops_colours(tmp_path, capsys, a_terminal, monkeypatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    fit(tmp_path, {"terminal": True}, max_epochs=1)
    out = capsys.readouterr().out
    assert "\x1b[2K" in out and "3/3" in out
    assert not re.search(r"\x1b\[(?:3\d|9\d)(?:;\d+)*m", out)  # no foreground colour codes


def test_a_failed_fit_prints_no_summary_and_gives_stdout_back(tmp_path, capsys, a_terminal) -> None:
    class Failing(TinyTask):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    stdout = sys.stdout
    plugin = ProgressBar(terminal=True)
    engine = torchloom.Engine(plugins=[plugin], log_every_n_steps=1, output_dir=str(tmp_path / "runs"))
    with pytest.raises(RuntimeError, match="boom"):
        engine.fit(Failing(n=10))
    out = capsys.readouterr().out
    assert sys.stdout is stdout
    assert "\x1b[?25h" in out  # the cursor is shown again
    assert "summary" not in out and plugin.summary is None
    assert not (Path(engine.run_dir) / "summary.json").exists()


# ------------------------------------------------------------------------------------ validate, predict


def test_validate_prints_its_values_and_writes_its_own_summary(tmp_path, capsys) -> None:
    plugin = ProgressBar()
    engine = torchloom.Engine(plugins=[plugin], output_dir=str(tmp_path / "runs"))
    metrics = engine.validate(TinyTask(n=10))
    out = capsys.readouterr().out
    assert f"validation  val/loss {metrics['val/loss']:.4g}\n" in out
    assert table_row(out, "val/loss") == ["val/loss", f"{metrics['val/loss']:.6g}"]
    summary = json.loads((Path(engine.run_dir) / "summary.json").read_text())
    assert summary["stage"] == "validate" and summary["run_dir"] == engine.run_dir
    assert summary["metrics"]["val/loss"]["last"] == metrics["val/loss"]


def test_predict_shows_a_counter_in_a_terminal_and_nothing_in_plain_output(tmp_path, capsys, a_terminal) -> None:
    data = DataLoader(tiny_dataset(12).tensors[0], batch_size=4)
    for terminal in (False, True):
        engine = torchloom.Engine(plugins={"progress": {"terminal": terminal}}, output_dir=str(tmp_path / "runs"))
        assert len(engine.predict(TinyTask(), dataloader=data)) == 3
        out = capsys.readouterr().out
        if terminal:
            assert "predict" in out and "batches" in out and "\x1b[?25h" in out
        else:
            assert out == ""
        assert not (Path(engine.run_dir) / "summary.json").exists()


# ----------------------------------------------------------------------------------------------- off


def test_disabled_prints_nothing_and_writes_nothing(tmp_path, capsys) -> None:
    engine, plugin = fit(tmp_path, {"enabled": False}, ScriptedMetrics())
    engine.validate(TinyTask(n=10))
    assert capsys.readouterr().out == ""
    assert plugin.summary is None
    assert not list((tmp_path / "runs").rglob("summary.json"))


# ----------------------------------------------------------------------------------------------- CLI


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command in this process (tests/cli_util.py), its output a pipe as under ``subprocess.run``, whatever the
    terminal the tests run in says."""
    unset: dict[str, str | None] = {variable: None for variable in ("TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR")}
    return cli_util.run_cli(*args, cwd=cwd, env={**unset, **(env or {})})


def write_config(tmp_path: Path, plugins: Any = None) -> None:
    config: dict[str, Any] = {
        "engine": {"max_epochs": 2, "log_every_n_steps": 2, "output_dir": str(tmp_path / "runs")},
        "task": {"class_path": "torchloom.testing.TinyTask", "init_args": {"n": 32}},
    }
    if plugins is not None:
        config["plugins"] = plugins
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))


def test_the_command_enables_it_by_default(tmp_path) -> None:
    write_config(tmp_path, {"grad_clip": {"max_norm": 1.0}})
    proc = run_cli("fit", "--config", "c.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "runs" / "version_0"
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    # After the config's own plugins, with every default filled in, like any other plugin.
    assert list(resolved["plugins"]) == ["grad_clip", "progress"]
    assert resolved["plugins"]["progress"] == {
        "enabled": True,
        "refresh_per_second": 4.0,
        "plain_every_n_seconds": 0.0,
        "terminal": None,
    }
    out = proc.stdout
    assert ANSI not in out  # a pipe: plain lines
    training = re.findall(r"^epoch (\d)/1  step (\d+)/16  loss ", out, re.MULTILINE)
    assert training == [(str((s - 1) // 8), str(s)) for s in range(2, 17, 2)]
    assert len(re.findall(r"^validation  epoch \d/1  step (?:8|16)/16  val/loss ", out, re.MULTILINE)) == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == 16 and summary["samples"] == 64
    assert table_row(out, "val/loss")[1] == f"{summary['metrics']['val/loss']['last']:.6g}"
    lines = out.splitlines()
    # The command's own lines keep their places: the run directory first, the results last.
    assert lines[0] == f"torchloom fit: run directory {run_dir}"
    assert out.index("fit summary") < out.index(f"torchloom fit: output in {run_dir}")
    assert lines[-2:] == [
        f"  train/loss = {summary['metrics']['train/loss']['last']:.6g}",
        f"  val/loss = {summary['metrics']['val/loss']['last']:.6g}",
    ]


def test_a_config_can_turn_it_off(tmp_path) -> None:
    write_config(tmp_path, {"progress": {"enabled": False}})
    proc = run_cli("fit", "--config", "c.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "runs" / "version_0"
    assert proc.stdout.splitlines()[:2] == [
        f"torchloom fit: run directory {run_dir}",
        f"torchloom fit: output in {run_dir}",
    ]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["plugins"]["progress"]["enabled"] is False
    assert not (run_dir / "summary.json").exists()
    proc = run_cli("validate", "--config", "c.yaml", "--plugins.progress.enabled=false", cwd=tmp_path)
    assert proc.returncode == 0 and "summary" not in proc.stdout, proc.stderr


def test_the_command_runs_without_it_when_torchloom_plugins_does_not_allow_it(tmp_path) -> None:
    write_config(tmp_path, {"grad_clip": {}})
    proc = run_cli("fit", "--config", "c.yaml", cwd=tmp_path, env={"TORCHLOOM_PLUGINS": "grad_clip"})
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load((tmp_path / "runs" / "version_0" / "config.yaml").read_text())
    assert list(resolved["plugins"]) == ["grad_clip"]
    assert "summary" not in proc.stdout and "val/loss = " in proc.stdout


@pytest.mark.multiprocess
def test_two_processes_print_once_and_count_the_samples_of_both(tmp_path) -> None:
    write_config(tmp_path)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(SOURCE_PATHS)
    require_multiprocess_marker("torchrun")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*command, "-m", "torchloom.cli", "fit", "--config", "c.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # 32 samples, batch 4 per process, 2 processes: 4 optimizer steps per epoch; each line and the table once.
    assert out.count("fit summary") == 1
    assert re.findall(r"^epoch \d/1  step (\d)/8  loss", out, re.MULTILINE) == ["2", "4", "6", "8"]
    assert out.count("validation  epoch") == 2
    summary = json.loads((tmp_path / "runs" / "version_0" / "summary.json").read_text())
    assert summary["optimizer_steps"] == 8 and summary["samples"] == 2 * 32
    assert math.isfinite(summary["metrics"]["val/loss"]["best"])
