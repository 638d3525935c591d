"""Runs never lose or mix work (issue 8): every call has a run directory of its own, created atomically; a
``latest`` link names the last completed fit; metrics lines are always complete; a bad ``output_dir`` is one
clear error before anything is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import torchloom
from torchloom.testing import TinyTask, tiny_fit


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_second_fit_into_the_same_output_dir_keeps_the_first(tmp_path):
    first = tiny_fit(output_dir=str(tmp_path), max_epochs=2, save_model=True)
    kept = files(tmp_path / "version_0")
    assert {"config.yaml", "metrics.jsonl", "model/model.safetensors"} <= set(kept)
    second = tiny_fit(output_dir=str(tmp_path), max_epochs=1)  # a short smoke run, no model
    assert (first.run_dir, second.run_dir) == (str(tmp_path / "version_0"), str(tmp_path / "version_1"))
    assert files(tmp_path / "version_0") == kept  # the 2-epoch run and its model, untouched
    assert not (tmp_path / "version_1" / "model").exists()  # no earlier model next to the new config
    assert os.readlink(tmp_path / "latest") == "version_1"  # a relative link: the tree can be moved


def test_validate_and_predict_never_write_into_the_fits_directory(tmp_path):
    engine = torchloom.Engine(output_dir=str(tmp_path), log_every_n_steps=1)
    task = TinyTask()
    engine.fit(task)
    fit_files = files(tmp_path / "version_0")
    engine.validate(task)
    engine.predict(task, DataLoader(torch.zeros(3, 4), batch_size=2))
    assert files(tmp_path / "version_0") == fit_files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "version_0", "version_1", "version_2"]
    assert len((tmp_path / "version_1" / "metrics.jsonl").read_text().splitlines()) == 1  # the validation's record
    assert os.readlink(tmp_path / "latest") == "version_0"  # latest names the last completed fit


def test_a_run_whose_set_up_fails_leaves_no_directory(tmp_path):
    class NoModel(TinyTask):
        def configure_model(self):
            return None

    with pytest.raises(torchloom.TaskError):
        tiny_fit(task=NoModel(), output_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_two_runs_started_at_once_never_share_a_directory(tmp_path):
    script = textwrap.dedent(
        f"""
        import json, sys
        from torchloom.testing import tiny_fit
        engine = tiny_fit(output_dir={str(tmp_path)!r}, max_epochs=3)
        print(json.dumps({{"run_dir": engine.run_dir, "history": engine.history}}))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env) for _ in "ab"]
    results = [json.loads(run.communicate(timeout=300)[0].splitlines()[-1]) for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert sorted(r["run_dir"] for r in results) == [str(tmp_path / "version_0"), str(tmp_path / "version_1")]
    for r in results:  # each file holds exactly its own run's records, none of the other's
        lines = (Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == r["history"]


def test_temporary_files_of_a_killed_save_are_removed_at_the_next_start(tmp_path):
    tiny_fit(output_dir=str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has ended
    orphans = [tmp_path / f".latest.tmp-{pid}", tmp_path / "version_0" / f".config.yaml.tmp-{pid}"]
    live = tmp_path / f".latest.tmp-{os.getppid()}"  # a save in progress in a process that still runs
    for path in [*orphans, live]:
        path.write_text("half")
    tiny_fit(output_dir=str(tmp_path))
    assert not any(path.exists() for path in orphans)
    assert live.exists()


@pytest.mark.parametrize("kind", ["a file", "unwritable"])
def test_a_bad_output_dir_is_one_clear_error_before_anything_is_built(tmp_path, kind):
    if kind == "a file":
        output_dir = tmp_path / "runs"
        output_dir.write_text("not a directory")
    else:
        if os.geteuid() == 0:
            pytest.skip("root can write into a read-only directory")
        output_dir = tmp_path / "ro"
        output_dir.mkdir(mode=0o500)

    class Counting(TinyTask):
        built = 0

        def configure_model(self):
            Counting.built += 1
            return super().configure_model()

    with pytest.raises(torchloom.RunFileError, match=r"cannot create a run directory in output_dir '.*': "):
        tiny_fit(task=Counting(), output_dir=str(output_dir))
    assert Counting.built == 0


def test_a_full_disk_while_writing_metrics_leaves_only_complete_lines(tmp_path):
    # RLIMIT_FSIZE makes a write past 2000 bytes fail part-way (EFBIG), as a full disk does: the file keeps only
    # complete JSON lines, the error is one RunFileError naming the file, and every plugin's teardown ran.
    script = textwrap.dedent(
        f"""
        import resource, signal
        import torchloom
        from torchloom.testing import TinyTask, tiny_fit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))

        class Closer(torchloom.Plugin):
            name = "closer"
            @torchloom.hookimpl
            def teardown(self):
                print("teardown ran")

        class Chatty(TinyTask):
            def training_step(self, batch, batch_idx):
                for i in range(8):
                    self.log(f"extra/value_{{i}}", 1.0)
                return super().training_step(batch, batch_idx)

        try:
            tiny_fit([Closer()], task=Chatty(n=256, batch_size=4), output_dir={str(tmp_path)!r})
        except torchloom.RunFileError as exc:
            print("error:", exc)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "teardown ran" in result.stdout, result.stderr[-2000:]
    (error,) = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert "metrics.jsonl" in error and "File too large" in error
    text = (tmp_path / "version_0" / "metrics.jsonl").read_text()
    assert text.endswith("\n") and len(text) <= 2000
    assert all(isinstance(json.loads(line), dict) for line in text.splitlines())


def test_a_partial_last_line_is_cut_when_the_file_is_opened_again(tmp_path):
    from torchloom.rundir.runfiles import MetricsFile

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "train/lo')  # a process killed mid-write

    class Progress:
        global_step, epoch = 3, 0

    class Main:
        is_main_process = True

    metrics = MetricsFile()
    metrics.start(str(path))
    metrics.on_log({"train/loss": 0.5}, Progress(), Main())
    metrics.teardown()
    assert path.read_text() == '{"step": 1}\n{"step": 3, "epoch": 0, "train/loss": 0.5}\n'


def test_predict_writes_its_predictions_into_its_own_run_directory(tmp_path):
    engine = torchloom.Engine(output_dir=str(tmp_path))
    task = TinyTask()
    engine.fit(task)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    predictions = engine.predict(task, DataLoader(x, batch_size=2))
    rows = [json.loads(line) for line in (Path(engine.run_dir) / "predictions.jsonl").read_text().splitlines()]
    assert engine.run_dir == str(tmp_path / "version_1")
    assert rows == [{"prediction": row} for row in torch.cat(predictions).tolist()]  # one line per sample, in order


def test_predictions_of_a_dict_of_tensors_are_one_line_per_sample(tmp_path):
    from torchloom.rundir.runfiles import write_predictions

    class One:
        num_processes, process_index = 1, 0

    outputs = [{"label": torch.tensor([1, 0]), "p": torch.tensor([0.75, 0.25])}, {"label": torch.tensor([1])}]
    path = write_predictions(str(tmp_path), [*outputs, "text"], One())
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert rows == [{"label": 1, "p": 0.75}, {"label": 0, "p": 0.25}, {"label": 1}, {"prediction": "text"}]


def test_a_full_disk_while_saving_the_model_is_one_error_and_the_previous_run_is_untouched(tmp_path):
    script = textwrap.dedent(
        f"""
        import resource, signal
        import torchloom
        from torchloom.testing import TinyTask, tiny_fit
        tiny_fit(task=TinyTask(in_features=2000), output_dir={str(tmp_path)!r}, save_model=True)  # a good run
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))  # the 8 kB model no longer fits
        try:
            tiny_fit(task=TinyTask(in_features=2000), output_dir={str(tmp_path)!r}, save_model=True)
        except torchloom.RunFileError as exc:
            print("error:", exc)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    (error,) = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert f"cannot save the model to '{tmp_path / 'version_1' / 'model'}': File too large" in error
    assert (tmp_path / "version_0" / "model" / "model.safetensors").stat().st_size > 8000
    assert os.readlink(tmp_path / "latest") == "version_0"  # the failed run is not the latest


def test_on_run_start_names_the_run_directory_and_its_config_for_every_stage(tmp_path):
    """Trackers start in ``on_run_start``: the directory exists, config.yaml holds the same settings, and
    Accelerate's project and logging directories point into it."""
    seen: list[tuple[str, str, dict, str | None, str | None]] = []

    class Starter:
        @torchloom.hookimpl
        def on_run_start(self, accelerator, stage, run_dir, run_config):
            written = (Path(run_dir) / "config.yaml").read_text()
            assert "max_epochs: 1" in written and run_config["engine"]["max_epochs"] == 1
            seen.append((stage, run_dir, run_config, accelerator.project_dir, accelerator.logging_dir))

    engine = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1, plugins=[Starter()])
    task = TinyTask()
    engine.fit(task)
    engine.validate(task)
    engine.predict(task, DataLoader(torch.zeros(4, 4), batch_size=2))
    assert [s[0] for s in seen] == ["fit", "validate", "predict"]
    assert [s[1] for s in seen] == [str(tmp_path / f"version_{i}") for i in range(3)]
    assert all(project == logging == run_dir for _, run_dir, _, project, logging in seen)


def test_run_directories_are_ordered_by_number_wherever_they_are_listed(tmp_path):
    """version_10 comes after version_9 (not between version_1 and version_2) for the next run's number, for the
    latest checkpoint (tests/plugins/test_checkpoint.py) and in inspect's hint."""
    from torchloom.rundir.layout import run_directories

    for n in (10, 2, 9, 1):
        (tmp_path / f"version_{n}").mkdir()
    (tmp_path / "version_x").mkdir()
    (tmp_path / "version_3").write_text("a file")
    assert [p.name for p in run_directories(tmp_path)] == ["version_1", "version_2", "version_9", "version_10"]
    with pytest.raises(torchloom.ConfigError, match=r"it holds runs \(version_1, version_2, version_9, \.\.\.\)"):
        torchloom.inspect_path(tmp_path)
