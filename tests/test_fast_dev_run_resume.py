"""``fast_dev_run`` with a resume (issue 39, item 6), and a fast_dev_run that trains nothing.

A fast_dev_run trains its N batches from the start of one epoch and saves nothing; resuming a training past that
point ran zero steps and printed "fast_dev_run passed". Now ``fast_dev_run`` with a checkpoint to resume from
(``ckpt_path=PATH``, ``--resume PATH``, ``--resume`` alone, or ``"auto"`` / ``--resume auto`` over an output_dir that
has checkpoints) is a `ConfigError` before anything runs; ``"auto"`` over an output_dir without checkpoints is a
fresh fast_dev_run. And whatever the reason, a fast_dev_run that made no optimizer step never says it passed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import torchloom
from cli_util import run_cli
from torchloom.errors import ConfigError
from torchloom.testing import TinyTask
from torchloom_plugins import _summary_text as text

PLUGINS = [{"checkpoint": {"every_n_steps": 4, "every_n_epochs": None}}]


def _train(out: Path) -> Path:
    torchloom.Engine(output_dir=str(out), plugins=PLUGINS, default_plugins=False, max_epochs=1).fit(TinyTask())
    return sorted((out / "version_0" / "checkpoints").iterdir())[-1]


@pytest.mark.parametrize("named", ["checkpoint", "output_dir", "auto"])
def test_fast_dev_run_with_a_checkpoint_to_resume_from_is_a_config_error(tmp_path, named):
    out = tmp_path / "out"
    checkpoint = _train(out)
    ckpt_path = {"checkpoint": str(checkpoint), "output_dir": str(out), "auto": "auto"}[named]
    engine = torchloom.Engine(output_dir=str(out), plugins=PLUGINS, default_plugins=False, fast_dev_run=True)
    with pytest.raises(ConfigError) as caught:
        engine.fit(TinyTask(), ckpt_path=ckpt_path)
    shown = str(out) if named == "auto" else ckpt_path
    assert str(caught.value) == (
        f"fit: fast_dev_run = True cannot be combined with a resume (ckpt_path {shown!r}, --resume): a fast_dev_run "
        "trains its batches from the start of one epoch and saves nothing, so it would continue none of the "
        "training; expected fast_dev_run false to resume, or no ckpt_path (no --resume) to check the run from "
        "scratch with fast_dev_run"
    )
    assert not (out / "version_1").exists() and engine.resumed_from is None


def test_fast_dev_run_with_auto_over_an_output_dir_without_checkpoints_is_a_fresh_check(tmp_path, capsys):
    engine = torchloom.Engine(output_dir=str(tmp_path / "out"), plugins=PLUGINS, fast_dev_run=2)
    engine.fit(TinyTask(), ckpt_path="auto")
    assert engine.resumed_from is None and engine.progress.global_step == 2
    assert not (tmp_path / "out" / "version_0" / "checkpoints").exists()  # a fast_dev_run saves nothing
    assert capsys.readouterr().out.splitlines()[-1].startswith("fast_dev_run passed (2 batches): 2 optimizer steps")


def _project(tmp_path: Path) -> Path:
    config = {
        "engine": {"max_epochs": 1, "output_dir": str(tmp_path / "out")},
        "task": {"class_path": "torchloom.testing.TinyTask"},
        "plugins": {"checkpoint": {"every_n_steps": 4, "every_n_epochs": None}},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "out"


def test_the_cli_fast_dev_run_with_resume_auto_checks_from_scratch_then_refuses_once_there_are_checkpoints(tmp_path):
    out = _project(tmp_path)
    quick = run_cli("fit", "--config", "config.yaml", "--engine.fast_dev_run=true", "--resume", "auto", cwd=tmp_path)
    assert quick.returncode == 0, quick.stderr
    assert "fast_dev_run passed (1 batch): 1 optimizer step" in quick.stdout
    assert run_cli("fit", "--config", "config.yaml", cwd=tmp_path).returncode == 0  # version_1: checkpoints
    checkpoint = sorted((out / "version_1" / "checkpoints").iterdir())[-1]
    for resume in (["--resume", "auto"], ["--resume", str(checkpoint)], ["--resume"]):
        proc = run_cli("fit", "--config", "config.yaml", "--engine.fast_dev_run=true", *resume, cwd=tmp_path)
        assert proc.returncode != 0, resume
        assert "fast_dev_run = True cannot be combined with a resume" in proc.stderr, resume
        assert "fast_dev_run passed" not in proc.stdout
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("version_")) == ["version_0", "version_1"]


def test_a_fast_dev_run_that_made_no_optimizer_step_never_says_it_passed() -> None:
    summary = {"optimizer_steps": 0, "metrics": {}, "wall_time_s": 1.0, "run_dir": "runs/r"}
    assert text.fast_dev_run_line(summary, 2) == (
        "fast_dev_run did NOT pass: it trained 0 optimizer steps of the 2 batches it was to train, so nothing was "
        "checked; wall time 1 s; nothing saved; run directory: runs/r"
    )
    # This run's own steps count, not those of the runs a resumed fit continues
    resumed = {**summary, "optimizer_steps": 8, "this_run": {"optimizer_steps": 0}}
    assert text.fast_dev_run_line(resumed, 1).startswith("fast_dev_run did NOT pass: it trained 0 optimizer steps")
    assert text.fast_dev_run_line({**resumed, "this_run": {"optimizer_steps": 1}}, 1).startswith(
        "fast_dev_run passed (1 batch): 8 optimizer steps"
    )
