"""``torchloom tune-lr``: a learning-rate range test (Smith 2017; fastai's ``lr_find``, Lightning's
``LearningRateFinder``) on the config's task, data and plugins, in a throw-away run.

The sweep trains ``--num_steps`` optimizer steps with the learning rate of step ``i`` (every parameter group)
``min_lr * (max_lr / min_lr) ** (i / (num_steps - 1))``, set just before the step (so the task's scheduler does not
count), through the same plugins as a fit (accumulation, precision, clipping), on one or several processes. The loss
of each optimizer step (the mean over its micro-batches and the processes) is smoothed with a bias-corrected
exponential moving average, ``avg = beta * avg + (1 - beta) * loss``, ``smoothed = avg / (1 - beta ** (i + 1))``;
the sweep stops early when the smoothed loss is not finite or exceeds ``--divergence`` times its best.

**The rule** (Lightning's ``suggestion()``): the learning rate at the steepest descent of the smoothed curve,
``argmin(numpy.gradient(smoothed))`` over the points without the first ``skip_begin = 10`` and the last
``skip_end = 1``.

The run goes to ``<output_dir>/tune-lr/version_N`` (its own ``latest``), never to a run of ``output_dir`` itself; the
``checkpoint``, ``early_stopping`` and ``trackers`` plugins are left out and no model is saved. It writes
``lr_find.csv`` (``step,lr,loss,smoothed``), ``lr_find.json`` (the suggestion, the rule, the settings) and, when
matplotlib is installed, ``lr_find.png`` (the smoothed loss against the learning rate, log scale, the suggestion
marked).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torchloom
from torchloom import ConfigError

from ._run import prepare

__all__ = ["RULE", "add_arguments", "rates", "run", "smooth", "suggest"]

HELP = "find a learning rate: an exponential sweep of the config's task (a throw-away run)"
#: The rule of the suggestion, as the command prints and lr_find.json records it.
RULE = "steepest descent of the smoothed loss (argmin of its gradient, the first 10 and the last 1 points left out)"
SKIP_BEGIN, SKIP_END = 10, 1
#: The capability (`torchloom.Plugin`'s ``capabilities``) of the plugins that would write into or act on the user's
#: runs (the checkpoint, early_stopping and trackers plugins declare it); a sweep leaves them out.
LEFT_OUT = "outside_sweeps"


def add_arguments(sub: Any) -> None:
    """The sweep's options."""
    sub.add_argument("--min_lr", type=float, default=1e-8, help="The first learning rate of the sweep")
    sub.add_argument("--max_lr", type=float, default=1.0, help="The last learning rate of the sweep")
    sub.add_argument("--num_steps", type=int, default=100, help="Optimizer steps of the sweep")
    sub.add_argument("--beta", type=float, default=0.98, help="Smoothing of the loss (exponential moving average)")
    sub.add_argument("--divergence", type=float, default=4.0, help="Stop once the smoothed loss is this x its best")


def rates(min_lr: float, max_lr: float, num_steps: int) -> list[float]:
    """The sweep's learning rates: geometric from ``min_lr`` to ``max_lr`` in ``num_steps`` steps."""
    if num_steps == 1:
        return [min_lr]
    return [min_lr * (max_lr / min_lr) ** (i / (num_steps - 1)) for i in range(num_steps)]


def smooth(losses: Sequence[float], beta: float) -> list[float]:
    """The bias-corrected exponential moving average of ``losses`` (fastai's and Lightning's)."""
    out, avg = [], 0.0
    for i, loss in enumerate(losses):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta ** (i + 1)))
    return out


def suggest(lrs: Sequence[float], smoothed: Sequence[float]) -> float | None:
    """The learning rate at the steepest descent of ``smoothed`` (`RULE`); ``None`` when the sweep has too few
    finite points (fewer than ``SKIP_BEGIN + SKIP_END + 2``)."""
    import numpy as np

    n = len(smoothed)
    if n < SKIP_BEGIN + SKIP_END + 2 or not all(math.isfinite(v) for v in smoothed[SKIP_BEGIN : n - SKIP_END]):
        return None
    window = np.asarray(smoothed[SKIP_BEGIN : n - SKIP_END], dtype=np.float64)
    return float(lrs[SKIP_BEGIN + int(np.argmin(np.gradient(window)))])


class LRSweep:
    """The sweep as a plugin: sets the step's learning rate, records the step's loss, stops on divergence."""

    name = "torchloom.tune_lr"

    def __init__(self, lrs: list[float], beta: float, divergence: float) -> None:
        self.lrs, self.beta, self.divergence = lrs, beta, divergence
        self.losses: list[float] = []
        self.smoothed: list[float] = []
        self._window: list[Any] = []
        self._avg, self._best = 0.0, math.inf

    @torchloom.hookimpl
    def on_train_batch_end(self, outputs: Any) -> None:
        self._window.append(outputs["loss"].detach().float())

    @torchloom.hookimpl(tryfirst=True)
    def before_optimizer_step(self, optimizer: Any, progress: Any) -> None:
        lr = self.lrs[min(progress.global_step, len(self.lrs) - 1)]  # global_step: the steps done before this one
        for group in optimizer.param_groups:
            group["lr"] = lr

    @torchloom.hookimpl
    def on_train_step_end(self, accelerator: Any) -> None:
        import torch

        loss = torch.stack(self._window).mean()
        self._window = []
        loss = accelerator.reduce(loss, "mean") if accelerator.num_processes > 1 else loss
        value = float(loss)  # one sync per step: a tuning run, not a training one
        self.losses.append(value)
        i = len(self.losses) - 1
        self._avg = self.beta * self._avg + (1 - self.beta) * value
        smoothed = self._avg / (1 - self.beta ** (i + 1))
        self.smoothed.append(smoothed)
        self._best = min(self._best, smoothed)
        if not math.isfinite(smoothed) or smoothed > self.divergence * self._best:
            torchloom.request_stop(f"tune-lr: the loss diverged at lr {self.lrs[i]:.3g}")


def run(parser: Any, cfg: Any) -> int:
    """Sweep, write the curve and the suggestion, print them."""
    options = cfg["tune-lr"]
    min_lr, max_lr, num_steps = options.min_lr, options.max_lr, options.num_steps
    if not (0 < min_lr < max_lr and math.isfinite(max_lr)):
        raise ConfigError(f"tune-lr: --min_lr {min_lr!r} and --max_lr {max_lr!r}; expected 0 < min_lr < max_lr")
    if num_steps < SKIP_BEGIN + SKIP_END + 2:
        raise ConfigError(f"tune-lr: --num_steps {num_steps}; expected at least {SKIP_BEGIN + SKIP_END + 2}")
    if not 0 <= options.beta < 1 or options.divergence <= 1:
        raise ConfigError(f"tune-lr: --beta {options.beta!r} in [0, 1) and --divergence {options.divergence!r} > 1")
    user, task, data = prepare(parser, cfg, "tune-lr")
    settings = dataclasses.replace(
        user.config,
        output_dir=os.path.join(user.config.output_dir, "tune-lr"),
        max_steps=num_steps,
        max_epochs=max(user.config.max_epochs, 10**9),
        val_check_interval=num_steps,  # no validation during the sweep: one at its end, as every fit ends with
        num_sanity_val_steps=0,
        log_every_n_steps=1,  # a stop request is agreed at the logging interval
        save_model=False,
        nonfinite_loss="ignore",  # a diverging sweep ends on it, not with an error
        fast_dev_run=False,
    )
    sweep = LRSweep(rates(min_lr, max_lr, num_steps), options.beta, options.divergence)
    engine = torchloom.Engine(settings, plugins=[*_kept(cfg["tune-lr"].plugins), sweep])
    engine.fit(task, datamodule=data)
    lrs = sweep.lrs[: len(sweep.losses)]
    suggestion = suggest(lrs, sweep.smoothed)
    if engine.accelerator is None or engine.accelerator.is_main_process:
        assert engine.run_dir is not None  # the fit made it
        for line in _write(engine.run_dir, lrs, sweep, suggestion, options):
            print(line)
    return 0


def _kept(plugins: Any) -> Any:
    """The config's plugins without those that declare `LEFT_OUT`."""
    from torchloom.utils import plugins_with

    if plugins is None:
        return []
    if isinstance(plugins, Mapping):
        left_out = {name for name, _ in plugins_with(LEFT_OUT, [n for n in plugins if isinstance(n, str)])}
        return [{name: settings} for name, settings in plugins.items() if name not in left_out]
    named = [
        item if isinstance(item, str) else next(iter(item)) if isinstance(item, Mapping) else None for item in plugins
    ]
    left_out = {name for name, _ in plugins_with(LEFT_OUT, [n for n in named if isinstance(n, str)])}
    return [item for item, name in zip(plugins, named) if name not in left_out]


def _write(run_dir: str, lrs: list[float], sweep: LRSweep, suggestion: float | None, options: Any) -> list[str]:
    rows = ["step,lr,loss,smoothed"] + [
        f"{i},{lr!r},{loss!r},{s!r}" for i, (lr, loss, s) in enumerate(zip(lrs, sweep.losses, sweep.smoothed))
    ]
    csv = os.path.join(run_dir, "lr_find.csv")
    torchloom.utils.write_atomically(csv, "\n".join(rows) + "\n")
    summary = {
        "suggestion": suggestion,
        "rule": RULE,
        "min_lr": options.min_lr,
        "max_lr": options.max_lr,
        "num_steps": options.num_steps,
        "steps_done": len(sweep.losses),
        "beta": options.beta,
        "divergence": options.divergence,
    }
    torchloom.utils.write_atomically(
        os.path.join(run_dir, "lr_find.json"), torchloom.utils.json_dumps(summary, indent=2) + "\n"
    )
    lines = [f"torchloom tune-lr: curve in {csv}"]
    try:
        import matplotlib
    except ImportError:
        lines.append("torchloom tune-lr: matplotlib is not installed, so no lr_find.png (the CSV has the curve)")
    else:
        matplotlib.use("Agg")
        from matplotlib import pyplot

        figure, axes = pyplot.subplots(figsize=(6, 4))
        axes.plot(lrs, sweep.smoothed)
        axes.set_xscale("log")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("loss (smoothed)")
        if suggestion is not None:
            axes.axvline(suggestion, color="red", linestyle="--", label=f"suggested {suggestion:.3g}")
            axes.legend()
        figure.tight_layout()
        png = os.path.join(run_dir, "lr_find.png")
        torchloom.utils.write_atomically(png, lambda path: figure.savefig(path, format="png"))
        pyplot.close(figure)
        lines.append(f"torchloom tune-lr: plot in {png}")
    if suggestion is None:
        lines.append("torchloom tune-lr: no suggestion: the sweep ended too early (diverged); lower --min_lr")
    else:
        lines.append(f"torchloom tune-lr: suggested learning rate {suggestion:.3g} ({RULE})")
    return lines
