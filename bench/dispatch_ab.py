"""Hook dispatch of this checkout's relay against another checkout's, A/B in one process.

    python bench/dispatch_ab.py --base /path/to/other/src [--n 3000] [--json out.json]

For a change to the dispatch itself (``torchloom/plugins.py``, ``torchloom/step.py``), where `dispatch.py`'s
absolute figures move with the load of a shared machine more than the change moves them. The other checkout's
``torchloom/plugins.py`` and ``torchloom/step.py`` are loaded as modules of their own, next to this checkout's
(both use this checkout's hook specs). Each side gets the same stand-in plugins, whose implementations are empty and
register what the W1 plugin sets register per micro-step (the implementations' arguments as the built-ins name them):

- every built-in as a no-op: the default step's ``run_train_step``; ``optimizer``'s ``before_optimizer_step``;
  ``local_sgd``'s and ``optimizer``'s ``after_optimizer_step``. One micro-step: ``run_train_step`` through
  ``HookRelay.call``, then both optimizer-step hooks through `StepHooks`.
- the realistic set (grad_accum 2, bf16, grad_clip, adamw8bit): ``grad_accum``'s ``run_train_step`` wrapper around
  the default step; ``grad_accum`` (``tryfirst``), ``grad_clip`` and ``optimizer`` on ``before_optimizer_step``;
  ``optimizer`` on ``after_optimizer_step``. Two micro-steps per optimizer step.

A real W1 training step runs before each timed micro-step, so that the calls find the caches as in a fit (in a tight
loop they run several times faster); the two sides alternate, one micro-step each. Reported: the median time of a
micro-step's dispatch per side (the empty implementations' own calls included, alike on both sides) and the median
of the paired differences. Not a test: numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

if os.path.dirname(os.path.abspath(__file__)) not in map(os.path.abspath, sys.path):  # imported from elsewhere
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads

import torchloom
from torchloom import RankAgreement
from torchloom import plugins as this_plugins
from torchloom import step as this_step

clock = time.perf_counter


def _load(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class DefaultStep:
    name = "torchloom.default_step"

    @torchloom.hookimpl(trylast=True)
    def run_train_step(self, task, model, optimizer, scheduler, accelerator, batch, progress, hooks) -> Any:
        return {"loss": 0.0}


class Optimizer:
    name = "optimizer"

    @torchloom.hookimpl
    def before_optimizer_step(self, optimizer) -> None:
        return None

    @torchloom.hookimpl
    def after_optimizer_step(self, optimizer, log) -> None:
        return None


class LocalSGD:
    name = "local_sgd"

    @torchloom.hookimpl
    def after_optimizer_step(self) -> None:
        return None


class GradAccum:
    name = "grad_accum"

    @torchloom.hookimpl(wrapper=True)
    def run_train_step(self, accelerator, model, progress) -> Any:
        return (yield)

    @torchloom.hookimpl(tryfirst=True)
    def before_optimizer_step(self, model, accelerator) -> None:
        return None


class GradClip:
    name = "grad_clip"

    @torchloom.hookimpl
    def before_optimizer_step(self, model, accelerator, log) -> None:
        return None


#: label -> (stand-in plugin classes in the engine's order, micro-steps per optimizer step)
SETS = {
    "every built-in as a no-op": ((Optimizer, LocalSGD, DefaultStep), 1),
    "realistic set": ((GradAccum, GradClip, Optimizer, DefaultStep), 2),
}


def _window(plugins_module: Any, step_module: Any, classes: tuple[type, ...], micro_steps: int) -> Any:
    """A function running one optimizer step's dispatch (``micro_steps`` micro-steps) through one side."""
    relay = plugins_module.HookRelay([cls() for cls in classes])
    hooks = step_module.StepHooks(relay, lambda *args, **kwargs: None, False, RankAgreement(1))
    step_kwargs = dict(zip(("task", "model", "optimizer", "scheduler", "accelerator", "batch", "progress"), range(7)))

    def window() -> None:
        for _ in range(micro_steps):
            relay.call("run_train_step", **step_kwargs, hooks=hooks)
        hooks.before_optimizer_step(1, 2, 3, 4)
        hooks.after_optimizer_step(1, 2, 3, 4, 5)

    return window


def measure(base_src: str, n: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    base_plugins = _load(os.path.join(base_src, "torchloom", "plugins.py"), "_base_torchloom_plugins")
    base_step = _load(os.path.join(base_src, "torchloom", "step.py"), "_base_torchloom_step")
    model = workloads.W1.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=workloads.LR)
    batch = next(iter(workloads.W1.loader(1)))

    def disturb() -> None:  # a real W1 training step
        workloads.W1.forward(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    rows = {}
    for label, (classes, micro_steps) in SETS.items():
        sides = {
            "this": _window(this_plugins, this_step, classes, micro_steps),
            "base": _window(base_plugins, base_step, classes, micro_steps),
        }
        times: dict[str, list[float]] = {"this": [], "base": []}
        for i in range(n):
            for side in ("this", "base") if i % 2 else ("base", "this"):
                disturb()
                t0 = clock()
                sides[side]()
                times[side].append((clock() - t0) / micro_steps)
        diffs = [a - b for a, b in zip(times["this"], times["base"])]
        rows[label] = {
            "this_us": statistics.median(times["this"]) * 1e6,
            "base_us": statistics.median(times["base"]) * 1e6,
            "paired_difference_us": statistics.median(diffs) * 1e6,
        }
    return {"n": n, "base": base_src, "load_average": os.getloadavg(), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the other checkout's src folder (holding torchloom/)")
    parser.add_argument("--n", type=int, default=3000, help="timed optimizer steps per side and plugin set")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = measure(args.base, args.n)
    print(f"Hook dispatch per micro-step, this checkout vs {args.base} ({args.n} paired optimizer steps each):\n")
    print("| plugins (stand-ins) | this, us | base, us | this - base (paired median), us |")
    print("|---|---:|---:|---:|")
    for label, row in result["rows"].items():
        print(f"| {label} | {row['this_us']:.2f} | {row['base_us']:.2f} | {row['paired_difference_us']:+.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
