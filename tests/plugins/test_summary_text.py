"""The text of the progress plugin's end-of-run summary (torchloom_plugins._summary_text): each line exactly, as a
user reads it under the table, and summary.json written strictly and atomically."""

from __future__ import annotations

import json
import math

import pytest

import torchloom
from torchloom_plugins import _summary_text as text


def _fit(**changes):
    summary = {
        "stage": "fit",
        "epochs": 2,
        "resumed_from": None,
        "runs": 1,
        **text.counts(steps=40, samples=640, train_time=3.2, wall_time=5.25),
        "parameters": {"total": 134_515_008, "trainable": 921_600, "bytes": 538_060_032},
        "optimizer_state_bytes": 7_372_800,
        "run_dir": "runs/demo/run-1",
        "model_dir": "runs/demo/run-1/model",
    }
    return {**summary, **changes}


def test_counts_give_the_rates_over_the_training_time_and_none_where_they_are_undefined() -> None:
    assert text.counts(40, 640, 3.2, 5.25) == {
        "optimizer_steps": 40,
        "samples": 640,
        "train_time_s": 3.2,
        "samples_per_s": 200.0,
        "steps_per_s": 12.5,
        "wall_time_s": 5.25,
    }
    assert text.counts(40, None, 3.2, 5.25)["samples_per_s"] is None  # batches without a size
    zero = text.counts(0, 0, 0.0, 0.1)  # nothing trained (a resume at the end): no division by zero
    assert (zero["samples_per_s"], zero["steps_per_s"]) == (None, None)


def test_a_fit_prints_what_it_trained_the_rates_beside_their_time_the_sizes_and_where_things_are() -> None:
    assert text.info_lines(_fit()) == [
        "40 optimizer steps, 2 epochs, 640 samples",
        "training time 3.2 s (validation excluded): 200 samples/s, 12.5 steps/s",
        "wall time 5.25 s (the whole fit call: set-up, validation and saving included)",
        "parameters 134,515,008 (921,600 trainable, 0.685 %), 513 MiB; optimizer state 7.03 MiB",
        "run directory: runs/demo/run-1",
        "model: runs/demo/run-1/model",
    ]


def test_one_epoch_no_sizes_and_no_saved_model_read_so() -> None:
    lines = text.info_lines(_fit(epochs=1, parameters=None, model_dir=None, samples=None, samples_per_s=None))
    assert lines == [
        "40 optimizer steps, 1 epoch",
        "training time 3.2 s (validation excluded): 12.5 steps/s",
        "wall time 5.25 s (the whole fit call: set-up, validation and saving included)",
        "run directory: runs/demo/run-1",
        "model: not saved (engine setting save_model: false)",
    ]


def test_a_fit_that_trained_nothing_prints_no_rates() -> None:
    lines = text.info_lines(_fit(**text.counts(steps=0, samples=None, train_time=0.0, wall_time=0.1)))
    assert lines[:3] == [
        "0 optimizer steps, 2 epochs",
        "training time 0 s (validation excluded)",
        "wall time 0.1 s (the whole fit call: set-up, validation and saving included)",
    ]


def test_a_resumed_fit_prints_the_whole_training_then_its_own_part() -> None:
    own = text.counts(steps=10, samples=160, train_time=0.8, wall_time=2.5)
    lines = text.info_lines(_fit(resumed_from="runs/demo/run-1/checkpoints/step-30", runs=2, this_run=own))
    assert lines[:7] == [
        "whole training (2 runs): 40 optimizer steps, 2 epochs, 640 samples",
        "  training time 3.2 s (validation excluded): 200 samples/s, 12.5 steps/s",
        "  wall time 5.25 s (the fit calls: set-up, validation and saving included)",
        "this run: 10 optimizer steps, 160 samples",
        "  training time 0.8 s (validation excluded): 200 samples/s, 12.5 steps/s",
        "  wall time 2.5 s (this fit call: set-up, validation and saving included)",
        "resumed from runs/demo/run-1/checkpoints/step-30",
    ]


def test_a_validate_call_prints_its_wall_time_and_run_directory_only() -> None:
    assert text.info_lines({"stage": "validate", "wall_time_s": 0.41237, "run_dir": "runs/v"}) == [
        "wall time 0.412 s (the whole validate call, set-up included)",
        "run directory: runs/v",
    ]


@pytest.mark.parametrize(
    ("trainable", "share"),
    [
        (921_600, " (921,600 trainable, 0.685 %)"),
        (1, " (1 trainable, 7.43e-07 %)"),
        (134_515_008, " (134,515,008 trainable)"),
        (0, " (0 trainable)"),
    ],
)
def test_the_trainable_share_is_shown_only_for_a_part(trainable: int, share: str) -> None:
    parameters = {"total": 134_515_008, "trainable": trainable, "bytes": 1024}
    line = text.info_lines(_fit(parameters=parameters))[3]
    assert line == f"parameters 134,515,008{share}, 1 KiB; optimizer state 7.03 MiB"


def test_the_fast_dev_run_line_says_what_ran_and_that_nothing_was_saved() -> None:
    summary = {
        "optimizer_steps": 1,
        "metrics": {"val/loss": {"last": 0.693147}, "train/loss": {"last": 0.70001}},
        "wall_time_s": 12.345,
        "run_dir": "runs/r",
    }
    assert text.fast_dev_run_line(summary, 1) == (
        "fast_dev_run passed (1 batch): 1 optimizer step, train/loss 0.7, val/loss 0.6931; wall time 12.3 s; "
        "nothing saved; run directory: runs/r"
    )
    assert text.fast_dev_run_line({**summary, "optimizer_steps": 2, "metrics": {}}, 3) == (
        "fast_dev_run passed (3 batches): 2 optimizer steps; wall time 12.3 s; nothing saved; run directory: runs/r"
    )


def test_the_number_formats() -> None:
    assert (text.epoch_label(0, 2), text.epoch_label(3, None), text.epoch_label(0, 1)) == (
        "epoch 0/1",
        "epoch 3",
        "epoch 0/0",
    )
    assert (text.short(1.234567), text.short(0.000123456), text.short(12345.6)) == ("1.235", "0.0001235", "1.235e+04")
    assert (text.seconds(9.996), text.seconds(10.0), text.seconds(10.04), text.seconds(103.24)) == (
        "10",
        "10.0",
        "10.0",
        "103.2",
    )
    assert (text.rate(99.94), text.rate(100.0), text.rate(1234.5), text.rate(0.01234)) == (
        "99.9",
        "100",
        "1234",
        "0.0123",
    )


def test_summary_json_is_strict_json_written_whole(tmp_path) -> None:
    path = tmp_path / "summary.json"
    text.write_json(str(path), {"best": math.nan, "rate": math.inf, "steps": 3})
    assert path.read_text(encoding="utf-8").endswith("}\n")
    assert '\n  "steps": 3' in path.read_text(encoding="utf-8")  # one name a line, for people reading the run
    assert json.loads(path.read_text(encoding="utf-8")) == {"best": "NaN", "rate": "Infinity", "steps": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left
    with pytest.raises(torchloom.RunFileError, match=r"cannot write '.*missing/summary.json': No such file"):
        text.write_json(str(tmp_path / "missing" / "summary.json"), {})
