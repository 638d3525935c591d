"""Run a script under ``torchrun --nproc_per_node N`` on CPU (gloo) and return its JSON results.

Each script in tests/mp/ takes an output directory as its first argument and writes
``result-<rank>.json`` there; tests compare ranks with each other and with a 1-process run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MP_DIR = Path(__file__).parent / "mp"


def torchrun(script: str, out_dir: Path, *args: str, nproc: int = 2, timeout: float = 240) -> list[Any]:
    """Run ``tests/mp/<script>`` on ``nproc`` CPU processes; return the per-rank results, rank order.

    One launch, never retried: any failure (a rank that raised, a process killed by a signal, an abort at exit)
    fails the test with the launch's output. ``--standalone`` lets torchrun choose a free port itself, so no two
    launches can race for one.

    Raises:
        AssertionError: the launch failed (its output is in the message).
    """
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(MP_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    for stale in out_dir.glob("result-*.json"):
        stale.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = subprocess.run(
        [*cmd, str(MP_DIR / script), str(out_dir), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"torchrun {script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return [json.loads((out_dir / f"result-{rank}.json").read_text()) for rank in range(nproc)]
