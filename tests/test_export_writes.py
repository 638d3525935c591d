"""Exports that fail or are killed half-way (issue 39, item 11): a full disk is one error naming what was written,
where and why, leaving nothing; a killed export's temporary folder is removed by the next export next to it, and
nothing else there is touched. Real failures: ``RLIMIT_FSIZE`` (the kernel refuses to grow a file, as a full disk
does) and SIGKILL of a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import torchloom
from cli_util import run_cli
from torchloom.checkpoint.store import list_checkpoints
from torchloom.testing import TinyTask, tiny_fit
from torchrun_util import MP_DIR

sys.path.insert(0, str(MP_DIR))

from file_limits import file_size_limit


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("export_writes")
    tiny_fit([{"checkpoint": {"every_n_steps": 2}}], max_steps=2, output_dir=str(root / "runs"))
    (found,) = list_checkpoints(root / "runs" / "version_0")
    return found


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)


@pytest.mark.parametrize(("limit", "what"), [(40, "model.safetensors"), (300, "torchloom_model.json")])
def test_a_full_disk_during_an_export_is_one_error_and_leaves_nothing(checkpoint, tmp_path, limit, what):
    """40 bytes: safetensors cannot write the weights (a ``SafetensorError``); 300 bytes: the weights (about 150
    bytes) are written and the card is refused (an `OSError`)."""
    out = tmp_path / "exported"
    engine = torchloom.Engine(output_dir=str(tmp_path / "runs"))
    with file_size_limit(limit), pytest.raises(torchloom.RunFileError) as info:
        engine.export(TinyTask(), checkpoint, out)
    message = str(info.value)
    assert message.startswith(f"export: cannot write the model of checkpoint {checkpoint!r} to {str(out)!r}: ")
    assert "File too large" in message and "bytes free on that file system" in message
    assert message.endswith("; nothing was left there")
    assert isinstance(info.value.__cause__, OSError) == (what == "torchloom_model.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither OUT nor a temporary folder


def test_the_export_command_on_a_full_disk_prints_one_line(checkpoint, tmp_path):
    (tmp_path / "run.yaml").write_text("task:\n  class_path: torchloom.testing.TinyTask\n")
    (tmp_path / "models").mkdir()
    with file_size_limit(40):
        done = run_cli("export", checkpoint, "models/out", "--config", "run.yaml", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        f"torchloom: error: export: cannot write the model of checkpoint {checkpoint!r} to 'models/out': "
    )
    assert "File too large" in done.stderr
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == []


_KILLED_EXPORT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torchloom
    from torchloom.testing import TinyTask

    checkpoint, out = sys.argv[1], Path(sys.argv[2])

    class Slow(TinyTask):
        def save_model(self, directory, **kwargs):
            super().save_model(directory, **kwargs)  # the weights are written...
            (out.parent / "paused").write_text(str(directory))
            time.sleep(600)  # ... and the process is killed before the export ends

    torchloom.Engine(output_dir=str(out.parent / "runs")).export(Slow(), checkpoint, out)
    """
)


def test_a_killed_export_leaves_only_what_the_next_export_next_to_it_removes(checkpoint, tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    child = subprocess.Popen([sys.executable, "-c", _KILLED_EXPORT, checkpoint, str(folder / "first")])
    try:
        deadline = time.monotonic() + 120
        while not (folder / "paused").exists():
            assert child.poll() is None and time.monotonic() < deadline, "the child never reached the model save"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    (folder / "paused").unlink()
    staging = folder / f".first.tmp-{child.pid}"
    assert sorted(p.name for p in staging.iterdir()) == [".torchloom-export-in-progress", "model.safetensors"]
    assert not (folder / "first").exists()
    # What is not a killed export's is left alone: a running process's, an unmarked folder of another name, a file.
    dead = _dead_pid()
    kept = {
        f".notes.tmp-{dead}": "dir",  # a folder of the same pattern, not an export's (no marker)
        f".notes.tmp-{dead}-0a1b2c3d": "file",
        f".third.tmp-{os.getpid()}": "dir",  # a live process's
        "user.tmp-1": "dir",
    }
    for name, kind in kept.items():
        (folder / name).mkdir() if kind == "dir" else (folder / name).write_text("x")
    (folder / f".third.tmp-{os.getpid()}" / ".torchloom-export-in-progress").touch()
    torchloom.Engine(output_dir=str(tmp_path / "runs")).export(TinyTask(), checkpoint, folder / "second")
    assert not staging.exists()  # removed by the next export into the same folder, whatever its name
    assert sorted(p.name for p in folder.iterdir()) == sorted([*kept, "second"])
    assert sorted(p.name for p in (folder / "second").iterdir()) == ["model.safetensors", "torchloom_model.json"]


def test_an_export_removes_what_an_earlier_attempt_at_the_same_folder_left(checkpoint, tmp_path):
    """An unmarked temporary folder of the same OUT (a kill between the marker's removal and the rename, or an older
    torchloom) is that export's own: removed; an unmarked one of another name is not."""
    dead = _dead_pid()
    for name in (f".out.tmp-{dead}", f".other.tmp-{dead}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_text("half")
    torchloom.Engine(output_dir=str(tmp_path / "runs")).export(TinyTask(), checkpoint, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".other.tmp-{dead}", "out"]
