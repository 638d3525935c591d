"""Step time and peak memory of the examples with and without an adapter, interleaved: full fine-tune, LoRA, QLoRA.

    python bench/adapter_steps.py [--rounds 2] [--steps 12] [--work chat|fine_foods] [--json out.json]

Each runner is ``torchloom fit --config examples/<config>`` in a fresh process, for ``--steps`` optimizer steps
with 1 validation batch (``limit_val_batches: 1``) and no saved model: ``fine_foods_chat.yaml``,
``fine_foods_chat_lora.yaml`` and ``fine_foods_chat_qlora.yaml`` for ``--work chat`` (SmolLM2-135M-Instruct, packed
rows of 256 tokens, 2 per micro-batch), ``fine_foods.yaml`` and ``fine_foods_lora.yaml`` for ``--work fine_foods``
(MiniLM, 16 reviews of up to 64 tokens). Reported per runner: seconds per optimizer step over the training time
(``summary.json``: validation excluded), its ratio to the full fine-tune of the same round (median, min-max), and
the process's peak resident set (``wait4``). Rounds run every runner once, in an order rotated by one per round,
so that a change of the machine's load weighs on every runner alike. Not a test: printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKS = {
    "chat": ["fine_foods_chat.yaml", "fine_foods_chat_lora.yaml", "fine_foods_chat_qlora.yaml"],
    "fine_foods": ["fine_foods.yaml", "fine_foods_lora.yaml"],
}


def run(config: str, steps: int, out: Path) -> dict[str, float]:
    """One short fit of ``config`` in its own process: seconds per optimizer step and peak resident bytes."""
    command = [
        sys.executable, "-m", "torchloom.cli", "fit", "--config", str(ROOT / "examples" / config),
        f"--engine.max_steps={steps}", "--engine.limit_val_batches=1", "--engine.num_sanity_val_steps=0",
        "--engine.save_model=false", f"--engine.output_dir={out}",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(command, cwd=ROOT / "examples", env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            stderr.seek(0)
            raise SystemExit(f"{config}: exited with {proc.returncode}\n{stderr.read().decode()[-3000:]}")
    summary = json.loads((out / "latest" / "summary.json").read_text())
    return {
        "s_per_step": summary["train_time_s"] / summary["optimizer_steps"],
        "peak_rss_bytes": usage.ru_maxrss * 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--work", choices=sorted(WORKS), default="chat")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torchloom

    configs = WORKS[args.work]
    results: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for config in configs[round_ % len(configs) :] + configs[: round_ % len(configs)]:
                results[config].append(run(config, args.steps, Path(tmp) / f"{round_}-{config}"))
                print(f"round {round_}: {config}: {results[config][-1]['s_per_step']:.2f} s/step", file=sys.stderr)
                load.append(os.getloadavg()[0])
    full = results[configs[0]]
    rows: list[dict[str, Any]] = []
    span = f"load {min(load):.1f}-{max(load):.1f}"
    print(f"\n{args.work}: {args.steps} optimizer steps per run, {args.rounds} interleaved rounds, {span}\n")
    print("| config | s / step | x full fine-tune (min-max) | peak memory |\n|---|---:|---:|---:|")
    for config in configs:
        ratios = [r["s_per_step"] / f["s_per_step"] for r, f in zip(results[config], full)]
        row = {
            "config": config,
            "s_per_step": statistics.median(r["s_per_step"] for r in results[config]),
            "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results[config]),
        }
        rows.append(row)
        print(
            f"| {config} | {row['s_per_step']:.2f} | {row['ratio']:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
            f"{torchloom.utils.format_bytes(row['peak_rss_bytes'])} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load": load, "rows": rows, "runs": results}))


if __name__ == "__main__":
    main()
