"""bench/gpu.py keeps working without a GPU: ``--tiny`` trains every row at tiny sizes on the CPU and prints one
table whose rows are all there, with positive, finite rates (nothing about speed is asserted)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"
CONFIGS = [
    "bf16, adamw",
    "fp16, adamw",
    "fp8, adamw",
    "bf16 + grad_checkpoint, adamw",
    "bf16, adamw8bit",
]


@pytest.mark.slow  # every row of the benchmark, end to end in a process of its own
def test_gpu_script_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    header, body = table[0], table[1:]
    assert header.split("|")[1:-1] == [
        " runner ",
        " config ",
        " tokens/s ",
        " vs hand ",
        " step ms ",
        " model TFLOP/s ",
        " MFU ",
        " peak GiB ",
    ]
    printed = [(cells[1].strip(), cells[2].strip()) for cells in (line.split("|") for line in body)]
    assert printed == [(runner, config) for config in CONFIGS for runner in ("torchloom", "hand")]

    result = json.loads(out.read_text())
    assert result["device"].startswith("CPU")
    for row in result["rows"]:
        if row["config"].startswith("fp8"):  # no fp8 on a CPU: the row says why instead of a number
            assert "compute capability" in row["skipped"]
            continue
        assert "skipped" not in row, row
        for key in ("tokens_per_s", "step_ms", "model_tflops"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["runner"], row["config"], key, row[key])
        assert row["mfu"] is None and row["peak_memory_gib"] is None  # no GPU peak to divide by on a CPU
        if row["runner"] == "torchloom":
            assert math.isfinite(row["vs_hand"]) and row["vs_hand"] > 0
