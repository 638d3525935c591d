"""Preempt, requeue, resume under a real SLURM (issue 29, item 1): the test session starts a single-node SLURM on
this machine (Debian's ``slurm-wlm``: ``munged``, ``slurmctld``, ``slurmd``, each on a socket or ports of its own in
the test's directory, stopped by process id afterwards), submits a 2-step job whose second step is
``torchloom fit --config config.yaml --resume auto`` with the ``checkpoint`` plugin's ``requeue``, and preempts it
with ``scancel --signal=TERM``. The fit saves, runs ``scontrol requeue $SLURM_JOB_ID`` and exits 143; SLURM queues
the job again and starts the same script, whose fit resumes and ends bitwise where an uninterrupted fit ends.

Where SLURM cannot run here (its programs are not installed, the test does not run as root, or the daemons do not
come up), the test is skipped and says why; ``tests/test_preempt_requeue.py`` runs the same loop, three times, with
a stand-in ``scontrol`` that records its calls.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_util import SOURCE_PATHS, run_cli
from test_preempt_requeue import KEEP_LAST, _project, _records, _weights
from torchloom.checkpoint.store import list_checkpoints

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")

SLURM_CONF = """ClusterName=torchloom
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
JobRequeue=1
MinJobAge=600
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

#: The job: step 0 records the start (SLURM_RESTART_COUNT is unset at the first), step 1 is the fit.
JOB = """#!/bin/bash
#SBATCH --job-name=torchloom-preempt --requeue --open-mode=append --output=job.out
srun -n1 bash -c 'echo "start ${{SLURM_RESTART_COUNT:-0}}" >> starts.txt'
srun -n1 {python} -m torchloom.cli fit --config config.yaml --resume auto
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Slurm:
    """A single-node SLURM of the test's own, in ``root``; ``env`` points its commands at it (``SLURM_CONF``)."""

    def __init__(self, root: Path) -> None:
        self.root, self.pid_files = root, []
        self.env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))

    def start(self) -> str | None:
        """Start munged, slurmctld and slurmd; return why SLURM cannot run here, or None once the node is idle."""
        root = self.root
        for folder in ("munge", "state", "spool"):
            (root / folder).mkdir(mode=0o700)
        key = root / "munge" / "key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        munge = ["munged", f"--key-file={key}", f"--socket={root}/munge/socket", f"--pid-file={root}/munge/pid"]
        munge += [f"--log-file={root}/munge/log", f"--seed-file={root}/munge/seed", "--force"]
        self.pid_files.append(root / "munge" / "pid")
        conf = SLURM_CONF.format(
            host=socket.gethostname(), root=root, ctld_port=_free_port(), d_port=_free_port(), cpus=os.cpu_count()
        )
        (root / "slurm.conf").write_text(conf)
        for command, pid_file in [
            (munge, None),
            (["slurmctld", "-f", str(root / "slurm.conf")], root / "slurmctld.pid"),
            (["slurmd", "-f", str(root / "slurm.conf")], root / "slurmd.pid"),
        ]:
            done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
            if pid_file is not None:
                self.pid_files.append(pid_file)
            if done.returncode != 0:
                return f"{command[0]} did not start: {' '.join((done.stderr or done.stdout).split())[:300]}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-o", "%t").stdout.strip()
            if state == "idle":
                return None
            time.sleep(0.5)
        log = (root / "slurmctld.log").read_text(errors="replace")[-300:] if (root / "slurmctld.log").exists() else ""
        return f"the SLURM node did not come up (sinfo: {state!r}); slurmctld.log ends: {' '.join(log.split())}"

    def run(self, *command: str, cwd: Path | None = None, env: dict[str, str] | None = None):
        return subprocess.run(command, cwd=cwd, env=env or self.env, capture_output=True, text=True, timeout=60)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ...)."""
        text = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def stop(self) -> None:
        """Stop the daemons this fixture started, each by its process id (slurmd, slurmctld, then munged)."""
        for pid_file in reversed(self.pid_files):
            try:
                os.kill(int(pid_file.read_text().strip()), 15)
            except (OSError, ValueError):
                continue


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[Slurm]:
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        pytest.skip(f"real SLURM not available here ({', '.join(missing)} not installed: apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("real SLURM not available here: starting slurmctld and slurmd as one node needs root")
    cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        why = cluster.start()
        if why is not None:
            pytest.skip(f"real SLURM not available here: {why}")
        yield cluster
    finally:
        cluster.stop()


def _wait(what: str, condition, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_real_slurm_job_preempted_with_sigterm_is_requeued_and_resumes_bitwise(slurm, tmp_path):
    print("SLURM: real single-node slurmctld + slurmd (slurm-wlm), started by this test")
    _project(tmp_path)
    whole = run_cli("fit", "--config", "config.yaml", "--engine.output_dir=whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    (tmp_path / "job.sh").write_text(JOB.format(python=sys.executable))
    hold = tmp_path / "hold"
    hold.write_text("5")  # the first start waits in its 5th step until preempted
    env = dict(slurm.env, PREEMPT_HOLD=str(hold))
    env["PYTHONPATH"] = os.pathsep.join([*SOURCE_PATHS, *filter(None, [env.get("PYTHONPATH")])])
    submitted = slurm.run("sbatch", "--parsable", "job.sh", cwd=tmp_path, env=env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]

    _wait("the fit to reach step 5", (tmp_path / "hold.reached").exists)
    signalled = slurm.run("scancel", "--signal=TERM", job_id)  # SIGTERM to the job's steps, as a preemption sends
    assert signalled.returncode == 0, signalled.stderr
    hold.unlink()
    _wait("the job to be requeued", lambda: slurm.job(job_id).get("Restarts") == "1")
    # A requeued job waits about 2 minutes (its BeginTime) before SLURM starts it again: the test does not.
    _wait("the requeued job to be pending", lambda: slurm.job(job_id).get("JobState") == "PENDING")
    # The kill of the first start revoked the job's credential, and slurmd refuses a credential made in the same
    # second as that revocation ("Job N already killed, do not launch batch job": its times are whole seconds). The
    # job is pending, so the revocation is behind us: release it once a whole second has passed after this one.
    pending_at = time.time()
    while time.time() < math.floor(pending_at) + 2:
        time.sleep(0.05)
    released = slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    assert released.returncode == 0, released.stderr
    _wait("the job to complete", lambda: slurm.job(job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"))
    job = slurm.job(job_id)
    out = (tmp_path / "job.out").read_text()
    assert (job["JobState"], job["Restarts"]) == ("COMPLETED", "1"), out

    # Both steps ran at each start; the fit was preempted after step 5, requeued itself, and resumed from step 5.
    assert (tmp_path / "starts.txt").read_text().splitlines() == ["start 0", "start 1"]
    assert "interrupted by SIGTERM after optimizer step 5" in out
    assert f"checkpoint: requeued SLURM job {job_id} (scontrol requeue {job_id})" in out
    assert "torchloom fit: resumed from job/version_0/checkpoints/step-00000005 (step 5)" in out
    runs = [tmp_path / "job" / f"version_{i}" for i in range(2)]
    for restarts, run in enumerate(runs):
        recorded = json.loads((run / "slurm.json").read_text())
        assert (recorded["job_id"], recorded["restart_count"]) == (job_id, restarts)
    expected, got = _weights(tmp_path / "whole" / "version_0"), _weights(runs[-1])
    assert expected.keys() == got.keys() and all(expected[k].equal(got[k]) for k in expected)
    assert _records(runs[-1]) == _records(tmp_path / "whole" / "version_0")
    assert len(list_checkpoints(tmp_path / "job")) <= KEEP_LAST
