"""Gradient clipping by total norm (or by value), once per optimizer step, on unscaled gradients.

Method card
-----------
- **What:** if the total ``norm_type``-norm of all gradients exceeds ``max_norm``, scale every gradient by
  ``max_norm / (norm + 1e-6)`` (`torch.nn.utils.clip_grad_norm_`); log the norm before clipping as
  ``grad_norm``. With ``clip_value`` set, clip every gradient element to ``[-clip_value, clip_value]`` instead
  (`torch.nn.utils.clip_grad_value_`, Lightning's ``gradient_clip_algorithm="value"``); no norm is computed or logged.
- **Mechanism:** `accelerate.Accelerator.clip_grad_norm_`, which first unscales the gradients of an fp16
  loss scaler (``GradScaler.unscale_``, at most once per optimizer step; ``optimizer.step()`` then does not
  unscale again) and handles FSDP / DeepSpeed / XLA.
- **Hook:** ``before_optimizer_step``: it fires once per optimizer step, only on the micro-batch that ends
  an accumulation window, after the gradients are all-reduced and after ``grad_accum``'s window rescale
  (``tryfirst``), and before ``optimizer.step()``.
- **Logging:** ``log("grad_norm", norm)`` buffers the 0-dim tensor on its device (no host sync); the value
  reported at each logging interval is the mean over the optimizer steps since the previous one. On a step
  that the fp16 loss scaler skips (overflow) the norm is ``inf`` or ``nan``.
- **Sources:** Pascanu et al., "On the difficulty of training recurrent neural networks" (ICML 2013);
  Lightning-AI/pytorch-lightning issue #9694 and rwth-i6/returnn issue #1590 (clipping scaled gradients);
  huggingface/accelerate issue #641 (unscale once per step under accumulation); Composer's
  ``gradient_clipping`` algorithm.

Functional use, without the engine: Accelerate's own ``accelerator.clip_grad_norm_(model.parameters(), 1.0)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

import torchloom

__all__ = ["GradientClipping", "GradientClippingConfig"]


@dataclass
class GradientClippingConfig:
    """Settings of the ``grad_clip`` plugin.

    Args:
        max_norm (`float`, defaults to 1.0): the largest allowed total gradient norm; ``> 0``.
        norm_type (`float`, defaults to 2.0): the p of the p-norm; ``> 0``, or ``inf`` for the max-norm.
        clip_value (`float`, *optional*): clip by value instead: every gradient element to
            ``[-clip_value, clip_value]`` (``> 0``); ``max_norm`` and ``norm_type`` are then not used and no
            ``grad_norm`` is logged. ``None`` (the default) clips by norm.

    Raises:
        ConfigError: ``max_norm``, ``norm_type`` or ``clip_value`` not positive (or not a number).
    """

    max_norm: float = 1.0  # largest allowed total gradient norm (> 0)
    norm_type: float = 2.0  # p of the p-norm (> 0, or inf)
    clip_value: float | None = None  # clip by value to [-clip_value, clip_value] instead of by norm

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_norm) and self.max_norm > 0):
            raise torchloom.ConfigError(f"setting 'max_norm' = {self.max_norm!r}; expected a finite number > 0")
        if math.isnan(self.norm_type) or self.norm_type <= 0:
            raise torchloom.ConfigError(f"setting 'norm_type' = {self.norm_type!r}; expected a number > 0 or inf")
        if self.clip_value is not None and not (math.isfinite(self.clip_value) and self.clip_value > 0):
            raise torchloom.ConfigError(
                f"setting 'clip_value' = {self.clip_value!r}; expected a finite number > 0 (or null: clip by norm)"
            )


class GradientClipping(torchloom.Plugin):
    """Clip the total gradient norm once per optimizer step and log it as ``grad_norm`` (or clip by value).

    Implements ``configure_model`` (under DeepSpeed: its ``gradient_clipping``) and ``before_optimizer_step``. See
    the module docstring and ``docs/plugins/grad_clip.md``.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"grad_clip": {"max_norm": 1.0}})
    """

    name = "grad_clip"
    Config = GradientClippingConfig

    @torchloom.hookimpl
    def configure_model(self, accelerator) -> None:
        """Under DeepSpeed, which clips inside its own step (in ``accelerator.backward``, before this plugin's
        ``before_optimizer_step``): make its ``gradient_clipping`` ``max_norm`` (from ``"auto"``), or refuse what it
        would not do."""
        if str(getattr(accelerator.distributed_type, "value", "")) != "DEEPSPEED":
            return
        c = self.config
        why = None
        if c.clip_value is not None:
            why = f"setting 'clip_value' = {c.clip_value}: DeepSpeed clips by the total 2-norm only"
        elif c.norm_type != 2:
            why = f"setting 'norm_type' = {c.norm_type}: DeepSpeed clips by the total 2-norm only"
        for ds in _deepspeed_plugins(accelerator):
            current = ds.deepspeed_config.get("gradient_clipping", 0.0)
            if why is None and current == "auto":
                ds.deepspeed_config["gradient_clipping"] = ds.gradient_clipping = float(c.max_norm)
            elif why is None and float(current) != float(c.max_norm):
                why = (
                    f"max_norm {c.max_norm:g}, but the DeepSpeed config's gradient_clipping is {current}; set it to "
                    '"auto" (filled from max_norm) or to the same value'
                )
        if why is not None:
            raise torchloom.ConfigError(
                f"plugin 'grad_clip' under DeepSpeed, which clips the gradients inside its own step (its "
                f"gradient_clipping), so this plugin cannot clip them otherwise: {why}"
            )

    @torchloom.hookimpl
    def before_optimizer_step(self, model: torch.nn.Module, accelerator, log) -> None:
        if self.config.clip_value is not None:  # by value: unscales once (fp16), then clamps every element
            accelerator.clip_grad_value_(model.parameters(), self.config.clip_value)
            return
        # Unscales once (fp16) and clips; the norm is inf / nan on an overflow step the scaler will skip, and
        # None under DeepSpeed without an engine.
        norm = accelerator.clip_grad_norm_(model.parameters(), self.config.max_norm, norm_type=self.config.norm_type)
        if norm is not None:
            log("grad_norm", norm)


def _deepspeed_plugins(accelerator: Any) -> list[Any]:
    """The Accelerator's DeepSpeed plugins (Accelerate keeps one, or a dict of several)."""
    plugins = accelerator.state.deepspeed_plugins
    return list(plugins.values()) if isinstance(plugins, dict) else [plugins] if plugins is not None else []
