"""The ``checkpoint`` plugin: its schedules (steps, epochs), what it keeps (the last K, the best by a monitored value),
its settings errors, and preemption: SIGTERM saves at the next optimizer step and exits 143, ``--resume`` continues
to the same result as an uninterrupted run, on one process and on two (the flag is agreed over the processes).

The exactness of resume itself (parameters, optimizer, data order, random states) is tested in ``tests/test_resume.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import torchloom
from torchloom.checkpoint import list_checkpoints, read_manifest
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
    (plugin,) = engine.plugins
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
    (plugin,) = engine.plugins
    assert plugin.scores[str(Path(engine.run_dir) / "checkpoints" / best)] == {"max": 0.9, "min": 0.1}[mode]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"every_n_steps": 0}, r"'every_n_steps' = 0; expected an integer >= 1 or null"),
        ({"keep_last": 0}, r"'keep_last' = 0"),
        ({"every_n_steps": None, "every_n_epochs": None, "save_on_interrupt": False}, r"would never save"),
        ({"mode": "best"}, r"'mode' = 'best'; expected one of min, max"),
        ({"keep_best": 0}, r"'keep_best' = 0"),
        ({"monitor": ""}, r"'monitor' = ''"),
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
    assert records(tmp_path / "run" / "version_0") == [r for r in uninterrupted if r["step"] <= 11]
    assert records(tmp_path / "run" / "version_1") == [r for r in uninterrupted if r["step"] > 11]


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    plugin = Checkpoint()

    class Task(TinyTask):
        def training_step(self, batch, batch_idx):
            os.kill(os.getpid(), signal.SIGINT)  # the first asks for a checkpoint at the end of the step ...
            os.kill(os.getpid(), signal.SIGINT)  # ... the second, before that, stops the fit at once
            return super().training_step(batch, batch_idx)

    with pytest.raises(KeyboardInterrupt):
        torchloom.Engine(output_dir=str(tmp_path), plugins=[plugin]).fit(Task())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # teardown put the handler back
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


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
