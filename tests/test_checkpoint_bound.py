"""Checkpoints bounded across the runs of one ``output_dir`` (issue 24, item 5): the ``checkpoint`` plugin's
``keep_across_runs``.

After every save at most ``keep_across_runs`` checkpoints stay over all the ``version_N`` of the fit's
``output_dir``, the most recent ones, besides those that must stay: the checkpoint the fit resumed from, the best
by ``monitor``, and every checkpoint of a run that another process is still running. Nothing outside the
``output_dir``'s own run directories is touched. On two processes every process knows what the main process
deleted. A bad value is one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import torchloom
from torchloom.checkpoint.store import list_checkpoints
from torchloom.testing import TinyTask
from torchrun_util import MP_DIR, torchrun

ROOT = Path(__file__).resolve().parents[1]


class AfterEachSave:
    """Calls ``check(progress)`` after the checkpoint plugin's saves (listed before it, it runs after it: ``*_end``
    hooks run in reverse order)."""

    name = "test.after_each_save"

    def __init__(self, check: Any) -> None:
        self.check, self.calls = check, 0

    @torchloom.hookimpl
    def on_train_step_end(self, progress: Any) -> None:
        self.calls += 1
        self.check(progress)

    @torchloom.hookimpl
    def on_train_epoch_end(self, progress: Any) -> None:
        self.calls += 1
        self.check(progress)


def _fit(output_dir: Path, task: Any = None, plugins: tuple[Any, ...] = (), ckpt_path: Any = None, **checkpoint: Any):
    """A fit of ``task`` (TinyTask: 8 steps per epoch, 2 epochs) saving every 4 steps and every epoch."""
    settings = {"every_n_steps": 4, "keep_last": 2, **checkpoint}
    engine = torchloom.Engine(
        plugins=[*plugins, {"checkpoint": settings}],
        default_plugins=False,
        output_dir=str(output_dir),
        max_epochs=2,
        num_sanity_val_steps=0,
    )
    engine.fit(task or TinyTask(), ckpt_path=ckpt_path)
    return engine


def _names(output_dir: Path) -> list[str]:
    return [str(Path(p).relative_to(output_dir)) for p in list_checkpoints(output_dir)]


def test_keep_across_runs_bounds_the_checkpoints_over_the_runs_of_an_output_dir(tmp_path) -> None:
    # Each fit saves at 4, 8, 8-epoch-end, 12, 16, 16-epoch-end; keep_last: 2 keeps its own last two.
    most = []
    bound = AfterEachSave(lambda progress: most.append(len(list_checkpoints(tmp_path))))
    for _ in range(3):
        _fit(tmp_path, plugins=(bound,), keep_across_runs=3)
    assert _names(tmp_path) == [
        "version_1/checkpoints/step-00000016-epoch-end",
        "version_2/checkpoints/step-00000016",
        "version_2/checkpoints/step-00000016-epoch-end",
    ]
    assert bound.calls == 3 * 18 and max(most) == 3  # never more than 3, at any save of any run


def test_without_keep_across_runs_each_run_keeps_its_own(tmp_path) -> None:
    for _ in range(3):
        _fit(tmp_path)
    assert len(list_checkpoints(tmp_path)) == 6  # 2 per run: the plugin's default bounds nothing across runs


def test_the_checkpoint_a_fit_resumes_from_is_never_deleted_while_it_runs(tmp_path) -> None:
    first = _fit(tmp_path, keep_last=None)
    oldest = str(Path(first.run_dir) / "checkpoints" / "step-00000004")
    present = []
    resumed = _fit(
        tmp_path,
        plugins=(AfterEachSave(lambda progress: present.append(os.path.isdir(oldest))),),
        ckpt_path=oldest,
        keep_across_runs=1,
    )
    assert present and all(present)  # at every save of the resumed fit
    run = Path(resumed.run_dir).name
    assert _names(tmp_path) == ["version_0/checkpoints/step-00000004", f"{run}/checkpoints/step-00000016-epoch-end"]
    _fit(tmp_path, keep_across_runs=1)  # a later fit that does not resume from it: it goes then
    assert _names(tmp_path) == ["version_2/checkpoints/step-00000016-epoch-end"]


class ScriptedValidation(TinyTask):
    """Logs a scripted ``val/score`` per validation pass (one per epoch)."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = iter(scores)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.log("val/score", next(self.scores))


@pytest.mark.parametrize(("mode", "scores"), [("min", ([0.1, 0.9], [0.5, 0.7])), ("max", ([0.9, 0.1], [0.5, 0.3]))])
def test_the_best_checkpoint_is_kept_across_runs(tmp_path, mode, scores) -> None:
    """Run 0's epoch 0 scored best; run 1 scores worse. With keep_across_runs: 1, run 0's best (by the value its
    manifest recorded) stays, and so does run 1's own best (the one its plugin keeps), next to the newest."""
    settings = {"every_n_steps": None, "keep_last": 1, "monitor": "val/score", "mode": mode}
    _fit(tmp_path, ScriptedValidation(scores[0]), **settings)
    assert _names(tmp_path) == [
        "version_0/checkpoints/step-00000008-epoch-end",
        "version_0/checkpoints/step-00000016-epoch-end",
    ]
    _fit(tmp_path, ScriptedValidation(scores[1]), keep_across_runs=1, **settings)
    assert _names(tmp_path) == [
        "version_0/checkpoints/step-00000008-epoch-end",  # the best of the output_dir
        "version_1/checkpoints/step-00000008-epoch-end",  # the best of this fit
        "version_1/checkpoints/step-00000016-epoch-end",  # the newest
    ]
    _fit(tmp_path, ScriptedValidation(scores[1]), keep_across_runs=1, **settings)
    assert _names(tmp_path)[0] == "version_0/checkpoints/step-00000008-epoch-end"
    assert "version_1/checkpoints/step-00000016-epoch-end" not in _names(tmp_path)


def test_other_output_dirs_are_never_touched(tmp_path) -> None:
    """``runs/a`` is bounded; ``runs/ab`` (a name that starts like it), ``runs/b`` (which ``runs/a`` resumes from)
    and a run directory of ``runs/b`` linked into ``runs/a`` keep every checkpoint."""
    runs = tmp_path / "runs"
    _fit(runs / "ab")
    b = _fit(runs / "b")
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "version_7").symlink_to(b.run_dir)
    others = {d: sorted(list_checkpoints(runs / d)) for d in ("ab", "b")}
    assert [len(v) for v in others.values()] == [2, 2]
    resumed = _fit(runs / "a", ckpt_path=list_checkpoints(runs / "b")[0], keep_across_runs=1)
    _fit(runs / "a", keep_across_runs=1)
    assert {d: sorted(list_checkpoints(runs / d)) for d in ("ab", "b")} == others
    assert not list_checkpoints(resumed.run_dir)  # a's own older run was bounded
    assert len(list_checkpoints(runs / "a" / "version_9")) == 1


def test_a_run_that_another_process_still_runs_keeps_its_checkpoints(tmp_path) -> None:
    """A child fit saves at step 2, then pauses inside the save of step 4: its run is still running. A fit with
    keep_across_runs: 1 in the same output_dir deletes none of its checkpoints; once the child is gone, the next
    one does."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(MP_DIR), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, str(MP_DIR / "resume_fit.py"), str(tmp_path), "pause_save"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    output_dir, kept = tmp_path / "run", "version_0/checkpoints/step-00000002"
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "paused").exists():
            assert child.poll() is None, child.stdout.read().decode() if child.stdout else ""
            assert time.monotonic() < deadline, "the child never reached the save of step 4"
            time.sleep(0.05)
        assert (output_dir / "version_0" / f".in-use.tmp-{child.pid}").is_file()  # marked while its fit runs
        _fit(output_dir, keep_across_runs=1)
        assert _names(output_dir) == [kept, "version_1/checkpoints/step-00000016-epoch-end"]
        assert (output_dir / "version_0" / "checkpoints" / f".step-00000004.tmp-{child.pid}").is_dir()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    last = _fit(output_dir, keep_across_runs=1)
    assert _names(output_dir) == [f"{Path(last.run_dir).name}/checkpoints/step-00000016-epoch-end"]
    assert not [p for p in output_dir.rglob(".*") if p.name.startswith(".in-use")]  # every mark gone


def test_a_fit_marks_its_run_directory_in_use_while_it_runs(tmp_path) -> None:
    seen = []
    engine = _fit(
        tmp_path,
        plugins=(AfterEachSave(lambda progress: seen.append(sorted(os.listdir(tmp_path / "version_0")))),),
    )
    assert all(f".in-use.tmp-{os.getpid()}" in names for names in seen)
    assert not [name for name in os.listdir(engine.run_dir) if name.startswith(".")]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "plugin 'checkpoint': setting 'keep_across_runs' = 0; expected an integer >= 1 or null"),
        (-2, "plugin 'checkpoint': setting 'keep_across_runs' = -2; expected an integer >= 1 or null"),
        ("two", "plugin 'checkpoint': setting 'keep_across_runs' = 'two' (str); expected int | None"),
        (True, "plugin 'checkpoint': setting 'keep_across_runs' = True (bool); expected int | None"),
    ],
)
def test_a_bad_keep_across_runs_is_one_line(value, message) -> None:
    with pytest.raises(torchloom.ConfigError) as info:
        torchloom.Engine(plugins={"checkpoint": {"keep_across_runs": value}})
    assert str(info.value) == message


def test_the_examples_that_save_checkpoints_bound_them() -> None:
    for config in sorted((ROOT / "examples").glob("*.yaml")):
        plugins = yaml.safe_load(config.read_text()).get("plugins") or {}
        if "checkpoint" in plugins:
            assert (plugins["checkpoint"] or {}).get("keep_across_runs") is not None, config.name


@pytest.mark.multiprocess
def test_two_processes_agree_on_what_the_main_process_deleted(tmp_path) -> None:
    ranks = torchrun("checkpoint_bound.py", tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1]
    first, resumed = ranks[0]["first"], ranks[0]["resumed"]
    assert ranks[0]["saved"] == ranks[1]["saved"] == [f"{resumed}/checkpoints/step-00000008-epoch-end"]  # not step-8
    assert ranks[0]["listed"] == [
        f"{first}/checkpoints/step-00000002",
        f"{resumed}/checkpoints/step-00000008-epoch-end",
    ]
    assert json.dumps(ranks[0]["listed"]) == json.dumps(ranks[1]["listed"])
