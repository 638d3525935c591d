"""Automatic mixed precision (AMP): bf16, fp16 with dynamic loss scaling, or fp8, through Accelerate.

Method card
-----------
- **What:** run the model's forward under ``torch.autocast`` so that matrix multiplications use a 16-bit
  (or 8-bit) type while the parameters, their gradients and the optimizer state stay float32. With fp16 the
  loss is multiplied by a dynamic scale before backward so that small gradients do not underflow; a step
  whose gradients overflow is skipped and the scale backs off.
- **Mechanism:** ``Accelerator(mixed_precision=dtype)``. Accelerate wraps the prepared model's forward in
  autocast (and casts its outputs back to float32), scales the loss in ``accelerator.backward``, unscales
  in ``accelerator.clip_grad_norm_``, steps through the scaler in the prepared optimizer (which reports
  ``optimizer.step_was_skipped``; the engine then does not step the LR scheduler) and saves / loads the
  scaler with ``save_state`` / ``load_state``. The scaler settings go through Accelerate's
  `accelerate.utils.GradScalerKwargs`.
- **fp16 on a CPU:** Accelerate 1.15 accepts ``Accelerator(cpu=True, mixed_precision="fp16")`` but then
  silently trains in float32 (no autocast, no scaler). PyTorch supports float16 autocast on CPU and
  ``torch.amp.GradScaler("cpu")`` (torch >= 2.3), so this plugin completes the set-up that Accelerate does
  on GPUs: before the model is prepared it installs ``torch.amp.GradScaler("cpu", **GradScalerKwargs)`` as
  ``accelerator.scaler`` and turns ``accelerator.native_amp`` on. From there on, every step runs through
  Accelerate's own fp16 code (autocast forward, scaled backward, unscale, skip, save / load). It is correct
  but slow: CPUs have no fast float16 matrix units, so use it to test fp16 behaviour, not for speed.
- **bf16 on a CPU:** native in Accelerate (autocast to bfloat16 on the CPU); slower than float32 on CPUs
  without bf16 matrix units.
- **fp8:** only on an NVIDIA GPU of compute capability >= 8.9 (Ada, Hopper or newer) with an fp8 backend
  installed (torchao, transformer-engine or MS-AMP); anywhere else the fit stops at start-up with a
  `ConfigError`.
- **Hooks:** ``configure_accelerator`` (``mixed_precision`` and the scaler settings), ``configure_model``
  (the CPU fp16 scaler, before ``accelerator.prepare``). No ``run_train_step`` wrapper: Accelerate already
  autocasts the model's forward only, which keeps the loss and backward out of autocast as PyTorch
  recommends.
- **Sources:** Micikevicius et al., "Mixed Precision Training" (ICLR 2018); PyTorch AMP docs
  (``torch.autocast``, ``torch.amp.GradScaler``); huggingface/accelerate PRs #906 and #909 (bf16 autocast on
  CPU); Lightning-AI/pytorch-lightning issue #5558 and pytorch/pytorch issue #55585 (skipped fp16 steps must
  not step the scheduler); huggingface/transformers issue #34053 and PR #11663 (save the scaler state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from accelerate.utils import DistributedType, GradScalerKwargs, is_fp8_available

import torchloom

__all__ = ["MixedPrecision", "MixedPrecisionConfig", "check_fp8_support", "install_cpu_grad_scaler"]

_SCALER_FIELDS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


@dataclass
class MixedPrecisionConfig:
    """Settings of the ``mixed_precision`` plugin.

    Args:
        dtype (`str`, defaults to ``"bf16"``): ``"no"`` (float32), ``"bf16"``, ``"fp16"`` (with dynamic loss
            scaling) or ``"fp8"`` (GPUs of compute capability >= 8.9 only).
        init_scale (`float`, *optional*): fp16 only: the initial loss scale; ``None`` keeps PyTorch's
            default (65536.0).
        growth_factor (`float`, *optional*): fp16 only: factor (> 1) the scale grows by after
            ``growth_interval`` steps without overflow; ``None`` keeps 2.0.
        backoff_factor (`float`, *optional*): fp16 only: factor (between 0 and 1) the scale shrinks by on an
            overflow; ``None`` keeps 0.5.
        growth_interval (`int`, *optional*): fp16 only: optimizer steps without overflow before the scale
            grows; ``None`` keeps 2000.

    Raises:
        ConfigError: a scaler setting out of range, or given while ``dtype`` is not ``"fp16"``.
    """

    dtype: Literal["no", "bf16", "fp16", "fp8"] = "bf16"  # the autocast / training precision
    init_scale: float | None = None  # fp16: initial loss scale (default 65536.0)
    growth_factor: float | None = None  # fp16: scale growth factor, > 1 (default 2.0)
    backoff_factor: float | None = None  # fp16: scale backoff factor on overflow, in (0, 1) (default 0.5)
    growth_interval: int | None = None  # fp16: good steps before the scale grows, >= 1 (default 2000)

    def __post_init__(self) -> None:
        given = [f for f in _SCALER_FIELDS if getattr(self, f) is not None]
        if given and self.dtype != "fp16":
            raise torchloom.ConfigError(
                f"setting {given[0]!r} = {getattr(self, given[0])!r} configures the fp16 loss scaler, but "
                f"dtype = {self.dtype!r}; set dtype: fp16 or remove {', '.join(repr(f) for f in given)}"
            )
        checks = {
            "init_scale": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
            "growth_factor": (lambda v: math.isfinite(v) and v > 1, "a finite number > 1"),
            "backoff_factor": (lambda v: 0 < v < 1, "a number between 0 and 1 (exclusive)"),
            "growth_interval": (lambda v: v >= 1, "an integer >= 1"),
        }
        for field, (ok, valid) in checks.items():
            value = getattr(self, field)
            if value is not None and not ok(value):
                raise torchloom.ConfigError(f"setting {field!r} = {value!r}; expected {valid}")

    def scaler_kwargs(self) -> dict[str, Any]:
        """The loss-scaler settings that were given, as keyword arguments of `torch.amp.GradScaler`."""
        return {f: getattr(self, f) for f in _SCALER_FIELDS if getattr(self, f) is not None}


# ------------------------------------------------------------------------------------------ functional core


def check_fp8_support() -> None:
    """Check that this machine can train in fp8 through Accelerate.

    Raises:
        ConfigError: no CUDA device, a CUDA device of compute capability below 8.9, or no fp8 backend
            (torchao, transformer-engine, MS-AMP) installed.
    """
    valid = "valid here: 'no', 'bf16', 'fp16'"
    if not torch.cuda.is_available():
        raise torchloom.ConfigError(
            "plugin 'mixed_precision': dtype = 'fp8' needs an NVIDIA GPU of compute capability >= 8.9 "
            f"(Ada, Hopper or newer) and this machine has no CUDA device; {valid}"
        )
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        raise torchloom.ConfigError(
            "plugin 'mixed_precision': dtype = 'fp8' needs an NVIDIA GPU of compute capability >= 8.9; "
            f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}; {valid}"
        )
    if not is_fp8_available():
        raise torchloom.ConfigError(
            "plugin 'mixed_precision': dtype = 'fp8' needs an fp8 backend for Accelerate: install torchao, "
            "transformer-engine or ms-amp"
        )


def install_cpu_grad_scaler(accelerator: Any) -> bool:
    """Give an fp16 Accelerator on a CPU the loss scaler and autocast that Accelerate gives it on GPUs.

    Accelerate 1.15 leaves ``Accelerator(cpu=True, mixed_precision="fp16")`` without autocast and without a
    scaler (it trains in float32). This installs ``torch.amp.GradScaler("cpu", **kwargs)``, built from the
    Accelerator's `accelerate.utils.GradScalerKwargs` handler if it has one, and sets
    ``accelerator.native_amp``, so that `accelerate.Accelerator.prepare` autocasts the model's forward to
    float16 and wraps the optimizer with the scaler. Call it before ``prepare``. Does nothing if the
    Accelerator is not fp16, not on a CPU, or already has a scaler.

    Args:
        accelerator (`accelerate.Accelerator`): the run's Accelerator, before ``prepare``.

    Returns:
        `bool`: whether a scaler was installed.
    """
    if (
        accelerator.mixed_precision != "fp16"
        or accelerator.device.type != "cpu"
        or accelerator.scaler is not None
        or accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
    ):
        return False
    handler = accelerator.scaler_handler
    kwargs = handler.to_kwargs() if handler is not None else {}
    accelerator.scaler = torch.amp.GradScaler("cpu", **kwargs)
    accelerator.native_amp = True
    return True


# ------------------------------------------------------------------------------------------------- plugin


class MixedPrecision(torchloom.Plugin):
    """Train with automatic mixed precision (bf16, fp16 with loss scaling, or fp8) through Accelerate.

    Implements ``configure_accelerator`` and ``configure_model``. See the module docstring and
    ``docs/plugins/mixed_precision.md``.

    Raises:
        ConfigError: (at the start of a fit) ``dtype="fp8"`` on a machine without fp8 support.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"mixed_precision": {"dtype": "bf16"}})
    """

    name = "mixed_precision"
    Config = MixedPrecisionConfig

    @torchloom.hookimpl
    def configure_accelerator(self) -> dict[str, Any]:
        if self.config.dtype == "fp8":
            check_fp8_support()
        fragment: dict[str, Any] = {"mixed_precision": self.config.dtype}
        scaler_kwargs = self.config.scaler_kwargs()
        if scaler_kwargs:
            fragment["kwargs_handlers"] = [GradScalerKwargs(**scaler_kwargs)]
        return fragment

    @torchloom.hookimpl
    def configure_model(self, accelerator) -> None:
        install_cpu_grad_scaler(accelerator)
