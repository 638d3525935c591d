"""Memory estimates made before training, from a model's parameters alone (no step is run).

`estimate_optimizer_memory` predicts, in bytes, the optimizer state that the ``optimizer`` plugin builds for a
model: the same number that plugin logs as ``optimizer/state_bytes`` after the first optimizer step.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

import torch

from torchloom.errors import ConfigError

__all__ = ["OPTIMIZER_NAMES", "estimate_optimizer_memory"]

#: The optimizer names the ``optimizer`` plugin and `estimate_optimizer_memory` accept.
OPTIMIZER_NAMES = ("adamw", "adafactor", "adamw8bit", "adam8bit", "paged_adamw8bit", "sgd")

# Settings of the ``optimizer`` plugin. Only ``momentum``, ``min_8bit_size`` and ``embedding_32bit`` change
# the state size; the others are accepted so that one settings mapping serves both.
_SETTINGS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "momentum",
    "no_decay",
    "scale_parameter",
    "warmup_init",
    "embedding_32bit",
    "min_8bit_size",
    "scheduler",
    "warmup_steps",
    "warmup_ratio",
    "scheduler_kwargs",
)

# bitsandbytes 0.45-0.50 (`Optimizer2State.init_state`): blockwise 8-bit state uses one float32 absmax per
# block of 256 elements, and the optimizer shares two 256-entry float32 quantization maps ("dynamic" and
# "udynamic") between all of its 8-bit parameters.
_BNB_BLOCKSIZE = 256
_BNB_QMAP_BYTES = 2 * 256 * 4


def estimate_optimizer_memory(model: torch.nn.Module, name: str = "adamw", **settings: Any) -> int:
    """Return the bytes of optimizer state that the ``optimizer`` plugin will hold for ``model``.

    The count is the sum of ``nbytes`` of every distinct state tensor once each trainable parameter
    (``requires_grad=True``; tied parameters count once) has taken one step, which is exactly what the plugin
    logs as ``optimizer/state_bytes``. Per parameter ``p`` with ``n`` elements and element size ``s`` bytes:

    - ``adamw`` (`torch.optim.AdamW`): ``exp_avg`` and ``exp_avg_sq`` (``2 * n * s``) and a 0-dim ``step``
      tensor (4 bytes; 8 when the default dtype is float64).
    - ``sgd`` (`torch.optim.SGD`): a ``momentum_buffer`` (``n * s``) when ``momentum`` is not 0, else nothing.
    - ``adafactor`` (`transformers.Adafactor`, ``beta1=None``): for a matrix of shape ``(..., r, c)`` the
      factored second moment (row ``prod(...) * r`` plus column ``prod(...) * c`` elements), for other shapes
      a full ``exp_avg_sq`` (``n`` elements), and a 0-dim ``RMS`` tensor; all in float32 for fp16/bf16
      parameters, else in the parameter's dtype.
    - ``adamw8bit`` / ``adam8bit`` / ``paged_adamw8bit`` (bitsandbytes): two uint8 states (``2 * n``) plus two
      float32 absmax values per block of 256 elements; parameters with fewer than ``min_8bit_size`` elements,
      and embedding weights when ``embedding_32bit`` is on, keep two float32 states (``8 * n``). The two
      256-entry float32 quantization maps are shared by all 8-bit parameters and counted once (2048 bytes).

    Args:
        model (`torch.nn.Module`): the model, on any device (``meta`` works: nothing is allocated).
        name (`str`, defaults to ``"adamw"``): one of ``adamw``, ``adafactor``, ``adamw8bit``, ``adam8bit``,
            ``paged_adamw8bit``, ``sgd``.
        **settings: the ``optimizer`` plugin's settings. Those that change the size are ``momentum`` (sgd,
            default 0), ``min_8bit_size`` (default 4096) and ``embedding_32bit`` (default True); the others
            (``lr``, ``betas``, ``weight_decay``, ...) are accepted and do not change it.

    Returns:
        `int`: bytes. Parameters that never receive a gradient get no state, so a model with such parameters
        uses less than estimated.

    Raises:
        ConfigError: an unknown optimizer name or setting.

    Example:

    .. code-block:: python

        >>> model = torch.nn.Linear(1000, 1000)
        >>> torchloom.estimate_optimizer_memory(model, "adamw")  # 2 * 1001000 * 4 + 2 * 4
        8008008
    """
    if name not in OPTIMIZER_NAMES:
        close = difflib.get_close_matches(str(name), OPTIMIZER_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"estimate_optimizer_memory: unknown optimizer {name!r}{hint} Valid: {', '.join(OPTIMIZER_NAMES)}"
        )
    unknown = sorted(set(settings) - set(_SETTINGS))
    if unknown:
        raise ConfigError(
            f"estimate_optimizer_memory: unknown setting {unknown[0]!r}; valid settings: {', '.join(_SETTINGS)}"
        )
    params = [p for p in model.parameters() if p.requires_grad]  # parameters() yields a tied tensor once
    if name == "adamw":
        step_bytes = torch.tensor(0.0, dtype=_scalar_dtype(), device="meta").element_size()
        return sum(2 * p.numel() * p.element_size() + step_bytes for p in params)
    if name == "sgd":
        momentum = settings.get("momentum") or 0.0
        return sum(p.numel() * p.element_size() for p in params) if momentum != 0 else 0
    if name == "adafactor":
        return sum(_adafactor_bytes(p) for p in params)
    # bitsandbytes 8-bit Adam
    min_8bit_size = settings.get("min_8bit_size")
    min_8bit_size = 4096 if min_8bit_size is None else min_8bit_size
    embedding_32bit = settings.get("embedding_32bit")
    embedding_32bit = True if embedding_32bit is None else embedding_32bit
    forced_32bit = {id(p) for p in _embedding_weights(model)} if embedding_32bit else set()
    total, any_8bit = 0, False
    for p in params:
        n = p.numel()
        if n < min_8bit_size or id(p) in forced_32bit:
            total += 2 * n * 4
        else:
            total += 2 * n + 2 * math.ceil(n / _BNB_BLOCKSIZE) * 4
            any_8bit = True
    return total + (_BNB_QMAP_BYTES if any_8bit else 0)


def _embedding_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of every `torch.nn.Embedding` in ``model`` (what the HF Trainer keeps in 32-bit state)."""
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]


def _scalar_dtype() -> torch.dtype:
    # torch.optim's ``step`` tensor: float64 when the default dtype is float64, else float32.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _adafactor_bytes(p: torch.Tensor) -> int:
    itemsize = 4 if p.dtype in (torch.float16, torch.bfloat16) else p.element_size()
    shape = tuple(p.shape)
    if len(shape) >= 2:
        lead = math.prod(shape[:-2])
        elements = lead * shape[-2] + lead * shape[-1]
    else:
        elements = p.numel()
    return (elements + 1) * itemsize  # + the 0-dim RMS
