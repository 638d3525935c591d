"""``torchloom tune-lr``: the sweep's rates, smoothing and rule by hand; on a regression whose stable range is
derived by hand the suggestion lies in it (also with accumulation, clipping and bf16, and on 2 processes); the run
is a throw-away one (nothing in the user's runs, no checkpoint), it stops on divergence, and bad options are one
error."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest

from cli_util import run_cli
from torchloom.cli.tune_lr import RULE, rates, smooth, suggest
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))

from lr_tasks import GOOD_RANGE

SWEEP = ["--min_lr", "1e-4", "--max_lr", "10", "--num_steps", "100"]


def test_the_rates_are_geometric_from_min_to_max():
    lrs = rates(1e-4, 1.0, 5)
    assert lrs == pytest.approx([1e-4, 1e-3, 1e-2, 1e-1, 1.0])
    assert rates(0.1, 1.0, 1) == [0.1]


def test_the_smoothing_is_the_bias_corrected_moving_average():
    assert smooth([3.0, 3.0, 3.0], 0.98) == pytest.approx([3.0, 3.0, 3.0])  # no pull towards 0 at the start
    assert smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, (0.25 + 1.5) / 0.75])


def test_the_rule_is_the_steepest_descent_of_the_smoothed_curve_without_the_first_10_and_the_last():
    lrs = rates(1e-4, 1.0, 40)
    curve = [2.0 - math.tanh(i - 25) for i in range(40)]  # falls fastest at point 25 ...
    curve[3] -= 5.0  # ... but for a drop in the first 10 points, left out
    assert suggest(lrs, curve) == lrs[25]
    assert suggest(lrs[:12], curve[:12]) is None  # too few points
    assert "steepest descent" in RULE


def _config(tmp_path: Path, plugins: str = "") -> None:
    (tmp_path / "lr.yaml").write_text(
        "engine:\n  output_dir: runs\ntask:\n  class_path: lr_tasks.ScalarRegression\n" + plugins
    )


def _tune(tmp_path: Path, *args: str):
    return run_cli("tune-lr", "--config", "lr.yaml", *SWEEP, *args, cwd=tmp_path, env={"PYTHONPATH": str(MP_DIR)})


@pytest.mark.parametrize(
    "plugins",
    [
        "",
        "plugins:\n  grad_accum: {steps: 2}\n  mixed_precision: {dtype: bf16}\n  grad_clip: {max_norm: 10.0}\n"
        "  checkpoint: {every_n_steps: 5}\n",
    ],
    ids=["plain", "accumulation-bf16-clipping-checkpoint"],
)
def test_the_suggestion_lies_in_the_range_derived_by_hand_and_the_run_is_thrown_away(tmp_path, plugins):
    _config(tmp_path, plugins)
    proc = _tune(tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "runs" / "tune-lr" / "version_0"
    summary = json.loads((run / "lr_find.json").read_text())
    assert GOOD_RANGE[0] <= summary["suggestion"] < GOOD_RANGE[1]
    assert summary["rule"] == RULE
    assert f"suggested learning rate {summary['suggestion']:.3g} ({RULE})" in proc.stdout
    rows = list(csv.DictReader((run / "lr_find.csv").open()))
    assert [float(r["lr"]) for r in rows] == pytest.approx(rates(1e-4, 10.0, 100)[: len(rows)])
    assert len(rows) == summary["steps_done"] < 100  # lr > 1 diverges: the sweep stopped on it
    assert float(rows[-1]["smoothed"]) > 4 * min(float(r["smoothed"]) for r in rows)
    assert float(rows[0]["loss"]) == pytest.approx(4.0, rel=0.1)  # the first step ran at 1e-4 (w still near 0)
    # A throw-away run: nothing in the output_dir's own runs, no checkpoint, no model.
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["tune-lr"]
    assert not (run / "checkpoints").exists() and not (run / "model").exists()
    if importlib_util_find("matplotlib"):
        assert (run / "lr_find.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert "matplotlib is not installed, so no lr_find.png" in proc.stdout


def importlib_util_find(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min_lr", "1", "--max_lr", "0.1"], "expected 0 < min_lr < max_lr"),
        (["--num_steps", "5"], "--num_steps 5; expected at least 13"),
    ],
)
def test_bad_options_are_one_error(tmp_path, args, message):
    _config(tmp_path)
    proc = _tune(tmp_path, *args)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_agree_and_suggest_in_the_range(tmp_path):
    ranks = torchrun("tune_lr_fit.py", tmp_path)
    assert [r["status"] for r in ranks] == [0, 0]
    summary = ranks[0]["summary"]
    assert GOOD_RANGE[0] <= summary["suggestion"] < GOOD_RANGE[1]
    assert summary["steps_done"] < 60  # stopped on divergence, on both processes at the same step (no hang)
