"""Run a script under ``torchrun --nproc_per_node N`` on CPU (gloo) and return its JSON results.

Each script in tests/mp/ takes an output directory as its first argument and writes
``result-<rank>.json`` there; tests compare ranks with each other and with a 1-process run.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MP_DIR = Path(__file__).parent / "mp"
#: The test being run (set by tests/conftest.py before its fixtures): `torchrun` checks it is marked multiprocess.
current_test: Any = None


def require_multiprocess_marker(what: str) -> None:
    """Fail unless the running test is marked ``multiprocess``: the quick subset (``-m "not slow and not
    multiprocess"``, CONTRIBUTING.md) starts no torchrun, whoever adds one."""
    if current_test is not None and current_test.get_closest_marker("multiprocess") is None:
        raise AssertionError(f"{current_test.nodeid} starts {what}: mark it @pytest.mark.multiprocess")


#: The longest a launch may take to start when a test waits for it (``torchrun(started=...)``).
START_LIMIT = 300.0


def torchrun(
    script: str,
    out_dir: Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 240,
    started: Callable[[], bool] | None = None,
) -> list[Any]:
    """Run ``tests/mp/<script>`` on ``nproc`` CPU processes; return the per-rank results, rank order.

    One launch, never retried: any failure (a rank that raised, a process killed by a signal, an abort at exit)
    fails the test with the launch's output. ``--standalone`` lets torchrun choose a free port itself, so no two
    launches can race for one. A launch still running after ``timeout`` seconds is a hang: the launcher and every
    process it started are killed (torchrun starts each worker in a session of its own, so ending the launcher
    alone, as ``subprocess.run(timeout=...)`` does, would leave the workers running after the test), and the test
    fails with their last output. With ``started``, the ``timeout`` counts from when ``started()`` is first true
    (polled every 0.1 s, for at most `START_LIMIT` seconds): a test of the hang itself then does not depend on how
    long a busy machine takes to start the launcher and its workers.

    Raises:
        AssertionError: the launch failed or hung (its output is in the message).
    """
    require_multiprocess_marker(f"torchrun {script}")
    env = _launch_environment(out_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    launcher = subprocess.Popen(
        [*cmd, str(MP_DIR / script), str(out_dir), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if started is not None:
        limit = time.monotonic() + START_LIMIT
        while not started() and launcher.poll() is None and time.monotonic() < limit:
            time.sleep(0.1)
    try:
        stdout, stderr = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        workers = kill_tree(launcher.pid)
        stdout, stderr = launcher.communicate()
        raise AssertionError(
            f"torchrun {script} hung: still running after {timeout:g} s; the launcher and its {len(workers)} "
            f"worker(s) (pids {workers}) were killed. Their last output:\n{stdout[-4000:]}\n{stderr[-8000:]}"
        ) from None
    assert launcher.returncode == 0, (
        f"torchrun {script} failed ({launcher.returncode}):\n{stdout[-4000:]}\n{stderr[-8000:]}"
    )
    return [json.loads((out_dir / f"result-{rank}.json").read_text()) for rank in range(nproc)]


def torchrun_nodes(
    script: str, out_dir: Path, *args: str, nnodes: int = 2, nproc: int = 1, timeout: float = 300
) -> list[Any]:
    """Run ``tests/mp/<script>`` as ``nnodes`` torchrun "nodes" on this machine, ``nproc`` CPU processes each: one
    launcher per node (``--nnodes``, ``--node_rank``), meeting at a static rendezvous on 127.0.0.1, as the
    launchers of several machines meet at the first one's address. Return the per-rank results, global rank order.

    Raises:
        AssertionError: a launcher failed or hung (every launcher and its workers are then killed).
    """
    import socket

    require_multiprocess_marker(f"torchrun --nnodes {nnodes} {script}")
    with socket.socket() as probe:  # a free port for the rendezvous (the first node's agent binds it)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = _launch_environment(out_dir)

    def node_command(node: int) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node}",
            f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}",
            str(MP_DIR / script), str(out_dir), *args,
        ]  # fmt: skip

    launchers = [
        subprocess.Popen(node_command(node), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in range(nnodes)
    ]
    outputs = []
    deadline = time.monotonic() + timeout
    try:
        for launcher in launchers:
            outputs.append(launcher.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for launcher in launchers:
            kill_tree(launcher.pid)
        raise AssertionError(f"torchrun --nnodes {nnodes} {script} hung: still running after {timeout:g} s") from None
    for node, (launcher, (stdout, stderr)) in enumerate(zip(launchers, outputs)):
        assert launcher.returncode == 0, (
            f"torchrun node {node} of {script} failed ({launcher.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}"
        )
    return [json.loads((out_dir / f"result-{rank}.json").read_text()) for rank in range(nnodes * nproc)]


def _launch_environment(out_dir: Path) -> dict[str, str]:
    """The environment of a launch's processes (CPU processes, one thread each, offline, tests/mp importable); the
    results of an earlier launch into ``out_dir`` are removed first."""
    for stale in out_dir.glob("result-*.json"):
        stale.unlink()
    return {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(MP_DIR), os.environ.get("PYTHONPATH", "")]),
    }


def kill_tree(pid: int) -> list[int]:
    """SIGKILL the process ``pid`` and every process below it, whatever session each is in; return the
    descendants' pids."""
    import psutil

    try:
        root = psutil.Process(pid)
        descendants = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for process in [*descendants, root]:  # the children first: none is reparented out of reach
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs([*descendants, root], timeout=30)
    return [process.pid for process in descendants]
