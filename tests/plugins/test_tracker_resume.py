"""A resumed fit continues the same W&B and MLflow runs (issue 29, item 1): one run id over a training interrupted
twice, each logged step once, with the values of the uninterrupted training.

A trains C11's task (10 ids, batches of 2, 3 epochs: 15 steps, logging every step, validating every 4) without a
stop. B saves at step 7 and dies at step 9; C resumes B's checkpoint, saves at step 11 and dies at step 13; D
resumes C's checkpoint and finishes. All log to TensorBoard, W&B (offline, its transaction log read back with W&B's
own protobuf records) and MLflow (its file store, read with ``MlflowClient``). B's run goes on in C and D: W&B's
offline folders of the three run directories carry B's id, and each holds only the steps its run added (B 1-9, C
10-13, D 14-15: the steps C and D log again after their checkpoints are not sent twice); MLflow holds one run whose
history is A's curve, step for step. TensorBoard, which writes into each run directory, gets the whole curve in D's.

Skipped where ``wandb`` or ``mlflow`` (``mlflow-skinny``) is not installed (both are in the ``test`` extra).
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from torchloom_plugins._tracker_runs import Continued, continue_kwargs, read_runs, run_ids
from torchrun_util import MP_DIR

sys.path.insert(0, str(MP_DIR))

from resume_fit import DiesAt, ShuffleTask, fit

wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
mlflow = pytest.importorskip("mlflow")

SETTINGS = {"log_every_n_steps": 1, "val_check_interval": 4}
TRACKERS = {"trackers": {"log_with": ["tensorboard", "wandb", "mlflow"]}}


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a W&B transaction log (``run-<id>.wandb``): LevelDB's log format (32 KiB blocks of chunks,
    each with a 7-byte header: CRC, length, type) after W&B's 7-byte file header, each record a ``Record``."""
    data, pos, pending = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:  # zeros: the end of what was written
            return
        pending = chunk if kind in (1, 2) else pending + chunk  # full / first, middle / last
        if kind in (1, 4):
            record = wandb_pb.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_run(run_dir: str) -> tuple[str, list[int]]:
    """The run id and the logged steps of the one W&B offline run in ``run_dir``."""
    (folder,) = (Path(run_dir) / "wandb").glob("offline-run-*")
    (log,) = folder.glob("run-*.wandb")
    steps = [r.history.step.num for r in _wandb_records(log) if r.WhichOneof("record_type") == "history"]
    return folder.name.rsplit("-", 1)[1], steps


def _curve(records: list[dict[str, Any]], name: str) -> list[tuple[int, float]]:
    return [(r["step"], r[name]) for r in records if name in r]


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as env:
        for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
            env.delenv(name, raising=False)
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # recorded, then removed: the plugin sets it
        env.delenv("MLFLOW_ALLOW_FILE_STORE")
        env.setenv("WANDB_SILENT", "true")
        a = fit(ShuffleTask, tmp_path_factory.mktemp("a"), [], **SETTINGS)
        out = tmp_path_factory.mktemp("bcd")
        b = fit(ShuffleTask, out, [TRACKERS, DiesAt(9)], save_at=[7], crash=False, **SETTINGS)
        c = fit(ShuffleTask, out, [TRACKERS, DiesAt(13)], save_at=[11], crash=False, ckpt_path=b.checkpoint, **SETTINGS)
        d = fit(ShuffleTask, out, [TRACKERS], ckpt_path=c.checkpoint, **SETTINGS)
    assert b.crashed and c.crashed and not d.crashed
    return {"a": a, "b": b, "c": c, "d": d}


def test_the_resumed_fits_continue_the_w_and_b_run_each_step_logged_once(chain) -> None:
    b, c, d = (chain[k].engine.run_dir for k in "bcd")
    (b_id, b_steps), (c_id, c_steps), (d_id, d_steps) = _wandb_run(b), _wandb_run(c), _wandb_run(d)
    assert b_id == c_id == d_id  # one W&B run, continued twice
    assert b_steps == list(range(1, 10))  # B logged up to its death at step 9
    assert c_steps == [10, 11, 12, 13]  # C logged 8 and 9 again (bitwise the same): B's run holds them
    assert d_steps == [14, 15]
    for run_dir in (b, c, d):
        recorded = json.loads((Path(run_dir) / "trackers.json").read_text())["runs"]
        assert recorded["wandb"]["run_id"] == b_id
    assert json.loads((Path(d) / "trackers.json").read_text())["runs"]["wandb"]["last_step"] == 15


def test_the_resumed_fits_continue_the_mlflow_run_whose_history_is_the_uninterrupted_curve(chain) -> None:
    a, b, d = chain["a"], chain["b"], chain["d"]
    recorded = json.loads((Path(d.engine.run_dir) / "trackers.json").read_text())["runs"]["mlflow"]
    store = Path(b.engine.run_dir, "mlruns").resolve().as_uri()
    assert recorded["tracking_uri"] == store  # the run lives where B started it
    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    (experiment,) = [e for e in client.search_experiments() if e.name == "torchloom"]
    (run,) = client.search_runs([experiment.experiment_id])  # one run: C and D wrote into B's
    assert run.info.run_id == recorded["run_id"]
    whole = [dict(r) for r in a.engine.history]
    for name in ("train/loss", "val/loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert history == _curve(whole, name), name  # each step once, with the uninterrupted run's values
    for run_dir in (chain["c"].engine.run_dir, d.engine.run_dir):
        assert not (Path(run_dir) / "mlruns").exists()  # no second store


def test_tensorboard_still_gets_the_whole_curve_in_the_last_run_directory(chain) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    a, d = chain["a"], chain["d"]
    reader = EventAccumulator(str(Path(d.engine.run_dir) / "torchloom"))
    reader.Reload()
    steps = [e.step for e in reader.Scalars("train/loss")]
    assert steps == [s for s, _ in _curve([dict(r) for r in a.engine.history], "train/loss")] == list(range(1, 16))


def test_a_run_the_user_names_wins_over_the_recorded_one(tmp_path) -> None:
    recorded = {"wandb": {"run_id": "abc", "last_step": 7}, "mlflow": {"run_id": "r1", "last_step": None}}
    (tmp_path / "trackers.json").write_text(json.dumps({"runs": recorded}))
    runs = read_runs(tmp_path, {})
    assert runs == {"wandb": Continued("wandb", "abc", None, 7), "mlflow": Continued("mlflow", "r1", None, None)}
    assert read_runs(tmp_path, {"WANDB_RUN_ID": "mine"}) == {"mlflow": runs["mlflow"]}  # the environment chose
    assert read_runs(None, {}) == {} and read_runs(tmp_path / "missing", {}) == {}
    kwargs: dict[str, dict[str, Any]] = {"wandb": {"id": "mine"}}
    assert continue_kwargs(kwargs, runs) == {"mlflow"}
    assert kwargs == {"wandb": {"id": "mine"}, "mlflow": {"run_id": "r1"}}
    kwargs = {"wandb": {"resume": "must"}}
    assert continue_kwargs(kwargs, {"wandb": runs["wandb"]}) == {"wandb"}
    assert kwargs == {"wandb": {"resume": "must", "id": "abc"}}


def test_a_continued_run_skips_only_the_steps_it_holds() -> None:
    known, unknown = Continued("wandb", "abc", None, 9), Continued("wandb", "abc", None, None)
    assert [s for s in range(6, 12) if not known.holds(s, 7)] == [10, 11]  # 8 and 9 were logged before the crash
    assert [s for s in range(6, 12) if not unknown.holds(s, 7)] == list(range(6, 12))  # not recorded: all sent
    assert not Continued("wandb", "abc", None, 5).holds(6, 5) and Continued("wandb", "abc", None, 5).holds(5, 5)


def test_only_w_and_b_and_mlflow_runs_are_recorded_whatever_run_object_another_tracker_holds(tmp_path) -> None:
    """Accelerate's AimTracker holds a ``run`` as its WandBTracker does: it is no W&B run to continue."""
    from types import SimpleNamespace

    wandb_run, aim_run = SimpleNamespace(id="w1"), SimpleNamespace(id="not-a-wandb-id", hash="a1")
    trackers = [SimpleNamespace(name="aim", run=aim_run), SimpleNamespace(name="tensorboard", writer=object())]
    assert run_ids(trackers) == {}
    assert run_ids([*trackers, SimpleNamespace(name="wandb", run=wandb_run)]) == {"wandb": {"run_id": "w1"}}
    assert run_ids([SimpleNamespace(name="wandb", run=None)]) == {}  # not started (another process)
