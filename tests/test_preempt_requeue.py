"""Preempt, requeue, resume (issue 29, item 1): ``torchloom fit --resume auto`` is the one command line of a job
that a scheduler stops and restarts. The first start finds no checkpoint and starts fresh; every restart resumes
from the latest complete checkpoint of the ``output_dir``. ``keep_last`` counts the training, not the run, so the
checkpoints left stay within it however often the job is stopped; under SLURM the ``checkpoint`` plugin's
``requeue`` runs ``scontrol requeue $SLURM_JOB_ID`` after the save and ``<run_dir>/slurm.json`` records the
restart counter.

The SLURM here is a stand-in: an ``scontrol`` script on ``PATH`` that records its calls, and the variables SLURM
sets for a job (``SLURM_JOB_ID``, ``SLURM_RESTART_COUNT``) set by the test, since a SLURM controller is not part of
the test session. ``tests/test_slurm.py`` runs the same job under a real single-node SLURM where one can be started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

import torchloom
from cli_util import SOURCE_PATHS, run_cli
from torchloom.checkpoint.store import list_checkpoints
from torchloom.testing import TinyTask

#: The task of the job: shuffled samples, dropout, AdamW with a scheduler (so the data position, the random
#: states, the optimizer and the scheduler must all come back). ``PREEMPT_HOLD`` names a file holding a number k:
#: the k-th training step of the process then waits (writing ``<file>.reached``) until the file is removed, so
#: that the test's SIGTERM lands in a known step.
TASK_MODULE = """
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom


class Preemptible(torchloom.TaskModule):
    def __init__(self, n: int = 12, batch_size: int = 2):
        super().__init__()
        self.n, self.batch_size, self.calls = n, batch_size, 0

    def configure_model(self):
        return torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(self.n, 2, generator=g), torch.randn(self.n, 1, generator=g))
        return DataLoader(data, batch_size=self.batch_size, shuffle=True, generator=torch.Generator().manual_seed(1))

    def training_step(self, batch, batch_idx):
        self.calls += 1
        hold = os.environ.get("PREEMPT_HOLD")
        if hold and Path(hold).is_file() and int(Path(hold).read_text()) == self.calls:
            Path(hold + ".reached").write_text(str(self.calls))
            deadline = time.monotonic() + 120
            while Path(hold).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)
"""

#: A stand-in for SLURM's ``scontrol``: appends its arguments to ``$SCONTROL_CALLS``, one call a line. As SLURM
#: does, a requeue ends the running job with a SIGTERM: sent to the process that asked, from the background, every
#: 5 ms until it is gone, so that one arrives after the fit returned (while the process reports and exits).
SCONTROL = """#!/bin/sh
echo "$@" >> "$SCONTROL_CALLS"
job=$PPID
(while kill -TERM "$job" 2>/dev/null; do sleep 0.005; done) </dev/null >/dev/null 2>&1 &
"""

KEEP_LAST = 2
JOB_ID = "4242"


def _project(tmp_path: Path) -> Path:
    (tmp_path / "preemptible.py").write_text(TASK_MODULE)
    config = {
        "engine": {"max_epochs": 3, "log_every_n_steps": 1, "output_dir": "job", "seed": 7, "save_model": True},
        "task": {"class_path": "preemptible.Preemptible"},
        "plugins": {"checkpoint": {"every_n_steps": 2, "keep_last": KEEP_LAST, "requeue": True}},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    return bin_dir


def _job_env(tmp_path: Path, bin_dir: Path, restarts: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*SOURCE_PATHS, *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        SLURM_JOB_ID=JOB_ID,
        SLURM_RESTART_COUNT=str(restarts),
        SCONTROL_CALLS=str(tmp_path / "scontrol-calls.txt"),
        PREEMPT_HOLD=str(tmp_path / "hold"),
    )
    return env


def _preempted_start(tmp_path: Path, env: dict[str, str], hold_at: int) -> subprocess.CompletedProcess[str]:
    """The job's command line in a process of its own, sent SIGTERM in its ``hold_at``-th training step."""
    hold, reached = tmp_path / "hold", tmp_path / "hold.reached"
    reached.unlink(missing_ok=True)
    hold.write_text(str(hold_at))
    command = [sys.executable, "-m", "torchloom.cli", "fit", "--config", "config.yaml", "--resume", "auto"]
    with subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        deadline = time.monotonic() + 240
        while not reached.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reached.exists(), "the fit never reached the step to preempt"
        process.send_signal(signal.SIGTERM)  # as SLURM's preemption does, before it kills the job
        hold.unlink()
        out, err = process.communicate(timeout=240)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "model" / "model.safetensors"))


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "carried_over_from"} for line in lines]


@pytest.mark.slow
def test_three_preemptions_with_requeue_end_bitwise_as_an_uninterrupted_run_within_keep_last(tmp_path):
    bin_dir = _project(tmp_path)
    whole = run_cli("fit", "--config", "config.yaml", "--resume", "auto", "--engine.output_dir=whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert "resumed from" not in whole.stdout  # --resume auto on an empty output_dir: a fresh start

    # 12 samples in batches of 2: 6 steps an epoch, 18 in all. SIGTERM in the 5th step of the first start (step
    # 5), the 4th of the first restart (step 9), the 5th of the second (step 14, in the last epoch).
    stops, previous = [5, 9, 14], 0
    for restarts, stop in enumerate(stops):
        env = _job_env(tmp_path, bin_dir, restarts)
        cut = _preempted_start(tmp_path, env, hold_at=stop - previous)
        assert cut.returncode == 143, cut.stderr
        assert f"interrupted by SIGTERM after optimizer step {stop}" in cut.stderr
        assert f"checkpoint: requeued SLURM job {JOB_ID} (scontrol requeue {JOB_ID})" in cut.stdout
        if previous:
            assert f"(step {previous})" in cut.stdout and "torchloom fit: resumed from" in cut.stdout
        else:
            assert "resumed from" not in cut.stdout
        # keep_last over the training, and the checkpoint the interrupted fit resumed from (kept while it trains)
        assert len(list_checkpoints(tmp_path / "job")) <= KEEP_LAST + (1 if previous else 0)
        previous = stop
    env = _job_env(tmp_path, bin_dir, len(stops))
    env.pop("PREEMPT_HOLD")
    last = subprocess.run(
        [sys.executable, "-m", "torchloom.cli", "fit", "--config", "config.yaml", "--resume", "auto"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert last.returncode == 0, last.stderr
    assert "torchloom fit: resumed from job/version_2/checkpoints/step-00000014 (step 14)" in last.stdout

    runs = [tmp_path / "job" / f"version_{i}" for i in range(4)]
    # One requeue per preemption, of this job; each run recorded the job and its restart counter.
    assert (tmp_path / "scontrol-calls.txt").read_text().splitlines() == [f"requeue {JOB_ID}"] * 3
    for restarts, run in enumerate(runs):
        slurm = json.loads((run / "slurm.json").read_text())
        assert (slurm["job_id"], slurm["restart_count"]) == (JOB_ID, restarts)
    # The end of the 4 runs is the uninterrupted run, bitwise; its metrics.jsonl is the whole run's, record for record.
    expected, got = _weights(tmp_path / "whole" / "version_0"), _weights(runs[-1])
    assert expected.keys() == got.keys() and all(expected[k].equal(got[k]) for k in expected)
    assert _records(runs[-1]) == _records(tmp_path / "whole" / "version_0")
    # At most keep_last checkpoints left in the output_dir after 3 preemptions (the runs saved 10 in all): the last
    # run's newest two, the step-18 one and the end of the last epoch (at the same step).
    left = list_checkpoints(tmp_path / "job")
    assert [Path(p).relative_to(tmp_path / "job").as_posix() for p in left] == [
        "version_3/checkpoints/step-00000018",
        "version_3/checkpoints/step-00000018-epoch-end",
    ]


def test_fit_with_ckpt_path_auto_starts_fresh_on_an_empty_output_dir_then_resumes_its_latest(tmp_path):
    settings = {"output_dir": str(tmp_path / "out"), "max_epochs": 1, "log_every_n_steps": 1}
    first = torchloom.Engine(plugins=["checkpoint"], default_plugins=False, **settings)
    first.fit(TinyTask(), ckpt_path="auto")
    assert first.resumed_from is None and first.progress.global_step == 8
    settings["max_epochs"] = 2
    second = torchloom.Engine(plugins=["checkpoint"], default_plugins=False, **settings)
    second.fit(TinyTask(), ckpt_path="auto")
    assert second.resumed_from == list_checkpoints(tmp_path / "out" / "version_0")[-1]
    assert second.progress.global_step == 16


@pytest.fixture
def sigterm_restored():
    """The test process's SIGTERM handler as it was, after a fit that may leave SIGTERM ignored."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


class _SigtermAt:
    name = "test.sigterm_at"

    @torchloom.hookimpl
    def on_train_batch_start(self, progress) -> None:
        if progress.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize(
    ("job", "scontrol", "warning"),
    [
        (None, None, "requeue is set but SLURM_JOB_ID is not: not a SLURM job, nothing requeued"),
        ("17", None, "cannot requeue SLURM job 17: no 'scontrol' on PATH"),
        ("17", "echo 'Invalid job id specified' >&2; exit 1", "scontrol requeue 17: Invalid job id specified"),
    ],
)
def test_a_requeue_that_cannot_be_done_warns_and_the_fit_still_stops_with_its_checkpoint(
    tmp_path, monkeypatch, sigterm_restored, job, scontrol, warning
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if scontrol is not None:
        (bin_dir / "scontrol").write_text(f"#!/bin/sh\n{scontrol}\n")
        (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))  # no scontrol but the stand-in
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    if job is not None:
        monkeypatch.setenv("SLURM_JOB_ID", job)
    engine = torchloom.Engine(
        output_dir=str(tmp_path / "out"),
        plugins=[{"checkpoint": {"every_n_epochs": None, "requeue": True}}, _SigtermAt()],
        default_plugins=False,
    )
    with pytest.warns(UserWarning, match=warning), pytest.raises(torchloom.TrainingInterrupted) as stopped:
        engine.fit(TinyTask())
    assert stopped.value.checkpoint.endswith("step-00000003")
    slurm = Path(engine.run_dir) / "slurm.json"
    assert slurm.is_file() == (job is not None)
    if job is not None:
        assert json.loads(slurm.read_text())["restart_count"] == 0  # SLURM_RESTART_COUNT unset: the first start


@pytest.mark.parametrize(("job", "requeue", "ignored"), [("17", True, True), ("17", False, False), (None, True, False)])
def test_after_a_requeue_under_slurm_sigterm_is_ignored_and_otherwise_the_handler_is_restored(
    tmp_path, monkeypatch, sigterm_restored, job, requeue, ignored
):
    """SLURM ends the job it requeued with a SIGTERM: after the fit, it must not kill the process before the
    process reports the interruption. Without a requeue, or outside SLURM, the handler from before the fit is back."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    if job is not None:
        monkeypatch.setenv("SLURM_JOB_ID", job)

    def mine(number, frame):  # the handler the fit finds, and must give back
        raise AssertionError("not called")

    signal.signal(signal.SIGTERM, mine)
    engine = torchloom.Engine(
        output_dir=str(tmp_path / "out"),
        plugins=[{"checkpoint": {"every_n_epochs": None, "requeue": requeue}}, _SigtermAt()],
        default_plugins=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # outside SLURM: "nothing requeued"
        with pytest.raises(torchloom.TrainingInterrupted):
            engine.fit(TinyTask())
    assert signal.getsignal(signal.SIGTERM) is (signal.SIG_IGN if ignored else mine)
    plugins = [{"checkpoint": {"every_n_steps": 1, "every_n_epochs": None, "requeue": requeue}}]
    engine = torchloom.Engine(output_dir=str(tmp_path / "again"), max_steps=1, plugins=plugins, default_plugins=False)
    engine.fit(TinyTask())  # a later fit that no signal stopped gives back what it found
    assert signal.getsignal(signal.SIGTERM) is (signal.SIG_IGN if ignored else mine)


def test_keep_last_counts_the_training_but_a_resumed_fit_that_saves_nothing_deletes_nothing(tmp_path):
    out = tmp_path / "out"

    def fit(epochs: int, keep_last: int | None) -> torchloom.Engine:
        plugins = {"checkpoint": {"every_n_steps": 2, "keep_last": keep_last}}
        engine = torchloom.Engine(output_dir=str(out), max_epochs=epochs, plugins=plugins, default_plugins=False)
        engine.fit(TinyTask(), ckpt_path="auto")
        return engine

    fit(1, None)  # steps 2, 4, 6, 8 and the end of epoch 0
    assert len(list_checkpoints(out)) == 5
    fit(1, 2)  # resumed at the end of training: nothing to train, nothing saved, nothing deleted
    assert len(list_checkpoints(out)) == 5
    fit(2, 2)  # trains epoch 1: keeps the newest 2 of the whole training, the one resumed from gone at the end
    assert [Path(p).relative_to(out).as_posix() for p in list_checkpoints(out)] == [
        "version_2/checkpoints/step-00000016",
        "version_2/checkpoints/step-00000016-epoch-end",
    ]
