"""Checkpoint saves and resumes near the machine's limit (issue 27, item 5).

    python bench/checkpoint_io.py [--rounds 5] [--stall-rounds 2] [--resume-rounds 15] [--every 30] [--width 2048]
                                  [--json out.json] [--dir DIR]

The model: an MLP of three ``Linear(width, width)`` layers and a head (width 2048: 12.6 M parameters, 50 MB of
fp32 weights), AdamW, batch 16 of random in-memory data, 1 torch thread; with AdamW's two moments a checkpoint
holds about 150 MB of tensors. Everything is written under ``--dir`` (default: a temporary directory on the disk
that holds ``/tmp``); saves and baselines go to the same directory.

(a) **Write throughput.** One fit; at every other optimizer step a probe plugin times a synchronous
    `torchloom.save_checkpoint` (what the ``checkpoint`` plugin does: Accelerate's ``save_state`` of the model and
    the optimizer, the engine's and the plugins' states, every file's checksum (XXH3-128) in the manifest, ``fsync`` of
    every file, the rename) and a plain ``safetensors.torch.save_file`` of the same tensors (the model's state dict and
    every tensor of the optimizer's state) into the same directory; also that ``save_file`` followed by an
    ``fsync`` of the file. The order of the three rotates each round; every file is deleted after its round.
    Throughput = bytes written / seconds; the ratio is the checkpoint's throughput over the plain save's, paired
    within a round. Goal (issue 40): >= 0.8 of ``save_file`` + ``fsync`` (both make the bytes durable).
(b) **Stall of the step that triggers a save.** Fits with the ``checkpoint`` plugin saving every ``--every``
    optimizer steps (three saves a fit), synchronously or with ``async_save``, alternating; two probe plugins
    note the time right before and right after the checkpoint plugin's ``on_train_step_end``: the stall of a
    save is the time between them at its step (the save, or the copy and the start of the thread, and any wait
    for the save before). Also reported: the time the training loses over the window from a save to the next
    one (the sum of the step times minus as many median steps: the background thread competes for the cores),
    and how long the end of the fit waits for the last save. Goal: async stall / sync stall <= 0.2.
(c) **Resume start-up.** One fit over a long epoch (a map-style dataset of 80,000 samples, batch 8: 10,000
    batches, a tiny model) saves at 10 %, 50 % and 90 % of it; then each is resumed in turn (interleaved,
    rotated): a new `torchloom.Engine` and task, timed from the ``fit`` call to the first trained batch's
    ``on_train_batch_start`` (the fit is stopped there). The dataset counts its ``__getitem__`` calls: skipping
    the batches already trained must not read them (the first batch's 8 samples are read, and the 8 of the
    batch Accelerate's loader fetches ahead: 16 at every position). Goal (issue 40): the slowest position / the
    fastest <= 1.1.

Medians over rounds with min-max; the load average (``os.getloadavg``) before and after, the commit and the date
are in the output. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset, TensorDataset

import torchloom
from torchloom_plugins.checkpoint import Checkpoint

MB = 1e6


class Stop(Exception):
    """Ends a fit from a probe."""


# ------------------------------------------------------------------------------------------------ the tasks


class BigTask(torchloom.TaskModule):
    """Three Linear(width, width) + ReLU, a head, MSE, AdamW; batch 16 of in-memory data."""

    def __init__(self, width: int, batches: int) -> None:
        super().__init__()
        self.width, self.batches = width, batches

    def configure_model(self) -> torch.nn.Module:
        w = self.width
        layers: list[torch.nn.Module] = []
        for _ in range(3):
            layers += [torch.nn.Linear(w, w), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(w, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        n = 16 * self.batches
        return DataLoader(TensorDataset(torch.randn(n, self.width, generator=g), torch.randn(n, 1)), batch_size=16)


class CountingDataset(Dataset):
    """``n`` samples of 4 features; counts ``__getitem__`` calls."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
        self.reads = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        return self.x[i], self.y[i]


class LongEpochTask(torchloom.TaskModule):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.data = CountingDataset(n)

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8, shuffle=True)


def _engine(out: Path, plugins: list[Any], **settings: Any) -> torchloom.Engine:
    settings = {"max_epochs": 1, "seed": 0, "log_every_n_steps": 1000, "default_plugins": False, **settings}
    return torchloom.Engine(output_dir=str(out), plugins=plugins, **settings)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# ------------------------------------------------------------------------------------------ (a) throughput


class ThroughputProbe:
    name = "bench.throughput_probe"

    def __init__(self, out: Path, rounds: int) -> None:
        self.out, self.rounds, self.rows = out, rounds, []
        self.model: Any = None
        self.optimizer: Any = None

    @torchloom.hookimpl
    def on_fit_start(self, accelerator: Any, model: Any, optimizer: Any) -> None:
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer

    def _tensors(self) -> dict[str, torch.Tensor]:
        tensors = {f"model.{k}": v for k, v in self.accelerator.unwrap_model(self.model).state_dict().items()}
        for index, state in self.optimizer.state_dict()["state"].items():
            tensors.update({f"optimizer.{index}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
        return tensors

    @torchloom.hookimpl
    def on_train_step_end(self, progress: Any) -> None:
        step = progress.global_step
        if step % 2:
            return
        done = step // 2 - 1  # round index; round 0 warms the page cache and the code paths, and is dropped
        if done > self.rounds:
            raise Stop
        timings: dict[str, tuple[float, int]] = {}

        def checkpoint() -> None:
            began = time.perf_counter()
            path = Path(torchloom.save_checkpoint(str(self.out / f"ckpt-{step}")))
            timings["checkpoint"] = (time.perf_counter() - began, _bytes(path))

        def plain(sync: bool) -> None:
            target = self.out / f"plain-{step}-{int(sync)}.safetensors"
            tensors = self._tensors()
            began = time.perf_counter()
            save_file(tensors, str(target))
            if sync:
                with target.open("rb") as f:
                    os.fsync(f.fileno())
            timings["plain+fsync" if sync else "plain"] = (time.perf_counter() - began, target.stat().st_size)

        order = [checkpoint, lambda: plain(False), lambda: plain(True)]
        shift = done % len(order)
        for action in order[shift:] + order[:shift]:
            action()
        for entry in self.out.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        if done > 0:
            self.rows.append({k: {"seconds": s, "bytes": b} for k, (s, b) in timings.items()})


def throughput(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    probe = ThroughputProbe(out / "saves", args.rounds)
    probe.out.mkdir(parents=True)
    with contextlib.suppress(Stop):
        _engine(out / "runs", [probe], max_steps=2 * args.rounds + 4).fit(BigTask(args.width, 2 * args.rounds + 4))
    rate = {k: [r[k]["bytes"] / r[k]["seconds"] / MB for r in probe.rows] for k in probe.rows[0]}
    ratios = [c / p for c, p in zip(rate["checkpoint"], rate["plain"])]  # paired within a round
    ratios_sync = [c / p for c, p in zip(rate["checkpoint"], rate["plain+fsync"])]
    return {
        "bytes": {k: probe.rows[0][k]["bytes"] for k in probe.rows[0]},
        "seconds": {k: _summary([r[k]["seconds"] for r in probe.rows]) for k in probe.rows[0]},
        "mb_per_s": {k: _summary(v) for k, v in rate.items()},
        "ratio": _summary(ratios),
        "ratio_to_plain_fsync": _summary(ratios_sync),
        "rounds": len(probe.rows),
    }


# ----------------------------------------------------------------------------------------------- (b) stall


class StepClock:
    """Notes the time of every ``on_train_step_end``; listed on both sides of the ``checkpoint`` plugin, one
    runs right before it and one right after it (``*_end`` hooks run in the reverse of the listed order)."""

    def __init__(self, name: str) -> None:
        self.name, self.times = name, []

    @torchloom.hookimpl
    def on_train_step_end(self) -> None:
        self.times.append(time.perf_counter())


def stall_fit(out: Path, args: argparse.Namespace, async_save: bool) -> dict[str, Any]:
    every = args.every
    before, after = StepClock("bench.before_checkpoint"), StepClock("bench.after_checkpoint")
    plugin = Checkpoint(every_n_steps=every, every_n_epochs=None, keep_last=1, async_save=async_save)
    steps = 3 * every + every // 2  # saves at every, 2 every, 3 every; then half a window
    engine = _engine(out, [after, plugin, before], max_steps=steps)
    engine.fit(BigTask(args.width, steps))
    ended = time.perf_counter()
    durations = [b - a for a, b in zip(after.times, after.times[1:])]  # durations[i]: step i + 2, its hooks included
    normal = statistics.median(durations)
    stalls, windows = [], []
    for save in (every, 2 * every, 3 * every):
        stalls.append(after.times[save - 1] - before.times[save - 1])  # in the checkpoint plugin's hook
        window = durations[save - 1 : save - 1 + every]  # from the save to the next one: steps slowed by the write
        windows.append(sum(window) - normal * len(window))
    return {"normal_step": normal, "stalls": stalls, "windows": windows, "end_wait": ended - after.times[-1]}


def stall(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    for r in range(args.stall_rounds + 1):  # round 0 warms up, dropped
        order = ["sync", "async"] if r % 2 == 0 else ["async", "sync"]
        for mode in order:
            result = stall_fit(out / f"{mode}-{r}", args, mode == "async")
            shutil.rmtree(out / f"{mode}-{r}")
            if r > 0:
                runs[mode].append(result)
    pairs = [
        statistics.median(a["stalls"]) / statistics.median(s["stalls"]) for s, a in zip(runs["sync"], runs["async"])
    ]
    return {
        "every": args.every,
        "normal_step": {m: _summary([r["normal_step"] for r in rs]) for m, rs in runs.items()},
        "stall": {m: _summary([x for r in rs for x in r["stalls"]]) for m, rs in runs.items()},
        "window": {m: _summary([x for r in rs for x in r["windows"]]) for m, rs in runs.items()},
        "end_wait": {m: _summary([r["end_wait"] for r in rs]) for m, rs in runs.items()},
        "ratio": _summary(pairs),
        "rounds": len(pairs),
    }


# ---------------------------------------------------------------------------------------------- (c) resume


class SaveAt:
    name = "bench.save_at"

    def __init__(self, steps: dict[int, str]) -> None:
        self.steps, self.paths = steps, {}

    @torchloom.hookimpl
    def on_train_step_end(self, progress: Any) -> None:
        label = self.steps.get(progress.global_step)
        if label is not None:
            self.paths[label] = torchloom.save_checkpoint()
            if label == "90%":
                raise Stop


class FirstBatch:
    name = "bench.first_batch"

    def __init__(self, task: LongEpochTask) -> None:
        self.task, self.at, self.reads = task, None, None

    @torchloom.hookimpl
    def on_train_batch_start(self) -> None:
        self.at, self.reads = time.perf_counter(), self.task.data.reads
        raise Stop


def resume(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    n, batches = args.samples, args.samples // 8
    marks = {round(batches * f): f"{int(f * 100)}%" for f in (0.1, 0.5, 0.9)}
    saver = SaveAt(marks)
    began = time.perf_counter()
    with contextlib.suppress(Stop):
        _engine(out / "long", [saver]).fit(LongEpochTask(n))
    made = time.perf_counter() - began
    labels = list(saver.paths)
    times: dict[str, list[float]] = {label: [] for label in labels}
    reads: dict[str, list[int]] = {label: [] for label in labels}
    for r in range(args.resume_rounds + 1):  # round 0 warms up, dropped
        for label in labels[r % 3 :] + labels[: r % 3]:
            task = LongEpochTask(n)
            first = FirstBatch(task)
            engine = _engine(out / f"resume-{r}-{label}", [first])
            started = time.perf_counter()
            with contextlib.suppress(Stop):
                engine.fit(task, ckpt_path=saver.paths[label])
            if r > 0:
                assert first.at is not None
                times[label].append(first.at - started)
                reads[label].append(first.reads)
    medians = {label: statistics.median(v) for label, v in times.items()}
    return {
        "samples": n,
        "batches_per_epoch": batches,
        "positions": {label: step for step, label in marks.items()},
        "made_in_s": made,
        "seconds": {label: _summary(v) for label, v in times.items()},
        "reads": {label: max(v) for label, v in reads.items()},
        "ratio": max(medians.values()) / min(medians.values()),
        "rounds": args.resume_rounds,
    }


# -------------------------------------------------------------------------------------------------- report


def _range(s: dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    return f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})"


def format_table(result: dict[str, Any]) -> str:
    meta, a, b, c = result["meta"], result["throughput"], result["stall"], result["resume"]
    load = meta["loadavg"]
    lines = [
        f"{meta['date']}, commit {meta['commit']}, {meta['cpus']} CPUs, load average (1 min) {load['before'][0]:.2f} "
        f"before, {load['after'][0]:.2f} after; {meta['seconds']:.0f} s. Model: 3 x Linear({meta['width']}, "
        f"{meta['width']}) + head, AdamW ({meta['parameters'] / 1e6:.1f} M parameters); files in {meta['dir_kind']}.",
        "",
        f"(a) Write throughput, {a['rounds']} rounds (median, min-max):",
        "",
        "| write | MB | seconds | MB/s |",
        "|---|---:|---:|---:|",
    ]
    names = {
        "checkpoint": "`torchloom.save_checkpoint` (synchronous; XXH3-128 + fsync)",
        "plain": "`safetensors.torch.save_file`, same tensors",
        "plain+fsync": "`save_file` + `fsync`",
    }
    for key, label in names.items():
        rate = _range(a["mb_per_s"][key], digits=0)
        lines.append(f"| {label} | {a['bytes'][key] / MB:.1f} | {_range(a['seconds'][key])} | {rate} |")
    lines += [
        "",
        f"Checkpoint / save_file + fsync throughput: **{_range(a['ratio_to_plain_fsync'])}** (goal >= 0.8); / plain "
        f"save_file (page cache only): {_range(a['ratio'])}.",
        "",
        f"(b) Stall of the step that triggers a save (every {b['every']} steps, 3 saves a fit, {b['rounds']} pairs of "
        "fits), seconds:",
        "",
        "| save | median step | stall at the save step | training time lost until the next save | end of fit waits |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode in ("sync", "async"):
        label = "synchronous" if mode == "sync" else "`async_save: true`"
        lines.append(
            f"| {label} | {_range(b['normal_step'][mode], digits=3)} | {_range(b['stall'][mode], digits=3)} "
            f"| {_range(b['window'][mode])} | {_range(b['end_wait'][mode])} |"
        )
    lines += [
        "",
        f"Async stall / sync stall, paired per round: **{_range(b['ratio'])}** (goal <= 0.2).",
        "",
        f"(c) Resume start-up over a long epoch ({c['samples']:,} samples, {c['batches_per_epoch']:,} batches of 8; "
        f"checkpoints made in {c['made_in_s']:.0f} s), {c['rounds']} rounds, milliseconds from `fit` to the first "
        "trained batch:",
        "",
        "| resumed at | step | ms | samples read before the first batch |",
        "|---|---:|---:|---:|",
    ]
    for label, seconds in c["seconds"].items():
        ms = _range(seconds, 1000, 1)
        lines.append(f"| {label} of the epoch | {c['positions'][label]:,} | {ms} | {c['reads'][label]} |")
    lines += ["", f"Slowest / fastest position (medians): **{c['ratio']:.2f}** (goal <= 1.1)."]
    return "\n".join(lines)


def goals(result: dict[str, Any]) -> list[tuple[str, str, bool]]:
    a, b, c = result["throughput"], result["stall"], result["resume"]
    reads = set(c["reads"].values())
    return [
        (
            "checkpoint write throughput >= 0.8 x save_file + fsync",
            _range(a["ratio_to_plain_fsync"]),
            a["ratio_to_plain_fsync"]["median"] >= 0.8,
        ),
        ("async save stall <= 0.2 x synchronous save", _range(b["ratio"]), b["ratio"]["median"] <= 0.2),
        ("resume start-up independent of the position (max / min <= 1.1)", f"{c['ratio']:.2f}", c["ratio"] <= 1.1),
        (
            "skipping does not read the data",
            f"{', '.join(map(str, sorted(reads)))} samples read before the first batch, at every position",
            len(reads) == 1 and max(reads) <= 16,
        ),
    ]


def format_report(result: dict[str, Any]) -> str:
    """The tables, then each goal with its measured figure (what the suite's report shows)."""
    met = [f"- {goal}: {measured}: {'met' if ok else 'not met'}" for goal, measured, ok in result["goals"]]
    return format_table(result) + "\n\nGoals (issue 27 item 5, issue 40):\n\n" + "\n".join(met)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stall-rounds", type=int, default=2)
    parser.add_argument("--resume-rounds", type=int, default=15)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=80_000)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    args, _ = parser.parse_known_args()
    torch.set_num_threads(1)
    torchloom.utils.quiet_libraries()
    began = time.perf_counter()
    commit = subprocess.run(
        ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or None,
        "cpus": os.cpu_count(),
        "loadavg": {"before": os.getloadavg()},
        "width": args.width,
        "parameters": sum(p.numel() for p in BigTask(args.width, 1).configure_model().parameters()),
        "dir_kind": "--dir" if args.dir else "a temporary directory under " + tempfile.gettempdir(),
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        result = {
            "throughput": throughput(root / "a", args),
            "stall": stall(root / "b", args),
            "resume": resume(root / "c", args),
        }
    meta["loadavg"]["after"] = os.getloadavg()
    meta["seconds"] = time.perf_counter() - began
    result["meta"] = meta
    result["goals"] = goals(result)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
