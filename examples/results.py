"""Run the examples' measured configurations and record what they reach in ``examples/results.json``.

    python examples/results.py                    # every run below (about 10 minutes on the 2-core machine)
    python examples/results.py fashion_mnist/cnn keywords/three_epochs   # these runs only (the others are kept)
    python examples/results.py --list
    python examples/results.py --kernel-spread keywords/three_epochs   # how far other CPU kernels move a run

The example pages (``docs/examples/*.md``) quote these results; ``tests/test_docs.py`` checks that every row it
names shows the recorded values, and the example tests check that their own slice of the data still reaches the
recorded values, so a change that moves a result fails a test until this script has been run again and the page
updated. Each run is ``torchloom fit --config examples/<config> <overrides>`` in a fresh subprocess, in a new
output directory under a temporary folder (the example's data caches are used and filled as usual). Recorded per
run: the last validation values, the ``val/accuracy`` after each validation, the optimizer steps, the model's
parameters (total, trainable, bytes) and the optimizer state's bytes at the end (``summary.json``), the seconds
per optimizer step over the training time (validation excluded), the process's peak resident set (``wait4``), the
fit's wall time and the process's, the load average before it, and what the values depend on (torch,
the CPU, the thread count of the config).

The values are deterministic for a given machine kind, torch build and thread count (the configs set
``engine.num_threads: 1``); another CPU (other vector units), another torch or another thread count changes the
last digits and can move an accuracy by a few samples. Times depend on the load of the machine.

``--kernel-spread`` measures how far: it runs each named run again under every vector instruction set this CPU
offers to torch's and oneDNN's kernels (``ATEN_CPU_CAPABILITY`` with ``ONEDNN_MAX_CPU_ISA``: ``default``,
``avx2``, ``avx512`` where the CPU has them), as another CPU would pick, and records each value's largest
distance from the recorded one (``kernel_spread``; the recorded values are left as they are, and recording a run
again drops its spread, to be measured again). On a CPU other than the recording one, the example tests compare
their runs within that spread (``tests/example_results.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"
FINE_FOODS, FASHION_MNIST, KEYWORDS, INDEX, CHAT = (
    f"docs/examples/{name}.md" for name in ("fine_foods", "fashion_mnist", "keywords", "index", "fine_foods_chat")
)
PEFT = "docs/plugins/peft.md"
#: What the adapter table of the peft page shows of each run (``quoted_facts``): recorded name -> its format
#: (``"bytes"``: `torchloom.utils.format_bytes`; else a format spec).
SIZES = {
    "trainable_parameters": ",",
    "parameter_bytes": "bytes",
    "optimizer_state_bytes": "bytes",
    "peak_rss_bytes": "bytes",
    "s_per_step": ".2f",
}

#: run id -> its config and overrides, and where a page quotes it: ``quoted`` maps a page to the first cell of the
#: table row that shows the run (and, third, which values it shows, else those of ``shown``); ``shown`` gives the
#: decimals each value has there, ``decimals`` those of values only some rows show (tests/test_docs.py checks them).
#: ``quoted_facts`` names rows that show other recorded values (`SIZES`). The slices are the example tests' own.
RUNS: dict[str, dict[str, Any]] = {
    "fine_foods/full": {
        "config": "fine_foods.yaml",
        "overrides": [],
        "quoted": [
            (FINE_FOODS, "**`torchloom fit --config examples/fine_foods.yaml`**"),
            (FINE_FOODS, "plain (`fine_foods.yaml`, fp32, torch AdamW)"),
            (INDEX, "[fine_foods](fine_foods.md): is this review a 5-star one? (text)", ["val/accuracy", "val/auroc"]),
            (PEFT, "fine_foods: full fine-tune (`fine_foods.yaml`)", ["val/accuracy"]),
        ],
        "quoted_facts": [(PEFT, "fine_foods: full fine-tune (`fine_foods.yaml`)", SIZES)],
        "shown": {"val/accuracy": 3, "val/majority_rate": 3, "val/loss": 3},
        "decimals": {"val/auroc": 4},  # shown only where a row names it
    },
    "fine_foods/test_slice": {
        "config": "fine_foods.yaml",
        "overrides": [
            "--data.init_args.max_train_samples=64",
            "--data.init_args.max_val_samples=64",
            "--data.init_args.max_length=32",
            "--data.init_args.batch_size=16",
            "--data.init_args.eval_batch_size=32",
        ],
        "quoted": [(FINE_FOODS, "the test's slice (`tests/test_example_fine_foods.py`)")],
        "shown": {"val/accuracy": 3, "val/majority_rate": 3, "val/loss": 3},
    },
    "fashion_mnist/cnn": {
        "config": "fashion_mnist.yaml",
        "overrides": [],
        "quoted": [
            (FASHION_MNIST, "**`torchloom fit --config examples/fashion_mnist.yaml`** (CNN)"),
            (INDEX, "[fashion_mnist](fashion_mnist.md): which kind of clothing is this? (images)", ["val/accuracy"]),
        ],
        "shown": {"val/accuracy": 4, "val/majority_rate": 3, "val/loss": 3},
    },
    "fashion_mnist/vit": {
        "config": "fashion_mnist_vit.yaml",
        "overrides": [],
        "quoted": [
            (FASHION_MNIST, "`torchloom fit --config examples/fashion_mnist_vit.yaml` (ViT + ViTImageProcessor)")
        ],
        "shown": {"val/accuracy": 4, "val/majority_rate": 3, "val/loss": 3},
    },
    "fashion_mnist/test_slice": {
        "config": "fashion_mnist.yaml",
        "overrides": [
            "--data.init_args.max_train_samples=1024",
            "--data.init_args.max_val_samples=500",
            "--data.init_args.batch_size=64",
            "--data.init_args.eval_batch_size=250",
            "--engine.max_epochs=1",
        ],
        "quoted": [(FASHION_MNIST, "the test's slice: 1,024 train / 500 val, 1 epoch")],
        "shown": {"val/accuracy": 3, "val/majority_rate": 3, "val/loss": 3},
    },
    "keywords/full": {
        "config": "keywords.yaml",
        "overrides": [],
        "quoted": [
            (
                KEYWORDS,
                "**`torchloom fit --config examples/keywords.yaml`**, "
                "fresh cache (makes the clips, featurises, trains)",
            ),
            (KEYWORDS, "the same, data cached"),
            (INDEX, "[keywords](keywords.md): which word was spoken? (audio)", ["val/accuracy"]),
            (KEYWORDS, "`python examples/keywords.py` (the same config)"),
        ],
        "shown": {"val/accuracy": 4, "val/chance_rate": 3, "val/loss": 3},
        "curve": (KEYWORDS, "The first row's held-out accuracy after each epoch: "),
    },
    "keywords/three_epochs": {
        "config": "keywords.yaml",
        "overrides": ["--engine.max_epochs=3"],
        "quoted": [(KEYWORDS, "shorter: `engine.max_epochs=3` (what the test runs)")],
        "shown": {"val/accuracy": 4, "val/chance_rate": 3},
    },
    "fine_foods_chat/fine_tuned": {
        "config": "fine_foods_chat.yaml",
        "overrides": [],
        "quoted": [
            (CHAT, "fine-tuned: **`torchloom fit --config examples/fine_foods_chat.yaml`**"),
            (INDEX, "[fine_foods_chat](fine_foods_chat.md): is this review a 5-star one? (chat)", ["val/accuracy"]),
            (PEFT, "fine_foods_chat: full fine-tune (`fine_foods_chat.yaml`)", ["val/accuracy"]),
        ],
        "quoted_facts": [(PEFT, "fine_foods_chat: full fine-tune (`fine_foods_chat.yaml`)", SIZES)],
        "shown": {"val/accuracy": 3, "val/majority_rate": 3, "val/loss": 3},
    },
    **{
        run_id: {
            "config": config,
            "overrides": [],
            "quoted": [(PEFT, row, ["val/accuracy"])],
            "quoted_facts": [(PEFT, row, SIZES)],
            "shown": {"val/accuracy": 3, "val/loss": 3},
        }
        for run_id, config, row in (
            ("fine_foods/lora", "fine_foods_lora.yaml", "fine_foods: LoRA (`fine_foods_lora.yaml`)"),
            (
                "fine_foods_chat/lora",
                "fine_foods_chat_lora.yaml",
                "fine_foods_chat: LoRA (`fine_foods_chat_lora.yaml`)",
            ),
            (
                "fine_foods_chat/qlora",
                "fine_foods_chat_qlora.yaml",
                "fine_foods_chat: QLoRA (`fine_foods_chat_qlora.yaml`)",
            ),
        )
    },
}


def environment() -> dict[str, Any]:
    """What the values depend on."""
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"torch": torch.__version__, "cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version()}


#: The vector instruction sets ``--kernel-spread`` runs under: torch's ``ATEN_CPU_CAPABILITY`` -> oneDNN's
#: ``ONEDNN_MAX_CPU_ISA`` (the convolutions and matrix products of the examples run in either library).
KERNELS = {"default": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE"}


def kernels() -> list[str]:
    """The entries of `KERNELS` this CPU runs: up to the capability torch picks for it."""
    import torch

    best = torch.backends.cpu.get_cpu_capability().lower()
    names = list(KERNELS)
    return names[: names.index(best) + 1] if best in names else ["default"]


def kernel_spread(run_id: str, root: Path, recorded: dict[str, float]) -> dict[str, Any]:
    """Run ``run_id`` under each of `kernels`; each recorded value's largest distance from its value there."""
    spread = dict.fromkeys(recorded, 0.0)
    for name in kernels():
        env = {"ATEN_CPU_CAPABILITY": name, "ONEDNN_MAX_CPU_ISA": KERNELS[name]}
        got = run(run_id, root / name, env)["metrics"]
        print(f"  {name}: {json.dumps(got)}", flush=True)
        spread = {key: max(spread[key], abs(got[key] - value)) for key, value in recorded.items()}
    return {"kernels": kernels(), "cpu": environment()["cpu"], "metrics": spread}


def run(run_id: str, root: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One run through the command line (``env``: added to the environment); its recorded values."""
    spec = RUNS[run_id]
    out = root / run_id.replace("/", "_")
    command = [
        sys.executable,
        "-m",
        "torchloom.cli",
        "fit",
        "--config",
        str(HERE / spec["config"]),
        *spec["overrides"],
        f"--engine.output_dir={out}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(command, cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)  # this run's own peak resident set, not the children's maximum
        process_s = time.perf_counter() - start
        returncode = os.waitstatus_to_exitcode(status)
        proc.returncode = returncode  # reaped here: Popen must not wait for it again
        if returncode != 0:
            stderr.seek(0)
            raise SystemExit(f"{run_id}: exited with {returncode}\n{stderr.read().decode()[-3000:]}")
    records = [json.loads(line) for line in (out / "latest" / "metrics.jsonl").read_text().splitlines()]
    validations = [r for r in records if "val/accuracy" in r]
    summary = json.loads((out / "latest" / "summary.json").read_text())
    config = yaml.safe_load((out / "latest" / "config.yaml").read_text())
    final = validations[-1]
    return {
        "command": "torchloom fit --config examples/" + " ".join([spec["config"], *spec["overrides"]]),
        "metrics": {k: v for k, v in final.items() if k.startswith("val/")},
        "val_accuracy_per_validation": [r["val/accuracy"] for r in validations],
        "optimizer_steps": summary["optimizer_steps"],
        "parameters": summary["parameters"]["total"],
        "trainable_parameters": summary["parameters"]["trainable"],
        "parameter_bytes": summary["parameters"]["bytes"],
        "optimizer_state_bytes": summary["optimizer_state_bytes"],
        "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
        "s_per_step": round(summary["train_time_s"] / summary["optimizer_steps"], 2),
        "fit_s": round(summary["wall_time_s"], 1),
        "process_s": round(process_s, 1),
        "load_before": round(load, 2),
        "num_threads": config["engine"].get("num_threads"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", help=f"run ids (default: all): {', '.join(RUNS)}")
    parser.add_argument("--list", action="store_true", help="list the run ids and stop")
    parser.add_argument(
        "--kernel-spread",
        action="store_true",
        help="measure how far each named (already recorded) run moves under the other vector kernels of this CPU",
    )
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(f"{k}: {v['config']} {' '.join(v['overrides'])}".rstrip() for k, v in RUNS.items()))
        return
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown:
        parser.error(f"unknown run id(s) {', '.join(unknown)}; valid: {', '.join(RUNS)}")
    import torchloom

    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": {}}
    if args.kernel_spread and (unrecorded := [r for r in args.runs or RUNS if r not in results["runs"]]):
        parser.error(f"--kernel-spread needs recorded runs; not recorded yet: {', '.join(unrecorded)}")
    with tempfile.TemporaryDirectory() as tmp:
        for run_id in args.runs or list(RUNS):
            print(f"{run_id} ...", flush=True)
            if args.kernel_spread:
                record = results["runs"][run_id]
                record["kernel_spread"] = kernel_spread(run_id, Path(tmp), record["metrics"])
            else:
                results["runs"][run_id] = {**run(run_id, Path(tmp)), "environment": environment()}
            print(json.dumps(results["runs"][run_id]["metrics"]), flush=True)
            results["runs"] = dict(sorted(results["runs"].items()))
            # each finished run is kept, even if a later one fails
            torchloom.utils.write_atomically(RESULTS, json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
