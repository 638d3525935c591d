"""Torch's thread count on a small model: the quick start's fit with ``engine.num_threads`` unset (torch's default,
one thread per core) against 1 thread, on the machine as it is and on the same machine made busier.

    python bench/threads.py [--rounds 5] [--json out.json]

The task and config are the quick start's own (``docs/quickstart.md``: its ``quickstart.py`` and
``quickstart.yaml`` blocks, written to a temporary directory), run as ``torchloom fit --config quickstart.yaml``
in a fresh subprocess per fit (``HF_HUB_OFFLINE=1``, ``OMP_NUM_THREADS`` removed from its environment). "as
found" runs on the machine with whatever else it runs (the load average before the rounds is reported); "busier"
adds one spinning Python process per core for the duration of those rounds (a stand-in for the other jobs of a
shared machine; they use no torch). Each round runs every variant once, the order rotated by one each round,
after one discarded warm-up round. Reported per variant: the median over the rounds (and min-max) of the fit's
``wall_time_s`` and ``train_time_s`` from its ``summary.json``, and of the process's wall time. Not a test:
numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"default": [], "num_threads 1": ["--engine.num_threads=1"]}


def write_quickstart(directory: Path) -> None:
    """The quick start page's ``# quickstart.py`` and ``# quickstart.yaml`` blocks, as the page has them."""
    page = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    for match in re.finditer(r"```(?:python|yaml)\n(# (quickstart\.(?:py|yaml))\n.*?)```", page, re.S):
        (directory / match.group(2)).write_text(match.group(1), encoding="utf-8")


def default_threads() -> int:
    """torch's own intra-op thread count in a fresh process without ``OMP_NUM_THREADS``."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    code = "import torch; print(torch.get_num_threads())"
    return int(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout)


def spin() -> None:
    while True:
        pass


def one_fit(directory: Path, extra: list[str], index: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["HF_HUB_OFFLINE"] = "1"
    out = directory / "runs" / f"fit_{index}"
    argv = [sys.executable, "-m", "torchloom", "fit", "--config", "quickstart.yaml", f"--engine.output_dir={out}"]
    start = time.perf_counter()
    subprocess.run([*argv, *extra], cwd=directory, env=env, check=True, capture_output=True)
    process = time.perf_counter() - start
    summary = json.loads((out / "latest" / "summary.json").read_text())
    return {"process_s": process, "fit_s": summary["wall_time_s"], "train_s": summary["train_time_s"]}


def measure(directory: Path, rounds: int, busy: bool) -> dict[str, dict[str, list[float]]]:
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(os.cpu_count() or 1)] if busy else []
    for p in spinners:
        p.start()
    try:
        names, results = list(VARIANTS), {name: {} for name in VARIANTS}  # type: dict[str, dict[str, list[float]]]
        index = 0
        for r in range(rounds + 1):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                index += 1
                times = one_fit(directory, VARIANTS[name], index)
                if r == 0:
                    continue  # warm-up
                for key, value in times.items():
                    results[name].setdefault(key, []).append(value)
        return results
    finally:
        for p in spinners:
            p.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {"cpus": os.cpu_count(), "rounds": args.rounds, "machines": {}}
    lines = [
        f"Quick start fit, {args.rounds} rounds, {os.cpu_count()} CPUs (torch's default: {default_threads()} threads);"
        " median (min-max) in seconds",
        "",
        "| machine | num_threads | fit wall_time_s | of it training (train_time_s) | whole process |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        write_quickstart(directory)
        for machine in ("as found", f"busier (+{os.cpu_count()} spinning processes)"):
            load_before = os.getloadavg()[0]
            results = measure(directory, args.rounds, busy=machine.startswith("busier"))
            report["machines"][machine] = {"load_before": load_before, "results": results}
            for name, times in results.items():
                cells = [
                    f"{statistics.median(times[k]):.2f} ({min(times[k]):.2f}-{max(times[k]):.2f})"
                    for k in ("fit_s", "train_s", "process_s")
                ]
                label = f"{machine}, load {load_before:.1f} before"
                lines.append(f"| {label} | {name.removeprefix('num_threads ')} | {' | '.join(cells)} |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
