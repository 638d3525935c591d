"""FSDP2 against DDP on CPU processes: what each process holds, how long a checkpoint takes, and how close the
numbers are (issue 41, item 10).

    python bench/fsdp_scale.py [--rounds 3] [--nproc 2] [--steps 16] [--hidden 256] [--layers 4] [--json out.json]

A Llama of ``--layers`` layers (hidden ``--hidden``, vocabulary 4,096: 5.3 M parameters at the defaults), AdamW,
the realistic plugin set (grad_accum 2 with token normalisation, grad_clip 1.0, a checkpoint at the last step),
``--steps`` optimizer steps on random token rows, on ``--nproc`` CPU processes (gloo, ``torchrun --standalone``,
1 torch thread each), once as DDP and once as FSDP2 (the ``fsdp`` plugin, each decoder layer a unit) per round,
the order alternating. Each process reports:

- the bytes it holds of the parameters, their gradients and the optimizer state after the last step (each
  tensor's local shard: ``torchloom.utils.local_tensor``; what stays allocated between steps, the figure FSDP
  divides; the gathered layer during a forward is on top of it);
- the seconds of its ``torchloom.save_checkpoint`` of the last step (every process writes its part; under DDP
  the main process writes the whole model and optimizer state);
- the whole weights after the fit (gathered), to compare FSDP2 with DDP.

Goals (issue 41): per-process parameters + gradients + optimizer state under FSDP2 <= 0.55x DDP's; a sharded save
per process <= 0.6x the time of the full save; FSDP2 within 1e-6 of DDP after 16 steps (fp32). Medians over rounds
with min-max; the load average before and after. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def worker(out: Path, mode: str, steps: int, hidden: int, layers: int) -> None:
    """One process of one fit (under torchrun): writes ``result-<rank>.json``."""
    import torch
    import transformers
    from torch.utils.data import DataLoader, TensorDataset

    import torchloom
    from torchloom.utils import full_tensor, local_tensor, optimizer_state_bytes

    vocab, length = 4096, 64

    class Task(torchloom.TaskModule):
        def configure_model(self) -> torch.nn.Module:
            torch.manual_seed(0)
            config = transformers.LlamaConfig(
                vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length,
            )  # fmt: skip
            return transformers.LlamaForCausalLM(config)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (ids,) = batch
            return {"loss": self.model(input_ids=ids, labels=ids).loss, "num_items": ids[:, 1:].numel()}

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader:
            world = int(os.environ["WORLD_SIZE"])
            g = torch.Generator().manual_seed(0)
            rows = 2 * 2 * world * steps  # micro-batch 2, 2 micro-batches per step
            return DataLoader(TensorDataset(torch.randint(0, vocab, (rows, length), generator=g)), batch_size=2)

    saved: dict[str, float] = {}

    class Saver:
        name = "bench.saver"

        @torchloom.hookimpl
        def on_train_step_end(self, progress: Any) -> None:
            if progress.global_step == steps:
                began = time.perf_counter()
                torchloom.save_checkpoint()
                saved["seconds"] = time.perf_counter() - began

    plugins: dict[str, Any] = {"grad_accum": {"steps": 2, "normalization": "tokens"}, "grad_clip": {"max_norm": 1.0}}
    if mode == "fsdp":
        plugins["fsdp"] = {}
    engine = torchloom.Engine(
        output_dir=str(out / "run"), max_epochs=1, seed=0, log_every_n_steps=1000, default_plugins=False,
        plugins=[Saver(), *[{name: settings} for name, settings in plugins.items()]],
    )  # fmt: skip
    engine.fit(Task())
    model, optimizer = engine._run.model, engine._run.optimizer
    held = sum(local_tensor(p).nbytes for p in model.parameters())
    grads = sum(local_tensor(p.grad).nbytes for p in model.parameters() if p.grad is not None)
    state = optimizer_state_bytes(optimizer, per_process=True)
    weights = [full_tensor(p).detach().double().flatten() for p in model.parameters()]
    rank = int(os.environ["RANK"])
    result = {
        "params": held,
        "grads": grads,
        "optimizer": state,
        "held": held + grads + state,
        "save_s": saved["seconds"],
        "elements": sum(p.numel() for p in model.parameters()),
    }
    if rank == 0:
        torch.save(torch.cat(weights), out / "weights.pt")
    (out / f"result-{rank}.json").write_text(json.dumps(result))


def launch(out: Path, mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        str(Path(__file__).resolve()), "--worker", str(out), mode, str(args.steps), str(args.hidden), str(args.layers),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(args.nproc)]


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        out, mode, steps, hidden, layers = sys.argv[2:7]
        worker(Path(out), mode, int(steps), int(hidden), int(layers))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    load_before = os.getloadavg()
    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["ddp", "fsdp"] if r % 2 == 0 else ["fsdp", "ddp"]
            runs = {mode: launch(Path(tmp) / f"{mode}-{r}", mode, args) for mode in order}
            a = torch.load(Path(tmp) / f"ddp-{r}" / "weights.pt")
            b = torch.load(Path(tmp) / f"fsdp-{r}" / "weights.pt")
            rows.append(
                {
                    "held_ratio": max(x["held"] for x in runs["fsdp"]) / max(x["held"] for x in runs["ddp"]),
                    "save_ratio": max(x["save_s"] for x in runs["fsdp"]) / max(x["save_s"] for x in runs["ddp"]),
                    "max_difference": float((a - b).abs().max()),
                    "runs": runs,
                }
            )
    ddp0, fsdp0 = rows[0]["runs"]["ddp"][0], rows[0]["runs"]["fsdp"][0]
    result = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=HERE).stdout.strip(),
            "loadavg": {"before": load_before, "after": os.getloadavg()},
            "seconds": time.perf_counter() - began,
            "args": vars(args),
            "elements": ddp0["elements"],
        },
        "held_bytes": {"ddp": ddp0["held"], "fsdp": fsdp0["held"]},
        "held_ratio": _summary([r["held_ratio"] for r in rows]),
        "save_ratio": _summary([r["save_ratio"] for r in rows]),
        "save_s": {
            mode: _summary([max(x["save_s"] for x in r["runs"][mode]) for r in rows]) for mode in ("ddp", "fsdp")
        },
        "max_difference": _summary([r["max_difference"] for r in rows]),
    }  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    m = result["meta"]
    print(
        f"{m['date']}, commit {m['commit']}, {args.nproc} CPU processes, load {m['loadavg']['before'][0]:.2f} before, "
        f"{m['loadavg']['after'][0]:.2f} after; {m['seconds']:.0f} s; Llama of {m['elements']:,} parameters, "
        f"{args.steps} steps, {args.rounds} rounds (median, min-max)\n"
    )
    held = result["held_bytes"]
    print(f"- held per process (params + grads + AdamW state): DDP {held['ddp']:,} B, FSDP2 {held['fsdp']:,} B")
    for key, goal in (("held_ratio", "<= 0.55"), ("save_ratio", "<= 0.6"), ("max_difference", "<= 1e-6")):
        s = result[key]
        print(f"- {key}: {s['median']:.3g} ({s['min']:.3g}-{s['max']:.3g}), goal {goal}")
    save = result["save_s"]
    print(f"- save seconds (slowest process): DDP {save['ddp']['median']:.3f}, FSDP2 {save['fsdp']['median']:.3f}")


if __name__ == "__main__":
    main()
