"""DeepSpeed ZeRO: every process holds a shard of the optimizer state (ZeRO-1) and of the gradients (ZeRO-2), and
DeepSpeed's engine runs the backward's reduction and the optimizer step.

Method card
-----------
- **What:** the model is wrapped in DeepSpeed's engine (``deepspeed.initialize``); the optimizer becomes DeepSpeed's
  ZeRO optimizer over the task's own (``DeepSpeedZeroOptimizer``): each process updates its partition of the
  flattened parameters and all-gathers the others. ZeRO-1 partitions AdamW's moments (and the fp32 master copy),
  ZeRO-2 also the reduced gradients. The numbers are those of data parallelism over the same global batch (the
  same mean gradient, reduced in another order: within about 1e-6 of DDP in fp32, see docs/distributed.md).
- **Mechanism:** Accelerate's ``DeepSpeedPlugin(zero_stage=..., gradient_clipping=...)`` given to the
  ``Accelerator`` (``configure_accelerator``); Accelerate's ``prepare`` calls ``deepspeed.initialize``. The same
  settings come from an Accelerate config file (``accelerate launch --use_deepspeed --zero_stage 2``); this plugin
  is the engine's own way to ask, from a torchloom config. DeepSpeed accumulates, clips and steps inside
  ``accelerator.backward`` of a window's last micro-batch: the ``grad_clip`` plugin sets DeepSpeed's
  ``gradient_clipping`` (its ``configure_model``; 0, no clipping, without it), its accumulation is the run's
  (``grad_accum``), and what DeepSpeed's step would silently not do is refused at start-up. On CPU processes (gloo)
  torchloom lets Accelerate choose DeepSpeed, which it otherwise does not under ``cpu=True`` (one documented
  place: ``torchloom._accelerator.sharding_on_cpu``): ZeRO-1 and ZeRO-2 there; ZeRO-3 and offload are refused.
- **Checkpoints:** DeepSpeed's own (``engine.save_checkpoint`` through Accelerate's ``save_state``: every
  process writes its optimizer partition) inside torchloom's checkpoint (manifest, checksums, atomic rename); a
  resume on the same number of processes is bitwise equal to an uninterrupted run. The end-of-fit model and
  ``torchloom export`` are the whole model (under ZeRO-1/2 every process holds all the parameters).
- **Sources:** Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
  (SC 2020); DeepSpeed's ZeRO tutorial and configuration reference; Accelerate's DeepSpeed guide.

Functional use, without the engine: ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torchloom

__all__ = ["DeepSpeed", "DeepSpeedConfig"]


@dataclass
class DeepSpeedConfig:
    """Settings of the ``deepspeed`` plugin (Accelerate's ``DeepSpeedPlugin`` names).

    Args:
        zero_stage (`int`, defaults to 2): DeepSpeed's ZeRO stage: 1 (optimizer state partitioned), 2 (and the
            gradients), 3 (and the parameters; on GPUs only) or 0 (DeepSpeed's data parallelism, nothing
            partitioned).
        offload_optimizer_device (`str`, defaults to ``"none"``): ``"cpu"`` / ``"nvme"`` to keep the optimizer
            state there (ZeRO-2 and 3, on GPUs only: CPU processes hold it in CPU memory already).
        offload_param_device (`str`, defaults to ``"none"``): ``"cpu"`` / ``"nvme"`` for the parameters (ZeRO-3).

    Gradient clipping and accumulation are not settings of this plugin: they are the ``grad_clip`` and
    ``grad_accum`` plugins', which torchloom gives DeepSpeed.

    Raises:
        ConfigError: a stage other than 0-3, or an offload device other than none / cpu / nvme, or an offload at a
            stage that does not have it.
    """

    zero_stage: int = 2
    offload_optimizer_device: str = "none"
    offload_param_device: str = "none"

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise torchloom.ConfigError(f"setting 'zero_stage' = {self.zero_stage!r}; expected 0, 1, 2 or 3")
        for name in ("offload_optimizer_device", "offload_param_device"):
            if getattr(self, name) not in ("none", "cpu", "nvme"):
                raise torchloom.ConfigError(
                    f"setting {name!r} = {getattr(self, name)!r}; expected 'none', 'cpu' or 'nvme'"
                )
        if self.offload_optimizer_device != "none" and self.zero_stage < 2:
            raise torchloom.ConfigError(
                f"setting 'offload_optimizer_device' = {self.offload_optimizer_device!r} needs zero_stage 2 or 3 "
                f"(got {self.zero_stage})"
            )
        if self.offload_param_device != "none" and self.zero_stage != 3:
            raise torchloom.ConfigError(
                f"setting 'offload_param_device' = {self.offload_param_device!r} needs zero_stage 3 (got "
                f"{self.zero_stage})"
            )


class DeepSpeed(torchloom.Plugin):
    """Partition the optimizer state (ZeRO-1) and the gradients (ZeRO-2) over the processes (DeepSpeed, through
    Accelerate).

    Implements ``configure_accelerator``. See the module docstring and ``docs/plugins/deepspeed.md``.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"deepspeed": {"zero_stage": 2}, "grad_clip": {"max_norm": 1.0}})
        # torchrun --nproc_per_node 8 train.py (GPUs), or ACCELERATE_USE_CPU=1 torchrun ... (CPU processes)
    """

    name = "deepspeed"
    Config = DeepSpeedConfig

    @torchloom.hookimpl
    def configure_accelerator(self) -> dict[str, Any]:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:  # Accelerate's DeepSpeedPlugin needs it importable
            raise torchloom.ConfigError(
                "plugin 'deepspeed': the deepspeed package is not installed: install it with "
                "\"DS_BUILD_OPS=0 pip install 'torchloom[deepspeed]'\" (DS_BUILD_OPS=0 installs it without "
                "compiling its CUDA ops, as on CPU machines), or remove the plugin"
            )
        from accelerate.utils import DeepSpeedPlugin

        c = self.config
        return {
            "deepspeed_plugin": DeepSpeedPlugin(
                zero_stage=c.zero_stage,
                offload_optimizer_device=c.offload_optimizer_device,
                offload_param_device=c.offload_param_device,
                # "auto": filled from the grad_clip plugin (or 0, none) by torchloom before the Accelerator is built
                gradient_clipping="auto",
            )
        }
