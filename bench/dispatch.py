"""Hook dispatch: microseconds per micro-step that torchloom spends calling hooks, outside the hooks' own code.

    python bench/dispatch.py [--repeats 2] [--steps 1000] [--sample-steps 20000] [--json out.json]

Real fits of the W1 workload (`workloads.W1`, 1 torch thread) with three plugin sets: none; every built-in as a
no-op (`workloads.NOOP_SETTINGS`); the realistic set (grad_accum 2, bf16, grad_clip, adamw8bit). Two methods:

**Sampled** (py-spy). One fit per plugin set runs in a child process under ``py-spy record --nonblocking`` (about
1000 samples a second, read from outside the process, which is not stopped). A sample of the training loop (its
stack has the loop's ``FitLoop._epoch``) counts as dispatch when its innermost Python frame is dispatch code:
pluggy's, torchloom/plugins.py (``HookRelay.call``) or torchloom/step.py (`StepHooks`); time in C code (a torch
op) is charged to the Python frame that called it. Dispatch per micro-step = the fraction of samples x the time
per micro-step, +- one binomial standard error. Samples in the engine's own files (engine.py, the log buffer,
the progress record) are reported apart: engine overhead that is not dispatch. (An in-process sampler on
SIGALRM was tried first and dropped: Python handles a signal only at the next function entry or loop, so time in a
long C call such as ``backward()`` was charged to whatever Python function came next, often a hook.)

**Instrumented** (per hook). While the fits run in this process, every entry into the engine's dispatch
(``HookRelay.call``; the `StepHooks` methods, including the check that skips a hook nobody implements) and every
hook implementation (each ``@hookimpl`` method of each registered plugin, the engine's default step and metrics
writer included, wrapped on the instance before the relay registers it; a ``wrapper=True`` implementation in each
of its segments) is timed with ``time.perf_counter``. The dispatch time of one entry is its elapsed time minus
that of what it called directly: implementations, and nested entries (which count on their own). So the forward,
backward and optimizer step inside the default ``run_train_step`` are implementation time, and
``before_optimizer_step`` fired from inside it is an entry of its own. The wrappers' own cost is measured on empty
functions in a tight loop and subtracted from each call; in a fit the caches are colder than in a tight loop (a
training step runs between two hooks), so hooks and wrappers cost more there, the subtraction falls short and the
figures err high. A method check measures that: a relay with one plugin whose implementations are empty, a real
training step between calls, timed by this method and by plain A/B (the call through the engine's path minus a
direct call of the implementation, each timed on its own). A call on this shared machine is now and then
descheduled for milliseconds, which would dominate a mean: each (hook, layer) reports the *median* per call,
times its calls per micro-step. Calls are recorded from the first ``HookRelay.call`` after micro-batch
``warmup``'s forward starts until micro-batch ``warmup + steps``'s forward starts; the garbage collector is off
in that span (a collection would be charged to whichever call it interrupts).

Not a test: numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch

if os.path.dirname(os.path.abspath(__file__)) not in map(os.path.abspath, sys.path):  # imported from elsewhere
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads

import torchloom
from torchloom import RankAgreement, StepHooks
from torchloom.hookspecs import PROJECT_NAME
from torchloom.plugins import HookRelay  # the engine's dispatcher: what this measures (not public API)

MARKER = f"{PROJECT_NAME}_impl"
STEP_HOOKS = ("before_backward", "before_optimizer_step", "after_optimizer_step")
clock = time.perf_counter

ENTRY, IMPL = 0, 1


# A frame is a list (cheaper to make than an object, which matters: its cost is subtracted as calibrated):
# [time of direct children, kind (ENTRY: a dispatch entry; IMPL: an implementation segment), nested in an entry,
#  plain implementations called, wrapper implementations called]
CHILDREN, KIND, NESTED, IMPLS, WRAPPERS = range(5)


class Recorder:
    def __init__(self) -> None:
        self.armed = False  # the span started: record from the next HookRelay.call made outside any hook call
        self.active = False
        self.depth = 0  # hook calls open while not recording
        self.frozen = False  # the span is over: drop everything still open
        self.stack: list[list[Any]] = []
        self.samples: dict[tuple[str, str], list[float]] = defaultdict(list)  # (hook, layer) -> dispatch per call
        self.cost: dict[str, float] = {}  # from `_calibrate`
        self.stray: set[str] = set()

    def reset(self, cost: dict[str, float] | None = None) -> None:
        self.__init__()
        self.cost = cost or {}


REC = Recorder()


def _timed_entry(fn: Any, layer: str, hook_name: Any) -> Any:
    """Wrap a dispatch entry ``fn(self, ...)``; ``hook_name(args)`` names the hook it fires."""

    def entry(*args: Any, **kwargs: Any) -> Any:
        rec = REC
        if rec.armed and rec.depth == 0 and layer == "HookRelay.call":
            rec.armed, rec.active = False, True
        if not rec.active or rec.frozen:
            rec.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                rec.depth -= 1
        stack = rec.stack
        frame = [0.0, ENTRY, bool(stack) and stack[-1][KIND] == ENTRY, 0, 0]
        stack.append(frame)
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = clock() - t0
            stack.pop()
            if not rec.frozen:
                cost = rec.cost
                added = cost.get("nested_entry" if frame[NESTED] else "entry", 0.0)
                added += frame[IMPLS] * cost.get("impl", 0.0) + frame[WRAPPERS] * cost.get("wrapper", 0.0)
                rec.samples[(hook_name(args), layer)].append(elapsed - frame[CHILDREN] - added)
                if stack:
                    stack[-1][CHILDREN] += elapsed

    return entry


def _impl_segment(step: Any, *args: Any, **kwargs: Any) -> Any:
    """Run one segment of an implementation, as implementation time of the open entry."""
    stack = REC.stack
    if not stack:
        if REC.active and not REC.frozen:
            REC.stray.add(getattr(step, "__qualname__", repr(step)))
        return step(*args, **kwargs)
    stack.append([0.0, IMPL])
    t0 = clock()
    try:
        return step(*args, **kwargs)
    finally:
        elapsed = clock() - t0
        stack.pop()
        stack[-1][CHILDREN] += elapsed


def _timed_impl(fn: Any) -> Any:
    """Wrap a plain implementation (a bound method)."""

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        stack = REC.stack
        if stack and stack[-1][KIND] == ENTRY:
            stack[-1][IMPLS] += 1
        return _impl_segment(fn, *args, **kwargs)

    return timed


def _timed_wrapper(fn: Any) -> Any:
    """Wrap a ``wrapper=True`` implementation (a generator): each of its segments is implementation time."""

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        stack = REC.stack
        if stack and stack[-1][KIND] == ENTRY:
            stack[-1][WRAPPERS] += 1
        gen = fn(*args, **kwargs)
        value = _impl_segment(gen.__next__)
        while True:
            try:
                sent = yield value
            except BaseException as exc:
                try:
                    value = _impl_segment(gen.throw, exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = _impl_segment(gen.send, sent)
                except StopIteration as stop:
                    return stop.value

    return timed


def _instrument_plugin(plugin: Any) -> None:
    """Shadow each ``@hookimpl`` method of ``plugin`` with a timed one (before pluggy registers it)."""
    for name in dir(type(plugin)):
        attr = getattr(type(plugin), name, None)
        if not callable(attr) or not hasattr(attr, MARKER) or name in vars(plugin):
            continue
        bound = getattr(plugin, name)
        opts = getattr(attr, MARKER)
        wrapped = _timed_wrapper(bound) if opts.get("wrapper") or opts.get("hookwrapper") else _timed_impl(bound)
        setattr(plugin, name, wrapped)


@contextlib.contextmanager
def instrumented():
    """Patch the relay (its entry, and instrumenting plugins as they are registered) and `StepHooks`."""
    init, call = HookRelay.__init__, HookRelay.call
    saved_steps = {name: getattr(StepHooks, name) for name in STEP_HOOKS}

    def instrumenting_init(self: Any, plugins: Any) -> None:
        for plugin in plugins:
            _instrument_plugin(plugin)
        init(self, plugins)

    HookRelay.__init__ = instrumenting_init  # type: ignore[method-assign]
    HookRelay.call = _timed_entry(call, "HookRelay.call", lambda args: args[1])  # type: ignore[method-assign]
    for name in STEP_HOOKS:
        setattr(StepHooks, name, _timed_entry(saved_steps[name], "StepHooks", lambda args, name=name: name))
    try:
        yield
    finally:
        HookRelay.__init__, HookRelay.call = init, call  # type: ignore[method-assign]
        for name, original in saved_steps.items():
            setattr(StepHooks, name, original)


class SpanClock(workloads.Clock):
    """The overhead benchmark's clock, arming the recorder and switching the garbage collector off for the
    span."""

    def tick(self) -> None:
        if self.count == self.start:
            REC.armed = True
            gc.disable()
        elif self.count == self.stop:
            REC.frozen = True
            gc.enable()
        super().tick()


# ------------------------------------------------------------------------------------------------ calibration


class _Cache:
    """A real W1 training step, run between the timed calls of the method check so that they find the caches as
    the hooks of a fit do (in a tight loop the same calls run several times faster)."""

    def __init__(self) -> None:
        self.model = workloads.W1.build_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=workloads.LR)
        self.batch = next(iter(workloads.W1.loader(1)))

    def disturb(self) -> None:
        workloads.W1.forward(self.model, self.batch).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _calibrate(repeats: int = 7, n: int = 20000) -> dict[str, float]:
    """Seconds of dispatch that the instrumentation itself adds per event, measured by running empty functions
    through the same wrappers: the dispatch recorded, less the real cost of the same calls uninstrumented (all of
    which is dispatch, the functions being empty). Per plain implementation, per wrapper implementation (two
    segments), per top-level entry and per entry nested in an entry."""

    class Empty:
        def f(self, a: Any, b: Any = None) -> None:
            return None

        def g(self, a: Any, b: Any = None) -> Any:
            yield

    e = Empty()
    impl, wrapper = _timed_impl(e.f), _timed_wrapper(e.g)
    entry = _timed_entry(Empty.f, "HookRelay.call", lambda args: "calibration")

    def outer_raw(self: Any, a: Any, b: Any = None) -> None:
        Empty.f(self, a, b=b)

    def outer_inner(self: Any, a: Any, b: Any = None) -> None:
        entry(self, a, b=b)

    outer = _timed_entry(outer_inner, "StepHooks", lambda args: "calibration")

    def drive(gen: Any) -> None:  # what pluggy does with a wrapper: next, then send the result
        next(gen)
        with contextlib.suppress(StopIteration):
            gen.send(None)

    def loop(body: Any) -> float:
        t0 = clock()
        for _ in range(n):
            body()
        return clock() - t0

    def recorded(body: Any, open_entry: bool) -> float:
        """Dispatch recorded over ``n`` runs of ``body`` (inside one open entry frame, its share included)."""
        REC.reset()
        REC.active = True
        frame = [0.0, ENTRY, False, 0, 0]
        if open_entry:
            REC.stack.append(frame)
        t = loop(body)
        if open_entry:
            REC.stack.pop()
        total = sum(sum(v) for v in REC.samples.values())
        return total + (t - frame[CHILDREN] if open_entry else 0.0)

    # Each quantity is the least of ``repeats`` loops (timeit's rule: noise from other processes only adds).
    def least(body: Any, *args: Any) -> float:
        return min(body(*args) for _ in range(repeats))

    raw_call = least(loop, lambda: e.f(1, b=2))
    entry_cost = (least(recorded, lambda: entry(e, 1, b=2), False) - raw_call) / n
    pair = (least(recorded, lambda: outer(e, 1, b=2), False) - least(loop, lambda: outer_raw(e, 1, b=2))) / n
    found = {
        "impl": (least(recorded, lambda: impl(1, b=2), True) - raw_call) / n,
        "wrapper": (least(recorded, lambda: drive(wrapper(1, b=2)), True) - least(loop, lambda: drive(e.g(1, b=2))))
        / n,
        "entry": entry_cost,
        "nested_entry": pair - entry_cost,  # an entry inside an entry: the pair's excess less the outer's
    }
    REC.reset()
    return {key: max(0.0, value) for key, value in found.items()}


def _check_method(n: int = 1500) -> dict[str, dict[str, float]]:
    """The method checked against an A/B timing in the same conditions as a fit.

    A relay with one plugin whose implementations are empty (``run_train_step`` with the default step's eight
    arguments, ``before_optimizer_step`` fired through `StepHooks`, ``on_train_batch_end``). Between calls a real
    W1 training step runs, so that the calls find the caches as the hooks of a fit do (in a tight loop they run
    several times faster). A/B: the median time of a call through the engine's path minus the median time of
    calling the implementation directly, each call timed on its own. Instrumented: the same calls, measured by
    this script's method. The two should agree.
    """

    class Empty:
        name = "empty"

        @torchloom.hookimpl(trylast=True)
        def run_train_step(self, task, model, optimizer, scheduler, accelerator, batch, progress, hooks) -> Any:
            return None

        @torchloom.hookimpl
        def before_optimizer_step(self, model: Any) -> None:
            return None

        @torchloom.hookimpl
        def on_train_batch_end(self, batch: Any, progress: Any) -> None:
            return None

    train_step = _Cache().disturb

    step_kwargs = dict(zip(("task", "model", "optimizer", "scheduler", "accelerator", "batch", "progress"), range(7)))
    end_kwargs = {"outputs": {}, "batch": 1, "accelerator": 2, "progress": 3, "log": None}

    def paths(plugin: Any) -> dict[str, Any]:
        relay = HookRelay([plugin])
        hooks = StepHooks(relay, None, False, RankAgreement(1))
        return {
            "run_train_step (HookRelay.call)": lambda: relay.call("run_train_step", **step_kwargs, hooks=hooks),
            "before_optimizer_step (StepHooks)": lambda: hooks.before_optimizer_step(1, 2, 3, 4),
            "on_train_batch_end (HookRelay.call)": lambda: relay.call("on_train_batch_end", **end_kwargs),
        }

    plain = Empty()
    direct = {
        "run_train_step (HookRelay.call)": lambda: plain.run_train_step(0, 1, 2, 3, 4, 5, 6, None),
        "before_optimizer_step (StepHooks)": lambda: plain.before_optimizer_step(1),
        "on_train_batch_end (HookRelay.call)": lambda: plain.on_train_batch_end(1, 3),
    }
    through = paths(plain)
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(n):
        for name in direct:
            for kind, call in (("engine", through[name]), ("direct", direct[name])):
                train_step()
                t0 = clock()
                call()
                times[(name, kind)].append(clock() - t0)
    with instrumented():
        timed = paths(Empty())
        REC.reset(REC.cost)
        REC.active = True
        for _ in range(n):
            for call in timed.values():
                train_step()
                call()
        medians = {key: statistics.median(v) for key, v in REC.samples.items()}
    REC.reset(REC.cost)
    result = {}
    for name in direct:
        hook = name.split()[0]
        ab = statistics.median(times[(name, "engine")]) - statistics.median(times[(name, "direct")])
        instrumented_value = sum(v for (h, _), v in medians.items() if h == hook)
        result[name] = {"ab_us": ab * 1e6, "instrumented_us": instrumented_value * 1e6}
    return result


# --------------------------------------------------------------------------------------------------- sampling

#: Where a sampled stack's innermost frame must be for the sample to count as dispatch: pluggy, the relay
#: (torchloom/plugins.py: ``HookRelay.call`` and its comprehension) or `StepHooks` (torchloom/step.py).
DISPATCH_FILES = (f"pluggy{os.sep}", f"torchloom{os.sep}plugins.py", f"torchloom{os.sep}step.py")
#: The engine's own per-step code (counted apart: engine overhead that is not hook dispatch).
ENGINE_FILES = tuple(
    f"torchloom{os.sep}{name}"
    for name in ("engine.py", "_loop.py", "_logbuffer.py", "_logging.py", "progress.py", "_guards.py")
)
#: (function, file) of a frame that every sample of the training loop has (set-up and teardown samples are left out).
LOOP_FRAME = "_epoch (", f"torchloom{os.sep}_loop.py"


def _child_fit(label: str, warmup: int, steps: int, out: str) -> None:
    """The fit that py-spy samples (``--child``): writes its seconds per micro-step."""
    torch.set_num_threads(1)
    plugins = _plugin_sets()[0][label]
    clock = workloads.Clock(warmup, steps)
    with workloads.quiet():
        workloads.torchloom_run(workloads.W1, plugins, clock, warmup + steps + 1)
    with open(out, "w") as f:
        json.dump({"seconds_per_micro_step": clock.seconds() / steps}, f)


def sample_with_py_spy(label: str, warmup: int, steps: int, rate: int) -> dict[str, Any]:
    """Run one fit in a child process under ``py-spy record`` (it reads the child's stacks from outside, without
    stopping it: ``--nonblocking``); charge each sample of the training loop by its innermost Python frame."""
    exe = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if exe is None:
        return {"error": "py-spy is not installed (nox -s bench installs it)"}
    with tempfile.TemporaryDirectory() as tmp:
        raw, timing = os.path.join(tmp, "raw.txt"), os.path.join(tmp, "timing.json")
        argv = [exe, "record", "--nonblocking", "-r", str(rate), "-f", "raw", "-o", raw, "--"]
        argv += [sys.executable, os.path.abspath(__file__), "--child", label, "--warmup", str(warmup)]
        argv += ["--sample-steps", str(steps), "--json", timing]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not os.path.exists(timing):
            return {"error": f"py-spy failed (exit {done.returncode}): {done.stderr.strip()[-300:]}"}
        with open(timing) as f:
            per_step = json.load(f)["seconds_per_micro_step"]
        loop = dispatch = engine = 0
        with open(raw) as f:
            for line in f:
                stack, _, count = line.rstrip("\n").rpartition(" ")
                if not any(LOOP_FRAME[0] in frame and LOOP_FRAME[1] in frame for frame in stack.split(";")):
                    continue
                n = int(count)
                loop += n
                leaf = stack.rsplit(";", 1)[-1]
                if any(name in leaf for name in DISPATCH_FILES):
                    dispatch += n
                elif any(name in leaf for name in ENGINE_FILES):
                    engine += n
    if loop == 0:
        return {"error": "py-spy recorded no sample of the training loop"}
    us = per_step * 1e6
    fraction = dispatch / loop
    return {
        "samples": loop,
        "dispatch_samples": dispatch,
        "us_per_micro_step": fraction * us,
        "standard_error_us": math.sqrt(fraction * (1 - fraction) / loop) * us,
        "engine_own_us_per_micro_step": engine / loop * us,
        "step_us": us,
    }


# ----------------------------------------------------------------------------------------------------- runs


def measure_once(plugins: dict[str, dict[str, Any]], warmup: int, steps: int, cost: dict[str, float]) -> dict:
    """One fit: (hook, layer) -> (median dispatch seconds per call, calls per micro-step)."""
    REC.reset(cost)
    span = SpanClock(warmup, steps)
    try:
        with workloads.quiet():
            workloads.torchloom_run(workloads.W1, plugins, span, warmup + steps + 1)
    finally:
        gc.enable()
    span.seconds()
    per_call = {key: (statistics.median(v), len(v) / steps) for key, v in REC.samples.items()}
    return {"per_call": per_call, "stray": sorted(REC.stray)}


def _plugin_sets() -> tuple[dict[str, dict[str, dict[str, Any]]], list[str]]:
    noop, notes = workloads.noop_plugins()
    sets = {"no plugins": {}, "every built-in as a no-op": noop}
    if workloads.bitsandbytes_available() is None:
        sets["realistic set"] = workloads.TORCHLOOM_PLUGINS["realistic"]
    else:
        notes.append("realistic set skipped: bitsandbytes' 8-bit AdamW does not run here")
    return sets, notes


def measure(repeats: int, warmup: int, steps: int, sample_steps: int, rate: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    cost = _calibrate()
    REC.cost = cost
    check = _check_method()
    sets, notes = _plugin_sets()
    sampled = {label: sample_with_py_spy(label, warmup, sample_steps, rate) for label in sets}
    rows = []
    with instrumented():
        for label, plugins in sets.items():
            totals: list[float] = []
            by_key: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
            for _ in range(repeats):
                m = measure_once(plugins, warmup, steps, cost)
                if m["stray"]:
                    note = (
                        f"{label}: implementations called outside HookRelay.call / StepHooks (the engine dispatches "
                        f"them some other way; their dispatch is missing here): {', '.join(m['stray'])}"
                    )
                    if note not in notes:
                        notes.append(note)
                totals.append(sum(seconds * calls for seconds, calls in m["per_call"].values()) * 1e6)
                for key, value in m["per_call"].items():
                    by_key[key].append(value)
            hooks: dict[str, dict[str, float]] = defaultdict(lambda: {"us_per_micro_step": 0.0})
            for (hook, layer), values in sorted(by_key.items()):
                us_per_call = statistics.median(v[0] for v in values) * 1e6
                calls = statistics.median(v[1] for v in values)
                hooks[hook]["us_per_micro_step"] += us_per_call * calls
                hooks[hook][f"{layer} calls / micro-step"] = calls
                hooks[hook][f"{layer} us / call"] = us_per_call
            rows.append(
                {
                    "plugins": label,
                    "enabled": list(plugins),
                    "sampled": sampled[label],
                    "us_per_micro_step": {"median": statistics.median(totals), "min": min(totals), "max": max(totals)},
                    "hooks": dict(hooks),
                }
            )
    return {
        "workload": workloads.W1.label,
        "repeats": repeats,
        "warmup_micro_steps": warmup,
        "timed_micro_steps": steps,
        "sampled_micro_steps": sample_steps,
        "sample_rate_hz": rate,
        "instrumentation_cost_us": {k: v * 1e6 for k, v in cost.items()},
        "method_check": check,
        "rows": rows,
        "notes": notes,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"Hook dispatch, {result['workload']}. Sampled: py-spy at {result['sample_rate_hz']} Hz over one fit of "
        f"{result['sampled_micro_steps']} micro-steps (+- one standard error). Instrumented: "
        f"{result['repeats']} fits x {result['timed_micro_steps']} micro-steps, median per call x calls per "
        "micro-step (min-max over the fits; errs high, see the method check).",
        "",
        "| plugins | sampled us / micro-step | instrumented us / micro-step | engine's own code, sampled | per hook, "
        "instrumented: (relay calls / micro-step) us / micro-step |",
        "|---|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        t, sampled = row["us_per_micro_step"], row["sampled"]
        hooks = ", ".join(
            f"{name} ({h.get('HookRelay.call calls / micro-step', 0):.2g}) {h['us_per_micro_step']:.1f}"
            for name, h in row["hooks"].items()
        )
        if "error" in sampled:
            cells = f"not run: {sampled['error']} | | "
        else:
            cells = (
                f"{sampled['us_per_micro_step']:.1f} +- {sampled['standard_error_us']:.1f} | "
                f"{t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) | "
                f"{sampled['engine_own_us_per_micro_step']:.1f} of {sampled['step_us']:.0f} |"
            )
        lines.append(f"| {row['plugins']} | {cells} {hooks} |")
    checks = "; ".join(
        f"{name}: {c['instrumented_us']:.2f} us instrumented vs {c['ab_us']:.2f} us A/B"
        for name, c in result["method_check"].items()
    )
    lines += ["", f"Method check on a one-plugin relay with empty implementations: {checks}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="instrumented fits per plugin set")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--steps", type=int, default=1000, help="timed micro-steps per instrumented fit")
    parser.add_argument("--sample-steps", type=int, default=20000, help="timed micro-steps of the sampled fit")
    parser.add_argument("--rate", type=int, default=997, help="py-spy samples per second")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the fit py-spy samples
    args = parser.parse_args()
    if args.child is not None:
        _child_fit(args.child, args.warmup, args.sample_steps, args.json)
        return
    result = measure(args.repeats, args.warmup, args.steps, args.sample_steps, args.rate)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
