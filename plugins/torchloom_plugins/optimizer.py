"""Optimizer swap by name, with parameter groups for weight decay and a schedule from transformers.

Method card
-----------
- **What:** builds the run's optimizer from a name (``adamw``: `torch.optim.AdamW`; ``sgd``: `torch.optim.SGD`;
  ``adafactor``: `transformers.Adafactor`, Shazeer & Stern 2018, arXiv:1804.04235; ``adamw8bit``,
  ``adam8bit``, ``paged_adamw8bit``: bitsandbytes 8-bit Adam, Dettmers et al. 2022, arXiv:2110.02861) and an
  optional learning-rate schedule from `transformers.get_scheduler`, so a config can switch optimizers without
  touching the task.
- **Hooks:** ``configure_optimizers`` (first result wins, so the task's own optimizer is not built);
  ``after_optimizer_step`` logs ``lr`` every optimizer step and ``optimizer/state_bytes`` once after the first
  step that ran; ``teardown`` releases the bitsandbytes overrides it registered.
- **Guarantees:** every configured hyperparameter reaches ``optimizer.param_groups`` exactly (no library default
  leaks in); weight decay skips biases and normalisation weights (``no_decay``); Adafactor's relative step
  (``lr: null``) runs under the transformers proxy schedule and logs the step size it really used; 8-bit Adam
  keeps 32-bit state for embeddings (the HF Trainer's module override) and for tensors under ``min_8bit_size``;
  the logged state size equals `torchloom.estimate_optimizer_memory` made before training.
- **Memory estimate:** the plugin answers `torchloom.estimate_optimizer_memory` for the names it builds
  (``optimizer_names``, classmethod ``estimate_optimizer_memory``; the interface any plugin may implement).
- **Functional core:** `create_optimizer`, `create_scheduler`, `decay_split`, `optimizer_state_bytes`,
  `estimate_state_bytes` work without the loop.

Run: ``torchloom fit config.yaml`` with ``plugins: {optimizer: {name: adamw, lr: 3.0e-4, weight_decay: 0.01,
scheduler: cosine, warmup_ratio: 0.05}}``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

import torch

import torchloom
from torchloom import ConfigError

__all__ = [
    "OptimizerConfig",
    "OptimizerSwap",
    "adamw_kernel",
    "create_optimizer",
    "create_scheduler",
    "decay_split",
    "estimate_state_bytes",
    "fused_devices",
    "optimizer_state_bytes",
]

OptimizerName = Literal["adamw", "adafactor", "adamw8bit", "adam8bit", "paged_adamw8bit", "sgd"]
_ADAM = ("adamw", "adamw8bit", "adam8bit", "paged_adamw8bit")
_EIGHT_BIT = ("adamw8bit", "adam8bit", "paged_adamw8bit")
# Settings that only some optimizers take: setting one for another optimizer is an error, never ignored.
_ONLY_FOR = {
    "betas": _ADAM,
    "eps": (*_ADAM, "adafactor"),
    "momentum": ("sgd",),
    "scale_parameter": ("adafactor",),
    "warmup_init": ("adafactor",),
    "embedding_32bit": _EIGHT_BIT,
    "min_8bit_size": _EIGHT_BIT,
    "implementation": ("adamw",),
}
#: How the 8-bit optimizers' error says to install bitsandbytes: the README's install line with the ``8bit`` extra.
INSTALL_8BIT = 'python3 -m pip install -c constraints.txt -e ".[8bit]"'
# Schedules whose step() needs a metric or a loss: the engine calls scheduler.step() without arguments.
_UNSUPPORTED_SCHEDULES = ("reduce_lr_on_plateau", "greedy")
_NEEDS_TOTAL = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
)


@dataclass
class OptimizerConfig:
    """Settings of the ``optimizer`` plugin. ``None`` means "the optimizer's own default" (listed per field).

    Args:
        name (`str`, defaults to ``"adamw"``): which optimizer: ``adamw``, ``adafactor``, ``adamw8bit``,
            ``adam8bit``, ``paged_adamw8bit`` or ``sgd``.
        lr (`float`, *optional*, defaults to 1e-3): the learning rate, > 0; ``None`` (adafactor only):
            Adafactor's relative step size.
        betas (`tuple[float, float]`, *optional*): Adam family only, each in [0, 1); ``None``: (0.9, 0.999).
        eps (`float`, *optional*): Adam's epsilon, >= 0 (``None``: 1e-8); for adafactor the first of its
            ``eps=(eps, 1e-3)``, added to squared gradients (``None``: 1e-30).
        weight_decay (`float`, defaults to 0.0): weight decay, >= 0, applied the way the chosen optimizer
            applies it, to every parameter except those ``no_decay`` matches.
        momentum (`float`, *optional*): sgd only, in [0, 1); ``None``: 0.
        implementation (`str`, *optional*): adamw only: torch's ``fused`` kernel (one kernel per step for all
            parameters), ``foreach`` (one multi-tensor op per state) or ``for_loop`` (one op per parameter); the
            same update within rounding (`adamw_kernel`). ``None``: the fastest the device has, ``fused`` where
            torch has the kernel for it (CPU, CUDA, MPS, XPU, ...; the HF Trainer's default ``adamw_torch_fused``),
            else ``foreach``; ``foreach`` under fp16 loss scaling (the engine refuses a fused optimizer there).
        no_decay (`list[str]`, defaults to ``["bias", "norm"]``): a parameter is exempt from weight decay when
            an item is a case-insensitive substring of its qualified name or of its module's class name
            (``LayerNorm``, ``LlamaRMSNorm``, ``BatchNorm1d``); ``[]`` decays everything.
        scale_parameter (`bool`, *optional*): adafactor only: scale the step by the parameter's RMS (at least
            1e-3); ``None``: false with a fixed ``lr``, as the HF Trainer's ``optim="adafactor"`` builds it
            (transformers' own class default is true), and true with ``lr: null``, the relative step it belongs
            to.
        warmup_init (`bool`, *optional*): adafactor with ``lr: null`` only: relative step
            ``min(1e-6 * t, 1 / sqrt(t))`` instead of ``min(1e-2, 1 / sqrt(t))``; ``None``: false.
        embedding_32bit (`bool`, *optional*): 8-bit only: keep ``nn.Embedding`` weights in 32-bit state;
            ``None``: true.
        min_8bit_size (`int`, *optional*): 8-bit only: tensors with fewer elements keep 32-bit state, >= 0;
            ``None``: 4096.
        scheduler (`str`, *optional*): a ``transformers.SchedulerType`` name except ``reduce_lr_on_plateau``
            and ``greedy``: ``linear``, ``cosine``, ``cosine_with_restarts``, ``polynomial``, ``constant``,
            ``constant_with_warmup``, ``inverse_sqrt``, ``cosine_with_min_lr``, ``cosine_warmup_with_min_lr``,
            ``warmup_stable_decay``; ``None``: a constant learning rate.
        warmup_steps (`int`, defaults to 0): warm-up optimizer steps, >= 0 (needs a schedule with warm-up).
        warmup_ratio (`float`, defaults to 0.0): warm-up as a fraction of ``num_training_steps``, in [0, 1); not
            together with ``warmup_steps``.
        scheduler_kwargs (`dict`, defaults to ``{}``): extra arguments of the schedule (``num_cycles``,
            ``power``, ``min_lr``, ...).

    Raises:
        ConfigError: a value out of range, a setting the chosen optimizer does not take, or ``lr: null`` with an
            optimizer other than ``adafactor``.
    """

    name: OptimizerName = "adamw"  # which optimizer
    lr: float | None = 1e-3  # learning rate; null (adafactor only) = Adafactor's relative step size
    betas: tuple[float, float] | None = None  # Adam family; default (0.9, 0.999)
    eps: float | None = None  # Adam family: default 1e-8; adafactor: eps[0] (default 1e-30)
    weight_decay: float = 0.0  # applied to every parameter except those matched by no_decay
    momentum: float | None = None  # sgd only; default 0
    implementation: Literal["fused", "foreach", "for_loop"] | None = None  # adamw only; default: fused if supported
    no_decay: list[str] = field(default_factory=lambda: ["bias", "norm"])  # substrings exempt from decay
    scale_parameter: bool | None = None  # adafactor: scale steps by the parameter's RMS; default: lr is null
    warmup_init: bool | None = None  # adafactor with lr null: time-dependent warm-up; default False
    embedding_32bit: bool | None = None  # 8-bit: keep nn.Embedding weights in 32-bit state; default True
    min_8bit_size: int | None = None  # 8-bit: tensors with fewer elements keep 32-bit state; default 4096
    scheduler: str | None = None  # a transformers get_scheduler name ("linear", "cosine", ...); null = constant
    warmup_steps: int = 0  # warm-up optimizer steps of the schedule
    warmup_ratio: float = 0.0  # warm-up as a fraction of the run's optimizer steps (exclusive with warmup_steps)
    scheduler_kwargs: dict[str, Any] = field(default_factory=dict)  # extra get_scheduler arguments

    def __post_init__(self) -> None:
        name = self.name
        for setting, names in _ONLY_FOR.items():
            if getattr(self, setting) is not None and name not in names:
                raise ConfigError(
                    f"setting {setting!r} = {getattr(self, setting)!r} does not apply to optimizer {name!r}; "
                    f"it applies to {', '.join(names)}"
                )
        if self.lr is None:
            if name != "adafactor":
                raise ConfigError(
                    f"setting 'lr' = None: only 'adafactor' has a relative step; {name!r} needs an lr > 0"
                )
        elif not self.lr > 0:
            raise ConfigError(f"setting 'lr' = {self.lr!r}: expected a learning rate > 0 (or null for adafactor)")
        if self.betas is not None and (len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas)):
            raise ConfigError(f"setting 'betas' = {self.betas!r}: expected two numbers in [0, 1)")
        if self.eps is not None and not self.eps >= 0:
            raise ConfigError(f"setting 'eps' = {self.eps!r}: expected a number >= 0")
        if not self.weight_decay >= 0:
            raise ConfigError(f"setting 'weight_decay' = {self.weight_decay!r}: expected a number >= 0")
        if self.momentum is not None and not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"setting 'momentum' = {self.momentum!r}: expected a number in [0, 1)")
        if self.warmup_init and self.lr is not None:
            raise ConfigError("setting 'warmup_init' = True needs Adafactor's relative step: set lr to null")
        if self.min_8bit_size is not None and self.min_8bit_size < 0:
            raise ConfigError(f"setting 'min_8bit_size' = {self.min_8bit_size!r}: expected an integer >= 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"setting 'warmup_steps' = {self.warmup_steps!r}: expected an integer >= 0")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"setting 'warmup_ratio' = {self.warmup_ratio!r}: expected a number in [0, 1)")
        if self.warmup_steps and self.warmup_ratio:
            raise ConfigError("settings 'warmup_steps' and 'warmup_ratio' are both set; set one of them")
        if self.scheduler is not None:
            valid = _schedule_names()
            if self.scheduler not in valid:
                close = torchloom.utils.closest_name(self.scheduler, valid)
                hint = f" (did you mean {close!r}?)" if close else ""
                raise ConfigError(f"setting 'scheduler' = {self.scheduler!r}{hint}: expected one of {', '.join(valid)}")
        if self.lr is None and self.scheduler not in (None, "constant"):
            raise ConfigError(
                f"setting 'scheduler' = {self.scheduler!r}: Adafactor's relative step (lr null) computes its own "
                "schedule; set scheduler to null, or set an lr to use an external schedule"
            )
        if (self.warmup_steps or self.warmup_ratio) and self.scheduler in (None, "constant"):
            raise ConfigError(
                f"warm-up is set but setting 'scheduler' = {self.scheduler!r} has none; "
                "use e.g. 'constant_with_warmup', 'linear' or 'cosine'"
            )


def _schedule_names() -> list[str]:
    from transformers import SchedulerType

    return [s.value for s in SchedulerType if s.value not in _UNSUPPORTED_SCHEDULES]


# ------------------------------------------------------------------------------------------ functional core


def decay_split(model: torch.nn.Module, no_decay: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Split the trainable parameters of ``model`` into (decayed, not decayed) qualified names.

    A parameter is not decayed when any ``no_decay`` item is a case-insensitive substring of its qualified name
    (``encoder.layer.0.output.dense.bias``) or of the class name of the module that owns it (``LayerNorm``,
    ``LlamaRMSNorm``, ``BatchNorm1d``), so ``["bias", "norm"]`` exempts biases and normalisation weights as the
    HF Trainer does. Frozen parameters (``requires_grad=False``) are in neither list.

    Args:
        model (`torch.nn.Module`): the model.
        no_decay (`list[str]`): substrings; empty = decay everything.

    Returns:
        `tuple[list[str], list[str]]`: names in ``model.named_parameters()`` order.
    """
    patterns = [s.lower() for s in no_decay]
    decay: list[str] = []
    skip: list[str] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        owner = type(module).__name__.lower()
        for param_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{module_name}.{param_name}" if module_name else param_name
            exempt = any(s in full.lower() or s in owner for s in patterns)
            (skip if exempt else decay).append(full)
    return decay, skip


def fused_devices() -> tuple[str, ...]:
    """The device types torch has fused optimizer kernels for (``cpu``, ``cuda``, ``mps``, ``xpu`` ... in torch
    2.13), from torch's own list (``torch.utils._foreach_utils``, what ``fused=True`` is checked against); only
    ``("cuda",)`` where a torch version lacks that function."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # pragma: no cover - torch versions before 2.2
        return ("cuda",)
    return tuple(_get_fused_kernels_supported_devices())


def adamw_kernel(implementation: str | None, device_type: str, loss_scaling: bool = False) -> dict[str, bool]:
    """The keyword arguments of `torch.optim.AdamW` that choose its implementation.

    Args:
        implementation (`str` or ``None``): ``"fused"``, ``"foreach"``, ``"for_loop"``, or ``None`` for the fastest
            the device has: ``fused`` where torch has a fused kernel for ``device_type`` (`fused_devices`), else
            ``foreach``; ``foreach`` under fp16 loss scaling, where the engine refuses a fused optimizer (it skips
            an overflow step inside ``step()``, where Accelerate cannot see it). All three give the same update
            within float rounding (a few ulp; tests/plugins/test_optimizer.py compares them).
        device_type (`str`): the device the run trains on (``accelerator.device.type``).
        loss_scaling (`bool`, defaults to False): the run scales its loss (``mixed_precision: fp16``).

    Returns:
        `dict[str, bool]`: ``{"fused": True}``, ``{"foreach": True}`` or ``{"foreach": False}``.

    Raises:
        ConfigError: ``"fused"`` on a device type torch has no fused kernel for.
    """
    if implementation is None:
        implementation = "fused" if device_type in fused_devices() and not loss_scaling else "foreach"
    if implementation == "fused":
        if device_type not in fused_devices():
            raise ConfigError(
                f"setting 'implementation' = 'fused': torch has no fused AdamW for device {device_type!r} (it has "
                f"one for {', '.join(fused_devices())}); use 'foreach' or leave it unset"
            )
        return {"fused": True}
    return {"foreach": implementation == "foreach"}


def create_optimizer(
    model: torch.nn.Module, config: OptimizerConfig, device_type: str = "cpu", loss_scaling: bool = False
) -> torch.optim.Optimizer:
    """Build the optimizer ``config`` names over the trainable parameters of ``model``.

    Parameter groups: group 0 holds the decayed parameters with ``weight_decay``, group 1 those matched by
    ``no_decay`` with weight decay 0 (see `decay_split`); when ``weight_decay`` is 0 or nothing is exempt there
    is one group. For the 8-bit optimizers with ``embedding_32bit``, every `torch.nn.Embedding` weight is
    registered with ``bitsandbytes.optim.GlobalOptimManager.register_module_override(module, "weight",
    {"optim_bits": 32})``, as the HF Trainer does; undo it with `release_overrides`.

    Args:
        model (`torch.nn.Module`): the unprepared model.
        config (`OptimizerConfig`): the settings.
        device_type (`str`, defaults to ``"cpu"``): the device the run trains on (``accelerator.device.type``).
        loss_scaling (`bool`, defaults to False): the run scales its loss (fp16; `adamw_kernel`).

    Returns:
        `torch.optim.Optimizer`.

    Raises:
        ConfigError: ``paged_adamw8bit`` on a device other than CUDA, or a model without trainable parameters.
    """
    c = config
    if c.name == "paged_adamw8bit" and device_type != "cuda":
        raise ConfigError(
            f"setting 'name' = 'paged_adamw8bit' pages optimizer state through CUDA unified memory and needs a "
            f"CUDA device; this run is on {device_type!r}. Use 'adamw8bit' (same update, no paging)"
        )
    named = dict(model.named_parameters())
    decay, skip = decay_split(model, c.no_decay if c.weight_decay else [])
    if not decay and not skip:
        raise ConfigError(f"optimizer {c.name!r}: the model has no trainable parameters (all requires_grad=False)")
    groups = [
        {"params": [named[n] for n in names], "weight_decay": wd}
        for names, wd in ((decay, c.weight_decay), (skip, 0.0))
        if names
    ]
    lr: Any = c.lr  # None only for adafactor (validated by OptimizerConfig)
    if c.name == "adamw":
        kernel = adamw_kernel(c.implementation, device_type, loss_scaling)
        return torch.optim.AdamW(groups, lr=lr, betas=c.betas or (0.9, 0.999), eps=_or(c.eps, 1e-8), **kernel)
    if c.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=_or(c.momentum, 0.0))
    if c.name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(
            groups,
            lr=lr,
            eps=(_or(c.eps, 1e-30), 1e-3),
            relative_step=lr is None,
            scale_parameter=_or(c.scale_parameter, lr is None),  # the HF Trainer's False with a fixed lr
            warmup_init=_or(c.warmup_init, False),
        )
    bnb = _import_bitsandbytes()

    cls = {
        "adamw8bit": bnb.optim.AdamW8bit,
        "adam8bit": bnb.optim.Adam8bit,
        "paged_adamw8bit": bnb.optim.PagedAdamW8bit,
    }[c.name]
    optimizer = cls(
        groups, lr=lr, betas=c.betas or (0.9, 0.999), eps=_or(c.eps, 1e-8), min_8bit_size=_or(c.min_8bit_size, 4096)
    )
    if _or(c.embedding_32bit, True):
        manager = bnb.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding) and module.weight.requires_grad:
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


#: The line bitsandbytes' CPU backend logs when it is imported on a CPU with AVX-512 BF16 and the optional ``kernels``
#: package is missing (bitsandbytes 0.49-0.50, ``bitsandbytes/backends/cpu/ops.py``): about a 4-bit inference kernel
#: that the 8-bit optimizers never use.
_BNB_KERNELS_LINE = "Failed to load CPU gemm_4bit_forward from kernels-community"
_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"


class _DropKernelsLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(_BNB_KERNELS_LINE))


def _import_bitsandbytes() -> Any:
    """Import bitsandbytes without the warning its CPU backend logs at import about the optional ``kernels``
    package ("Failed to load CPU gemm_4bit_forward from kernels-community ..."), which concerns 4-bit inference, not
    the 8-bit optimizers. A logging filter on that one logger drops that one message during the import; every other
    record passes, and so does this one when the user asked bitsandbytes for more than warnings (a level below
    ``WARNING`` on its logger or the root logger). Already imported: returned as it is."""
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    logger = logging.getLogger(_BNB_CPU_LOGGER)
    if logger.getEffectiveLevel() < logging.WARNING:
        return importlib.import_module("bitsandbytes")
    drop = _DropKernelsLine()
    logger.addFilter(drop)
    try:
        return importlib.import_module("bitsandbytes")
    finally:
        logger.removeFilter(drop)


def release_overrides(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Remove the bitsandbytes module overrides `create_optimizer` registered for ``model``.

    ``GlobalOptimManager`` is a process-wide singleton that keeps the overridden modules alive and keys its
    per-optimizer table by (group index, parameter index): left in place, a later optimizer in the same
    process would inherit 32-bit state at those positions.
    """
    bnb = _import_bitsandbytes()

    manager = bnb.optim.GlobalOptimManager.get_instance()
    modules = {id(m) for m in model.modules()}
    manager.module_weight_config_triple[:] = [t for t in manager.module_weight_config_triple if id(t[0]) not in modules]
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if manager.pid2config.pop(id(p), None) is not None:
                manager.index2config.pop((gi, pi), None)


def create_scheduler(optimizer: torch.optim.Optimizer, config: OptimizerConfig, num_training_steps: int | None) -> Any:
    """Build the learning-rate schedule, stepped once per optimizer step; ``None`` for a constant lr.

    With Adafactor's relative step (``lr`` null) this is `transformers.optimization.AdafactorSchedule`, the proxy
    whose ``get_lr`` reads the step size Adafactor computed (transformers PR #12123), so ``param_groups[0]["lr"]``
    holds the lr really used. Otherwise `transformers.get_scheduler` with ``num_warmup_steps = warmup_steps``
    or ``ceil(warmup_ratio * num_training_steps)``.

    Args:
        optimizer (`torch.optim.Optimizer`): from `create_optimizer`.
        config (`OptimizerConfig`): the settings.
        num_training_steps (`int`, *optional*): the run's optimizer steps (the ``configure_optimizers`` hook
            argument).

    Raises:
        ConfigError: the schedule or ``warmup_ratio`` needs ``num_training_steps`` and it is unknown, or the
            schedule rejects ``scheduler_kwargs``.
    """
    c = config
    if c.name == "adafactor" and c.lr is None:
        from transformers.optimization import AdafactorSchedule

        return AdafactorSchedule(optimizer)
    if c.scheduler is None:
        return None
    if num_training_steps is None and (c.scheduler in _NEEDS_TOTAL or c.warmup_ratio):
        what = f"scheduler {c.scheduler!r}" if c.scheduler in _NEEDS_TOTAL else "setting 'warmup_ratio'"
        raise ConfigError(
            f"{what} needs the run's number of optimizer steps, which is unknown (the train dataloader has no "
            "length): set the engine's max_steps"
        )
    warmup = c.warmup_steps or (math.ceil(c.warmup_ratio * num_training_steps) if num_training_steps else 0)
    from transformers import get_scheduler

    try:
        return get_scheduler(
            c.scheduler,
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=num_training_steps,
            scheduler_specific_kwargs=dict(c.scheduler_kwargs),
        )
    except TypeError as exc:
        raise ConfigError(f"setting 'scheduler_kwargs' = {c.scheduler_kwargs!r} for {c.scheduler!r}: {exc}") from None


optimizer_state_bytes = torchloom.utils.optimizer_state_bytes  # re-exported: the functional core's name


# bitsandbytes 0.45-0.50 (`Optimizer2State.init_state`): blockwise 8-bit state uses one float32 absmax per
# block of 256 elements, and the optimizer shares two 256-entry float32 quantization maps ("dynamic" and
# "udynamic") between all of its 8-bit parameters.
_BNB_BLOCKSIZE = 256
_BNB_QMAP_BYTES = 2 * 256 * 4


def estimate_state_bytes(model: torch.nn.Module, config: OptimizerConfig) -> int:
    """Return the bytes of state the optimizer ``config`` names will hold for ``model``, before any step.

    The count is the sum of ``nbytes`` of every distinct state tensor once each trainable parameter
    (``requires_grad=True``; tied parameters count once) has taken one step: what `optimizer_state_bytes`
    measures and the plugin logs as ``optimizer/state_bytes``. Per parameter ``p`` with ``n`` elements and
    element size ``s`` bytes:

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

    Only ``name``, ``momentum``, ``min_8bit_size`` and ``embedding_32bit`` change the size. Parameters that never
    receive a gradient get no state, so a model with such parameters uses less than estimated. Reads only
    parameter metadata: a model on the ``meta`` device works.

    Args:
        model (`torch.nn.Module`): the model, on any device.
        config (`OptimizerConfig`): the settings.

    Returns:
        `int`: bytes.
    """
    params = [p for p in model.parameters() if p.requires_grad]  # parameters() yields a tied tensor once
    if config.name == "adamw":
        step_bytes = torch.tensor(0.0, dtype=_scalar_dtype(), device="meta").element_size()
        return sum(2 * p.numel() * p.element_size() + step_bytes for p in params)
    if config.name == "sgd":
        return sum(p.numel() * p.element_size() for p in params) if _or(config.momentum, 0.0) != 0 else 0
    if config.name == "adafactor":
        return sum(_adafactor_bytes(p) for p in params)
    # bitsandbytes 8-bit Adam
    min_8bit_size = _or(config.min_8bit_size, 4096)
    embeddings = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    forced_32bit = {id(p) for p in embeddings} if _or(config.embedding_32bit, True) else set()
    total, any_8bit = 0, False
    for p in params:
        n = p.numel()
        if n < min_8bit_size or id(p) in forced_32bit:
            total += 2 * n * 4
        else:
            total += 2 * n + 2 * math.ceil(n / _BNB_BLOCKSIZE) * 4
            any_8bit = True
    return total + (_BNB_QMAP_BYTES if any_8bit else 0)


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


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


# ------------------------------------------------------------------------------------------------- plugin


class OptimizerSwap(torchloom.Plugin):
    """Builds the optimizer and lr schedule by name; logs ``lr`` and ``optimizer/state_bytes``.

    Args:
        config (`OptimizerConfig`, *optional*): ready-made settings, or pass them as keywords.

    Raises:
        ConfigError: a bad setting (at construction), or at ``configure_optimizers``: ``paged_adamw8bit`` off
            CUDA, a schedule that needs the run length when it is unknown.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"optimizer": {"name": "adamw", "lr": 3e-4, "weight_decay": 0.01,
                                                         "scheduler": "cosine", "warmup_ratio": 0.05}})
    """

    name = "optimizer"
    Config = OptimizerConfig
    #: The optimizer names this plugin builds (the first is the default), for `torchloom.estimate_optimizer_memory`.
    optimizer_names: ClassVar[tuple[str, ...]] = get_args(OptimizerName)

    @classmethod
    def estimate_optimizer_memory(cls, model: torch.nn.Module, name: str, settings: Mapping[str, Any]) -> int:
        """Answer `torchloom.estimate_optimizer_memory`: the bytes of state optimizer ``name`` will hold.

        ``settings`` are this plugin's (``weight_decay``, ``momentum``, ...), validated as at enabling; see
        `estimate_state_bytes` for the formulas.

        Raises:
            ConfigError: a bad setting.
        """
        return estimate_state_bytes(model, torchloom.build_config(cls, {**settings, "name": name}))

    def __init__(self, config: OptimizerConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        if self.config.name in _EIGHT_BIT and importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(
                f"optimizer {self.config.name!r} needs bitsandbytes, which is not installed: add torchloom's 8bit "
                f"extra, from the repository root: {INSTALL_8BIT} (or pip install bitsandbytes)"
            )
        self._state_logged = False
        self._lr_used: float | None = None
        self._built: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None

    @torchloom.hookimpl
    def configure_optimizers(self, model, accelerator, num_training_steps) -> Any:
        scaling = getattr(accelerator, "scaler", None) is not None  # fp16: not fused (adamw_kernel)
        optimizer = create_optimizer(model, self.config, accelerator.device.type, scaling)
        self._built, self._state_logged = (model, optimizer), False
        scheduler = create_scheduler(optimizer, self.config, num_training_steps)
        return optimizer if scheduler is None else (optimizer, scheduler)

    @torchloom.hookimpl
    def before_optimizer_step(self, optimizer) -> None:
        # The lr this step is about to use (a Python float: no sync). Adafactor's relative step computes its
        # step size inside step(), so with lr null it is read after the step instead.
        self._lr_used = None if self.config.lr is None else optimizer.param_groups[0]["lr"]

    @torchloom.hookimpl
    def after_optimizer_step(self, optimizer, log) -> None:
        # Under the Adafactor proxy schedule group 0's lr is a 0-dim tensor: logged without a sync.
        # A current value: the last one of the logging interval is reported, not an interval mean.
        log("lr", self._lr_used if self._lr_used is not None else optimizer.param_groups[0]["lr"], reduce="last")
        if not self._state_logged and not getattr(optimizer, "step_was_skipped", False):
            log("optimizer/state_bytes", float(optimizer_state_bytes(optimizer)), reduce="last")
            self._state_logged = True

    @torchloom.hookimpl
    def teardown(self) -> None:
        if self._built is not None and self.config.name in _EIGHT_BIT:
            release_overrides(*self._built)
        self._built = None
