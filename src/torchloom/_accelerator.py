"""The Accelerator of a run and the lifetime of the process group.

Everything here touches Accelerate's per-process state: merging the plugins' ``Accelerator`` settings,
resetting the singletons that one run leaves behind for the next, joining several CPU processes into one gloo
group, and releasing the process group when the process ends.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DataLoaderConfiguration, DistributedType, str_to_bool

from torchloom.config import EngineConfig
from torchloom.errors import ConfigError, PluginError
from torchloom.plugins import HookRelay

__all__ = [
    "LIST_KWARGS",
    "build_accelerator",
    "note_run_failed",
    "restore_launch_environment",
    "settle_deepspeed_clipping",
]


#: Accelerator arguments that are lists: fragments from several plugins are concatenated, not compared.
LIST_KWARGS = ("kwargs_handlers", "log_with")


def build_accelerator(relay: HookRelay, config: EngineConfig) -> Accelerator:
    """Merge the plugins' Accelerator settings and build the Accelerator.

    Two plugins giving one key different values is a `PluginError` naming both; list-valued keys
    (`LIST_KWARGS`) are concatenated in plugin order.
    """
    kwargs: dict[str, Any] = {}
    owners: dict[str, str] = {}
    for name, fragment in relay.call_each("configure_accelerator", config=config):
        if fragment is None:
            continue
        if not isinstance(fragment, Mapping):
            raise PluginError(f"plugin {name!r}: configure_accelerator returned {fragment!r}; expected a dict or None")
        for key, value in fragment.items():
            if key in LIST_KWARGS:  # handlers and trackers from several plugins add up
                kwargs[key] = [*kwargs.get(key, []), *value]
                owners[key] = f"{owners[key]}, {name}" if key in owners else name
                continue
            if key in kwargs and kwargs[key] != value:
                raise PluginError(
                    f"plugins {owners[key]!r} and {name!r} both set Accelerator({key}=...): "
                    f"{kwargs[key]!r} vs {value!r}; configure it in one plugin"
                )
            kwargs[key], owners[key] = value, name
    if config.seed is not None:
        # The shuffle of every epoch is drawn from seed + epoch (Accelerate's SeedableRandomSampler, as in the HF
        # Trainer), not from a generator that Accelerate would otherwise attach to the user's sampler and that
        # keeps advancing: the same seed gives the same data order, also with the same DataLoader passed again.
        kwargs.setdefault(
            "dataloader_config", DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed)
        )
    # Trackers that write files (TensorBoard, Aim) need a logging directory when the Accelerator is built; the engine
    # points project_dir and logging_dir at the run directory as soon as that exists, before any tracker starts.
    kwargs.setdefault("project_dir", config.output_dir)
    if _cpu_only_multiprocess_launch():
        # Without cpu=True, Accelerate on a machine without GPUs would run every torchrun process as an
        # independent single-process job. With it, the processes form one gloo data-parallel group.
        kwargs.setdefault("cpu", True)
    sharding = requested_sharding(kwargs, owners)
    if sharding is not None and sharding.kind == "DeepSpeed" and importlib.util.find_spec("deepspeed") is None:
        raise deepspeed_missing(sharding)
    if sharding is not None and sharding.kind == "DeepSpeed":
        deepspeed_settings(kwargs, sharding)
    # AcceleratorState is a per-process singleton: clear the previous run's settings (mixed precision,
    # accumulation) so that several engines can run one after another in one process. The process group
    # (PartialState) is kept.
    reset_accelerate_state()
    _LAUNCH_ENVIRONMENT.update({key: os.environ.get(key) for key in _SHARDING_FLAGS if key not in _LAUNCH_ENVIRONMENT})
    try:
        try:
            with sharding_on_cpu(kwargs, sharding):
                accelerator = Accelerator(**kwargs)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            who = ", ".join(f"{k} from {owners[k]!r}" for k in kwargs if k in owners)
            raise ConfigError(f"cannot build the Accelerator ({who or 'defaults'}): {exc}") from None
        check_sharding(accelerator, sharding)
    except BaseException:
        restore_launch_environment()  # what the Accelerator set for the run it will not run
        raise
    if accelerator.num_processes > 1:
        _release_process_group_at_exit()
    return accelerator


# ----------------------------------------------------------------------------------- FSDP and DeepSpeed

#: The environment flags that an ``Accelerator`` given an FSDP or DeepSpeed plugin sets for the rest of the process
#: (``os.environ["ACCELERATE_USE_FSDP"] = "true"``) and reads while it runs (its ``clip_grad_norm_``).
_SHARDING_FLAGS = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")
#: Their values before the run's Accelerator was built (``None``: unset), until `restore_launch_environment`.
_LAUNCH_ENVIRONMENT: dict[str, str | None] = {}


def restore_launch_environment() -> None:
    """Put back the sharding flags as they were before the run's Accelerator set them (the end of every run): a
    later run, or the user's own Accelerator in the same process, is not made FSDP by an earlier run's plugin."""
    for key, value in _LAUNCH_ENVIRONMENT.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _LAUNCH_ENVIRONMENT.clear()


@dataclasses.dataclass(frozen=True)
class Sharding:
    """What a run asked Accelerate for: ``kind`` (``"FSDP"`` or ``"DeepSpeed"``), FSDP's ``version`` (1 or 2;
    ``None`` for DeepSpeed) and ``source`` (where it was asked: a plugin's ``configure_accelerator``, or the
    environment that ``accelerate launch`` sets from its config file)."""

    kind: str
    version: int | None
    source: str

    @property
    def name(self) -> str:
        return f"FSDP{self.version}" if self.kind == "FSDP" else self.kind


def requested_sharding(kwargs: dict[str, Any], owners: Mapping[str, str]) -> Sharding | None:
    """The FSDP or DeepSpeed the run asks for, or ``None`` (plain data parallelism). FSDP from the launcher's
    environment (``ACCELERATE_USE_FSDP``) is built into ``kwargs["fsdp_plugin"]`` here, as the ``Accelerator``
    would build it (``FullyShardedDataParallelPlugin()`` reads the ``FSDP_*`` variables), so its version is known
    before the Accelerator exists."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    fsdp = kwargs.get("fsdp_plugin")
    if fsdp is None and _env_flag("ACCELERATE_USE_FSDP"):
        kwargs["fsdp_plugin"] = fsdp = FullyShardedDataParallelPlugin()
        owners = {**owners, "fsdp_plugin": "ACCELERATE_USE_FSDP (accelerate launch)"}
    if isinstance(fsdp, FullyShardedDataParallelPlugin):
        source = owners.get("fsdp_plugin", "the Accelerator settings")
        return Sharding("FSDP", int(fsdp.fsdp_version), source)
    for key in ("deepspeed_plugin", "deepspeed_plugins"):
        if kwargs.get(key) is not None:
            return Sharding("DeepSpeed", None, owners.get(key, "the Accelerator settings"))
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return Sharding("DeepSpeed", None, "ACCELERATE_USE_DEEPSPEED (accelerate launch)")
    return None


#: Non-empty while the process group's distributed type is one `sharding_on_cpu` lifted (a CPU group's, MULTI_CPU).
_LIFTED: set[str] = set()


#: The ZeRO stages that `sharding_on_cpu` lets DeepSpeed run on CPU processes (see its docstring for 3 and offload).
DEEPSPEED_CPU_STAGES = (1, 2)


@contextlib.contextmanager
def sharding_on_cpu(kwargs: dict[str, Any], sharding: Sharding | None) -> Iterator[None]:
    """Let Accelerate choose FSDP2 or DeepSpeed (ZeRO-1, ZeRO-2) for a group of CPU processes (gloo) while the
    ``Accelerator`` is built.

    Accelerate (1.15) chooses FSDP only for GPU-like distributed types: ``AcceleratorState.__init__`` lists
    ``MULTI_GPU``, ``MULTI_XPU``, ... and not ``MULTI_CPU``, so FSDP requested on CPU processes silently runs DDP.
    torch runs FSDP2 (``fully_shard``, DTensor) on CPU with gloo, and so does Accelerate's own FSDP2 preparation
    once it has chosen FSDP. DeepSpeed it skips under ``cpu=True`` (``ACCELERATE_USE_DEEPSPEED ... and not cpu``,
    and ``ACCELERATE_USE_CPU`` sets ``cpu``), while DeepSpeed itself runs ZeRO-1 and ZeRO-2 on its CPU accelerator
    over the same gloo group, built without its compiled ops (``DS_BUILD_OPS=0``). This is the one place that lifts
    those gates: for FSDP2 the process group's distributed type (``PartialState``) reads as ``MULTI_GPU`` while
    the Accelerator is built, which then records ``FSDP``; for DeepSpeed the ``AcceleratorState`` is built with
    ``cpu=False`` (and ``ACCELERATE_USE_CPU`` hidden meanwhile) over the process group that is already a CPU one,
    which then records ``DEEPSPEED``. The device stays the CPU. The proposal upstream is in docs/distributed.md.

    Raises:
        ConfigError: FSDP1 on CPU processes (it wants an accelerator device); DeepSpeed on one CPU process, or on CPU
            processes with ZeRO-3 (a ZeRO-3 fit does run there, but torchloom has not tested it against DDP, nor its
            checkpoints, resume or export; ZeRO-3 checkpoints hold partitioned parameters) or with an offload of the
            optimizer or parameters (the processes' state is in CPU memory already, and DeepSpeed's CPU Adam is a
            compiled op that a ``DS_BUILD_OPS=0`` install does not have).
    """
    if sharding is None:
        yield
        return
    state = PartialState(cpu=bool(kwargs.get("cpu", False)))
    if sharding.kind == "DeepSpeed" and state.num_processes == 1 and state.device.type == "cpu":
        # Accelerate chooses DeepSpeed for one process without cpu=True, and deepspeed.initialize then looks for MPI
        raise ConfigError(
            f"DeepSpeed was requested ({sharding.source}) on 1 CPU process: it needs several processes: launch with "
            "torchrun --nproc_per_node N or accelerate launch --num_processes N (with ACCELERATE_USE_CPU=1)"
        )
    if state.distributed_type != DistributedType.MULTI_CPU:
        yield
        return
    where = f"{sharding.name} was requested ({sharding.source}) on {state.num_processes} CPU processes"
    if sharding.kind == "DeepSpeed":
        _check_deepspeed_on_cpu(kwargs, where)
        hidden = os.environ.pop("ACCELERATE_USE_CPU", None)
        kwargs["cpu"] = False  # the process group stays the CPU one built above: only DeepSpeed's gate reads it
        _LIFTED.add("distributed_type")  # AcceleratorState writes DEEPSPEED back into it: undone by reset_...
        try:
            yield
        finally:
            if hidden is not None:
                os.environ["ACCELERATE_USE_CPU"] = hidden
        return
    if sharding.version != 2:
        raise ConfigError(
            f"{where}: torch's FullyShardedDataParallel (FSDP1) needs an accelerator device; use FSDP2 "
            "(fsdp_version: 2). Without it, the run would silently be plain data parallelism (DDP)"
        )
    shared = PartialState._shared_state
    shared["distributed_type"] = DistributedType.MULTI_GPU
    _LIFTED.add("distributed_type")  # AcceleratorState writes FSDP back into it: undone by reset_accelerate_state
    try:
        yield
    finally:
        if shared.get("distributed_type") == DistributedType.MULTI_GPU:  # the Accelerator was not built
            shared["distributed_type"] = DistributedType.MULTI_CPU


def _check_deepspeed_on_cpu(kwargs: Mapping[str, Any], where: str) -> None:
    """Refuse the DeepSpeed settings that torchloom does not run on CPU processes (`sharding_on_cpu`)."""
    plugin = deepspeed_plugins(kwargs)[0]  # the active one (deepspeed_settings put it there)
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    stage = int(zero.get("stage", plugin.zero_stage if plugin.zero_stage is not None else 0))
    if stage not in DEEPSPEED_CPU_STAGES:
        raise ConfigError(
            f"{where} with ZeRO stage {stage}: on CPU processes torchloom runs DeepSpeed ZeRO stages "
            f"{' and '.join(map(str, DEEPSPEED_CPU_STAGES))} only (ZeRO-3 trains there, but torchloom does not "
            "test it against DDP, nor its checkpoints, resume and export, so it does not run it untested); use "
            "zero_stage 1 or 2, or FSDP2 (the fsdp plugin) to shard the parameters too"
        )
    precision = kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    enabled = [k for k in ("fp16", "bf16") if str((plugin.deepspeed_config.get(k) or {}).get("enabled")) == "True"]
    if str(precision) not in ("no", "None") or enabled:
        raise ConfigError(
            f"{where} with mixed precision ({precision if str(precision) not in ('no', 'None') else enabled[0]}): "
            "DeepSpeed's 16-bit optimizers are not run on its CPU accelerator by torchloom; train in float32 "
            "(no mixed_precision plugin) under DeepSpeed on CPU processes"
        )
    for what in ("offload_optimizer", "offload_param"):
        device = str((zero.get(what) or {}).get("device", "none")).lower()
        if device not in ("none", "auto"):
            raise ConfigError(
                f"{where} with {what} to {device!r}: the processes' state is in CPU memory already, and "
                "DeepSpeed's CPU Adam is a compiled op that a DS_BUILD_OPS=0 install does not have; remove the "
                "offload (offload_optimizer_device / offload_param_device: none)"
            )


def deepspeed_settings(kwargs: dict[str, Any], sharding: Sharding) -> None:
    """Put in ``kwargs["deepspeed_plugin"]`` the plugin that DeepSpeed is built from (from the launcher's environment,
    ``ACCELERATE_USE_DEEPSPEED``, as the Accelerator would build it), and refuse an accumulation it would not follow.

    DeepSpeed accumulates, clips and steps inside ``accelerator.backward`` of a window's last micro-batch, before
    any ``before_optimizer_step`` hook. Its ``gradient_accumulation_steps``, when explicit, must be the run's
    (``gradient_accumulation_steps`` of the plugins' Accelerator settings, 1 by default): Accelerate would take
    DeepSpeed's, which the engine's windows do not follow. Its ``gradient_clipping`` is the business of the plugins
    that clip (their ``configure_model``), and of `settle_deepspeed_clipping` after them.

    Raises:
        ConfigError: an explicit DeepSpeed ``gradient_accumulation_steps`` other than the run's.
    """
    from accelerate.utils import DeepSpeedPlugin

    if kwargs.get("deepspeed_plugin") is None and kwargs.get("deepspeed_plugins") is None:
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin()  # reads ACCELERATE_DEEPSPEED_* as the Accelerator would
    steps = int(kwargs.get("gradient_accumulation_steps", 1))
    for ds in deepspeed_plugins(kwargs):
        accumulation = ds.deepspeed_config.get("gradient_accumulation_steps", "auto")
        if accumulation != "auto" and int(accumulation) != steps:
            raise ConfigError(
                f"DeepSpeed was requested ({sharding.source}) with gradient_accumulation_steps {accumulation} in its "
                f"DeepSpeed config, but the run accumulates {steps} micro-batch(es) per optimizer step (the "
                "grad_accum plugin's steps; 1 without it): Accelerate would take DeepSpeed's value, which the "
                "engine's accumulation windows do not follow; set it to \"auto\" (filled from the run's) or to the "
                "same value"
            )


def deepspeed_plugins(kwargs: Mapping[str, Any]) -> list[Any]:
    """The ``DeepSpeedPlugin`` objects of the Accelerator settings ``kwargs`` (``deepspeed_plugin`` or the values of
    ``deepspeed_plugins``)."""
    several = kwargs.get("deepspeed_plugins")
    if isinstance(several, Mapping):
        return list(several.values())
    one = several if several is not None else kwargs.get("deepspeed_plugin")
    return [one] if one is not None else []


def settle_deepspeed_clipping(accelerator: Accelerator) -> None:
    """Make a DeepSpeed ``gradient_clipping`` that is still ``"auto"`` after the plugins' ``configure_model`` 0 (no
    clipping): no plugin asked for clipping (one that clips sets it there), and Accelerate would fill it with 1.0.
    Called before ``accelerator.prepare``; nothing without DeepSpeed."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    for ds in deepspeed_plugins({"deepspeed_plugins": accelerator.state.deepspeed_plugins}):
        if ds.deepspeed_config.get("gradient_clipping") == "auto":
            ds.deepspeed_config["gradient_clipping"] = ds.gradient_clipping = 0.0


def deepspeed_missing(sharding: Sharding) -> ConfigError:
    """The error for DeepSpeed requested where it is not installed (instead of Accelerate's ImportError)."""
    return ConfigError(
        f"DeepSpeed was requested ({sharding.source}), but the deepspeed package is not installed: install it "
        "with \"DS_BUILD_OPS=0 pip install 'torchloom[deepspeed]'\" (DS_BUILD_OPS=0 installs it without compiling "
        "its CUDA ops, as on CPU machines), or remove the request"
    )


def check_sharding(accelerator: Accelerator, sharding: Sharding | None) -> None:
    """Refuse a run whose requested FSDP or DeepSpeed did not take effect.

    Raises:
        ConfigError: Accelerate chose another distributed type (one process: FSDP and DeepSpeed need a launch of
            several, ``torchrun --nproc_per_node N`` or ``accelerate launch --num_processes N``).
    """
    if sharding is None:
        return
    wanted = DistributedType.FSDP if sharding.kind == "FSDP" else DistributedType.DEEPSPEED
    chosen = accelerator.distributed_type
    if chosen == wanted:
        return
    hint = (
        "it needs several processes: launch with torchrun --nproc_per_node N or accelerate launch --num_processes N"
        if accelerator.num_processes == 1
        else "Accelerate did not choose it for this launch"
    )
    raise ConfigError(
        f"{sharding.name} was requested ({sharding.source}), but Accelerate chose {chosen.value} on "
        f"{accelerator.num_processes} process(es): {hint}. Without it, the run would silently be "
        f"{'one process' if accelerator.num_processes == 1 else 'plain data parallelism (DDP)'}"
    )


def _env_flag(name: str) -> bool:
    """A boolean environment variable as Accelerate reads it (unset or not a boolean word: false)."""
    try:
        return bool(str_to_bool(os.environ.get(name, "false"), to_bool=True))
    except ValueError:
        return False


_PROCESS_GROUP_RELEASE_REGISTERED = False
_RUN_FAILED = False  # a fit / validate / predict raised in this process: do not wait for the others at exit


def note_run_failed() -> None:
    global _RUN_FAILED
    _RUN_FAILED = True


def _release_process_group_at_exit() -> None:
    """Close the default process group when the process ends (registered once, on a multi-process run).

    ``destroy_process_group()`` alone does not end a gloo group: it drops only ``torch.distributed``'s own
    references, while every DDP model and ``torch.distributed.nn.functional`` still hold the group (see
    `_drop_process_group_references`). Its gloo threads then outlive the atexit handlers and are torn down in the
    middle of interpreter finalization, racing it: a worker that still has to free a tensor owned by Python needs
    the GIL, and a thread that takes the GIL once finalization has begun is ended by the interpreter
    (``pthread_exit`` unwinding through a ``noexcept`` destructor): "terminate called without an active
    exception", SIGABRT, and ``torchrun`` reports a failure after a successful run. So the handler drops those
    references and releases the last one itself, after a barrier on success (every process is done with the
    group): the group's destructor joins the gloo threads while Python is fully alive. It runs in a helper
    thread with a bounded wait, so that a collective left queued by a failed run (a peer that never comes) cannot
    hold the exit. Several fits in one process share the group, so this waits until the process ends.
    """
    global _PROCESS_GROUP_RELEASE_REGISTERED
    if _PROCESS_GROUP_RELEASE_REGISTERED:
        return
    _PROCESS_GROUP_RELEASE_REGISTERED = True

    def release() -> None:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or PartialState().fork_launched:
            return  # nothing to release, or Accelerate's notebook launcher owns the group
        # sys.last_value is set by an uncaught exception; _RUN_FAILED by a run that raised, even if caught.
        failed = _RUN_FAILED or getattr(sys, "last_value", None) is not None
        if not failed:  # after an error the other processes may never get here
            dist.barrier()
        last_reference = [dist.group.WORLD]
        _drop_process_group_references(last_reference[0])
        dist.destroy_process_group()
        joiner = threading.Thread(target=last_reference.clear, name="torchloom-release-process-group", daemon=True)
        del last_reference  # the thread's list now holds the only reference the engine has
        joiner.start()
        joiner.join(timeout=10.0 if failed else 60.0)

    atexit.register(release)


def _drop_process_group_references(group: Any) -> None:
    """Drop the references to ``group`` that outlive ``destroy_process_group()``.

    Every ``DistributedDataParallel`` model holds it (``process_group``, and in C++ through its ``reducer`` and
    ``logger``); the functions of ``torch.distributed.nn.functional`` hold it as the default of their ``group``
    argument (``group=group.WORLD``, evaluated when that module was imported after the group was created), where
    ``None`` means the same group. Only at exit: the DDP models are unusable afterwards.
    """
    ddp_type = torch.nn.parallel.DistributedDataParallel
    for obj in gc.get_objects():
        if issubclass(type(obj), ddp_type):  # type(), not isinstance(): no __class__ lookups on proxies
            for attr in ("logger", "reducer", "process_group"):
                obj.__dict__.pop(attr, None)
    functional = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(functional).values() if functional is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if isinstance(defaults, tuple) and any(d is group for d in defaults):
            fn.__defaults__ = tuple(None if d is group else d for d in defaults)


def _cpu_only_multiprocess_launch() -> bool:
    """A launch of several processes (``WORLD_SIZE`` > 1) on a machine without CUDA, unless the user set
    ``ACCELERATE_USE_CPU`` to a false value (read as Accelerate reads it)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    explicit = os.environ.get("ACCELERATE_USE_CPU")
    try:
        opted_out = explicit is not None and not str_to_bool(explicit, to_bool=True)
    except ValueError:  # not a boolean word: Accelerate would reject it itself
        opted_out = False
    return world_size > 1 and not torch.cuda.is_available() and not opted_out


# ---------------------------------------------------------- library internals (tests/upstream_internals.py)


def reset_accelerate_state() -> None:
    """Clear Accelerate's per-process singletons of the previous Accelerator (its settings, its accumulation and
    registered loaders); the process group (``PartialState``) is kept, its distributed type put back to
    ``MULTI_CPU`` where a previous run's `sharding_on_cpu` made it FSDP."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    shared = PartialState._shared_state
    lifted = (DistributedType.FSDP, DistributedType.MULTI_GPU, DistributedType.DEEPSPEED)
    if _LIFTED and shared.get("distributed_type") in lifted:
        # A run that `sharding_on_cpu` made FSDP left FSDP in the process group's state (AcceleratorState.__init__
        # writes its distributed type back there): the next Accelerator of this process would read FSDP without
        # an FSDP plugin (a DDP run, or a second FSDP run, failing in prepare on ``is_fsdp2``)
        shared["distributed_type"] = DistributedType.MULTI_CPU
    _LIFTED.clear()
