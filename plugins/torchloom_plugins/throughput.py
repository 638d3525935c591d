"""Throughput: samples, real tokens and loss tokens per second, model-FLOP utilisation and peak memory, in the log.

Method card
-----------
- **What:** for every logging interval of training, logs (names under ``prefix``, default ``throughput/``):

  * ``samples``, ``tokens``, ``loss_tokens``, ``computed_tokens``: what the interval trained on, summed over
    micro-batches and ranks, exactly. A sample is a row, or in a packed row each sequence; ``tokens`` counts the
    real tokens only (`count_batch`: padding excluded), ``computed_tokens`` every position the model ran
    (rows x length), ``loss_tokens`` the batch's ``num_items`` (the tokens the loss is taken on);
  * ``samples_per_s``, ``tokens_per_s``, ``loss_tokens_per_s``: over all ranks, per second of training time
    (from one optimizer step to the next; validation passes excluded, checkpoint saves and data loading included);
  * ``padding_efficiency``: ``tokens / computed_tokens`` of the interval;
  * ``flops_per_s`` (with ``flops``) and ``mfu`` (with a peak): the model FLOPs of the interval's micro-batches
    (forward and backward, `torchloom.estimate_flops`, per row ``c + a * T + b * T**2`` in the row length ``T``,
    fitted once at the start of the fit on fake tensors and checked at a fourth length) per second, over all ranks,
    and that divided by ``peak_flops`` times the number of processes;
  * ``peak_memory_bytes``: the largest over ranks of ``torch.cuda.max_memory_allocated`` on CUDA (tensors PyTorch
    allocated), else of the process's peak resident set size (``resource.getrusage``'s ``ru_maxrss``).
- **No host-device sync:** token counts stay 0-dim tensors on the device, summed into the log's own buffers; the
  rates are each step's count divided by its host-measured time and averaged with that time as weight, which the
  log reduces (one reduction per interval, with the log's). The rate of an interval is then its count over its
  time exactly, on one process and over ranks (the mean step time of the ranks). On CUDA the host runs ahead of
  the device by a bounded queue, so an interval of many steps measures the device's time to within about one step.
- **Totals:** `totals` (samples, tokens, loss tokens of the whole fit, from the reduced log records) are the
  plugin's checkpointed state, so a resumed fit continues them exactly.
- **Peak FLOP/s:** ``peak_flops`` (per device, FLOP/s), or the dense tensor-core figure of `PEAK_FLOPS` for the
  CUDA device's name (``device``, default from ``torch.cuda.get_device_name``) and the run's ``mixed_precision``
  (``fp32`` runs use the TF32 figure when ``torch.backends.cuda.matmul.allow_tf32`` is set). On a CPU there is no
  peak: ``mfu`` is not logged unless ``peak_flops`` is given.
- **Hooks:** ``setup`` (a fit's totals start from zero, or from totals loaded outside a fit), ``on_fit_start``
  (the peak, the FLOPs per row), ``on_train_epoch_start`` (the first one starts the
  clock: the sanity pass before it is not training time), ``on_train_batch_start`` (counts, before
  ``training_step`` can take ``num_items`` out of the batch), ``on_train_batch_end`` (logs them; the rates when an
  optimizer step just happened), ``on_validation_end`` (restarts the clock), ``on_log`` (totals).
- **Sources:** Lightning's ``ThroughputMonitor`` (samples, items and FLOPs per second, MFU); PaLM (Chowdhery et al.
  2022, appendix B: model FLOPs utilisation, ``6N + 12LHQT`` per token); ``torch.utils.flop_counter``; NVIDIA's
  data sheets for `PEAK_FLOPS`.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from accelerate.utils import find_batch_size

import torchloom

__all__ = ["PEAK_FLOPS", "FlopsPerRow", "Throughput", "ThroughputConfig", "count_batch", "peak_flops_of"]

IGNORE_INDEX = -100

#: Dense (no sparsity) peak FLOP/s per device, by precision, from NVIDIA's data sheets. Keys are matched against
#: ``torch.cuda.get_device_name()`` in this order (a regular expression, case-insensitive).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    r"H200": {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12},
    r"H100.*PCIe": {"bf16": 756.5e12, "fp16": 756.5e12, "fp8": 1513e12, "tf32": 378e12, "fp32": 51.2e12},
    r"H100": {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12},
    r"A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    r"L40S": {"bf16": 362.05e12, "fp16": 362.05e12, "fp8": 733e12, "tf32": 183e12, "fp32": 91.6e12},
    r"\bL4\b": {"bf16": 121e12, "fp16": 121e12, "fp8": 242.5e12, "tf32": 60e12, "fp32": 30.3e12},
    r"\bA10\b": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    r"V100": {"fp16": 125e12, "fp32": 15.7e12},
}
#: Row lengths the FLOPs per row are fitted at (the first three) and checked at (the fourth).
FIT_LENGTHS = (16, 32, 64, 48)


@dataclass
class ThroughputConfig:
    """Settings of the ``throughput`` plugin.

    Args:
        peak_flops (`float`, *optional*): the peak FLOP/s of one device at the run's precision, > 0; default the
            figure of `PEAK_FLOPS` for the CUDA device (none on a CPU: no ``mfu``).
        device (`str`, *optional*): the `PEAK_FLOPS` entry to use (``"H100"``, ``"A100"`` ...); default the one
            matching ``torch.cuda.get_device_name()``.
        flops (`bool`, *optional*): count model FLOPs and log ``flops_per_s``; ``None``: only when a peak is known
            (for ``mfu``). Counting traces the model once at the start of the fit, on fake tensors.
        flops_per_sample (`float`, *optional*): the training FLOPs (forward and backward) of one sample, for models
            whose batches have no ``input_ids`` (images, audio); default counted for transformers models only.
        prefix (`str`, defaults to ``"throughput/"``): put before every logged name.

    Raises:
        ConfigError: a peak or ``flops_per_sample`` that is not a finite number > 0, a ``device`` not in
            `PEAK_FLOPS`; a setting the others make unused (``device`` with ``peak_flops``; ``flops: false`` with
            ``peak_flops``, ``device`` or ``flops_per_sample``).
    """

    peak_flops: float | None = None
    device: str | None = None
    flops: bool | None = None
    flops_per_sample: float | None = None
    prefix: str = "throughput/"

    def __post_init__(self) -> None:
        for name in ("peak_flops", "flops_per_sample"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise torchloom.ConfigError(f"throughput: setting {name!r} = {value!r}; expected a finite number > 0")
        if self.device is not None and _table_entry(self.device) is None:
            names = [re.sub(r"\\b|\.\*", " ", key).strip() for key in PEAK_FLOPS]
            close = torchloom.utils.closest_name(self.device, names)
            hint = f"; did you mean {close!r}?" if close else "."
            raise torchloom.ConfigError(
                f"throughput: setting 'device' = {self.device!r} is not in the peak table{hint} Known: "
                f"{', '.join(names)}; or set 'peak_flops'"
            )
        # Combinations in which a setting would be accepted and then ignored.
        if self.device is not None and self.peak_flops is not None:
            raise torchloom.ConfigError(
                f"settings 'device' = {self.device!r} and 'peak_flops' = {self.peak_flops!r}: the device only looks "
                "up a peak, and peak_flops gives it; set one of them"
            )
        unused = [n for n in ("peak_flops", "device", "flops_per_sample") if getattr(self, n) is not None]
        if self.flops is False and unused:
            given = " and ".join(f"{n!r} = {getattr(self, n)!r}" for n in unused)
            raise torchloom.ConfigError(
                f"setting 'flops' = False with {given}: without FLOPs there is no flops_per_s and no mfu, which "
                f"{'it is' if len(unused) == 1 else 'they are'} for; set flops: true (or null), or leave "
                f"{'it' if len(unused) == 1 else 'them'} out"
            )


def _table_entry(name: str) -> dict[str, float] | None:
    for pattern, peaks in PEAK_FLOPS.items():
        if re.search(pattern, name, flags=re.IGNORECASE):
            return peaks
    return None


def peak_flops_of(device_name: str, mixed_precision: str, allow_tf32: bool = False) -> float | None:
    """The dense peak FLOP/s of ``device_name`` (as ``torch.cuda.get_device_name()`` gives it) for a run with
    ``mixed_precision`` (Accelerate's ``"no"``, ``"fp16"``, ``"bf16"``, ``"fp8"``): the `PEAK_FLOPS` entry, TF32
    for ``"no"`` with ``allow_tf32`` (else FP32); ``None`` for an unknown device or precision."""
    peaks = _table_entry(device_name)
    if peaks is None:
        return None
    key = {"no": "tf32" if allow_tf32 else "fp32"}.get(mixed_precision, mixed_precision)
    return peaks.get(key)


def count_batch(batch: Any) -> dict[str, Any]:
    """What one micro-batch trains on: ``samples``, ``tokens`` (real), ``computed_tokens``, ``loss_tokens``, the
    row count and length (``rows``, ``length``); values are ints or 0-dim tensors on the batch's device (no sync).

    - a mapping with ``input_ids`` (rows x length) and an ``attention_mask``: one sample per row, ``tokens`` =
      the mask's sum;
    - packed rows (``position_ids`` and no ``attention_mask``, as `torchloom.data.packing.CausalLMCollator` makes
      them): one sample per sequence (a ``position_ids`` restart at 0); a row's last sequence is padding when none
      of its ``labels`` is a target (the collator numbers the padding as a sequence of its own; a real sequence
      always has a loss token), and its positions are not real tokens;
    - a mapping with ``input_ids`` and neither: every position is a real token;
    - any other batch: ``samples`` from `accelerate.utils.find_batch_size`, no token counts (``None``).

    ``loss_tokens`` is the batch's ``num_items`` when it has one (else ``None``).
    """
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    loss_tokens = batch.get("num_items") if isinstance(batch, Mapping) else None
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        return {"samples": find_batch_size(batch), "tokens": None, "computed_tokens": None,
                "loss_tokens": loss_tokens, "rows": None, "length": None}  # fmt: skip
    rows, length = ids.shape
    mask, positions, labels = batch.get("attention_mask"), batch.get("position_ids"), batch.get("labels")
    samples: Any = rows
    if isinstance(mask, torch.Tensor):
        tokens: Any = mask.sum()
    elif isinstance(positions, torch.Tensor) and positions.shape == ids.shape:
        starts = positions == 0
        index = torch.arange(length, device=positions.device)
        last = torch.where(starts, index, 0).amax(dim=-1)  # where each row's last sequence starts
        tail = index >= last[:, None]
        if isinstance(labels, torch.Tensor) and labels.shape == ids.shape:
            padding = ~((labels != IGNORE_INDEX) & tail).any(dim=-1)  # a last sequence without a target
        else:
            padding = torch.zeros(rows, dtype=torch.bool, device=positions.device)
        tokens = rows * length - ((length - last) * padding).sum()
        samples = starts.sum() - padding.sum()
    else:
        tokens = rows * length
    return {"samples": samples, "tokens": tokens, "computed_tokens": rows * length, "loss_tokens": loss_tokens,
            "rows": rows, "length": length}  # fmt: skip


class FlopsPerRow:
    """The training FLOPs of one row of ``T`` tokens, ``c + a * T + b * T**2``, fitted exactly (rational
    coefficients) to `torchloom.estimate_flops` of ``model`` at three lengths and checked at a fourth.

    Raises:
        ConfigError: the model cannot be traced, or its FLOPs are not such a polynomial in ``T``.
    """

    def __init__(self, model: torch.nn.Module, lengths: tuple[int, int, int, int] = FIT_LENGTHS) -> None:
        measured = {t: torchloom.estimate_flops(model, seq_len=t) for t in lengths}
        (t1, t2, t3), check = lengths[:3], lengths[3]
        f1, f2, f3 = (Fraction(measured[t]) for t in (t1, t2, t3))
        # Divided differences of the quadratic through the three points.
        d12, d23 = (f2 - f1) / (t2 - t1), (f3 - f2) / (t3 - t2)
        self.b = (d23 - d12) / (t3 - t1)
        self.a = d12 - self.b * (t1 + t2)
        self.c = f1 - self.a * t1 - self.b * t1 * t1
        if self(check) != measured[check]:
            raise torchloom.ConfigError(
                f"throughput: the FLOPs of {type(model).__name__} are not a quadratic in the row length ({measured}); "
                "set 'flops_per_sample' or 'flops: false'"
            )

    def __call__(self, length: int) -> float:
        return float(self.c + self.a * length + self.b * length * length)


class Throughput(torchloom.Plugin):
    """Log samples, tokens and loss tokens per second, FLOP/s and MFU, and peak memory, per logging interval.

    See the module docstring and ``docs/plugins/throughput.md``.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"throughput": {}})  # on an H100: mfu from the peak table
        engine.fit(task, datamodule=data)  # metrics.jsonl: throughput/tokens_per_s, throughput/mfu, ...

    Attributes:
        totals (`dict[str, float]`): ``samples``, ``tokens``, ``loss_tokens`` and ``computed_tokens`` of the whole
            fit over all ranks (continued by a resume).
        peak (`float` or ``None``): the peak FLOP/s per device used for ``mfu``.
        flops_per_row (`FlopsPerRow` or ``None``): the fitted FLOPs per row.
    """

    name = "throughput"
    Config = ThroughputConfig
    COUNTS = ("samples", "tokens", "loss_tokens", "computed_tokens")

    def __init__(self, config: ThroughputConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.totals: dict[str, float] = dict.fromkeys(self.COUNTS, 0.0)
        self.peak: float | None = None
        self.flops_per_row: FlopsPerRow | None = None
        # totals loaded outside a fit (a script's load_plugin_state before Engine.fit): the next fit continues them
        self._next_start: dict[str, float] | None = None
        self._clock = 0.0
        self._training = False  # whether the clock started (at the first epoch's start)
        self._window: dict[str, Any] = {}
        self._counts: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------------ fit start

    @torchloom.hookimpl
    def setup(self, stage: str) -> None:
        if stage == "fit":  # from zero, or from totals loaded outside a fit; a resume's load comes after
            self.totals = dict(self._next_start or dict.fromkeys(self.COUNTS, 0.0))

    @torchloom.hookimpl
    def on_fit_start(self, accelerator, model: torch.nn.Module) -> None:
        c = self.config
        self._next_start = None  # used: the next fit counts from zero unless totals are loaded before it
        self.peak = c.peak_flops
        if self.peak is None and accelerator.device.type == "cuda":
            name = c.device or torch.cuda.get_device_name(accelerator.device)
            allow_tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
            self.peak = peak_flops_of(name, str(accelerator.mixed_precision), allow_tf32)
        self.flops_per_row = None
        wanted = c.flops if c.flops is not None else self.peak is not None
        if wanted and c.flops_per_sample is None:
            self.flops_per_row = FlopsPerRow(accelerator.unwrap_model(model))
        self._window = {}
        self._training = False  # the clock starts at the first epoch's start

    @torchloom.hookimpl
    def on_train_epoch_start(self) -> None:
        if not self._training:  # after the sanity pass, which is not training time (and calls no validation hook)
            self._training = True
            self._clock = time.perf_counter()

    # ------------------------------------------------------------------------------------------------ per batch

    @torchloom.hookimpl
    def on_train_batch_start(self, batch: Any) -> None:
        self._counts = count_batch(batch)  # before training_step, which may pop num_items from the batch

    @torchloom.hookimpl
    def on_train_batch_end(self, accelerator, log) -> None:
        counts, self._counts = self._counts, None
        if counts is None:
            return
        prefix, window = self.config.prefix, self._window
        for name in self.COUNTS:
            value = counts[name]
            if value is not None:
                log(prefix + name, value, reduce="sum")
                window[name] = window.get(name, 0) + value
        if counts["tokens"] is not None:
            # The interval's real / computed tokens: weighted by computed tokens, the mean is their ratio.
            computed, tokens = counts["computed_tokens"], counts["tokens"]
            if isinstance(tokens, torch.Tensor) and tokens.device.type != "mps":
                tokens = tokens.to(torch.float64)  # the ratio to the last digit
            log(prefix + "padding_efficiency", tokens / computed, weight=computed)
        if self.flops_per_row is not None and counts["rows"] is not None:
            window["flops"] = window.get("flops", 0.0) + counts["rows"] * self.flops_per_row(counts["length"])
        elif self.config.flops_per_sample is not None:
            window["flops"] = window.get("flops", 0.0) + counts["samples"] * self.config.flops_per_sample
        if accelerator.sync_gradients:  # the window's last micro-batch: an optimizer step just happened
            self._log_rates(accelerator, log)

    def _log_rates(self, accelerator: Any, log: Any) -> None:
        now = time.perf_counter()
        elapsed, self._clock = now - self._clock, now
        window, self._window = {name: _float64(v) for name, v in self._window.items()}, {}
        prefix, world = self.config.prefix, accelerator.num_processes
        if elapsed > 0:
            # Weighted by the step's time, the mean over steps and ranks of count * world / time is the interval's
            # count over all ranks divided by the ranks' mean time: the rate over all processes.
            for name in ("samples", "tokens", "loss_tokens"):
                if name in window:
                    log(f"{prefix}{name}_per_s", window[name] * (world / elapsed), weight=elapsed)
            if "flops" in window:
                log(prefix + "flops_per_s", window["flops"] * (world / elapsed), weight=elapsed)
                if self.peak is not None:
                    log(prefix + "mfu", window["flops"] / (elapsed * self.peak), weight=elapsed)
        log(prefix + "peak_memory_bytes", float(peak_memory_bytes(accelerator.device)), reduce="max")

    @torchloom.hookimpl
    def on_validation_end(self) -> None:
        self._clock = time.perf_counter()  # validation is not training time

    @torchloom.hookimpl
    def on_log(self, metrics: dict[str, float]) -> None:
        for name in self.COUNTS:
            value = metrics.get(self.config.prefix + name)
            if value is not None:
                self.totals[name] += value

    # ---------------------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """``{"totals": {name: float}}``: the fit's counts so far (plain numbers)."""
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `totals`; the next fit (a resume) continues them.

        Raises:
            PluginError: ``state`` is not ``{"totals": {name: number}}`` with the names of ``COUNTS``.
        """
        totals = state.get("totals") if isinstance(state, Mapping) else None
        if (
            not isinstance(totals, Mapping)
            or set(totals) != set(self.COUNTS)
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in totals.values())
        ):
            raise torchloom.PluginError(
                f"throughput: state {state!r:.200}; expected {{'totals': {{{', '.join(self.COUNTS)}: number}}}}"
            )
        self.totals = {name: float(totals[name]) for name in self.COUNTS}
        self._next_start = dict(self.totals)  # (a resume's, loaded after setup, is forgotten at on_fit_start)


def _float64(value: Any) -> Any:
    """A count as float64 (a device tensor stays on its device; MPS has no float64), so that a rate keeps its digits."""
    if isinstance(value, torch.Tensor) and value.device.type != "mps":
        return value.to(torch.float64)
    return value


def peak_memory_bytes(device: torch.device) -> int:
    """The process's peak memory so far: ``torch.cuda.max_memory_allocated(device)`` on CUDA (no sync: the
    allocator's counter), else the peak resident set size (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource  # POSIX only

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
