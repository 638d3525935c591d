"""The benchmark suite that ``nox -s bench`` runs: every part in its own process, one Markdown table, one JSON file.

    python bench/suite.py                    # everything (5-8 minutes on the 2-core project machine, then
                                             # checkpoint_io 1.5-6 minutes and the Trainer / adapter parts
                                             # 15-25 minutes more, with the machine's load)
    python bench/suite.py --quick            # fewer rounds: a check that every part runs (noisier)
    python bench/suite.py --parts startup,w1 # some parts
    python bench/suite.py --out bench/results
    python bench/suite.py --from-json bench/results/latest.json > bench/RESULTS.md   # render a run again

Parts, in the order they run (see each script's docstring for its method):

======================  ========================================================================================
``startup``             bench/startup.py: ``torchloom --help`` / ``--version`` / ``plugins``, ``import torchloom``
                        vs ``import accelerate`` vs ``import torch`` (fresh processes)
``w1``, ``w2``          bench/engine_overhead.py: step-time ratios to the hand-written Accelerate loop doing the
                        same work (torchloom no plugins / every built-in as a no-op / realistic set, Lightning
                        Fabric, lean Lightning Trainer); w2 also gives bf16 vs fp32 step time
``dispatch``            bench/dispatch.py: hook dispatch microseconds per micro-step
``activation_memory``   bench/activation_memory.py: peak memory of a step with and without ``grad_checkpoint``
                        (12-layer GPT-2 from a config)
``optimizer_memory``    bench/optimizer_memory.py: optimizer state bytes per optimizer on the example model
``compile``             bench/compile_speed.py: compile time and steady-state step of the ``compile`` plugin
``checkpoint_io``       bench/checkpoint_io.py: checkpoint write MB/s vs a plain safetensors save, the stall of
                        a step that saves (synchronous vs ``async_save``), resume start-up at 10/50/90 % of an epoch
``trainer_lm``          bench/trainer_throughput.py: real tokens/s of a causal-LM fine-tune, the HF Trainer vs
                        torchloom on the same batches and with packing
``trainer_cls``         bench/trainer_classification.py: real tokens/s of the main job's MiniLM fine-tune, the HF
                        Trainer vs torchloom, on the same batches and each with length grouping
``adapter_steps``       bench/adapter_steps.py: step time and peak memory of fine_foods.yaml vs fine_foods_lora.yaml
                        (``--work chat`` on its own for the chat example's full / LoRA / QLoRA)
======================  ========================================================================================

``bench/diloco.py`` (2 processes, a few minutes) is not part of the suite: run it on its own.

Writes ``<out>/latest.md`` and ``<out>/latest.json`` (default ``bench/results/``, not committed; the committed
``bench/RESULTS.md`` is a copy of one run's ``latest.md``) and prints the Markdown. The machine's load average is
recorded before and after: timings taken while other processes run are noisy, and the min-max over rounds shows
how much. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))  # sys.path[0] when run as a script

#: part -> (script, arguments, arguments with --quick)
PARTS: dict[str, tuple[str, list[str], list[str]]] = {
    "startup": ("startup.py", [], ["--rounds", "2"]),
    "w1": ("engine_overhead.py", ["--workload", "W1"], ["--workload", "W1", "--rounds", "3", "--steps", "100"]),
    "dispatch": ("dispatch.py", [], ["--repeats", "1", "--steps", "300", "--sample-steps", "3000"]),
    "w2": ("engine_overhead.py", ["--workload", "W2"], ["--workload", "W2", "--rounds", "1", "--steps", "2"]),
    "activation_memory": ("activation_memory.py", ["--kind", "gpt2", "--blocks", "12"], ["--kind", "gpt2"]),
    "optimizer_memory": ("optimizer_memory.py", [], []),
    "compile": ("compile_speed.py", [], ["--steps", "10"]),
    "checkpoint_io": (
        "checkpoint_io.py",
        [],
        ["--rounds", "2", "--stall-rounds", "1", "--resume-rounds", "3", "--every", "10", "--samples", "20000"],
    ),
    "trainer_lm": ("trainer_throughput.py", ["--rounds", "3"], ["--rounds", "1", "--steps", "12", "--skip", "4"]),
    "trainer_cls": (
        "trainer_classification.py",
        ["--rounds", "3"],
        ["--rounds", "1", "--steps", "12", "--skip", "4", "--samples", "400"],
    ),
    "adapter_steps": (
        "adapter_steps.py",
        ["--work", "fine_foods", "--rounds", "3"],
        ["--work", "fine_foods", "--rounds", "1", "--steps", "3"],
    ),
}
JSON_PARTS = {"startup", "w1", "dispatch", "w2", "activation_memory", "optimizer_memory", "checkpoint_io"}


def run_part(name: str, quick: bool, env: dict[str, str]) -> dict[str, Any]:
    script, args, quick_args = PARTS[name]
    argv = [sys.executable, os.path.join(HERE, script), *(quick_args if quick else args)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "part.json")
        if name in JSON_PARTS:
            argv += ["--json", out]
        print(f"\n== {name}: {' '.join(argv[1:])}", flush=True)
        started = time.perf_counter()
        done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=False)
        seconds = time.perf_counter() - started
        print(done.stdout, end="", flush=True)
        part: dict[str, Any] = {"argv": argv[1:], "seconds": seconds, "returncode": done.returncode}
        part["stdout"] = done.stdout
        if done.returncode == 0 and name in JSON_PARTS:
            with open(out) as f:
                part["result"] = json.load(f)
    print(f"== {name}: {seconds:.0f} s, exit {done.returncode}", flush=True)
    return part


def machine() -> dict[str, Any]:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass
    versions = {}
    for dist in ("torch", "accelerate", "transformers", "pluggy", "bitsandbytes", "lightning", "torchloom"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        commit = subprocess.run(
            ["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
        "commit": commit or None,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


# ------------------------------------------------------------------------------------------------ the report


def _ratio(row: dict[str, Any] | None) -> str:
    if row is None or row.get("ratio") is None:
        return "-"
    r = row["ratio"]
    return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def summary_table(parts: dict[str, Any]) -> list[str]:
    columns = [
        ("torchloom, no plugins", "torchloom"),
        ("torchloom, every built-in as a no-op", "torchloom-noop"),
        ("torchloom, realistic set", "torchloom-realistic"),
        ("Lightning Fabric", "fabric"),
        ("Fabric, realistic set", "fabric-realistic"),
        ("Lightning Trainer (lean)", "trainer"),
        ("Trainer, realistic set", "trainer-realistic"),
    ]
    lines = [
        "| workload | " + " | ".join(label for label, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for key in ("w1", "w2"):
        result = parts.get(key, {}).get("result")
        if result is None:
            continue
        rows = {row["key"]: row for row in result["variants"]}
        cells = []
        for _, variant in columns:
            if variant in result["skipped"]:
                cells.append("skipped")
            else:
                cells.append(_ratio(rows.get(variant)))
        lines.append(f"| {result['label']} | " + " | ".join(cells) + " |")
    return lines


def targets(parts: dict[str, Any]) -> list[str]:
    """Issue 12's targets next to what this run measured (reported, never asserted)."""
    lines = ["| target (issue 12) | measured | met |", "|---|---|---|"]

    def ratio_row(part: str, key: str) -> dict[str, Any] | None:
        result = parts.get(part, {}).get("result")
        if not result:
            return None
        return next((row for row in result["variants"] if row["key"] == key), None)

    def add(target: str, value: float | None, limit: float, text: str) -> None:
        if value is None:
            lines.append(f"| {target} | not measured | |")
        else:
            lines.append(f"| {target} | {text} | {'yes' if value <= limit else 'no'} |")

    for target, part, key, limit in (
        ("W1 torchloom, no plugins <= 0.90 x hand loop", "w1", "torchloom", 0.90),
        ("W1 torchloom + the four plugins <= 0.95 x hand loop", "w1", "torchloom-realistic", 0.95),
        ("W2 torchloom, no plugins <= 1.01 x hand loop", "w2", "torchloom", 1.01),
    ):
        row = ratio_row(part, key)
        add(target, row["ratio"]["median"] if row else None, limit, _ratio(row))
    fabric, torchloom_w1 = ratio_row("w1", "fabric"), ratio_row("w1", "torchloom")
    if fabric and torchloom_w1:
        f, t = fabric["ratio"]["median"], torchloom_w1["ratio"]["median"]
        add("W1 stretch: torchloom at or below Fabric", t - f, 0.0, f"torchloom {t:.3f} vs Fabric {f:.3f}")
    dispatch = parts.get("dispatch", {}).get("result")
    if dispatch:
        for row in dispatch["rows"]:
            if row["plugins"] == "every built-in as a no-op":
                inst, sampled = row["us_per_micro_step"]["median"], row["sampled"]
                target = "hook dispatch <= 10 us / micro-step, every built-in enabled (as a no-op)"
                if "error" in sampled:
                    add(target, inst, 10.0, f"{inst:.1f} us instrumented (not sampled: {sampled['error']})")
                else:
                    us, se = sampled["us_per_micro_step"], sampled["standard_error_us"]
                    add(target, us, 10.0, f"{us:.1f} +- {se:.1f} us sampled, {inst:.1f} us instrumented")
    startup = parts.get("startup", {}).get("result")
    if startup:
        secs = {row["command"]: row["seconds"]["median"] for row in startup["rows"]}
        for command, value in secs.items():
            if command.endswith(("--help", "--version")):
                add(f"`{command}` under 1 s", value, 1.0, f"{value:.2f} s")
            elif command.endswith("plugins"):  # it imports no plugin (and so not torch)
                add(f"`{command}` under 0.5 s", value, 0.5, f"{value:.2f} s")
        if "import torchloom" in secs and "import accelerate" in secs:
            a, t = secs["import accelerate"], secs["import torchloom"]
            add("`import torchloom` no slower than `import accelerate`", t - a, 0.0, f"{t:.2f} s vs {a:.2f} s")
    return lines


def report(meta: dict[str, Any], parts: dict[str, Any]) -> str:
    load = meta["loadavg"]
    lines = [
        "# torchloom benchmarks",
        "",
        f"{meta['date']}, commit {meta['commit']}, {meta['cpu']} ({meta['cpus']} CPUs), Python {meta['python']}, "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
        + f". Load average (1 min) {load['before'][0]:.2f} before, {load['after'][0]:.2f} after; the suite took "
        f"{meta['seconds'] / 60:.1f} min{' (--quick)' if meta['quick'] else ''}. All timings use 1 torch thread; on "
        "a shared machine they move with other processes' load: the min-max over rounds shows how much.",
        "",
        "## Step time: ratio to the hand-written Accelerate loop doing the same work",
        "",
        "Median over rounds (min-max); each variant interleaved with the others in one process, rounds rotated, "
        "ratios paired within a round; set-up and warm-up micro-steps not timed (see bench/README.md). The realistic "
        "set is grad_accum 2 + bf16 + grad_clip 1.0 + adamw8bit; its ratios are to a hand loop doing that.",
        "",
        *summary_table(parts),
        "",
        "## Against issue 12's targets",
        "",
        *targets(parts),
    ]
    titles = {
        "w1": "W1 in detail",
        "w2": "W2 in detail (torchloom bf16 vs torchloom fp32: bf16 / fp32 step time)",
        "dispatch": "Hook dispatch",
        "startup": "Start-up",
        "activation_memory": "Activation memory with and without grad_checkpoint",
        "optimizer_memory": "Optimizer state",
        "compile": "Compile speed (bench/compile_speed.py)",
        "checkpoint_io": "Checkpoint saves and resumes (bench/checkpoint_io.py, issue 27 item 5)",
        "trainer_lm": "Causal-LM fine-tune against the HF Trainer, real tokens/s (bench/trainer_throughput.py)",
        "trainer_cls": "The main job against the HF Trainer, real tokens/s (bench/trainer_classification.py)",
        "adapter_steps": "The main job with and without LoRA: step time, peak memory (bench/adapter_steps.py)",
    }
    import activation_memory
    import checkpoint_io
    import dispatch
    import engine_overhead
    import optimizer_memory
    import startup

    formatters = {
        "w1": engine_overhead.format_table,
        "w2": engine_overhead.format_table,
        "dispatch": dispatch.format_table,
        "startup": startup.format_table,
        "optimizer_memory": optimizer_memory.format_table,
        "checkpoint_io": checkpoint_io.format_report,
    }
    shown: set[str] = set()  # a note (e.g. which built-ins the no-op set leaves out) is shown once
    for name, part in parts.items():
        lines += ["", f"## {titles[name]}", ""]
        if part["returncode"] != 0:
            lines.append(f"Failed (exit {part['returncode']}); see the suite's output.")
            continue
        if name in formatters:
            lines.append(formatters[name](part["result"]))
            notes = [note for note in part["result"].get("notes", []) if note not in shown]
            shown.update(notes)
            lines += ["", *(f"- {note}" for note in notes)] if notes else []
        elif name == "activation_memory":
            for entry in part["result"]:
                lines += [
                    f"{entry['kind']}, {entry['blocks']} layers, width {entry['width']}, batch {entry['batch']}, "
                    "sequence 128, SGD; one training step through the engine:",
                    "",
                    "```",
                    activation_memory.format_rows(entry["rows"]),
                    "```",
                    "",
                    "Measured on the CPU by a probe plugin wrapping run_train_step: 'saved for backward' is the peak "
                    "of bytes held by autograd's saved-tensor hooks (each storage once, parameters excluded); 'step "
                    "peak' the peak of all tensor storage allocated during the step and still alive, recomputation "
                    "included (a TorchDispatchMode); see bench/activation_memory.py.",
                ]
        else:
            lines += ["```", part["stdout"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (a check that all parts run)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--from-json", default=None, help="render the report of an earlier run's latest.json again")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        print(report(saved["meta"], saved["parts"]), end="")
        return
    names = [p for p in args.parts.split(",") if p]
    unknown = [p for p in names if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    meta = {**machine(), "quick": args.quick, "loadavg": {"before": os.getloadavg()}}
    started = time.perf_counter()
    parts = {name: run_part(name, args.quick, env) for name in names}
    meta["seconds"] = time.perf_counter() - started
    meta["loadavg"]["after"] = os.getloadavg()
    os.makedirs(args.out, exist_ok=True)
    text = report(meta, parts)
    with open(os.path.join(args.out, "latest.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "latest.json"), "w") as f:
        json.dump({"meta": meta, "parts": parts}, f, indent=1)
    print("\n" + text)
    print(f"written: {os.path.join(args.out, 'latest.md')}, {os.path.join(args.out, 'latest.json')}")
    failed = [name for name, part in parts.items() if part["returncode"] != 0]
    if failed:
        raise SystemExit(f"failed parts: {', '.join(failed)}")


if __name__ == "__main__":
    main()
