"""Per-step time of torchloom's engine against a hand-written Accelerate loop doing the same work.

    python bench/engine_overhead.py [--steps 300] [--repeats 3] [--plugins grad_accum,grad_clip]

The loops train the same MLP on the same in-memory batches in this process, alternating repeats so that machine
noise hits all of them; reported: median seconds per optimizer step of each, and their ratio to the hand-written
loop. A ratio near 1.0 means the hooks, the progress record and the log buffer cost nothing measurable at this size.
The engine runs three times per repeat: as configured, then with the ``progress`` plugin added (what the
``torchloom`` command enables by default) printing plain lines (stdout not a terminal), then drawing its bar
(``terminal: true``); their output goes to /dev/null, but is rendered in full.
Not a test: timings are never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader, TensorDataset

import torchloom

WIDTH = 256


def make_data(steps: int, batch: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, WIDTH, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=batch)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 1),
    )


class MLPTask(torchloom.TaskModule):
    def __init__(self, data: DataLoader) -> None:
        super().__init__()
        self.data = data

    def configure_model(self) -> torch.nn.Module:
        return make_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return self.data


def hand_written(data: DataLoader) -> float:
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, data)
    start = time.perf_counter()
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / len(loader)


def engine_run(data: DataLoader, plugins: list[Any]) -> float:
    with tempfile.TemporaryDirectory() as out, open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        engine = torchloom.Engine(max_epochs=1, log_every_n_steps=50, output_dir=out, plugins=plugins)
        start = time.perf_counter()
        engine.fit(MLPTask(data))
        elapsed = time.perf_counter() - start
    return elapsed / len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plugins", default="", help="comma-separated plugin names for the engine run")
    args = parser.parse_args()
    plugins: list[Any] = [p for p in args.plugins.split(",") if p]
    name = f"torchloom engine{' + ' + ','.join(plugins) if plugins else ''}"
    variants = {
        name: plugins,
        f"{name} + progress (plain lines)": [*plugins, {"progress": {"terminal": False}}],
        f"{name} + progress (bar)": [*plugins, {"progress": {"terminal": True}}],
    }
    data = make_data(args.steps)
    torch.set_num_threads(1)
    hand: list[float] = []
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    for _ in range(args.repeats):
        hand.append(hand_written(data))
        for variant, variant_plugins in variants.items():
            times[variant].append(engine_run(data, variant_plugins))
    h = statistics.median(hand)
    print(f"hand-written Accelerate loop: {h * 1e3:.3f} ms/step (median of {args.repeats} x {args.steps} steps)")
    for variant, measured in times.items():
        e = statistics.median(measured)
        print(f"{variant}: {e * 1e3:.3f} ms/step, ratio to hand-written {e / h:.3f}")
    print("(each engine run includes its set-up: Accelerator, prepare, hooks)")


if __name__ == "__main__":
    main()
