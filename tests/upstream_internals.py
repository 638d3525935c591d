"""Every private or undocumented part of a library that torchloom relies on, in one list (`INTERNALS`): test data,
not part of the package.

A library keeps its documented API across minor versions and changes the rest at will. What torchloom uses of
the rest (an underscore name, an attribute a class sets in ``__init__`` without documenting it, a file name that
Accelerate's ``save_state`` writes) is listed here, each entry with what torchloom uses it for and where, so that
an upgrade that removes one fails in one place: ``tests/test_internals.py`` resolves every entry on the installed
versions (`resolve`; a missing one fails with the entry's explanation), and scans ``src/`` and ``plugins/`` for
private accesses of these libraries that the list does not name, so that the list cannot fall behind the code.

Each internal is reached in the module that uses it; where several places of that module need it, through one small
accessor function there (``accessor``: `torchloom._accelerator.reset_accelerate_state`, the ``metric_*`` functions
of `torchloom._metric_sync`, the ``loader_*`` functions of `torchloom._padding`), so that a change upstream is one
edit. The built-in plugins import only torchloom's public API, so their entries name their modules and the uses
stay there.

Libraries: accelerate, torch, torchmetrics, transformers, pluggy, jsonargparse. Of datasets, safetensors and
huggingface_hub torchloom uses only documented names (safetensors' header is its documented file format).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any, Literal

__all__ = ["INTERNALS", "LIBRARIES", "Internal"]

#: The libraries whose internals the list covers (and `tests/test_internals.py` scans for).
LIBRARIES = (
    "accelerate",
    "torch",
    "torchmetrics",
    "transformers",
    "datasets",
    "safetensors",
    "huggingface_hub",
    "pluggy",
    "jsonargparse",
)

_UNSET: Any = object()


@dataclasses.dataclass(frozen=True)
class Internal:
    """One private or undocumented thing of a library that torchloom relies on.

    Attributes:
        path (`str`): its dotted path, ``module[.Class].name``.
        why (`str`): what torchloom uses it for (the test's message when it is gone).
        where (`tuple[str, ...]`): the torchloom modules that use it (a package counts for its modules).
        kind (`str`): how the test finds it: ``"attribute"`` (import and ``getattr`` along the path), ``"instance"``
            (an attribute of an instance that ``make`` builds), ``"source"`` (the source of the object at ``path``
            contains each of ``contains``: for what only a live process group or a running model would show) or
            ``"value"`` (the object at ``path`` equals ``value``).
        names (`tuple[str, ...]`): the identifiers that mark a use in the ``where`` modules; by default the private
            parts of ``path``, or its last part.
        accessor (`str`, *optional*): the function of the ``where`` module that wraps it for that module's uses.
    """

    path: str
    why: str
    where: tuple[str, ...]
    kind: Literal["attribute", "instance", "source", "value"] = "attribute"
    make: Callable[[], Any] | None = None
    contains: tuple[str, ...] = ()
    value: Any = _UNSET
    names: tuple[str, ...] = ()
    accessor: str | None = None

    @property
    def library(self) -> str:
        return self.path.split(".", 1)[0]

    @property
    def marks(self) -> tuple[str, ...]:
        """The identifiers that mark a use (`names`, else the private parts of `path`, else its last part)."""
        if self.names:
            return self.names
        private = tuple(part for part in self.path.split(".") if part.startswith("_") and not part.startswith("__"))
        return private or (self.path.rsplit(".", 1)[1],)


def _data_loader_shard() -> Any:
    from accelerate.data_loader import DataLoaderShard

    return DataLoaderShard(list(range(4)), batch_size=2, shuffle=True)


def _seedable_sampler() -> Any:
    from accelerate.data_loader import SeedableRandomSampler

    return SeedableRandomSampler(range(4), data_seed=0)


def _mean_metric() -> Any:
    import torchmetrics

    return torchmetrics.MeanMetric()


def _multiclass_metric() -> Any:
    from torchmetrics.classification import MulticlassAccuracy

    return MulticlassAccuracy(num_classes=3, top_k=1)


def _multilabel_metric() -> Any:
    from torchmetrics.classification import MultilabelAccuracy

    return MultilabelAccuracy(num_labels=2)


_ACC = "torchloom._accelerator"
_MEMORY = "torchloom.tools.memory_plan"

INTERNALS: tuple[Internal, ...] = (
    # ------------------------------------------------------------------------------------------------ accelerate
    Internal(
        "accelerate.state.AcceleratorState._reset_state",
        "to clear the per-process singleton of the previous Accelerator (mixed precision, accumulation) so that "
        "several engines run one after another in one process",
        (_ACC,),
        accessor="reset_accelerate_state",
    ),
    Internal(
        "accelerate.state.GradientState._reset_state",
        "with AcceleratorState._reset_state: the previous run's accumulation steps and registered loaders",
        (_ACC,),
        accessor="reset_accelerate_state",
    ),
    Internal(
        "accelerate.state.PartialState._shared_state",
        "sharding_on_cpu: the process group's distributed type reads as MULTI_GPU while the Accelerator is built, so "
        "that Accelerate chooses FSDP2 for CPU processes (its choice lists GPU-like types only)",
        (_ACC,),
        accessor="sharding_on_cpu",
    ),
    Internal(
        "accelerate.state.AcceleratorState.__init__",
        "sharding_on_cpu: Accelerate chooses FSDP inside the branch for GPU-like distributed types, which lists "
        "MULTI_GPU; if FSDP moves out of that branch (or MULTI_CPU joins it), the gate lifted there is not needed. "
        "It chooses DeepSpeed only when cpu is false (ACCELERATE_USE_CPU sets it), so DeepSpeed's Accelerator on CPU "
        "processes is built with cpu=False and ACCELERATE_USE_CPU hidden, over the CPU process group already made",
        (_ACC,),
        kind="source",
        contains=(
            "DistributedType.MULTI_GPU,",
            "self.distributed_type = DistributedType.FSDP",
            'os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and not cpu',
            'parse_flag_from_env("ACCELERATE_USE_CPU")',
        ),
        names=("sharding_on_cpu",),
    ),
    Internal(
        "accelerate.accelerator.Accelerator._prepare_deepspeed",
        "settle_deepspeed_clipping: Accelerate fills DeepSpeed's gradient_clipping 'auto' with 1.0 (clipping that no "
        "plugin asked for): a plugin that clips sets it in configure_model, and torchloom makes what is left 'auto' 0 "
        "before accelerator.prepare",
        (_ACC,),
        kind="source",
        contains=('"gradient_clipping": 1.0',),
        names=("settle_deepspeed_clipping",),
    ),
    Internal(
        "accelerate.state.PartialState",
        "fork_launched: at exit, leave the process group to Accelerate's notebook launcher when it owns it",
        (_ACC,),
        kind="source",
        contains=("fork_launched",),
        names=("fork_launched",),
    ),
    Internal(
        "accelerate.data_loader.DataLoaderShard.end",
        "to unregister from GradientState a loader whose iteration stopped early (max_steps, the sanity pass), "
        "which would otherwise decide sync_gradients for the next loader",
        ("torchloom._guards",),
    ),
    Internal(
        "accelerate.data_loader.DataLoaderShard.end_of_dataloader",
        "whether the batch just yielded is the last one, the one Accelerate pads on several processes",
        ("torchloom._padding",),
        accessor="loader_at_end",
    ),
    Internal(
        "accelerate.data_loader.DataLoaderShard.remainder",
        "how many samples of the last global batch are real (the rest are copies that validation outputs cut)",
        ("torchloom._padding",),
        accessor="loader_remainder",
    ),
    Internal(
        "accelerate.data_loader.DataLoaderShard.synchronized_generator",
        "the shuffling sampler's generator, whose state a checkpoint keeps as the epoch started",
        ("torchloom.checkpoint.data_position",),
        kind="instance",
        make=_data_loader_shard,
    ),
    Internal(
        "accelerate.data_loader.get_sampler",
        "the sampler of a prepared loader, whose initial_seed the data position records",
        ("torchloom.checkpoint.data_position",),
    ),
    Internal(
        "accelerate.data_loader.SeedableRandomSampler.initial_seed",
        "the seed of the data order, recorded in a checkpoint's data position and checked on resume",
        ("torchloom.checkpoint.data_position",),
        kind="instance",
        make=_seedable_sampler,
    ),
    Internal(
        "accelerate.utils.constants.RNG_STATE_NAME",
        "save_state writes random_states_<rank>.pkl, which a checkpoint removes and a load refuses (a pickle)",
        ("torchloom.checkpoint.entries",),
        kind="value",
        value="random_states",
        names=("random_states_",),
    ),
    Internal(
        "accelerate.utils.constants.SAFE_WEIGHTS_NAME",
        "the model file save_state writes: a checkpoint's required accelerate/model.safetensors, the weights "
        "predict(ckpt_path=<checkpoint>) loads",
        ("torchloom.checkpoint.entries", "torchloom.rundir.export"),
        kind="value",
        value="model.safetensors",
        names=("model.safetensors",),
    ),
    Internal(
        "accelerate.utils.constants.OPTIMIZER_NAME",
        "the optimizer file save_state writes (optimizer.bin), required in a checkpoint",
        ("torchloom.checkpoint.entries",),
        kind="value",
        value="optimizer",
        names=("optimizer.bin",),
    ),
    Internal(
        "accelerate.utils.constants.SCALER_NAME",
        "the fp16 loss scaler's file save_state writes, required in a checkpoint of an fp16 run",
        ("torchloom.checkpoint.entries",),
        kind="value",
        value="scaler.pt",
        names=("scaler.pt",),
    ),
    Internal(
        "accelerate.Accelerator.__init__",
        "the attributes Accelerator sets without documenting them: scaler (whether fp16 loss scaling is on; the "
        "CPU GradScaler mixed_precision installs), native_amp and scaler_handler (that install), "
        "project_configuration (pointed at the run directory once it exists); and the lists save_state reads, "
        "which the asynchronous save copies from the same places: _models, _optimizers, _schedulers, "
        "_custom_objects (what prepare and register_for_checkpointing registered) and _save_model_state_pre_hook "
        "(register_save_state_pre_hook's hooks)",
        (
            "torchloom.checkpoint.entries",
            "torchloom._lifetime",
            "torchloom_plugins.mixed_precision",
            "torchloom.checkpoint.async_save",
        ),
        kind="source",
        contains=(
            "self.scaler =",
            "self.native_amp =",
            "self.scaler_handler =",
            "self.project_configuration =",
            "self._models = []",
            "self._optimizers = []",
            "self._schedulers = []",
            "self._custom_objects = []",
            "self._save_model_state_pre_hook = OrderedDict()",
        ),
        names=(
            "scaler",
            "project_configuration",
            "_models",
            "_optimizers",
            "_schedulers",
            "_custom_objects",
            "_save_model_state_pre_hook",
        ),
    ),
    Internal(
        "accelerate.optimizer.AcceleratedOptimizer.step",
        "StepHooks.optimizer_step calls the inner optimizer directly when the wrapper's step would do nothing more "
        "(no scaler, not XLA, not LOMO), reading AcceleratedOptimizer.scaler and .optimizer",
        ("torchloom.step",),
        kind="source",
        contains=("self.scaler", "is_lomo_available", "XLA", "self.optimizer"),
        names=("AcceleratedOptimizer",),
    ),
    Internal(
        "accelerate.utils.is_lomo_available",
        "whether the inner optimizer may be LOMO's, whose step the wrapper skips (the optimizer step's fast path)",
        ("torchloom.step",),
    ),
    Internal(
        "accelerate.utils.str_to_bool",
        "to read ACCELERATE_USE_CPU as Accelerate reads it (a CPU-only launch of several processes)",
        (_ACC,),
    ),
    Internal(
        "accelerate.utils.calculate_maximum_sizes",
        "the parameter and buffer bytes of a model, in estimate-memory",
        (_MEMORY,),
    ),
    Internal(
        "accelerate.utils.convert_file_size_to_int",
        "to read a size such as 10GB or 512MiB as Accelerate does (estimate-memory's limits)",
        ("torchloom._bytes",),
    ),
    # ----------------------------------------------------------------------------------------------------- torch
    Internal(
        "torch._subclasses.fake_tensor.FakeTensorMode",
        "estimate-memory and estimate_flops run a training step on fake tensors (shapes and storage sizes, no data)",
        (_MEMORY, "torchloom.tools.flops"),
    ),
    Internal(
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        "estimate_flops gives FlopCounterMode a formula for the CPU's fused attention (torch 2.13 has none: it "
        "would count 0) and for its backward",
        ("torchloom.tools.flops",),
        names=("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"),
    ),
    Internal(
        "torch.ops.aten._scaled_dot_product_flash_attention_backward",
        "estimate_flops counts the fused attention kernels' backward as model FLOPs (twice the forward), not with "
        "torch's formula, which adds the recomputation of the scores",
        ("torchloom.tools.flops",),
        names=(
            "_scaled_dot_product_flash_attention_backward",
            "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_cudnn_attention_backward",
        ),
    ),
    Internal(
        "torch.utils._foreach_utils._get_fused_kernels_supported_devices",
        "the optimizer plugin's adamw takes torch's fused kernel on the device types torch lists (what fused=True is "
        "checked against)",
        ("torchloom_plugins.optimizer",),
    ),
    Internal(
        "torch.optim.AdamW._step_supports_amp_scaling",
        "a fused optimizer skips an fp16 overflow step inside step(), which Accelerate cannot see (it watches whether "
        "step() was called): the engine refuses fp16 loss scaling with such an optimizer",
        ("torchloom._setup",),
        kind="instance",
        make=lambda: __import__("torch").optim.AdamW([__import__("torch").zeros(1, requires_grad=True)], fused=True),
        names=("_step_supports_amp_scaling",),
    ),
    Internal(
        "torch.utils._python_dispatch.TorchDispatchMode",
        "estimate-memory counts every storage an operation creates and frees during the fake step",
        ("torchloom.tools.memory_trace",),
    ),
    Internal(
        "torch.utils._pytree.tree_flatten",
        "the tensors among an operation's outputs, in estimate-memory's dispatch mode",
        ("torchloom.tools.memory_trace",),
    ),
    Internal(
        "torch.UntypedStorage._cdata",
        "the identity of a storage, so that estimate-memory counts a storage shared by several tensors once",
        ("torchloom.tools.memory_trace", "torchloom.tools.memory_source"),
    ),
    Internal(
        "torch.distributed.nn.functional",
        "its functions hold the default process group as a default argument (group=group.WORLD), which the exit "
        "handler replaces by None so that the group can be released before interpreter finalization",
        (_ACC,),
        kind="source",
        contains=("group=group.WORLD",),
        names=("torch.distributed.nn.functional",),
    ),
    Internal(
        "torch.nn.parallel.DistributedDataParallel",
        "the exit handler drops a DDP model's logger, reducer and process_group attributes, which hold the process "
        "group past destroy_process_group()",
        (_ACC,),
        kind="source",
        contains=("self.logger", "self.reducer", "self.process_group"),
        names=("reducer",),
    ),
    Internal(
        "torch._dynamo.eval_frame.OptimizedModule",
        "a compiled model's state_dict keys start with _orig_mod., which loading a checkpoint's weights strips",
        ("torchloom.rundir.export", "torchloom.rundir.adapter_format"),
        kind="source",
        contains=("_orig_mod",),
        names=("_orig_mod",),
    ),
    Internal(
        "torch._foreach_mul_",
        "grad_accum scales every gradient of the window by one factor in one call",
        ("torchloom_plugins.grad_accum",),
    ),
    Internal(
        "torch._foreach_copy_",
        "ema writes the average into the parameters and the trained values back in one call (each process's shards "
        "under FSDP2)",
        ("torchloom_plugins.ema",),
    ),
    Internal(
        "torch._dynamo.utils.counters",
        "compile reports graphs compiled and graph breaks (counters['stats']['unique_graphs'], "
        "counters['graph_break']) with no device sync",
        ("torchloom_plugins.compile",),
    ),
    Internal(
        "torch._dynamo.utils.get_compilation_metrics",
        "compile's warning names the reason of the latest recompilation (CompilationMetrics.recompile_reason; the "
        "plugin falls back to no reason when it is gone)",
        ("torchloom_plugins.compile",),
    ),
    Internal(
        "torch._dynamo.list_backends",
        "the valid values of compile's backend setting",
        ("torchloom_plugins.compile",),
    ),
    Internal(
        "torch._dynamo.config.recompile_limit",
        "named in compile's warning: past it the model silently runs eagerly",
        ("torchloom_plugins.compile",),
    ),
    Internal(
        "torch.nn.Module._call_impl",
        "compile_in_place compiles a model's call through a frame of its own, as Module.compile compiles _call_impl",
        ("torchloom_plugins.compile",),
    ),
    Internal(
        "torch.nn.Module._compiled_call_impl",
        "compile_in_place installs the compiled call where Module.compile puts it",
        ("torchloom_plugins.compile",),
    ),
    # ----------------------------------------------------------------------------------------------- torchmetrics
    Internal(
        "torchmetrics.Metric._defaults",
        "which states of a metric exist, to find list states (synchronised with gather_states)",
        ("torchloom._metric_sync",),
        kind="instance",
        make=_mean_metric,
        accessor="metric_state_defaults",
    ),
    Internal(
        "torchmetrics.Metric._reductions",
        "each state's dist_reduce_fx: list states gathered element by element (None) are padded to one length",
        ("torchloom._metric_sync",),
        kind="instance",
        make=_mean_metric,
        accessor="metric_reductions",
    ),
    Internal(
        "torchmetrics.Metric._to_sync",
        "whether a metric synchronises on compute (sync_on_compute), before padding its list states",
        ("torchloom._metric_sync",),
        kind="instance",
        make=_mean_metric,
        accessor="metric_syncs_on_compute",
    ),
    Internal(
        "torchmetrics.Metric._is_synced",
        "after a compute that raised, whether the metric was left synchronised (then unsync() restores it)",
        ("torchloom._metric_sync",),
        kind="instance",
        make=_mean_metric,
        accessor="metric_is_synced",
    ),
    Internal(
        "torchmetrics.Metric.unsync",
        "called after a compute that raised, a state torchmetrics does not restore itself",
        ("torchloom._logbuffer",),
    ),
    Internal(
        "torchmetrics.Metric.dist_sync_fn",
        "set on a metric with list states for the duration of its compute (gather_states), then reset",
        ("torchloom._logbuffer", "torchloom._metric_sync"),
        kind="instance",
        make=_mean_metric,
    ),
    Internal(
        "torchmetrics.utilities.distributed.gather_all_tensors",
        "the gather that gather_states replaces and mirrors (every process's shape, then the padded data)",
        ("torchloom._metric_sync",),
    ),
    Internal(
        "torchmetrics.classification.MulticlassAccuracy.top_k",
        "eval_metrics reads a classification metric's stored arguments (num_classes, num_labels, ignore_index, "
        "multidim_average, top_k) to check its inputs",
        ("torchloom_plugins._metric_inputs",),
        kind="instance",
        make=_multiclass_metric,
        names=("multidim_average",),
    ),
    Internal(
        "torchmetrics.classification.MulticlassAccuracy.num_classes",
        "with top_k: the classes a multiclass metric's inputs are checked against",
        ("torchloom_plugins._metric_inputs",),
        kind="instance",
        make=_multiclass_metric,
    ),
    Internal(
        "torchmetrics.classification.MultilabelAccuracy.num_labels",
        "with top_k: the labels a multilabel metric's inputs are checked against",
        ("torchloom_plugins._metric_inputs",),
        kind="instance",
        make=_multilabel_metric,
    ),
    Internal(
        "torchmetrics.classification.MulticlassAccuracy.validate_args",
        "eval_metrics turns a metric's own per-batch checks off (they sync the host) once it checks the inputs",
        ("torchloom_plugins.eval_metrics",),
        kind="instance",
        make=_multiclass_metric,
    ),
    # ----------------------------------------------------------------------------------------------- transformers
    Internal(
        "transformers.modeling_utils.PreTrainedModel._set_gradient_checkpointing",
        "grad_checkpoint reads the use_reentrant bound into a layer's _gradient_checkpointing_func (a partial)",
        ("torchloom_plugins.grad_checkpoint",),
        kind="source",
        contains=("_gradient_checkpointing_func",),
        names=("_gradient_checkpointing_func",),
    ),
    Internal(
        "transformers.modeling_layers.GradientCheckpointingLayer.gradient_checkpointing",
        "whether a transformers layer is checkpointed (grad_checkpoint's checkpoint_use_reentrant)",
        ("torchloom_plugins.grad_checkpoint",),
    ),
    Internal(
        "transformers.modeling_utils.PreTrainedModel._no_split_modules",
        "fsdp's default blocks to wrap (Accelerate reads the same attribute for transformer_based_wrap), checked "
        "against the model's modules at start-up; estimate_memory's default FSDP2 units",
        ("torchloom_plugins.fsdp", "torchloom.tools.memory_shard"),
    ),
    Internal(
        "torch.nn.Module._parameters",
        "estimate_memory under FSDP2 puts parameters of the shards' shapes in place for the optimizer estimators "
        "(as_shards) and takes them out again",
        ("torchloom.tools.memory_shard",),
        kind="instance",
        make=lambda: __import__("torch").nn.Linear(1, 1),
    ),
    *(
        Internal(
            f"torch.nn.Module.{table}",
            "a copy of an FSDP2 model for tracing (FLOPs, memory) leaves out FSDP2's hooks, kept in this table",
            ("torchloom.parallel.copies",),
            kind="instance",
            make=lambda: __import__("torch").nn.Linear(1, 1),
        )
        for table in (
            "_forward_pre_hooks",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_hooks_always_called",
            "_backward_pre_hooks",
            "_backward_hooks",
            "_state_dict_hooks",
            "_state_dict_pre_hooks",
            "_load_state_dict_pre_hooks",
            "_load_state_dict_post_hooks",
        )
    ),
    Internal(
        "torch.distributed.fsdp.FSDPModule._orig_cls_mro_index",
        "where the class fully_shard replaced sits in FSDP<Class>'s method resolution order: a copy of an FSDP2 model "
        "for tracing is made of the original classes",
        ("torchloom.parallel.copies",),
    ),
    Internal(
        "torch.distributed._composable.contract.generate_state_key",
        "the prefix of the module attribute where torch.distributed's composable APIs keep their state (FSDPState): a "
        "copy of an FSDP2 model for tracing leaves it out",
        ("torchloom.parallel.copies",),
        kind="source",
        contains=("__composable_api_state_key",),
        names=("__composable_api_state_key",),
    ),
    Internal(
        "transformers.generation.utils.GenerationMixin._validate_model_kwargs",
        "generate checks its model keyword arguments at start-up with the check generate() itself runs, so that a "
        "misspelt one fails before training instead of at the first sample",
        ("torchloom_plugins.generate",),
    ),
    Internal(
        "transformers.configuration_utils.PreTrainedConfig._attn_implementation",
        "the attention implementation a model runs with, named in check_packed_attention's error (packed data)",
        ("torchloom.data.packing",),
    ),
    Internal(
        "transformers.trainer_pt_utils.AcceleratorConfig",
        "the defaults of TrainingArguments.accelerator_config, for convert-hf-args",
        ("torchloom.tools.hf_args.convert",),
    ),
    # ----------------------------------------------------------------------------------------------------- pluggy
    Internal(
        "pluggy.HookspecMarker.__call__",
        "a hook specification is marked with the attribute '<project>_spec' (torchloom_spec), by which "
        "hookspecs.HOOK_NAMES finds the hooks in definition order",
        ("torchloom.hookspecs",),
        kind="source",
        contains=('project_name + "_spec"',),
        names=("_spec",),
    ),
    Internal(
        "pluggy._callers._multicall",
        "the hook relay calls the plain implementations of a hook itself (HookImpl.function with its argnames, "
        "firstresult from HookCaller.spec.opts), as _multicall does, without its per-call set-up",
        ("torchloom.plugins",),
    ),
    # ----------------------------------------------------------------------------------------------- jsonargparse
    Internal(
        "jsonargparse._loaders_dumpers.get_yaml_default_loader",
        "the CLI reads config values (and the plugin options it parses itself) with jsonargparse's YAML rules "
        "(1e-3 is a float, a date stays a string), copied into cli._ConfigLoader",
        ("torchloom.cli",),
        names=("jsonargparse",),
    ),
)


# ------------------------------------------------------------------------------------------------- resolving


def resolve(entry: Internal) -> Any:
    """The object at ``entry.path`` on the installed versions.

    Raises:
        LookupError: it is not there (or not as the entry says); the message says what is missing.
    """
    parts = entry.path.split(".")
    if entry.kind == "instance":
        owner, name = ".".join(parts[:-1]), parts[-1]
        _lookup(owner)
        if entry.make is None:
            raise LookupError(f"{entry.path}: an 'instance' entry needs make")
        instance = entry.make()
        if not hasattr(instance, name):
            raise LookupError(f"a {type(instance).__name__} has no attribute {name!r}")
        return getattr(instance, name)
    found = _lookup(entry.path)
    if entry.kind == "source":
        try:
            source = inspect.getsource(found)
        except (OSError, TypeError) as exc:
            raise LookupError(f"the source of {entry.path} cannot be read: {exc}") from None
        missing = [text for text in entry.contains if text not in source]
        if missing:
            raise LookupError(f"the source of {entry.path} no longer contains {', '.join(map(repr, missing))}")
    elif entry.kind == "value" and found != entry.value:
        raise LookupError(f"{entry.path} is {found!r}, no longer {entry.value!r}")
    return found


def _lookup(path: str) -> Any:
    parts = path.split(".")
    module, index = None, len(parts)
    while index > 0:
        try:
            module = importlib.import_module(".".join(parts[:index]))
            break
        except ImportError:
            index -= 1
    if module is None:
        raise LookupError(f"module {parts[0]!r} cannot be imported")
    found: Any = module
    for i, part in enumerate(parts[index:], start=index):
        if not hasattr(found, part):
            raise LookupError(f"{'.'.join(parts[:i])} has no attribute {part!r}")
        found = getattr(found, part)
    return found
