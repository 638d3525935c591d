"""The ``trackers`` plugin: every value of ``engine.history`` reaches TensorBoard at its step (read back with
TensorBoard's own reader), the resolved configuration is recorded as hyperparameters, only the main process
writes, a failed run still closes its files, and bad settings are one `torchloom.ConfigError` each.

Offline and deterministic: TensorBoard writes local files; the trackers that talk to a service are only checked
for their offline defaults and their errors when not installed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata

import torchloom
from torchloom.testing import TinyTask, tiny_fit
from torchloom_plugins.trackers import TRACKERS, flatten_config, tracker_init_kwargs
from torchrun_util import torchrun


def _event_files(log_dir: Path) -> list[Path]:
    return sorted(log_dir.rglob("events.out.tfevents.*"))


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of the scalar event file directly in ``log_dir`` (TensorBoard's reader)."""
    reader = EventAccumulator(str(log_dir))
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def _expected(history: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value as float32)] from ``engine.history``: what TensorBoard must hold."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in history:
        for name, value in record.items():
            if name not in ("step", "epoch"):
                expected.setdefault(name, []).append((record["step"], float(np.float32(value))))
    return expected


def _hparams(log_dir: Path) -> dict[str, Any]:
    """The hyperparameters of the run, read from the hparams event file that TensorBoard's writer puts in a
    subdirectory of ``log_dir``."""
    for events in _event_files(log_dir):
        reader = EventAccumulator(str(events.parent))  # reads the event files directly in that directory
        reader.Reload()
        try:
            content = reader.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
        except KeyError:  # the scalars' file
            continue
        info = hparams_metadata.parse_session_start_info_plugin_data(content[hparams_metadata.SESSION_START_INFO_TAG])
        return {name: getattr(value, value.WhichOneof("kind")) for name, value in info.hparams.items()}
    raise AssertionError(f"no hyperparameters under {log_dir}")


# ------------------------------------------------------------------------------------------------ fit


def test_every_logged_value_reaches_tensorboard_at_its_step(tmp_path):
    """2 epochs of 8 steps, logging every step and validating each epoch: TensorBoard holds exactly the steps and
    values of engine.history (float32, the precision of a TensorBoard scalar), train and validation alike."""
    engine = tiny_fit({"trackers": {"log_with": ["tensorboard"]}}, output_dir=str(tmp_path), max_epochs=2)
    log_dir = Path(engine.run_dir) / "torchloom"
    scalars = _scalars(log_dir)
    expected = _expected(engine.history)
    assert set(scalars) == {"train/loss", "val/loss"}
    assert [step for step, _ in scalars["train/loss"]] == list(range(1, 17))
    assert [step for step, _ in scalars["val/loss"]] == [8, 16]
    assert scalars == expected
    assert (Path(engine.run_dir) / "metrics.jsonl").is_file()  # the engine's own file is still written


def test_the_resolved_config_is_recorded_as_flat_hyperparameters(tmp_path):
    engine = tiny_fit({"trackers": {}}, output_dir=str(tmp_path), max_epochs=1, seed=3)
    run_dir = Path(engine.run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    flat = flatten_config(config)
    assert flat["engine.max_epochs"] == 1 and flat["engine.seed"] == 3
    assert flat["plugins.trackers.log_with"] == '["tensorboard"]' and flat["plugins.trackers.init_kwargs"] == "{}"
    recorded = _hparams(run_dir / "torchloom")
    assert set(recorded) == set(flat)
    for name, value in flat.items():  # TensorBoard keeps numbers (bools too) as floats, strings as strings
        assert recorded[name] == (value if isinstance(value, str) else float(value)), name
    # Accelerate's TensorBoard tracker also writes them as YAML, next to the event files.
    (hparams_yaml,) = (run_dir / "torchloom").rglob("hparams.yml")
    assert yaml.safe_load(hparams_yaml.read_text()) == flat


def test_flatten_config_keeps_scalars_and_turns_the_rest_into_strings():
    config = {
        "engine": {"max_epochs": 2, "lr": 0.5, "save_model": True, "seed": None, "name": "x"},
        "plugins": {"grad_clip": {"max_norm": 1.0}, "bare": {}, "trackers": {"log_with": ["tensorboard", "wandb"]}},
        "task": {"init_args": {"sizes": (1, 2), "path": Path("/a/b")}},
    }
    assert flatten_config(config) == {
        "engine.max_epochs": 2,
        "engine.lr": 0.5,
        "engine.save_model": True,
        "engine.seed": "None",
        "engine.name": "x",
        "plugins.grad_clip.max_norm": 1.0,
        "plugins.bare": "{}",
        "plugins.trackers.log_with": '["tensorboard", "wandb"]',
        "task.init_args.sizes": "[1, 2]",
        "task.init_args.path": "/a/b",
    }


def test_init_kwargs_reach_the_tracker(tmp_path):
    """``init_kwargs["tensorboard"]`` goes to ``SummaryWriter``: a filename suffix shows on the event file."""
    settings = {"project_name": "exp1", "init_kwargs": {"tensorboard": {"filename_suffix": ".loom"}}}
    engine = tiny_fit({"trackers": settings}, output_dir=str(tmp_path), max_epochs=1)
    scalar_files = [p for p in _event_files(Path(engine.run_dir) / "exp1") if p.parent.name == "exp1"]
    assert len(scalar_files) == 1 and scalar_files[0].name.endswith(".loom")


class PredictingTask(TinyTask):
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])


def test_validate_writes_its_own_log_and_predict_none(tmp_path):
    """validate starts trackers in its own run directory (its values at the fit's last step); predict, which logs
    nothing, starts none. The fit's log is not touched by either."""
    task = PredictingTask()
    engine = torchloom.Engine(plugins={"trackers": {}}, output_dir=str(tmp_path), max_epochs=1)
    engine.fit(task)
    fit_dir = Path(engine.run_dir)
    fit_scalars = _scalars(fit_dir / "torchloom")
    metrics = engine.validate(task)
    validate_dir = Path(engine.run_dir)
    assert validate_dir != fit_dir
    assert _scalars(validate_dir / "torchloom") == {"val/loss": [(8, float(np.float32(metrics["val/loss"])))]}
    engine.predict(task, dataloader=task.val_dataloader())
    assert not (Path(engine.run_dir) / "torchloom").exists()
    assert _scalars(fit_dir / "torchloom") == fit_scalars


# ------------------------------------------------------------------------------------------- failure


class FailingTask(TinyTask):
    """TinyTask whose third training step raises."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("boom at batch 2")
        return super().training_step(batch, batch_idx)


class WriterProbe:
    """Keeps the run's TensorBoard event-file writer (torch's ``FileWriter``), to look at it after the run."""

    name = "writer_probe"

    @torchloom.hookimpl
    def on_fit_start(self, accelerator) -> None:
        self.file_writer = accelerator.get_tracker("tensorboard", unwrap=True).file_writer


def _writer_threads() -> set[threading.Thread]:
    """TensorBoard's background threads that write event files (one per open writer)."""
    return {t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread" and t.is_alive()}


def test_a_failed_run_still_closes_its_tracker_files(tmp_path):
    """The run raises in step 3: the event file holds steps 1 and 2 and is closed (its writer refuses to write, its
    writing thread has ended); the next fit in the same process writes a log of its own."""
    before = _writer_threads()
    probe = WriterProbe()
    engine = torchloom.Engine(
        plugins=[{"trackers": {}}, probe], output_dir=str(tmp_path), max_epochs=1, log_every_n_steps=1
    )
    with pytest.raises(RuntimeError, match="boom at batch 2"):
        engine.fit(FailingTask())
    failed_dir = Path(engine.run_dir)
    (events,) = [p for p in _event_files(failed_dir / "torchloom") if p.parent.name == "torchloom"]
    assert events.parent == Path(probe.file_writer.get_logdir())
    size = events.stat().st_size
    with pytest.raises(OSError, match="Writer is closed"):
        probe.file_writer.flush()
    assert _writer_threads() <= before and events.stat().st_size == size
    assert [step for step, _ in _scalars(failed_dir / "torchloom")["train/loss"]] == [1, 2]
    assert _scalars(failed_dir / "torchloom") == _expected(engine.history)

    engine.fit(TinyTask())
    assert Path(engine.run_dir) != failed_dir
    assert _scalars(Path(engine.run_dir) / "torchloom") == _expected(engine.history)
    assert _writer_threads() <= before


# ------------------------------------------------------------------------------------------ processes


@pytest.mark.multiprocess
def test_only_the_main_process_writes(tmp_path):
    """2 processes, two fits in one launch: every event file was written by rank 0's process (TensorBoard puts the
    writer's pid in the file name), rank 1 held no tracker, both logs hold the shared history, and the second fit
    ran on the process group of the first (the plugin does not destroy it, as ``end_training`` would)."""
    r0, r1 = torchrun("trackers_fit.py", tmp_path, nproc=2)
    assert r0["world_size"] == 2
    for run0, run1 in zip(r0["runs"], r1["runs"], strict=True):
        assert run0["run_dir"] == run1["run_dir"] and run0["history"] == run1["history"]
        assert (run0["trackers_during_fit"], run1["trackers_during_fit"]) == (1, 0)
        log_dir = Path(run0["run_dir"]) / "torchloom"
        files = _event_files(log_dir)
        assert len(files) == 2  # the scalars, and the hyperparameters in a subdirectory
        assert {f.name.split(".")[-2] for f in files} == {str(r0["pid"])}
        assert len(list(log_dir.rglob("hparams.yml"))) == 1
        assert _scalars(log_dir) == _expected(run0["history"])
        assert [step for step, _ in _scalars(log_dir)["train/loss"]] == list(range(1, 9))  # 8 steps over 2 ranks


# --------------------------------------------------------------------------------------------- settings


def test_offline_defaults_for_the_service_trackers(tmp_path):
    run_dir = str(tmp_path)
    names = ["tensorboard", "wandb", "comet_ml", "swanlab", "dvclive", "mlflow"]
    assert tracker_init_kwargs(names, {}, run_dir, {}) == {
        "wandb": {"mode": "offline", "dir": run_dir},
        "comet_ml": {"online": False},
        "swanlab": {"mode": "offline", "logdir": os.path.join(run_dir, "swanlog")},
        "dvclive": {"dir": os.path.join(run_dir, "dvclive")},
    }
    # The user's environment and init_kwargs win over the defaults.
    assert tracker_init_kwargs(["wandb"], {}, run_dir, {"WANDB_MODE": "online", "WANDB_DIR": "/w"}) == {}
    user = {"wandb": {"mode": "online", "tags": ["a"]}, "tensorboard": {"flush_secs": 5}}
    assert tracker_init_kwargs(["tensorboard", "wandb"], user, run_dir, {}) == {
        "tensorboard": {"flush_secs": 5},
        "wandb": {"mode": "online", "tags": ["a"], "dir": run_dir},
    }
    assert user == {"wandb": {"mode": "online", "tags": ["a"]}, "tensorboard": {"flush_secs": 5}}  # not mutated


def test_every_tracker_accelerate_knows_is_accepted_by_name():
    from accelerate.utils import LoggerType

    assert set(TRACKERS) == {str(t) for t in LoggerType} - {"all"}


def test_a_tracker_that_is_not_installed_is_one_config_error():
    missing = [(name, package) for name, (available, package) in TRACKERS.items() if not available()]
    if not missing:
        pytest.skip("every tracker Accelerate knows is installed here")
    name, package = missing[0]  # the test extra installs tensorboard, wandb and mlflow-skinny, not comet_ml
    with pytest.raises(torchloom.ConfigError) as info:
        torchloom.Engine(plugins={"trackers": {"log_with": ["tensorboard", name]}})
    assert str(info.value) == f"plugin 'trackers': setting 'log_with': {name!r} is not installed; pip install {package}"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"log_with": ["tensorbord"]},
            "setting 'log_with': unknown tracker 'tensorbord' (did you mean 'tensorboard'?); valid trackers: "
            "tensorboard, wandb, mlflow, aim, "
            "comet_ml, clearml, dvclive, swanlab, trackio",
        ),
        ({"log_with": ["all"]}, "unknown tracker 'all' (list the trackers by name); valid trackers: tensorboard, "),
        ({"log_with": []}, "setting 'log_with' = []; expected one or more of: tensorboard, wandb, "),
        ({"log_with": "tensorboard"}, "setting 'log_with' = 'tensorboard' (str); expected list[str]"),
        (
            {"log_with": ["tensorboard", "tensorboard"]},
            "setting 'log_with' = ['tensorboard', 'tensorboard']: 'tensorboard' is listed twice",
        ),
        ({"project_name": "a/b"}, "setting 'project_name' = 'a/b'; expected a non-empty name without '/'"),
        ({"project_name": ""}, "setting 'project_name' = ''; expected a non-empty name"),
        (
            {"init_kwargs": {"wandb": {"mode": "online"}}},
            "setting 'init_kwargs' has an entry for 'wandb', which is not in log_with ['tensorboard']",
        ),
        (
            {"init_kwargs": {"tensorboard": 5}},
            "setting 'init_kwargs' = {'tensorboard': 5}; expected a mapping of keyword arguments",
        ),
    ],
)
def test_bad_settings_are_one_config_error(settings, message):
    with pytest.raises(torchloom.ConfigError) as info:
        torchloom.Engine(plugins={"trackers": settings})
    assert str(info.value).startswith("plugin 'trackers': ")
    assert message in str(info.value)
