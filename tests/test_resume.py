"""Exact resume (issue 10; cases C10 and C11 of shared/cases/README.md), through `torchloom.Engine` only.

Each scenario runs A uninterrupted, and B that saves a checkpoint with `torchloom.save_checkpoint` (from
``on_train_step_end``, or ``on_train_epoch_end``) and stops right there, then C: a new Engine and a new task that
``fit(task, ckpt_path=B's checkpoint)``. B followed by C must be A: the same sample ids in the same order, the
same record of every optimizer step (LR used, skipped or not, loss-scaler state, every parameter after it, all
compared exactly), the same ``history`` (which needs the partial log sums of B's last interval), and at the end
the same parameters (``torch.equal``), optimizer state, scheduler, loss scaler and counters. The tasks, probe and
helpers are in tests/mp/resume_fit.py, which is also the 2-process script.

Also: incompatible and altered checkpoints are refused with one clear error (a pickle that would run code is
refused without running it), and a process killed inside a save leaves the previous checkpoint loadable and a
temporary directory that the next run in the same output_dir removes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import torchloom
from torchloom.checkpoint.store import list_checkpoints
from torchrun_util import MP_DIR, torchrun

sys.path.insert(0, str(MP_DIR))  # the tasks and helpers shared with the torchrun script

from resume_fit import (
    MP_SCENARIOS,
    OverflowTask,
    Run,
    ShuffleTask,
    fit,
    record,
    snapshot,
    stop_and_resume,
)

AMP16 = {"mixed_precision": {"dtype": "fp16", "init_scale": 1024.0, "growth_interval": 2}}


def assert_resumed_exactly(a: Run | dict[str, Any], b: Run | None = None, c: Run | None = None) -> dict[str, Any]:
    """B then C is A: ids, every step's record, history, and the final state (see the module docstring)."""
    rec = record(a, b, c) if isinstance(a, Run) else a
    assert rec["bc_ids"] == rec["a_ids"], "another sample order"
    a_steps, bc_steps = rec["a_steps"], rec["bc_steps"]
    assert [s["step"] for s in bc_steps] == [s["step"] for s in a_steps], "steps missing or repeated"
    for sa, sbc in zip(a_steps, bc_steps, strict=True):
        assert sbc == sa, f"optimizer step {sa['step']} differs"
    assert rec["bc_history"] == rec["a_history"], "another history"
    # C's metrics.jsonl is A's: B's records carried over (marked with B's run directory), then C's own.
    assert rec["c_file"] == rec["a_file"], "C's metrics.jsonl is not the uninterrupted run's"
    carried = len(rec["b_file"])  # B stopped right after its checkpoint: everything it logged is carried over
    assert rec["c_carried"] == [rec["b_run_dir"]] * carried + [None] * (len(rec["c_file"]) - carried)
    for key, value in rec["a"].items():
        assert rec["c"][key] == value, f"final {key} differs"
    if isinstance(a, Run):
        assert c is not None
        params_a, params_c = (r.engine.accelerator.unwrap_model(r.engine._run.model).parameters() for r in (a, c))
        assert all(torch.equal(p, q) for p, q in zip(params_a, params_c, strict=True))
    return rec


def _epochs(ids: list[int], per_epoch: int) -> list[list[int]]:
    return [ids[i : i + per_epoch] for i in range(0, len(ids), per_epoch)]


# ---------------------------------------------------------------------------------------------------- C11


@pytest.fixture(scope="module")
def shuffled(tmp_path_factory) -> Run:
    """Run A of C11 with the engine's default seed (0): the shuffle of epoch e is drawn from seed + e."""
    return fit(ShuffleTask, tmp_path_factory.mktemp("c11_a"))


@pytest.fixture(
    scope="module",
    params=[(0, True), (None, True), (0, False), (None, False)],
    ids=["seed0", "unseeded", "no_generator", "unseeded_no_generator"],
)
def c11(request, shuffled, tmp_path_factory) -> tuple[Any, dict[str, Any]]:
    """Run A of C11, its task and its engine settings. With ``seed=None`` the DataLoader's own generator (seeded
    to 1) shuffles, so the checkpoint must hold that generator's state; without a generator the DataLoader draws
    from the global torch generator as it starts, so the random states must be restored after that."""
    seed, generator = request.param
    if request.param == (0, True):
        return shuffled, ShuffleTask, {}
    make = lambda: ShuffleTask(generator=generator)  # noqa: E731
    settings = {} if seed == 0 else {"seed": None}
    return fit(make, tmp_path_factory.mktemp("c11_a"), **settings), make, settings


def test_c11_uninterrupted_order(c11) -> None:
    a, _, _ = c11
    assert a.engine.progress.global_step == 15
    epochs = _epochs(a.probe.ids, 10)
    assert len(epochs) == 3 and all(sorted(e) == list(range(10)) for e in epochs)  # each a permutation of 0..9
    assert epochs[1] != epochs[0] and epochs[2] not in epochs[:2]  # every epoch has its own shuffle
    assert [sum(s["epoch"] == e for s in a.probe.steps) for e in range(3)] == [5, 5, 5]


@pytest.mark.parametrize(
    "stop",
    [
        {"save_at": [7]},  # C11: epoch 1 after 2 of its batches
        {"save_at": [1]},
        {"save_at": [5]},  # an epoch's last step, saved from on_train_step_end: the epoch is not finished
        {"save_at": [10]},
        {"save_epoch_end": [0]},  # saved from on_train_epoch_end: resumes at the start of epoch 1
        {"save_epoch_end": [1]},
    ],
    ids=["step7", "step1", "step5", "step10", "epoch0_end", "epoch1_end"],
)
def test_c11_resume_continues_exactly(c11, stop, tmp_path) -> None:
    a, make, settings = c11
    b, c = stop_and_resume(make, tmp_path, **stop, **settings)
    k = b.engine.progress.global_step
    assert k == (stop["save_at"][0] if "save_at" in stop else 5 * (stop["save_epoch_end"][0] + 1))
    assert [s["step"] for s in c.probe.steps] == list(range(k + 1, 16))  # C continued: it did not start over
    assert_resumed_exactly(a, b, c)
    ids = b.probe.ids + c.probe.ids
    assert all(sorted(e) == list(range(10)) for e in _epochs(ids, 10))  # no sample repeated or lost
    first = c.probe.steps[0]["epoch"]
    for epoch in range(first + 1, 3):  # the epochs after the resumed one are whole: the skip applied once
        assert sum(s["epoch"] == epoch for s in c.probe.steps) == 5


def test_c11_resume_at_step_7_exactly_as_the_case(c11, tmp_path) -> None:
    a, make, settings = c11
    b, c = stop_and_resume(make, tmp_path, save_at=[7], **settings)
    assert len(b.probe.ids) == 14 and len(c.probe.ids) == 16
    assert c.probe.ids[:6] == a.probe.ids[14:20]  # the rest of epoch 1's own permutation, not epoch 0's
    assert c.engine.progress.global_step == 15
    manifest = json.loads((Path(b.checkpoint) / "manifest.json").read_text())
    seed = 0 if settings.get("seed", 0) == 0 else None
    order = {
        "dataset_length": 10,
        "total_batch_size": 2,
        "batches_per_epoch": 5,
        "world_size": 1,
        "sampler": "SeedableRandomSampler" if seed == 0 else "RandomSampler",
        "sampler_seed": seed,
    }
    assert manifest["position"] == {
        "epoch": 1,
        "batches_done": 2,
        "samples_done": 4,  # of epoch 1's global order
        "epoch_finished": False,
        "order": order,
    }


@pytest.mark.parametrize("stop", [{"save_at": [15]}, {"save_epoch_end": [2]}], ids=["step15", "epoch2_end"])
def test_a_checkpoint_of_the_last_step_resumes_to_the_same_end(stop, tmp_path) -> None:
    # Validated at step 15 (val_check_interval 5) before the save: C trains nothing and does not validate again.
    a = fit(ShuffleTask, tmp_path / "a", val_check_interval=5)
    b, c = stop_and_resume(ShuffleTask, tmp_path / "bc", **stop, val_check_interval=5)
    assert c.probe.ids == [] and c.probe.steps == []
    assert_resumed_exactly(a, b, c)


def test_resuming_with_another_seed_changes_nothing(shuffled, tmp_path) -> None:
    # The model, the random states and the data order (the sampler's seed) all come from the checkpoint.
    b = fit(ShuffleTask, tmp_path, save_at=[7])
    c = fit(ShuffleTask, tmp_path, ckpt_path=b.checkpoint, seed=123)
    assert_resumed_exactly(shuffled, b, c)


# -------------------------------------------------------------------------------------- gradient accumulation


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory) -> dict[int, Run]:
    """A with grad_accum: steps 2 over 5 micro-batches (windows 2, 2, 1), steps 3 over 7 (3, 3, 1)."""
    return {
        2: fit(ShuffleTask, tmp_path_factory.mktemp("ga2"), [{"grad_accum": {"steps": 2}}]),
        3: fit(lambda: ShuffleTask(n=14), tmp_path_factory.mktemp("ga3"), [{"grad_accum": {"steps": 3}}]),
    }


def test_grad_accum_windows_are_partial_at_each_epoch_end(accumulated) -> None:
    a2, a3 = accumulated[2], accumulated[3]
    assert [s["batch_idx"] for s in a2.probe.steps] == [1, 3, 4] * 3
    assert [s["batch_idx"] for s in a3.probe.steps] == [2, 5, 6] * 3


@pytest.mark.parametrize(
    ("steps", "k"),
    [(2, 1), (2, 2), (2, 3), (2, 4), (2, 8), (3, 2), (3, 3), (3, 4)],
    ids=lambda v: str(v),
)
def test_grad_accum_resume_continues_exactly(accumulated, steps, k, tmp_path) -> None:
    # (2, 2): the next window is the epoch's partial one; (2, 3) / (3, 3): right after it (the epoch's end).
    make = ShuffleTask if steps == 2 else (lambda: ShuffleTask(n=14))
    b, c = stop_and_resume(make, tmp_path, [{"grad_accum": {"steps": steps}}], save_at=[k])
    assert b.engine.progress.global_step == k
    assert_resumed_exactly(accumulated[steps], b, c)


# ---------------------------------------------------------------------------------------------------- C10


@pytest.fixture(scope="module")
def c10(tmp_path_factory) -> Run:
    return fit(OverflowTask, tmp_path_factory.mktemp("c10_a"), [AMP16], max_epochs=1, val_check_interval=None)


def test_c10_uninterrupted_scale_and_skips(c10) -> None:
    # The scale doubles every 2 good steps from 2**10; the injected overflow above 2**11 skips steps 5 and 8.
    assert c10.engine.accelerator.scaler is not None and c10.engine.accelerator.mixed_precision == "fp16"
    assert [s["skipped"] for s in c10.probe.steps] == [False] * 4 + [True, False, False, True]
    assert [s["scaler"]["scale"] for s in c10.probe.steps] == [2.0**k for k in (10, 11, 11, 12, 11, 11, 12, 11)]
    assert [s["lr"] for s in c10.probe.steps] == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025, 0.025, 0.0125]


@pytest.mark.parametrize("k", [4, 5])
def test_c10_resume_restores_the_loss_scaler(c10, k, tmp_path) -> None:
    b, c = stop_and_resume(OverflowTask, tmp_path, [AMP16], save_at=[k], max_epochs=1, val_check_interval=None)
    saved_scale = b.engine.accelerator.scaler.get_scale()
    assert saved_scale == c10.probe.steps[k - 1]["scaler"]["scale"] == (4096.0 if k == 4 else 2048.0)
    assert c.probe.scale_at_start == saved_scale  # right after the load: the saved scale, not init_scale
    rec = assert_resumed_exactly(c10, b, c)
    for sa, sc in zip(rec["a_steps"][k:], c.probe.steps, strict=True):  # steps k+1..8, field by field
        for field in ("lr", "skipped", "scaler", "params"):
            assert sc[field] == sa[field], f"step {sa['step']}: {field}"
    assert rec["c"]["skipped_steps"] == [0, 2]  # the scaler's skips of B and C together


# ---------------------------------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("stop", [{"save_at": [7]}, {"save_epoch_end": [0]}], ids=["step7", "epoch0_end"])
def test_bf16_resume_continues_exactly(stop, tmp_path) -> None:
    bf16 = [{"mixed_precision": {"dtype": "bf16"}}]
    a = fit(ShuffleTask, tmp_path / "a", bf16)
    assert a.engine.accelerator.mixed_precision == "bf16"
    b, c = stop_and_resume(ShuffleTask, tmp_path / "bc", bf16, **stop)
    assert_resumed_exactly(a, b, c)


# ------------------------------------------------------------------------------------------- 2 processes


@pytest.mark.multiprocess
def test_two_processes_resume_exactly(tmp_path) -> None:
    """DDP with a shuffle (mid-epoch, an epoch's last step, an epoch-end checkpoint), with grad_accum (around
    the partial window), and LocalSGD (K = 2) right after an average: each rank's B + C is its A, bitwise."""
    ranks = torchrun("resume_fit.py", tmp_path, nproc=2, timeout=300)
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    for name, spec in MP_SCENARIOS.items():
        for i, stop in enumerate(spec["stops"]):
            recs = [r[name][i] for r in ranks]
            for rank, rec in enumerate(recs):
                try:
                    assert_resumed_exactly(rec)
                except AssertionError as exc:
                    raise AssertionError(f"{name} {stop}, rank {rank}: {exc}") from None
            assert recs[0]["c"]["params"] == recs[1]["c"]["params"], f"{name} {stop}: the ranks differ"
            assert not set(recs[0]["a_ids"][:2]) & set(recs[1]["a_ids"][:2]), f"{name}: not data-parallel"
            assert recs[0]["b_global_step"] == recs[1]["b_global_step"]


# ------------------------------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A checkpoint of ShuffleTask at step 7 (AdamW + StepLR, no stateful plugin)."""
    return fit(ShuffleTask, tmp_path_factory.mktemp("saved"), save_at=[7]).checkpoint


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A copy of ``saved`` to alter."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def _resume(make, tmp_path: Path, ckpt_path: Any, plugins=(), **kwargs: Any) -> Run:
    return fit(make, tmp_path / "resumed", plugins, ckpt_path=str(ckpt_path), **kwargs)


def test_another_model_shape_is_refused_naming_the_parameter(saved, tmp_path) -> None:
    with pytest.raises(torchloom.CheckpointError, match=r"0\.weight: saved \[8, 2\], now \[9, 2\]"):
        _resume(lambda: ShuffleTask(hidden=9), tmp_path, saved)


def test_another_optimizer_is_refused_unless_reset(saved, tmp_path) -> None:
    make = lambda: ShuffleTask(optimizer="sgd+steplr", lr=0.01)  # noqa: E731
    with pytest.raises(torchloom.CheckpointError, match=r"its optimizer is AdamW, this run's is SGD.*reset_optimizer"):
        _resume(make, tmp_path, saved)
    with pytest.warns(UserWarning, match=r"reset_optimizer=True: the optimizer starts with fresh state"):
        c = _resume(make, tmp_path, saved, reset_optimizer=True)
    assert c.probe.optimizer_at_start == {"state": 0, "lr": [0.01], "class": "SGD"}  # fresh, its own lr
    assert c.engine.progress.global_step == 15 and c.probe.steps[0]["step"] == 8  # and it went on from step 7


def test_reset_optimizer_with_the_same_optimizer_class_starts_it_fresh(saved, tmp_path) -> None:
    """reset_optimizer=True discards the saved optimizer state whether or not the class changed (AdamW both times
    here); without it the saved state and learning rate come back."""
    make = lambda: ShuffleTask(lr=0.02)  # noqa: E731
    with pytest.warns(UserWarning, match=r"reset_optimizer=True: the optimizer starts with fresh state"):
        fresh = _resume(make, tmp_path / "fresh", saved, reset_optimizer=True)
    assert fresh.probe.optimizer_at_start == {"state": 0, "lr": [0.02], "class": "AdamW"}
    kept = _resume(make, tmp_path / "kept", saved)
    assert kept.probe.optimizer_at_start == {"state": 4, "lr": [0.05 * 0.5**3], "class": "AdamW"}  # StepLR(2, 0.5)


def test_a_scheduler_on_one_side_only_is_refused(saved, tmp_path) -> None:
    with pytest.raises(torchloom.CheckpointError, match=r"holds a learning-rate scheduler's state and this run has no"):
        _resume(lambda: ShuffleTask(optimizer="sgd"), tmp_path, saved, reset_optimizer=True)


def test_another_set_of_stateful_plugins_is_refused(saved, tmp_path) -> None:
    lsgd = [{"local_sgd": {"sync_every": 2}}]  # on one process it only warns, but it is stateful
    with pytest.warns(UserWarning, match="LocalSGD does nothing"):
        with_lsgd = fit(ShuffleTask, tmp_path / "lsgd", lsgd, save_at=[3]).checkpoint
    with pytest.raises(torchloom.CheckpointError, match=r"stateful plugins are 'local_sgd', this run's are none"):
        _resume(ShuffleTask, tmp_path, with_lsgd)
    with pytest.raises(torchloom.CheckpointError, match=r"stateful plugins are none, this run's are 'local_sgd'"):
        _resume(ShuffleTask, tmp_path, saved, lsgd)
    with pytest.raises(torchloom.CheckpointError, match=r"parameters differ \(0\.bias.*; its stateful plugins"):
        _resume(lambda: ShuffleTask(hidden=9), tmp_path, with_lsgd)  # one error says everything that differs


def test_a_changed_file_is_refused(ckpt, tmp_path) -> None:
    weights = ckpt / "accelerate" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last weight; the size stays
    weights.write_bytes(bytes(data))
    with pytest.raises(torchloom.CheckpointError, match=r"accelerate/model\.safetensors changed since"):
        _resume(ShuffleTask, tmp_path, ckpt)


class _Payload:
    """Unpickling it calls ``open(marker, "w")``: it creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (str(self.marker), "w"))


def test_a_planted_file_is_refused_without_loading_it(ckpt, tmp_path) -> None:
    marker = tmp_path / "planted-ran"
    torch.save(_Payload(marker), ckpt / "accelerate" / "custom_checkpoint_0.pkl")
    with pytest.raises(torchloom.CheckpointError, match=r"files its manifest does not list: accelerate/custom_"):
        _resume(ShuffleTask, tmp_path, ckpt)
    assert not marker.exists()


def test_a_malicious_pickle_is_refused_without_running_it(ckpt, tmp_path) -> None:
    live = tmp_path / "payload-is-live"
    torch.save(_Payload(live), tmp_path / "probe.bin")
    torch.load(tmp_path / "probe.bin", weights_only=False)  # an unsafe load of this payload creates a file
    assert live.exists()

    marker = tmp_path / "payload-ran"
    torch.save(_Payload(marker), ckpt / "accelerate" / "optimizer.bin")
    _add_to_manifest(ckpt, "accelerate/optimizer.bin")
    with pytest.raises(torchloom.CheckpointError, match=r"accelerate/ holds objects other than tensors"):
        _resume(ShuffleTask, tmp_path, ckpt)
    assert not marker.exists()


def _add_to_manifest(ckpt: Path, name: str) -> None:
    """List ``ckpt/name`` in the manifest with its real size and hash: only its content can refuse it."""
    manifest_path = ckpt / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = (ckpt / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


def test_a_checkpoint_holds_no_pickle_of_random_states(saved) -> None:
    """The random states are each process's engine state (JSON and safetensors), not Accelerate's pickle."""
    files = json.loads((Path(saved) / "manifest.json").read_text())["files"]
    assert not [name for name in files if name.endswith(".pkl")]
    assert {"engine/process_0/process.json", "engine/process_0/process.safetensors"} <= files.keys()
    process = json.loads((Path(saved) / "engine" / "process_0" / "process.json").read_text())["state"]
    assert sorted(process["random_states"]) == ["numpy", "python", "torch"]
    assert len(process["random_states"]["python"]["internal"]) == 625


def test_a_planted_random_state_pickle_is_refused_even_when_listed(ckpt, tmp_path) -> None:
    """Accelerate's loader unpickles ``random_states_<rank>.pkl`` and skips it in silence when torch refuses it:
    a checkpoint that holds one is refused before anything is loaded, and its payload never runs."""
    marker = tmp_path / "payload-ran"
    torch.save(_Payload(marker), ckpt / "accelerate" / "random_states_0.pkl")
    _add_to_manifest(ckpt, "accelerate/random_states_0.pkl")
    with pytest.raises(
        torchloom.CheckpointError, match=r"holds a pickle of random states \(accelerate/random_states_0"
    ):
        _resume(ShuffleTask, tmp_path, ckpt)
    assert not marker.exists()


class _Hooks:
    """Records the fit hooks that fire."""

    name = "test.hooks"

    def __init__(self) -> None:
        self.fired: list[str] = []

    @torchloom.hookimpl
    def on_fit_start(self) -> None:
        self.fired.append("on_fit_start")

    @torchloom.hookimpl
    def on_exception(self) -> None:
        self.fired.append("on_exception")

    @torchloom.hookimpl
    def on_fit_end(self) -> None:
        self.fired.append("on_fit_end")

    @torchloom.hookimpl
    def teardown(self) -> None:
        self.fired.append("teardown")


@pytest.mark.parametrize("refusal", ["shape", "changed_file", "missing_process_state"])
def test_a_refused_resume_is_a_failed_set_up(ckpt, tmp_path, refusal) -> None:
    """Nothing was trained: the run directory the fit created is removed again, and only ``teardown`` fires."""
    make: Any = ShuffleTask
    if refusal == "shape":
        make = lambda: ShuffleTask(hidden=9)  # noqa: E731
    elif refusal == "changed_file":
        (ckpt / "engine" / "engine.json").write_text("{}")
    else:
        shutil.rmtree(ckpt / "engine" / "process_0")
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("engine/process_0/")}
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
    output_dir = tmp_path / "out"
    fit(ShuffleTask, output_dir, max_epochs=1)  # a finished run in the same output_dir stays as it was
    before = sorted(p.name for p in output_dir.iterdir())
    hooks = _Hooks()
    with pytest.raises(torchloom.CheckpointError):
        fit(make, output_dir, [hooks], ckpt_path=str(ckpt))
    assert sorted(p.name for p in output_dir.iterdir()) == before == ["latest", "version_0"]
    assert hooks.fired == ["teardown"]


# ------------------------------------------------------------------------------------- killed during a save


def test_a_process_killed_inside_a_save_leaves_the_previous_checkpoint(shuffled, tmp_path) -> None:
    """A child saves at step 2, then is SIGKILLed inside the save of step 4 (paused right before the rename)."""
    a = shuffled
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(MP_DIR), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, str(MP_DIR / "resume_fit.py"), str(tmp_path), "pause_save"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "paused").exists():
            assert child.poll() is None, child.stdout.read().decode() if child.stdout else ""
            assert time.monotonic() < deadline, "the child never reached the save of step 4"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    output_dir = tmp_path / "run"
    checkpoints = output_dir / "version_0" / "checkpoints"
    tmp_dir = checkpoints / f".step-00000004.tmp-{child.pid}"
    assert Path((tmp_path / "paused").read_text()) == tmp_dir
    assert tmp_dir.is_dir() and (tmp_dir / "manifest.json").is_file()  # complete but for the rename
    assert list_checkpoints(output_dir) == [str(checkpoints / "step-00000002")]
    assert sorted(p.name for p in checkpoints.iterdir()) == [tmp_dir.name, "step-00000002"]

    c = fit(ShuffleTask, output_dir, ckpt_path=str(output_dir))  # the latest complete checkpoint of the latest run
    assert c.engine.resumed_from == str(checkpoints / "step-00000002")
    assert not tmp_dir.exists()  # the next run in this output_dir removed the orphan
    assert c.probe.ids == a.probe.ids[4:]
    assert c.probe.steps == a.probe.steps[2:]
    assert snapshot(c.engine) == snapshot(a.engine)
