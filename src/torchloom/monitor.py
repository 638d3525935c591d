"""`Monitor`: one logged value that a plugin watches (early stopping, the best checkpoint), checked for the mistakes
that would otherwise make the plugin silently do nothing.

A plugin that decides on a logged value (``monitor: val/loss``, ``mode: min``) can be configured so that it never
acts: the name is misspelt (``val/los``) and never logged; ``mode: max`` on a loss keeps the worst value as the best;
or the value is logged less often than the plugin needs it (a checkpoint every 100 steps of a value validated every
1,000, the last validation after the last save). `Monitor` answers "was this name logged, and does its mode look
right" for every such plugin alike, with one message each, and keeps the plugin's "best so far" by one rule (``min``:
``value < best - min_delta``; ``max``: ``value > best + min_delta``; NaN is never the best).

Everything here runs on the host, on values `on_log` already reduced to Python floats: no device work at all.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import ClassVar

from torchloom._suggest import closest_name
from torchloom._warn import warn
from torchloom.errors import ConfigError

__all__ = ["HIGHER_IS_BETTER", "LOWER_IS_BETTER", "NO_BEST", "Monitor"]

MODES = ("min", "max")
#: Name parts (split at ``/ . _ -`` and spaces) of values whose best is the smallest (also a part ending in ``loss``).
LOWER_IS_BETTER = frozenset({"loss", "error", "errors", "perplexity", "ppl", "mse", "mae", "rmse", "wer", "cer"})
#: Name parts of values whose best is the largest (also a part ending in one of `_HIGHER_SUFFIXES`).
HIGHER_IS_BETTER = frozenset(
    {
        "accuracy",
        "acc",
        "f1",
        "fbeta",
        "auroc",
        "auc",
        "auprc",
        "precision",
        "recall",
        "specificity",
        "bleu",
        "rouge",
        "rouge1",
        "rouge2",
        "rougel",
        "iou",
        "miou",
        "jaccard",
        "dice",
        "map",
        "ndcg",
        "mrr",
        "r2",
        "mcc",
    }
)
#: Name parts of values that describe the run's state, not a result: they have no best and no expected mode.
NO_BEST = frozenset({"lr", "learning", "norm", "scale", "skipped", "bytes"})
_HIGHER_SUFFIXES = ("accuracy", "precision", "recall", "auroc", "f1score")
_PARTS = re.compile(r"[/._\-\s]+")


class Monitor:
    """One logged value that a plugin watches: whether it was logged, whether ``mode`` reads right for its name, how
    often it was fresh when the plugin acted on it, and its best value so far.

    Make one per watched name when the plugin is made; then call `start` in ``on_fit_start``, `observe` in
    ``on_log``, `use` wherever the plugin acts on the value (a check, a save), `update` to keep the best, and
    `warn_if_never_logged` in ``on_fit_end`` of a completed fit (main process). See "Watching a logged value" in
    ``docs/writing-plugins.md``.

    Class attributes:
        MODES (`tuple[str, ...]`): the valid values of ``mode``, ``("min", "max")``, for a plugin's own check of
            its ``mode`` setting.

    Args:
        plugin (`str`): the plugin's name; every message starts with it.
        name (`str`): the logged name to watch (``"val/loss"``), as it appears in ``engine.history``.
        mode (`str`, defaults to ``"min"``): ``"min"`` (lower is better) or ``"max"`` (higher is better).
        min_delta (`float`, defaults to 0.0): an improvement must beat the best by more than this (>= 0).
        setting (`str`, defaults to ``"monitor"``): the plugin setting that holds ``name``, for the messages.

    Warns:
        UserWarning: once, when made, if ``mode`` is the opposite of what the name reads as (`direction`): ``max``
            on a name with a part ``loss``, ``error``, ``perplexity``, ``mse``, ``mae`` ...; ``min`` on one with
            ``accuracy``, ``f1``, ``auroc``, ``precision``, ``recall`` ... A name that reads as neither gets none.

    Raises:
        ConfigError: ``mode`` is not ``"min"`` / ``"max"``, or ``min_delta`` is negative or not finite.

    Example:

    .. code-block:: python

        monitor = torchloom.Monitor("my_plugin", "val/loss", mode="min")

        @torchloom.hookimpl
        def on_log(self, metrics, progress):
            value = self.monitor.observe(metrics, progress.global_step)
            if value is not None and self.monitor.update(value, progress.global_step):
                ...  # a new best

    Attributes:
        best (`float` or ``None``): the best value `update` saw (``None`` before the first non-NaN one).
        best_step (`int` or ``None``): the step `update` got ``best`` at.
        logged (`set[str]`): every name `observe` received since `start`.
        steps (`list[int]`): the steps at which the watched name was logged since `start`.
        uses (`list[tuple[int, bool]]`): ``(step, fresh)`` for each `use` since `start`.
    """

    MODES: ClassVar[tuple[str, ...]] = MODES

    def __init__(self, plugin: str, name: str, mode: str = "min", *, min_delta: float = 0.0, setting: str = "monitor"):
        if mode not in MODES:
            raise ConfigError(f"{plugin}: setting 'mode' = {mode!r}; expected 'min' (lower is better) or 'max'")
        if isinstance(min_delta, bool) or not isinstance(min_delta, int | float) or not 0 <= min_delta < math.inf:
            raise ConfigError(f"{plugin}: setting 'min_delta' = {min_delta!r}; expected a finite number >= 0")
        self.plugin, self.name, self.mode, self.min_delta, self.setting = plugin, name, mode, float(min_delta), setting
        self.best: float | None = None
        self.best_step: int | None = None
        self.logged: set[str] = set()
        self.steps: list[int] = []
        self.uses: list[tuple[int, bool]] = []
        expected = Monitor.direction(name, default=None)
        if expected is not None and expected != mode:
            reads = "lower-is-better (a loss or an error)" if expected == "min" else "higher-is-better (a score)"
            warn(
                f"{plugin}: mode {mode!r} with {setting} {name!r}, a name that reads as {reads}: the "
                f"{'highest' if mode == 'max' else 'lowest'} value will count as the best. Set mode to {expected!r}, "
                f"or keep {mode!r} if {'higher' if mode == 'max' else 'lower'} is better for this value",
            )

    # ------------------------------------------------------------------------------------------------ a fit

    def start(self, keep_best: bool = False) -> None:
        """Forget the names, steps and uses of the previous fit (at ``on_fit_start``), and ``best`` too unless
        ``keep_best`` (a resumed fit that loaded its best)."""
        self.logged, self.steps, self.uses = set(), [], []
        if not keep_best:
            self.best, self.best_step = None, None

    def observe(self, metrics: Mapping[str, float], step: int) -> float | None:
        """Record one ``on_log`` call's names; return the watched value as a float, or ``None`` when it is not in
        ``metrics``."""
        self.logged.update(metrics)
        if self.name not in metrics:
            return None
        self.steps.append(step)
        return float(metrics[self.name])

    @property
    def seen(self) -> bool:
        """Whether the watched name was logged since `start`."""
        return bool(self.steps)

    def use(self, step: int) -> bool:
        """Record that the plugin acts on the value at ``step`` (a check, a save); return whether the value is
        fresh, i.e. was logged at this very step (else it is an older value, or there is none)."""
        fresh = bool(self.steps) and self.steps[-1] == step
        self.uses.append((step, fresh))
        return fresh

    # ------------------------------------------------------------------------------------------ best so far

    @staticmethod
    def is_better(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
        """Whether ``value`` beats ``best`` (``None``: no best yet) under ``mode``, by more than ``min_delta``.

        ``min``: ``value < best - min_delta``; ``max``: ``value > best + min_delta``. NaN is never better, and the
        first value that is not NaN beats ``None``. A value equal to the best is not better.
        """
        if math.isnan(value):
            return False
        if best is None:
            return True
        return value < best - min_delta if mode == "min" else value > best + min_delta

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats `best` (`is_better` with this monitor's ``mode`` and ``min_delta``)."""
        return Monitor.is_better(value, self.best, self.mode, self.min_delta)

    def update(self, value: float, step: int) -> bool:
        """Make ``value`` (logged at ``step``) the best if it `improves` on it; return whether it did."""
        if not self.improves(value):
            return False
        self.best, self.best_step = value, step
        return True

    # ---------------------------------------------------------------------------------------------- names

    @staticmethod
    def direction(name: str, default: str | None = "max") -> str | None:
        """Which value of a logged name reads as its best: ``"min"``, ``"max"``, ``None`` (a state, not a
        result), or ``default`` for a name that reads as neither.

        The name is split into parts at ``/``, ``.``, ``_``, ``-`` and spaces, case-insensitively. A part in
        `NO_BEST` (``lr``, ``learning``, ``norm``, ``scale``, ``skipped``, ``bytes``) gives ``None``; else a part in
        `LOWER_IS_BETTER` (``loss``, ``error``, ``perplexity``, ``mse``, ``mae``, ``rmse``, ``wer``, ``cer`` ...) or
        one ending in ``loss`` gives ``"min"``; else a part in `HIGHER_IS_BETTER` (``accuracy``, ``f1``, ``auroc``,
        ``precision``, ``recall``, ``bleu`` ...) or one ending in ``accuracy``, ``precision``, ``recall``, ``auroc``
        or ``f1score`` (``MulticlassAccuracy``) gives ``"max"``; any other name gives ``default``.

        Example: ``direction("val/loss") == "min"``, ``direction("val/MulticlassAccuracy") == "max"``,
        ``direction("grad_norm") is None``, ``direction("val/power") == "max"``,
        ``direction("val/power", default=None) is None``.
        """
        parts = [p for p in _PARTS.split(name.lower()) if p]
        if any(p in NO_BEST for p in parts):
            return None
        if any(p in LOWER_IS_BETTER or p.endswith("loss") for p in parts):
            return "min"
        if any(p in HIGHER_IS_BETTER or p.endswith(_HIGHER_SUFFIXES) for p in parts):
            return "max"
        return default

    @staticmethod
    def describe_steps(steps: Iterable[int]) -> str:
        """``"no step"``, ``"step 4"``, ``"steps 2, 4, 6"``, or for more than 6 ``"steps 2, 4, 6, ..., 40 (20 in
        all)"``: step lists for messages."""
        steps = list(steps)
        if not steps:
            return "no step"
        if len(steps) == 1:
            return f"step {steps[0]}"
        if len(steps) <= 6:
            return "steps " + ", ".join(map(str, steps))
        return f"steps {', '.join(map(str, steps[:3]))}, ..., {steps[-1]} ({len(steps)} in all)"

    # ------------------------------------------------------------------------------------------- warnings

    def warn_if_never_logged(self, consequence: str) -> bool:
        """Warn when the watched name was not logged since `start`, naming the names that were and the closest one;
        return whether it warned. Call it once, at the end of a completed fit, on the main process.

        Args:
            consequence (`str`): what the plugin therefore did not do, e.g. ``"it was never checked"``.
        """
        if self.seen:
            return False
        logged = sorted(self.logged)
        close = closest_name(self.name, logged)
        hint = f"; did you mean {close!r}?" if close else "."
        warn(
            f"{self.plugin}: {self.setting} {self.name!r} was never logged during this fit, so {consequence}{hint} "
            f"Logged names: {', '.join(map(repr, logged)) or 'none'}. Log it (self.log({self.name!r}, ...) in "
            f"validation_step) or set {self.setting!r} to one of these",
        )
        return True
