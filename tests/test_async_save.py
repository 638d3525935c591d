"""The ``checkpoint`` plugin's ``async_save`` (`torchloom.save_checkpoint_async`): the state is copied at the save
step and written by a thread; the checkpoint holds exactly what a synchronous one holds (every file's SHA-256), a
resume from it continues bitwise, at most one save is in flight, the end of a fit (or its failure) waits for it,
a background error is raised on the main thread, a crash mid-write leaves the previous checkpoint the latest, and
``keep_last`` counts only complete checkpoints. The writer is made slow or blocked by wrapping
``torchloom.checkpoint.async_save.write_parts`` (what the thread runs). The 2-process case is
tests/mp/async_save_ddp.py."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file

import torchloom
from torchloom.checkpoint import async_save as _async_save
from torchloom.checkpoint.store import find_checkpoint, list_checkpoints, read_manifest, verify_files
from torchloom_plugins.checkpoint import Checkpoint
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))

from resume_fit import ShuffleTask

# ShuffleTask(n=16): batches of 2, 8 optimizer steps per epoch; AdamW + StepLR, dropout, shuffled data.


def _fit(out: Path, plugins: list[Any], ckpt_path: str | None = None, **settings: Any) -> torchloom.Engine:
    settings = {"max_epochs": 2, "seed": 0, "log_every_n_steps": 3, "default_plugins": False, **settings}
    engine = torchloom.Engine(output_dir=str(out), plugins=plugins, **settings)
    task = ShuffleTask(n=16)
    engine.fit(task, ckpt_path=ckpt_path)
    engine.test_task = task  # type: ignore[attr-defined]
    return engine


def _checkpoints(engine: torchloom.Engine) -> Path:
    return Path(engine.run_dir) / "checkpoints"


def _temporary(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith("."))


def _params(engine: torchloom.Engine) -> list[torch.Tensor]:
    task = engine.test_task  # type: ignore[attr-defined]
    model = task.accelerator.unwrap_model(task.model)
    return [p.detach().clone() for p in model.parameters()]


class Writes:
    """Wraps the thread's ``write_parts``: records each write's interval, optionally sleeps first, waits for an
    event (``gate``) or raises before writing."""

    def __init__(
        self, monkeypatch, sleep: float = 0.0, raise_at: str | None = None, error: BaseException | None = None
    ):
        self.original = _async_save.write_parts
        self.sleep, self.raise_at, self.error = sleep, raise_at, error
        self.gates: dict[str, threading.Event] = {}
        self.intervals: list[tuple[str, float, float]] = []
        self.active = self.most_active = 0
        self._lock = threading.Lock()
        monkeypatch.setattr(_async_save, "write_parts", self)

    def __call__(self, writer: Any) -> None:
        name = writer.tmp.name.split(".tmp-")[0].lstrip(".")
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        began = time.perf_counter()
        try:
            if name in self.gates:
                assert self.gates[name].wait(timeout=60), f"the gate of {name} was never opened"
            time.sleep(self.sleep)
            if name == self.raise_at:
                raise self.error or RuntimeError("the writer failed")
            self.original(writer)
        finally:
            with self._lock:
                self.active -= 1
            self.intervals.append((name, began, time.perf_counter()))


class AtStep:
    """Calls ``actions[step](accelerator)`` at ``on_train_step_end`` of that optimizer step."""

    name = "test.at_step"

    def __init__(self, actions: dict[int, Any]) -> None:
        self.actions = actions

    @torchloom.hookimpl
    def on_train_step_end(self, accelerator: Any, progress: Any) -> None:
        action = self.actions.get(progress.global_step)
        if action is not None:
            action(accelerator)


# ------------------------------------------------------------------------------------------------- content


def test_an_async_checkpoint_is_byte_for_byte_the_sync_one_and_resumes_alike(tmp_path):
    engines = {}
    for mode in ("sync", "async"):
        settings = {"every_n_steps": 3, "every_n_epochs": 1, "keep_last": None, "async_save": mode == "async"}
        engines[mode] = _fit(tmp_path / mode, [Checkpoint(**settings)])
    names = sorted(os.listdir(_checkpoints(engines["sync"])))
    assert names == sorted(os.listdir(_checkpoints(engines["async"])))
    assert len(names) == 7  # steps 3, 6, 8 (epoch end), 9, 12, 15, 16 (epoch end)
    for name in names:
        sync, background = (read_manifest(_checkpoints(engines[m]) / name) for m in ("sync", "async"))
        assert sync["files"] == background["files"], name  # every file, by size and SHA-256
        assert "accelerate/optimizer.bin" in sync["files"] and "engine/lr_scheduler.json" in sync["files"]
        assert {k: v for k, v in sync.items() if k != "training"} == {
            k: v for k, v in background.items() if k != "training"
        }
        verify_files(_checkpoints(engines["async"]) / name, background)
    assert _temporary(_checkpoints(engines["async"])) == []
    resumed = {
        mode: _fit(
            tmp_path / f"resume-{mode}",
            [Checkpoint(every_n_epochs=None, every_n_steps=100)],
            ckpt_path=str(_checkpoints(engines[mode]) / "step-00000009"),
        )
        for mode in ("sync", "async")
    }
    for a, b, c in zip(_params(resumed["sync"]), _params(resumed["async"]), _params(engines["sync"]), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)  # the resumed runs end where the uninterrupted one did


def test_the_state_is_copied_at_the_save_step_and_written_later(tmp_path, monkeypatch):
    """Training goes on while the step-4 save is blocked: what it writes is step 4's state, not the live one."""
    writes = Writes(monkeypatch)
    writes.gates["step-00000004"] = gate = threading.Event()
    seen: dict[str, Any] = {}
    holder: dict[str, Any] = {}

    def state(accelerator: Any) -> dict[str, Any]:
        model = accelerator.unwrap_model(holder["task"].model)
        optimizer = holder["task"].accelerator._optimizers[0].optimizer
        return {
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "exp_avg": [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()],
        }

    def at_4(accelerator: Any) -> None:
        seen[4] = state(accelerator)

    def at_5(accelerator: Any) -> None:
        seen["visible at 5"] = list_checkpoints(holder["run_dir"])
        seen["temporary at 5"] = _temporary(Path(holder["run_dir"]) / "checkpoints")

    def at_6(accelerator: Any) -> None:
        seen[6] = state(accelerator)
        gate.set()  # the write of step 4 starts only now, two optimizer steps later

    class Hold:
        name = "test.hold"

        @torchloom.hookimpl
        def on_fit_start(self, task: Any) -> None:
            holder["task"] = task

        @torchloom.hookimpl
        def on_run_start(self, run_dir: str) -> None:
            holder["run_dir"] = run_dir

    plugins = [
        Checkpoint(every_n_steps=4, every_n_epochs=None, async_save=True),
        AtStep({4: at_4, 5: at_5, 6: at_6}),
        Hold(),
    ]
    engine = _fit(tmp_path, plugins, max_steps=6)
    assert seen["visible at 5"] == [] and len(seen["temporary at 5"]) == 1  # in flight: nothing complete yet
    checkpoint = _checkpoints(engine) / "step-00000004"
    assert read_manifest(checkpoint)["global_step"] == 4
    written = load_file(checkpoint / "accelerate" / "model.safetensors")
    assert written.keys() == seen[4]["weights"].keys()
    for key, value in seen[4]["weights"].items():
        assert torch.equal(written[key], value), key
        assert not torch.equal(written[key], seen[6]["weights"][key]), key  # training did change them
    optimizer = torch.load(checkpoint / "accelerate" / "optimizer.bin", weights_only=True)
    for i, exp_avg in enumerate(seen[4]["exp_avg"]):
        assert torch.equal(optimizer["state"][i]["exp_avg"], exp_avg)
        assert not torch.equal(exp_avg, seen[6]["exp_avg"][i])


def test_copy_state_copies_each_storage_once_so_tied_tensors_stay_tied():
    weight = torch.randn(3, 2)
    state = {"a": weight, "b": weight, "view": weight[1], "other": torch.ones(2), "step": 3, "groups": [{"lr": 0.1}]}
    before = weight.clone()
    copied = _async_save.copy_state(state, {})
    assert copied["a"].untyped_storage().data_ptr() == copied["b"].untyped_storage().data_ptr()
    assert copied["view"].untyped_storage().data_ptr() == copied["a"].untyped_storage().data_ptr()
    assert copied["a"].untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    weight.add_(1.0)  # the live tensor changes; the copy does not
    assert torch.equal(copied["a"], before) and torch.equal(copied["view"], before[1])
    assert copied["step"] == 3 and copied["groups"] == [{"lr": 0.1}] and copied["groups"] is not state["groups"]


# ------------------------------------------------------------------------------------------------ ordering


def test_at_most_one_save_is_in_flight_and_the_next_save_waits_for_it(tmp_path, monkeypatch):
    writes = Writes(monkeypatch, sleep=0.3)  # far longer than the two optimizer steps between saves
    engine = _fit(
        tmp_path, [Checkpoint(every_n_steps=2, every_n_epochs=None, keep_last=None, async_save=True)], max_steps=6
    )
    assert [name for name, _, _ in writes.intervals] == ["step-00000002", "step-00000004", "step-00000006"]
    assert writes.most_active == 1
    for (_, _, ended), (_, began, _) in zip(writes.intervals, writes.intervals[1:]):
        assert began >= ended  # each write starts after the previous one ended
    assert sorted(os.listdir(_checkpoints(engine))) == ["step-00000002", "step-00000004", "step-00000006"]


def test_the_end_of_a_fit_waits_for_the_save_in_flight(tmp_path, monkeypatch):
    Writes(monkeypatch, sleep=0.5)
    engine = _fit(tmp_path, [Checkpoint(every_n_steps=4, every_n_epochs=None, async_save=True)], max_steps=4)
    checkpoint = _checkpoints(engine) / "step-00000004"
    verify_files(checkpoint, read_manifest(checkpoint))  # complete when fit returns
    assert _temporary(_checkpoints(engine)) == []
    assert engine.plugins[0].saved == [str(checkpoint)]


class FailAt(ShuffleTask):
    def __init__(self, at: int) -> None:
        super().__init__(n=16)
        self.at, self.calls = at, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise ValueError("the task failed")
        return super().training_step(batch, batch_idx)


def test_a_failed_fit_waits_for_the_save_in_flight_and_keeps_its_own_error(tmp_path, monkeypatch):
    Writes(monkeypatch, sleep=0.5)
    engine = torchloom.Engine(
        output_dir=str(tmp_path),
        max_epochs=1,
        seed=0,
        default_plugins=False,
        plugins=[Checkpoint(every_n_steps=2, every_n_epochs=None, keep_last=1, async_save=True)],
    )
    with pytest.raises(ValueError, match="the task failed"):
        engine.fit(FailAt(6))
    checkpoint = _checkpoints(engine) / "step-00000004"
    verify_files(checkpoint, read_manifest(checkpoint))  # completed: its state was copied before the failure
    assert sorted(os.listdir(_checkpoints(engine))) == ["step-00000004"]  # and kept as the last one
    assert engine.plugins[0].saved == [str(checkpoint)]


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (RuntimeError("the writer failed"), "RuntimeError: the writer failed"),
        (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    ],
)
def test_a_background_error_is_raised_on_the_main_thread_at_the_next_save(tmp_path, monkeypatch, error, message):
    Writes(monkeypatch, raise_at="step-00000004", error=error)
    steps: list[int] = []
    plugins = [
        Checkpoint(every_n_steps=2, every_n_epochs=None, keep_last=None, async_save=True),
        AtStep({s: (lambda acc, s=s: steps.append(s)) for s in range(1, 9)}),
    ]
    with pytest.raises(torchloom.RunFileError, match=message) as caught:
        _fit(tmp_path, plugins, max_steps=8)
    assert "step-00000004" in str(caught.value) and caught.value.__cause__ is error
    assert threading.current_thread() is threading.main_thread()
    assert max(steps) <= 6  # raised at the step-6 save, not later
    run = next(tmp_path.glob("version_*"))
    assert [Path(p).name for p in list_checkpoints(run)] == ["step-00000002"]
    assert _temporary(run / "checkpoints") == []
    verify_files(run / "checkpoints" / "step-00000002", read_manifest(run / "checkpoints" / "step-00000002"))


def test_a_background_error_of_the_last_save_fails_the_fit(tmp_path, monkeypatch):
    Writes(monkeypatch, raise_at="step-00000004")
    with pytest.raises(torchloom.RunFileError, match="step-00000004"):
        _fit(tmp_path, [Checkpoint(every_n_steps=4, every_n_epochs=None, async_save=True)], max_steps=4)


def test_keep_last_counts_only_complete_checkpoints(tmp_path, monkeypatch):
    writes = Writes(monkeypatch)
    writes.gates["step-00000004"] = gate = threading.Event()
    seen: dict[int, list[str]] = {}
    holder: dict[str, str] = {}

    def at_5(accelerator: Any) -> None:
        seen[5] = [Path(p).name for p in list_checkpoints(holder["run_dir"])]
        gate.set()

    class Hold:
        name = "test.hold"

        @torchloom.hookimpl
        def on_run_start(self, run_dir: str) -> None:
            holder["run_dir"] = run_dir

    checkpoint = Checkpoint(every_n_steps=2, every_n_epochs=None, keep_last=1, async_save=True)
    engine = _fit(tmp_path, [checkpoint, AtStep({5: at_5}), Hold()], max_steps=6)
    assert seen[5] == ["step-00000002"]  # step 4 in flight: step 2 is still the one kept
    assert sorted(os.listdir(_checkpoints(engine))) == ["step-00000006"]
    assert checkpoint.saved == [str(_checkpoints(engine) / "step-00000006")]


# --------------------------------------------------------------------------------------------------- crash

CRASH = """
import os, sys
from pathlib import Path
import torchloom
from torchloom.checkpoint import async_save as _async_save
from torchloom_plugins.checkpoint import Checkpoint
from resume_fit import ShuffleTask

original = _async_save.write_parts

def killed(writer):
    if "step-00000004" not in writer.tmp.name:
        return original(writer)
    (writer.tmp / "accelerate" / "model.safetensors").write_bytes(b"half a file")
    os._exit(9)  # killed mid-write, from the writing thread

_async_save.write_parts = killed
engine = torchloom.Engine(output_dir=sys.argv[1], max_epochs=1, seed=0, default_plugins=False,
                          plugins=[Checkpoint(every_n_steps=2, every_n_epochs=None, async_save=True)])
engine.fit(ShuffleTask(n=16))
"""


def test_a_process_killed_mid_write_leaves_the_previous_checkpoint_the_latest(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(["src", "plugins", str(MP_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CRASH), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 9, done.stderr[-2000:]
    run = tmp_path / "version_0"
    assert [Path(p).name for p in list_checkpoints(run)] == ["step-00000002"]
    assert len(_temporary(run / "checkpoints")) == 1  # the half-written one, under its temporary name
    assert find_checkpoint(tmp_path) == str(run / "checkpoints" / "step-00000002")
    verify_files(run / "checkpoints" / "step-00000002", read_manifest(run / "checkpoints" / "step-00000002"))
    resumed = _fit(
        tmp_path,
        [Checkpoint(every_n_steps=2, every_n_epochs=None, async_save=True)],
        ckpt_path=str(tmp_path),
        max_epochs=1,
    )
    assert resumed.plugins[0].resumed_from == str(run / "checkpoints" / "step-00000002")
    assert _temporary(run / "checkpoints") == []  # the next run in the output_dir removed it
    assert [Path(p).name for p in list_checkpoints(resumed.run_dir)] == ["step-00000006", "step-00000008"]


# ---------------------------------------------------------------------------------------------- limits


def test_async_save_refuses_sharded_runs():
    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        with pytest.raises(torchloom.CheckpointError, match="async_save: false"):
            _async_save.check_supported(SimpleNamespace(distributed_type=kind))
    _async_save.check_supported(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU))
    plugin = Checkpoint(async_save=True)
    with pytest.raises(torchloom.ConfigError, match="async_save"):
        plugin.on_fit_start(
            SimpleNamespace(distributed_type=DistributedType.FSDP, is_main_process=True), None, None, None
        )


# ------------------------------------------------------------------------------------------- 2 processes


@pytest.mark.multiprocess
def test_two_processes_async_checkpoints_equal_sync_ones_and_resume_alike(tmp_path):
    ranks = torchrun("async_save_ddp.py", tmp_path)
    assert ranks[0] == ranks[1]
    result = ranks[0]
    assert result["names"] == ["step-00000003", "step-00000006"]
    assert result["files"]["sync"] == result["files"]["async"]
    assert "engine/process_1/process.json" in result["files"]["async"]["step-00000006"]
    assert result["resumed"]["sync"] == result["resumed"]["async"] == result["uninterrupted"]
