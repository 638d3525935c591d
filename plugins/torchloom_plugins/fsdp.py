"""Fully sharded data parallelism (FSDP2): every process holds a shard of the parameters, gradients and optimizer
state, and gathers a layer's parameters only while it computes.

Method card
-----------
- **What:** the model's layers (``auto_wrap_policy``: each transformer block, or each module above a size) and the
  model itself become FSDP2 units (``torch.distributed.fsdp.fully_shard``): their parameters are ``DTensor`` shards
  over the processes; a unit's parameters are all-gathered before its forward and backward and freed after
  (``reshard_after_forward``), and its gradients are reduce-scattered. Per process, parameters + gradients +
  AdamW's state take about 1/N of what each DDP process holds. The numbers are those of data parallelism over
  the same global batch (the same mean gradient, reduced in another order: within about 1e-6 of DDP in fp32).
- **Mechanism:** Accelerate's ``FullyShardedDataParallelPlugin(fsdp_version=2, ...)``, given to the
  ``Accelerator`` (``configure_accelerator``); Accelerate's ``prepare`` shards the model and rebuilds the optimizer
  over the shards. The same settings come from an Accelerate config file (``accelerate launch --config_file``,
  ``distributed_type: FSDP``); this plugin is the engine's own way to ask, from a torchloom config. On CPU
  processes (gloo) torchloom lets Accelerate choose FSDP2, which it otherwise does only on GPUs (one documented
  place: ``torchloom._accelerator.sharding_on_cpu``); FSDP or DeepSpeed that is requested and does not take effect
  stops the run at start-up, never a silent DDP run.
- **Checkpoints:** with ``state_dict_type: SHARDED_STATE_DICT`` (the default) every process writes its own shards
  (``torch.distributed.checkpoint``, through Accelerate's ``save_state``) inside torchloom's checkpoint (manifest,
  checksums, atomic rename); a resume on the same number of processes is bitwise equal to an uninterrupted run.
  On one process, under DDP or on another number of processes, and from a one-process or DDP checkpoint,
  ``torch.distributed.checkpoint`` re-shards the state (`torchloom.checkpoint.layouts`): the same samples, the
  numbers within reduction order; ``torchloom export`` reads the shards whole.
- **Sources:** Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel" (VLDB 2023); torch's
  FSDP2 (``fully_shard``, per-parameter sharding with DTensor); Accelerate's FSDP guide; torchtitan.

Functional use, without the engine: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``
on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torchloom

__all__ = ["FullyShardedDataParallel", "FullyShardedDataParallelConfig"]

_WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
_STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


@dataclass
class FullyShardedDataParallelConfig:
    """Settings of the ``fsdp`` plugin (Accelerate's ``FullyShardedDataParallelPlugin`` names).

    Args:
        version (`int`, defaults to 2): FSDP's version; 2 (``fully_shard``, DTensor) runs on GPUs and CPU processes,
            1 (``FullyShardedDataParallel``) on GPUs only.
        auto_wrap_policy (`str`, defaults to ``"transformer_based_wrap"``): which modules become their own FSDP units:
            ``transformer_based_wrap`` (the classes of ``transformer_layer_cls_to_wrap``), ``size_based_wrap``
            (modules of at least ``min_num_params`` parameters) or ``no_wrap`` (the model as one unit).
        transformer_layer_cls_to_wrap (`list[str]`, *optional*): class names of the blocks to wrap; ``None``: the
            model's ``_no_split_modules`` (a transformers model's decoder layer), as Accelerate reads it.
        min_num_params (`int`, defaults to 100,000,000): the size of a unit under ``size_based_wrap``.
        reshard_after_forward (`bool`, defaults to True): free a unit's gathered parameters after its forward (and
            gather them again for its backward); ``False`` keeps them until the backward (ZeRO-2-like: more memory,
            less communication).
        state_dict_type (`str`, defaults to ``"SHARDED_STATE_DICT"``): how checkpoints hold the model and optimizer:
            each process's shards (``SHARDED_STATE_DICT``) or the whole state gathered on the main process
            (``FULL_STATE_DICT``).
        cpu_ram_efficient_loading (`bool`, defaults to False): only the main process loads the pretrained weights;
            the others get them broadcast when the model is sharded.

    Raises:
        ConfigError: a version other than 1 or 2, an unknown wrap policy or state-dict type, a ``min_num_params``
            below 1, or a class list that is empty or not a list of names.
    """

    version: int = 2
    auto_wrap_policy: str = "transformer_based_wrap"
    transformer_layer_cls_to_wrap: list[str] | None = None
    min_num_params: int = 100_000_000
    reshard_after_forward: bool = True
    state_dict_type: str = "SHARDED_STATE_DICT"
    cpu_ram_efficient_loading: bool = False

    def __post_init__(self) -> None:
        if self.version not in (1, 2):
            raise torchloom.ConfigError(f"setting 'version' = {self.version!r}; expected 1 or 2 (FSDP2: 2)")
        if self.auto_wrap_policy not in _WRAP_POLICIES:
            raise torchloom.ConfigError(
                f"setting 'auto_wrap_policy' = {self.auto_wrap_policy!r}; expected one of {', '.join(_WRAP_POLICIES)}"
            )
        if self.state_dict_type not in _STATE_DICT_TYPES:
            raise torchloom.ConfigError(
                f"setting 'state_dict_type' = {self.state_dict_type!r}; expected one of {', '.join(_STATE_DICT_TYPES)}"
            )
        if self.min_num_params < 1:
            raise torchloom.ConfigError(f"setting 'min_num_params' = {self.min_num_params!r}; expected an integer >= 1")
        names = self.transformer_layer_cls_to_wrap
        if names is not None and (not names or not all(isinstance(n, str) and n for n in names)):
            raise torchloom.ConfigError(
                f"setting 'transformer_layer_cls_to_wrap' = {names!r}; expected a non-empty list of class names, or "
                "null (the model's _no_split_modules)"
            )
        if self.version == 1 and not self.reshard_after_forward:
            raise torchloom.ConfigError(
                "setting 'reshard_after_forward' = False is an FSDP2 setting (version: 2); FSDP1 (version: 1) "
                "chooses it through its sharding strategy (SHARD_GRAD_OP), which this plugin does not set: use "
                "version 2, or an Accelerate config file for FSDP1"
            )


class FullyShardedDataParallel(torchloom.Plugin):
    """Shard the model, its gradients and its optimizer state over the processes (FSDP2, through Accelerate).

    Implements ``configure_accelerator``. See the module docstring and ``docs/plugins/fsdp.md``.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"fsdp": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}})
        # torchrun --nproc_per_node 8 train.py (GPUs), or ACCELERATE_USE_CPU=1 torchrun ... (CPU processes)
    """

    name = "fsdp"
    Config = FullyShardedDataParallelConfig

    @torchloom.hookimpl
    def configure_model(self, model: Any) -> None:
        """Refuse a wrap policy that matches no module of ``model`` (the model would be one FSDP unit: every
        parameter gathered at once, no memory saved over DDP but the optimizer state)."""
        c = self.config
        if c.auto_wrap_policy == "transformer_based_wrap":
            wanted = c.transformer_layer_cls_to_wrap or list(getattr(model, "_no_split_modules", None) or [])
            found = {type(module).__name__ for module in model.modules()}
            if not wanted:
                raise torchloom.ConfigError(
                    f"plugin 'fsdp': auto_wrap_policy 'transformer_based_wrap' needs the block classes to wrap: "
                    f"{type(model).__name__} has no _no_split_modules; set transformer_layer_cls_to_wrap (its modules' "
                    f"classes: {', '.join(sorted(found))}) or auto_wrap_policy 'size_based_wrap'"
                )
            missing = [name for name in wanted if name not in found]
            if missing:
                raise torchloom.ConfigError(
                    f"plugin 'fsdp': transformer_layer_cls_to_wrap names {missing}, which no module of "
                    f"{type(model).__name__} is; its modules' classes: {', '.join(sorted(found))}"
                )
        elif c.auto_wrap_policy == "size_based_wrap":
            sizes = [sum(p.numel() for p in m.parameters()) for name, m in model.named_modules() if name]
            if not any(size >= c.min_num_params for size in sizes):
                raise torchloom.ConfigError(
                    f"plugin 'fsdp': auto_wrap_policy 'size_based_wrap' with min_num_params {c.min_num_params:,} "
                    f"wraps no module of {type(model).__name__} (its largest submodule has {max(sizes, default=0):,} "
                    "parameters); lower min_num_params, or use 'no_wrap' for one unit"
                )

    @torchloom.hookimpl
    def configure_accelerator(self) -> dict[str, Any]:
        from accelerate.utils import FullyShardedDataParallelPlugin

        c = self.config
        return {
            "fsdp_plugin": FullyShardedDataParallelPlugin(
                fsdp_version=c.version,
                auto_wrap_policy=c.auto_wrap_policy,
                transformer_cls_names_to_wrap=c.transformer_layer_cls_to_wrap,
                min_num_params=c.min_num_params if c.auto_wrap_policy == "size_based_wrap" else None,
                reshard_after_forward=c.reshard_after_forward if c.version == 2 else None,
                state_dict_type=c.state_dict_type,
                cpu_ram_efficient_loading=c.cpu_ram_efficient_loading,
            )
        }
