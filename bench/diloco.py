"""DiLoCo vs LocalSGD vs plain DDP on 2 CPU processes: held-out loss after the same optimizer steps, and the bytes
each process all-reduces per optimizer step.

    python bench/diloco.py [--steps 400] [--sync-every 20]

Launches itself under ``torchrun --nproc_per_node 2`` (gloo). The task: an MLP (32 -> 128 -> 128 -> 1) learning a
fixed random teacher MLP from noisy samples, 2 x 16,384 training samples (each process its own shard), batch 32,
inner AdamW (lr 1e-3, weight decay 0); the three runs see the same data in the same order. DDP all-reduces every
gradient each step; LocalSGD and DiLoCo all-reduce the parameters every ``sync_every`` steps (plus once at the end).
Not a test: numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from torch.utils.data import DataLoader, TensorDataset


def _teacher_data(n: int, seed: int) -> TensorDataset:
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    torch.manual_seed(1234)
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=0.5)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=gen)
    with torch.no_grad():
        y = teacher(x) + 0.05 * torch.randn(n, 1, generator=gen)
    return TensorDataset(x, y)


def _worker(args: argparse.Namespace) -> None:
    import torchloom

    class Regression(torchloom.TaskModule):
        def configure_model(self):
            torch.manual_seed(0)
            return torch.nn.Sequential(
                torch.nn.Linear(32, 128),
                torch.nn.ReLU(),
                torch.nn.Linear(128, 128),
                torch.nn.ReLU(),
                torch.nn.Linear(128, 1),
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.0)

        def train_dataloader(self):
            return DataLoader(_teacher_data(2 * args.steps * 32, 0), batch_size=32)

    held_out = _teacher_data(4096, 1)
    runs = {
        "DDP": None,
        "LocalSGD": {"sync_every": args.sync_every},
        "DiLoCo (Nesterov, lr 0.7, momentum 0.9)": {
            "sync_every": args.sync_every,
            "outer_optimizer": "nesterov",
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
        },
    }
    results = {}
    for label, settings in runs.items():
        with tempfile.TemporaryDirectory() as out:
            engine = torchloom.Engine(
                output_dir=out,
                max_steps=args.steps,
                log_every_n_steps=args.steps,
                num_sanity_val_steps=0,
                plugins={"local_sgd": settings} if settings else None,
                default_plugins=False,
            )
            task = Regression()
            engine.fit(task)
            model = task.accelerator.unwrap_model(task.model)
            with torch.no_grad():
                loss = torch.nn.functional.mse_loss(model(held_out.tensors[0]), held_out.tensors[1]).item()
            param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            per_step = param_bytes if settings is None else param_bytes / args.sync_every
            results[label] = {"loss": loss, "train_loss": engine.history[-1]["train/loss"], "bytes_per_step": per_step}
    if task.accelerator.is_main_process:
        print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sync-every", type=int, default=20)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        _worker(args)
        return
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    done = subprocess.run(
        [*command, f"--steps={args.steps}", f"--sync-every={args.sync_every}"], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(done.stderr[-4000:])
    results = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    print(f"2 processes, {args.steps} optimizer steps, sync_every {args.sync_every}, batch 32 per process")
    print(f"{'run':<42} {'held-out MSE':>13} {'last train/loss':>16} {'bytes all-reduced / step':>25}")
    for label, r in results.items():
        print(f"{label:<42} {r['loss']:>13.5f} {r['train_loss']:>16.5f} {r['bytes_per_step']:>25,.0f}")


if __name__ == "__main__":
    main()
