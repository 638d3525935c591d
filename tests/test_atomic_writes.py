"""Writes that fail or are killed half-way (issue 21, items 10 and 13): nothing written is lost or left behind.

Real failures, not mocks: ``RLIMIT_FSIZE`` makes the kernel refuse to grow a file past a size (``EFBIG``, "File
too large"), and each of the three writers of a checkpoint reports that its own way: Python's ``open`` an
`OSError`, safetensors a ``SafetensorError``, ``torch.save`` a `RuntimeError`. Processes are killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import torchloom
from torchloom.checkpoint.store import list_checkpoints
from torchloom.rundir import atomic as _atomic
from torchloom.rundir import liveness as _liveness
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))

from file_limits import file_size_limit
from resume_fit import ShuffleTask, fit


class SaveUnderLimit:
    """Saves a checkpoint at step 2 as usual, then at step 4 with files limited to ``limit`` bytes."""

    name = "test.save_under_limit"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.error: BaseException | None = None

    @torchloom.hookimpl
    def on_train_step_end(self, progress: Any) -> None:
        if progress.global_step == 2:
            torchloom.save_checkpoint()
        elif progress.global_step == 4:
            with file_size_limit(self.limit):
                try:
                    torchloom.save_checkpoint()
                except BaseException as exc:
                    self.error = exc
            raise RuntimeError("stop here")


# Linear(2, 2048) -> Linear(2048, 1): 8,193 float32 weights, model.safetensors about 33 kB, AdamW's
# optimizer.bin about 66 kB, each process's random states about 8 kB.
@pytest.mark.parametrize(
    ("limit", "writer"),
    [(20_000, "safetensors (model.safetensors)"), (50_000, "torch.save (optimizer.bin)"), (1_000, "open (JSON)")],
    ids=["safetensors", "torch_save", "open"],
)
def test_a_full_disk_during_a_checkpoint_is_one_error_and_leaves_nothing(tmp_path, limit, writer) -> None:
    probe = SaveUnderLimit(limit)
    with pytest.raises(RuntimeError, match="stop here"):
        torchloom.Engine(plugins=[probe], output_dir=str(tmp_path), max_epochs=1).fit(ShuffleTask(hidden=2048))
    error = probe.error
    assert isinstance(error, torchloom.RunFileError), f"{writer}: {type(error).__name__}: {error}"
    message = str(error)
    assert "\n" not in message
    assert message.startswith(f"cannot write checkpoint '{tmp_path}/version_0/checkpoints/step-00000004': ")
    assert message.endswith(" bytes free on that file system)")
    if writer.startswith("torch.save"):  # torch names no OS error: "[enforce fail ...] unexpected pos N vs M"
        assert "torch.save failed ([enforce fail at inline_container.cc" in message
    else:
        assert "File too large" in message
    checkpoints = tmp_path / "version_0" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002"]  # no temporary directory left
    assert list_checkpoints(tmp_path) == [str(checkpoints / "step-00000002")]
    c = fit(lambda: ShuffleTask(hidden=2048), tmp_path, ckpt_path=str(checkpoints / "step-00000002"), max_epochs=1)
    assert c.engine.progress.global_step == 5  # the previous checkpoint still loads


@pytest.mark.multiprocess
def test_a_write_that_fails_on_one_process_fails_on_every_process(tmp_path) -> None:
    """Only rank 1's files are limited: both ranks raise the same RunFileError (none waits for the other
    forever), and the temporary directory is removed."""
    ranks = torchrun("write_failure.py", tmp_path, nproc=2, timeout=180)
    for rank in ranks:
        assert rank["error"] == "RunFileError"
        # Accelerate's save_state torch.saves rank 1's random states first: that write is refused
        assert "checkpoints/step-00000002': process 1: torch.save failed" in rank["message"]
    assert ranks[0]["message"] == ranks[1]["message"]
    assert ranks[0]["left"] == []  # no temporary directory


# ------------------------------------------------------------------------------------------ manifests


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return Path(fit(ShuffleTask, tmp_path_factory.mktemp("saved"), save_at=[7]).checkpoint)


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def _resume(ckpt: Path, tmp_path: Path) -> Any:
    return fit(ShuffleTask, tmp_path / "resumed", ckpt_path=str(ckpt))


def _files(ckpt: Path) -> list[str]:
    return sorted(json.loads((ckpt / "manifest.json").read_text())["files"])


FILES = [
    "accelerate/model.safetensors",
    "accelerate/optimizer.bin",
    "engine/engine.json",
    "engine/engine.safetensors",
    "engine/lr_scheduler.json",
    "engine/lr_scheduler.safetensors",
    "engine/process_0/process.json",
    "engine/process_0/process.safetensors",
]


def test_these_are_all_the_files_of_the_checkpoint(saved) -> None:
    assert _files(saved) == FILES  # so the test below drops each of them


@pytest.mark.parametrize("name", FILES)
def test_a_manifest_edited_to_drop_a_file_is_an_incomplete_checkpoint(ckpt, tmp_path, name) -> None:
    (ckpt / name).unlink()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"][name]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(torchloom.CheckpointError) as info:
        _resume(ckpt, tmp_path)
    message = str(info.value)
    assert "\n" not in message
    if name == "engine/lr_scheduler.json":  # the file that says a scheduler was saved
        assert message.endswith("this run has a learning-rate scheduler and the checkpoint holds none")
    else:
        assert f"checkpoint '{ckpt}' is incomplete: it lacks {name}, which this run loads" in message


# ------------------------------------------------------------------------------------------- links


def test_a_checkpoint_of_links_resumes(ckpt, tmp_path) -> None:
    """``cp -rs``: every file a link to the original; and a folder that is itself a link."""
    linked = tmp_path / "linked"
    for path in ckpt.rglob("*"):
        target = linked / path.relative_to(ckpt)
        if path.is_dir():
            target.mkdir(parents=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)
    assert _resume(linked, tmp_path / "a").engine.progress.global_step == 15
    folder = tmp_path / "folder_link"
    shutil.copytree(ckpt, folder, ignore=shutil.ignore_patterns("accelerate"))
    (folder / "accelerate").symlink_to(ckpt / "accelerate", target_is_directory=True)
    assert _resume(folder, tmp_path / "b").engine.progress.global_step == 15


def test_a_planted_file_inside_a_linked_folder_is_refused(ckpt, tmp_path) -> None:
    outside = tmp_path / "outside"
    shutil.move(ckpt / "accelerate", outside)
    (ckpt / "accelerate").symlink_to(outside, target_is_directory=True)
    (outside / "custom_checkpoint_0.pkl").write_bytes(b"planted")
    with pytest.raises(torchloom.CheckpointError, match=r"does not list: accelerate/custom_checkpoint_0\.pkl"):
        _resume(ckpt, tmp_path)


def test_a_link_to_nothing_is_named_as_such(ckpt, tmp_path) -> None:
    (ckpt / "accelerate" / "optimizer.bin").unlink()
    (ckpt / "accelerate" / "optimizer.bin").symlink_to(tmp_path / "gone.bin")
    with pytest.raises(
        torchloom.CheckpointError,
        match=rf"is incomplete: accelerate/optimizer\.bin is a symbolic link to '{tmp_path}/gone\.bin', which does "
        "not exist",
    ):
        _resume(ckpt, tmp_path)


# ------------------------------------------------------------------------------------- killed saves


def test_write_atomically_keeps_a_writer_s_own_temporary_files_to_itself(tmp_path) -> None:
    """A library that writes its own temporary file beside the path it is given (safetensors: ``.tmpXXXXXX``)
    writes it inside the private directory: a failure leaves nothing, a success only the file."""

    def failing(path: str) -> None:
        Path(path).with_name(".tmpABC123").write_bytes(b"x" * 1000)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        torchloom.utils.write_atomically(tmp_path / "state.safetensors", failing)
    assert list(tmp_path.iterdir()) == []
    from safetensors.torch import load_file, save_file

    torchloom.utils.write_atomically(tmp_path / "state.safetensors", lambda p: save_file({"t": torch.ones(3)}, p))
    torchloom.utils.write_atomically(tmp_path / "notes.txt", "text")
    torchloom.utils.write_atomically(tmp_path / "blob.bin", b"\x00\x01")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob.bin", "notes.txt", "state.safetensors"]
    assert torch.equal(load_file(tmp_path / "state.safetensors")["t"], torch.ones(3))
    assert (tmp_path / "blob.bin").read_bytes() == b"\x00\x01"


def test_the_sweep_removes_what_dead_processes_left_and_nothing_else(tmp_path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, live_pid = int(dead.stdout), os.getpid()
    names = {
        f".model.tmp-{dead_pid}": "dir",
        f".config.yaml.tmp-{dead_pid}-0a1b2c3d": "dir",
        f".step-00000004.deleting-{dead_pid}": "dir",
        f".latest.tmp-{dead_pid}": "file",
        f".model.tmp-{live_pid}": "dir",  # a running save
        ".tmpABC123": "file",  # not ours: never touched
        "model": "dir",
        f"notes.tmp-{dead_pid}": "file",  # not hidden: not a temporary name
    }
    for name, kind in names.items():
        (tmp_path / name).mkdir() if kind == "dir" else (tmp_path / name).write_text("x")
    removed = _atomic.remove_orphans(tmp_path)
    assert sorted(removed) == sorted(n for n in names if str(dead_pid) in n and n.startswith("."))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".model.tmp-{live_pid}", ".tmpABC123", "model", f"notes.tmp-{dead_pid}"]
    )


_KILLED_SAVE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torchloom
    from resume_fit import ShuffleTask

    out = Path(sys.argv[1])

    class Slow(ShuffleTask):
        def save_model(self, directory, **kwargs):
            super().save_model(directory, **kwargs)  # the weights are written...
            (out / "paused").write_text(str(directory))
            time.sleep(600)  # ... and the process is killed before the save ends

    torchloom.Engine(output_dir=str(out / "run"), max_epochs=1, save_model=True).fit(Slow(hidden=256))
    """
)


def test_a_killed_model_save_leaves_only_what_the_next_run_removes(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(MP_DIR), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "paused").exists():
            assert child.poll() is None and time.monotonic() < deadline, "the child never reached the model save"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    run_dir = tmp_path / "run" / "version_0"
    staging = run_dir / f".model.tmp-{child.pid}"
    assert Path((tmp_path / "paused").read_text()) == staging
    assert (staging / "model.safetensors").is_file()
    assert not (run_dir / "model").exists()  # no model/ that looks complete
    assert not (tmp_path / "run" / "latest").exists()
    torchloom.Engine(output_dir=str(tmp_path / "run"), max_epochs=1).fit(ShuffleTask())
    assert not staging.exists()  # the next run in the same output_dir removed it
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "metrics.jsonl"]


# ------------------------------------------------------------------------------------------ data cache


def test_the_data_cache_writes_under_the_same_convention_and_sweeps_it(tmp_path) -> None:
    import datasets

    from torchloom.data.cache import DatasetCache

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    cache = DatasetCache(tmp_path)
    table = datasets.Dataset.from_dict({"x": list(range(20_000))})
    left = tmp_path / f".k1.tmp-{int(dead.stdout)}-0a1b2c3d"  # what a killed save left
    left.mkdir(parents=True)
    with file_size_limit(10_000), pytest.raises(torchloom.RunFileError) as info:
        cache.save("k1", table)
    assert str(info.value).startswith(f"cannot write processed-dataset cache entry '{tmp_path / 'k1'}': ")
    assert "File too large" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # the leftover swept, the failed entry's directory removed
    cache.save("k1", table)
    assert [p.name for p in tmp_path.iterdir()] == ["k1"] and len(cache.load("k1")) == 20_000


# ---------------------------------------------------------------------------------------- the pieces


def test_temporary_names_follow_the_convention_the_sweep_knows(tmp_path):
    target = tmp_path / "model"
    assert _atomic.temporary_path(target) == tmp_path / f".model.tmp-{os.getpid()}"
    assert _atomic.temporary_path(target, pid=123) == tmp_path / ".model.tmp-123"
    first, second = (_atomic.temporary_path(target, pid=7, unique=True) for _ in range(2))
    assert first != second  # unique: several writes of one name at once
    for name in (first.name, second.name, ".model.tmp-7", ".model.deleting-7"):
        match = _atomic.TEMPORARY.fullmatch(name)
        assert match is not None and match.groups() == ("model", "7"), name
    assert len(first.name) == len(".model.tmp-7-") + 8


def test_two_writes_of_one_file_at_once_do_not_collide(tmp_path):
    """Two threads write the same file at the same time: each in its own private directory; the last rename
    wins, and nothing is left behind."""
    import threading

    started, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def slow(path: str) -> None:
        Path(path).write_text("first")
        started.set()
        release.wait(10)

    def first() -> None:
        try:
            torchloom.utils.write_atomically(tmp_path / "summary.json", slow)
        except BaseException as exc:  # pragma: no cover - the failure this test is about
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    assert started.wait(10)
    torchloom.utils.write_atomically(tmp_path / "summary.json", "second")  # while the first is still writing
    release.set()
    thread.join(10)
    assert errors == []
    assert (tmp_path / "summary.json").read_text() == "first" and sorted(os.listdir(tmp_path)) == ["summary.json"]


def test_non_ascii_text_is_written_as_utf8(tmp_path):
    torchloom.utils.write_atomically(tmp_path / "notes.txt", "é → ∞")
    assert (tmp_path / "notes.txt").read_bytes() == "é → ∞".encode()


def test_delete_directory_renames_out_of_sight_first(tmp_path):
    folder = tmp_path / "step-00000004"
    (folder / "accelerate").mkdir(parents=True)
    (folder / "accelerate" / "model.safetensors").write_bytes(b"x")
    renamed = []
    original = os.rename

    def watching_rename(src, dst):
        renamed.append((Path(src).name, Path(dst).name))
        return original(src, dst)

    os.rename = watching_rename
    try:
        _atomic.delete_directory(folder)
    finally:
        os.rename = original
    assert renamed == [("step-00000004", f".step-00000004.deleting-{os.getpid()}")]
    assert list(tmp_path.iterdir()) == []


def test_pid_alive_answers_for_running_dead_and_foreign_processes():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert _liveness.pid_alive(os.getpid()) is True
    assert _liveness.pid_alive(int(dead.stdout)) is False
    assert _liveness.pid_alive(10**12) is False  # not a pid at all (OverflowError)
    if os.geteuid() == 0:  # a process of another user: os.kill refuses (PermissionError), but it runs
        code = (
            "import os; from torchloom.rundir import liveness as _liveness; os.setuid(65534); "
            "print(_liveness.pid_alive(1))"
        )
        foreign = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert foreign.stdout.strip() == "True"


def test_write_failure_recognises_failed_writes_and_nothing_else(tmp_path):
    from safetensors import SafetensorError

    free = " bytes free on that file system)"
    cases = {
        OSError(28, "No space left on device"): "No space left on device (",
        OSError("a custom message"): "a custom message (",
        OSError(): "OSError (",
        SafetensorError("Error while serializing: I/O error: File too large (os error 27)"): "File too large (",
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"): (
            "torch.save failed ([enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598) ("
        ),
        RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed\nmore"): (
            "torch.save failed (PytorchStreamWriter failed writing file data/0: file write failed) ("
        ),
    }
    for exc, start in cases.items():
        reason = _atomic.write_failure(exc, tmp_path / "not" / "yet" / "made")  # the nearest existing folder
        assert reason is not None and reason.startswith(start) and reason.endswith(free), (exc, reason)
    for other in (
        RuntimeError("CUDA out of memory"),
        SafetensorError("Some tensors share memory"),
        ValueError("I/O error: not a write"),
        KeyError("inline_container"),
    ):
        assert _atomic.write_failure(other, tmp_path) is None, other
