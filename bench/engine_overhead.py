"""Step time of torchloom against the hand-written Accelerate loop doing the same work, and against Lightning.

    python bench/engine_overhead.py --workload W1 [--rounds 20] [--warmup 50] [--steps 300] [--json out.json]
    python bench/engine_overhead.py --workload W2 [--rounds 5] [--warmup 1] [--steps 4]
    python bench/engine_overhead.py --workload W1 --variants hand,torchloom,torchloom-progress-plain

Method (see bench/README.md): every variant runs in this one process with 1 torch thread. Each round runs every
variant once, in an order rotated by one each round; each run builds its own Accelerator / model / optimizer
(not timed), trains ``warmup`` micro-steps (not timed), then ``steps`` timed micro-steps (see
`workloads.Clock`: from the start of micro-batch ``warmup``'s forward to the start of micro-batch
``warmup + steps``'s). A variant's ratio in a round is its time divided by the time of the hand-written loop doing
the same work in the same round; reported: the median ratio and its min-max over the rounds (``warmup_rounds``
first rounds discarded), and the median time per micro-step.

Variants (``--variants`` picks a subset by key; the default set depends on the workload):

==========================  ===========================================================================
hand                        the Accelerate loop, fp32 AdamW (`workloads.hand_loop`)
torchloom                   ``Engine`` with no plugins, not even the default (``default_plugins=False``)
torchloom-noop              every built-in plugin with settings that make it a no-op (`NOOP_SETTINGS`)
fabric, trainer             Lightning Fabric loop; lean Lightning Trainer
hand-realistic              the Accelerate loop with grad_accum 2 + bf16 + grad_clip 1.0 + adamw8bit
torchloom-realistic         ``Engine`` with the plugins grad_accum, mixed_precision, grad_clip, optimizer
fabric-realistic, trainer-realistic   the same work in Fabric / the Trainer
torchloom-bf16              ``Engine`` with mixed_precision bf16 only: ratio to ``torchloom`` = bf16 / fp32
torchloom-progress-plain    ``Engine`` + the progress plugin printing plain lines (to /dev/null)
torchloom-progress-bar      ``Engine`` + the progress plugin drawing its bar (to /dev/null)
==========================  ===========================================================================

Not a test: timings are printed and written, never asserted. On a shared machine the numbers move with the load
of other processes; the min-max shows how much.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

if os.path.dirname(os.path.abspath(__file__)) not in map(os.path.abspath, sys.path):  # imported from elsewhere
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import (
    BF16,
    PLAIN,
    REALISTIC,
    TORCHLOOM_PLUGINS,
    WORKLOADS,
    Variant,
    bitsandbytes_available,
    lightning_available,
    noop_plugins,
    timed_run,
)

#: Per workload: (rounds, warm-up rounds, warm-up micro-steps, timed micro-steps, default variants).
DEFAULTS: dict[str, tuple[int, int, int, int, list[str]]] = {
    "W1": (
        20,
        1,
        50,
        300,
        [
            "hand",
            "torchloom",
            "torchloom-noop",
            "fabric",
            "trainer",
            "hand-realistic",
            "torchloom-realistic",
            "fabric-realistic",
            "trainer-realistic",
        ],
    ),
    # A W2 micro-step takes about a second here: few, short rounds (the ratios are noisier; see the min-max).
    "W2": (
        5,
        0,
        2,
        4,
        [
            *("hand", "torchloom", "torchloom-noop", "fabric", "trainer"),
            *("hand-realistic", "torchloom-realistic", "torchloom-bf16"),
        ],
    ),
}


def all_variants() -> tuple[dict[str, Variant], list[str]]:
    noop, notes = noop_plugins()
    progress = {"progress": {"terminal": False}}
    variants = [
        Variant("hand", "hand-written Accelerate loop", "hand", PLAIN),
        Variant("torchloom", "torchloom, no plugins", "torchloom", PLAIN, baseline="hand"),
        Variant("torchloom-noop", "torchloom, every built-in as a no-op", "torchloom", PLAIN, noop, baseline="hand"),
        Variant("fabric", "Lightning Fabric", "fabric", PLAIN, baseline="hand"),
        Variant("trainer", "Lightning Trainer (lean)", "trainer", PLAIN, baseline="hand"),
        Variant("hand-realistic", "hand-written Accelerate loop, realistic set", "hand", REALISTIC),
        Variant(
            "torchloom-realistic",
            "torchloom, realistic set",
            "torchloom",
            REALISTIC,
            TORCHLOOM_PLUGINS["realistic"],
            baseline="hand-realistic",
        ),
        Variant("fabric-realistic", "Lightning Fabric, realistic set", "fabric", REALISTIC, baseline="hand-realistic"),
        Variant(
            "trainer-realistic",
            "Lightning Trainer (lean), realistic set",
            "trainer",
            REALISTIC,
            baseline="hand-realistic",
        ),
        Variant("torchloom-bf16", "torchloom, bf16 (vs torchloom fp32)", "torchloom", BF16, TORCHLOOM_PLUGINS["bf16"]),
        Variant("torchloom-progress-plain", "torchloom + progress (plain lines)", "torchloom", PLAIN, progress),
        Variant(
            "torchloom-progress-bar",
            "torchloom + progress (bar)",
            "torchloom",
            PLAIN,
            {"progress": {"terminal": True}},
        ),
    ]
    by_key = {v.key: v for v in variants}
    by_key["torchloom-bf16"].baseline = "torchloom"
    by_key["torchloom-progress-plain"].baseline = by_key["torchloom-progress-bar"].baseline = "torchloom"
    return by_key, notes


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(workload_name: str, keys: list[str], rounds: int, warmup_rounds: int, warmup: int, steps: int) -> dict:
    workload = WORKLOADS[workload_name]
    by_key, notes = all_variants()
    skipped: dict[str, str] = {}
    if not lightning_available():
        skipped |= {
            k: "lightning is not installed (nox -s bench installs it)"
            for k in keys
            if by_key[k].runner in {"fabric", "trainer"}
        }
    bnb_problem = bitsandbytes_available()
    if bnb_problem is not None:
        skipped |= {
            k: f"bitsandbytes 8-bit AdamW unavailable: {bnb_problem}"
            for k in keys
            if by_key[k].work.optimizer == "adamw8bit"
        }
    chosen = [by_key[k] for k in keys if k not in skipped]
    for v in chosen:  # a ratio needs its baseline measured in the same rounds
        if v.baseline is not None and v.baseline not in {c.key for c in chosen}:
            raise SystemExit(f"variant {v.key!r} needs its baseline {v.baseline!r} in --variants")
    if REALISTIC.optimizer == "adamw8bit" and any(v.work.optimizer == "adamw8bit" for v in chosen):
        notes.append("adamw8bit: bitsandbytes' CPU kernels (no GPU here)")
    times: dict[str, list[float]] = {v.key: [] for v in chosen}
    ratios: dict[str, list[float]] = {v.key: [] for v in chosen if v.baseline}
    started = time.perf_counter()
    for r in range(warmup_rounds + rounds):
        shift = r % len(chosen)
        order = chosen[shift:] + chosen[:shift]
        this_round = {}
        for v in order:
            this_round[v.key] = timed_run(v, workload, warmup, steps)
        if r < warmup_rounds:
            continue
        for v in chosen:
            times[v.key].append(this_round[v.key])
            if v.baseline:
                ratios[v.key].append(this_round[v.key] / this_round[v.baseline])
        print(
            f"  {workload_name} round {r - warmup_rounds + 1}/{rounds}: "
            + ", ".join(f"{k} {this_round[k] * 1e6:.0f}us" for k in this_round),
            file=sys.stderr,
            flush=True,
        )
    rows = []
    for v in chosen:
        rows.append(
            {
                "key": v.key,
                "label": v.label,
                "runner": v.runner,
                "work": v.work.describe(),
                "plugins": v.plugins,
                "baseline": v.baseline,
                "us_per_micro_step": {k: x * 1e6 for k, x in summary(times[v.key]).items()},
                "ratio": summary(ratios[v.key]) if v.baseline else None,
                "ratios": ratios.get(v.key),
            }
        )
    return {
        "workload": workload_name,
        "label": workload.label,
        "rounds": rounds,
        "warmup_rounds": warmup_rounds,
        "warmup_micro_steps": warmup,
        "timed_micro_steps": steps,
        "torch_threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - started,
        "loadavg_end": os.getloadavg(),
        "variants": rows,
        "skipped": skipped,
        "notes": notes,
        "python": platform.python_version(),
    }


def _duration(us: float) -> str:
    return f"{us:.0f} us" if us < 10_000 else f"{us / 1e3:.0f} ms"


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['label']}: {result['rounds']} rounds x {result['timed_micro_steps']} timed micro-steps "
        f"(after {result['warmup_micro_steps']} warm-up)",
        "",
        "| variant | work | time / micro-step (median) | ratio (median) | ratio min-max | vs |",
        "|---|---|---:|---:|---:|---|",
    ]
    for row in result["variants"]:
        t, ratio = row["us_per_micro_step"], row["ratio"]
        cells = (f"{ratio['median']:.3f}", f"{ratio['min']:.3f}-{ratio['max']:.3f}") if ratio else ("", "")
        lines.append(
            f"| {row['label']} | {row['work']} | {_duration(t['median'])} | {cells[0]} | {cells[1]} | "
            f"{row['baseline'] or ''} |"
        )
    for key, why in result["skipped"].items():
        lines.append(f"| {key} | skipped: {why} | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup-rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None, help="warm-up micro-steps per run (not timed)")
    parser.add_argument("--steps", type=int, default=None, help="timed micro-steps per run")
    parser.add_argument("--variants", default=None, help="comma-separated variant keys (see above)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    rounds, warmup_rounds, warmup, steps, keys = DEFAULTS[args.workload]
    if args.variants:
        keys = args.variants.split(",")
    torch.set_num_threads(1)
    result = measure(
        args.workload,
        keys,
        args.rounds or rounds,
        warmup_rounds if args.warmup_rounds is None else args.warmup_rounds,
        args.warmup or warmup,
        args.steps or steps,
    )
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
