"""Compile time, steady-state step time and break-even of the ``compile`` plugin's in-place ``torch.compile``.

    python bench/compile_speed.py [--steps 40] [--width 256] [--blocks 4] [--batch 128] [--threads 1]

Trains the same residual MLP (LayerNorm, GELU) with SGD eagerly and compiled with inductor
(`torchloom_plugins.compile.compile_in_place`, what the plugin does), on one in-memory batch. Reported: the first
step (compilation included) and the median of the later steps of each, their ratio, and the number of steps after
which compiling pays off: (compiled first step - eager step) / (eager step - compiled step).
Not a test: timings are never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from torchloom_plugins.compile import compile_in_place


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up = torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def run(args: argparse.Namespace, compiled: bool) -> tuple[float, float]:
    """Return (first step seconds, median seconds of steps 6..)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(args.width) for _ in range(args.blocks)], torch.nn.Linear(args.width, 1))
    if compiled:
        compile_in_place(model, backend="inductor")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 1)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args, _ = parser.parse_known_args()  # the nox bench session passes its arguments to every script
    args.steps = max(args.steps, 10)
    torch.set_num_threads(args.threads)
    eager_first, eager = run(args, compiled=False)
    compiled_first, compiled = run(args, compiled=True)
    gain = eager - compiled
    break_even = f"{(compiled_first - eager) / gain:,.0f} steps" if gain > 0 else "never (no steady-state gain)"
    print(f"compile_speed: {args.blocks} blocks, width {args.width}, batch {args.batch}, {args.threads} thread(s)")
    print(f"  eager     first step {eager_first:8.3f} s   steady {eager * 1e3:8.2f} ms")
    print(
        f"  inductor  first step {compiled_first:8.3f} s   steady {compiled * 1e3:8.2f} ms   ({compiled / eager:.2f}x)"
    )
    print(f"  break-even: {break_even}")


if __name__ == "__main__":
    main()
