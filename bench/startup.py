"""Start-up time: the ``torchloom`` command and ``import torchloom`` against ``import accelerate`` / ``import torch``.

    python bench/startup.py [--rounds 5] [--json out.json]

Each command runs as a fresh subprocess (``HF_HUB_OFFLINE=1``, output discarded); its wall time is measured
around ``subprocess.run`` with ``time.perf_counter`` (interpreter start, imports, the command, exit). Each round
runs every command once, in an order rotated by one each round, after one discarded warm-up round (which fills
the OS file cache). Reported: the median over the rounds, its min-max, and the ratio of the medians to
``import torch``. The ``torchloom`` command is the console script installed next to this Python; where there is
none (running from a source tree), ``python -m torchloom`` is timed instead, and the table says so.
Not a test: numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any


def commands() -> tuple[dict[str, list[str]], str]:
    """label -> argv, and how the ``torchloom`` command is invoked."""
    script = shutil.which("torchloom", path=os.path.dirname(sys.executable))
    cli, how = ([script], "torchloom") if script else ([sys.executable, "-m", "torchloom"], "python -m torchloom")
    py = sys.executable
    return {
        "python -c pass": [py, "-c", "pass"],
        "import torch": [py, "-c", "import torch"],
        "import accelerate": [py, "-c", "import accelerate"],
        "import torchloom": [py, "-c", "import torchloom"],
        f"{how} --version": [*cli, "--version"],
        f"{how} --help": [*cli, "--help"],
        f"{how} plugins": [*cli, "plugins"],
    }, how


def run_once(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-2000:]}")
    return elapsed


def measure(rounds: int) -> dict[str, Any]:
    cmds, how = commands()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    labels = list(cmds)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(rounds + 1):
        shift = r % len(labels)
        for label in labels[shift:] + labels[:shift]:
            elapsed = run_once(cmds[label], env)
            if r > 0:  # round 0 warms the file cache
                times[label].append(elapsed)
    torch_median = statistics.median(times["import torch"])
    rows = [
        {
            "command": label,
            "argv": cmds[label],
            "seconds": {"median": statistics.median(t), "min": min(t), "max": max(t)},
            "ratio_to_import_torch": statistics.median(t) / torch_median,
        }
        for label, t in times.items()
    ]
    return {"rounds": rounds, "cli": how, "rows": rows, "loadavg_end": os.getloadavg()}


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"Start-up (wall time of a fresh process, median of {result['rounds']} rounds)",
        "",
        "| command | seconds (median) | min-max | x import torch |",
        "|---|---:|---:|---:|",
    ]
    for row in result["rows"]:
        s = row["seconds"]
        lines.append(
            f"| `{row['command']}` | {s['median']:.2f} | {s['min']:.2f}-{s['max']:.2f} | "
            f"{row['ratio_to_import_torch']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = measure(args.rounds)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
