"""Run a script under ``torchrun --nproc_per_node N`` on CPU (gloo) and return its JSON results.

Each script in tests/mp/ takes an output directory as its first argument and writes
``result-<rank>.json`` there; tests compare ranks with each other and with a 1-process run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

MP_DIR = Path(__file__).parent / "mp"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, out_dir: Path, *args: str, nproc: int = 2, timeout: float = 240) -> list[Any]:
    """Run ``tests/mp/<script>`` on ``nproc`` CPU processes; return the per-rank results, rank order.

    A launch is tried a second time only when the first failed for a reason outside the test: a process killed
    by a signal (an abort in gloo's teardown at exit) or the port taken between choosing and binding it. A rank
    that raised (exit code 1) is never retried. The first failure is printed, so a retry shows in the test log,
    and the results always come from one complete run.

    Raises:
        AssertionError: both launches failed (the output of the last is in the message).
    """
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(MP_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    for attempt in (1, 2):
        for stale in out_dir.glob("result-*.json"):
            stale.unlink()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(MP_DIR / script),
            str(out_dir),
            *args,
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            break
        report = f"torchrun {script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        retryable = "Signal" in proc.stderr or "exitcode  : -" in proc.stderr or "EADDRINUSE" in proc.stderr
        assert attempt == 1 and retryable, report
        print(f"retrying after a failed launch (attempt {attempt}):\n{report}", file=sys.stderr)
    return [json.loads((out_dir / f"result-{rank}.json").read_text()) for rank in range(nproc)]
