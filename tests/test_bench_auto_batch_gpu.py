"""bench/auto_batch_gpu.py keeps working without a GPU: ``--tiny`` runs the planner and the three fits at tiny sizes
on the CPU, where the budget between the planner's totals at micro-batches 2 and 4 makes it suggest 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "auto_batch_gpu.py"


@pytest.mark.slow  # the planner's traces and three short fits, in a process of its own
def test_auto_batch_gpu_script_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "auto_batch_gpu.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--json", str(out)], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["planner"]["micro_batch_size"] == 2
    assert [results[k]["micro_batch_size"] for k in ("suggested", "next larger", "back-off")] == [2, 4, 8]
    assert all(results[k]["fits"] for k in ("suggested", "next larger", "back-off"))  # no out-of-memory on a CPU
    assert "planner      micro-batch 2" in done.stdout
