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

__all__ = ["LIST_KWARGS", "build_accelerator", "note_run_failed", "restore_launch_environment"]


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


@contextlib.contextmanager
def sharding_on_cpu(kwargs: Mapping[str, Any], sharding: Sharding | None) -> Iterator[None]:
    """Let Accelerate choose FSDP2 for a group of CPU processes (gloo) while the ``Accelerator`` is built.

    Accelerate (1.15) chooses FSDP only for GPU-like distributed types: ``AcceleratorState.__init__`` lists
    ``MULTI_GPU``, ``MULTI_XPU``, ... and not ``MULTI_CPU``, so FSDP requested on CPU processes silently runs DDP.
    torch runs FSDP2 (``fully_shard``, DTensor) on CPU with gloo, and so does Accelerate's own FSDP2 preparation
    once it has chosen FSDP. This is the one place that lifts that gate: the process group's distributed type
    (``PartialState``) reads as ``MULTI_GPU`` while the Accelerator is built, which then records ``FSDP`` (the
    device stays the CPU). The proposal upstream is in docs/distributed.md.

    Raises:
        ConfigError: FSDP1 or DeepSpeed on CPU processes (FSDP1 wants an accelerator device; Accelerate skips
            DeepSpeed under ``cpu=True``).
    """
    if sharding is None:
        yield
        return
    state = PartialState(cpu=bool(kwargs.get("cpu", False)))
    if state.distributed_type != DistributedType.MULTI_CPU:
        yield
        return
    if sharding.kind != "FSDP" or sharding.version != 2:
        why = (
            "torch's FullyShardedDataParallel (FSDP1) needs an accelerator device; use FSDP2 (fsdp_version: 2)"
            if sharding.kind == "FSDP"
            else "Accelerate does not run DeepSpeed with cpu=True, and this torchloom does not lift that gate"
        )
        raise ConfigError(
            f"{sharding.name} was requested ({sharding.source}) on {state.num_processes} CPU processes: {why}. "
            "Without it, the run would silently be plain data parallelism (DDP)"
        )
    shared = PartialState._shared_state
    shared["distributed_type"] = DistributedType.MULTI_GPU
    try:
        yield
    finally:
        if shared.get("distributed_type") == DistributedType.MULTI_GPU:  # the Accelerator was not built
            shared["distributed_type"] = DistributedType.MULTI_CPU
        elif shared.get("distributed_type") == DistributedType.FSDP:
            # The Accelerator wrote FSDP into the process group's state: `reset_accelerate_state` puts MULTI_CPU
            # back before the next run's Accelerator is built in this process (which would otherwise find FSDP
            # there without an FSDP plugin of its own)
            _LIFTED_ON_CPU.append(True)


#: Non-empty while the process group's state reads FSDP because `sharding_on_cpu` let an Accelerator choose it.
_LIFTED_ON_CPU: list[bool] = []


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
    registered loaders); the process group (``PartialState``) is kept, with its distributed type ``MULTI_CPU`` again
    where an earlier run's Accelerator recorded ``FSDP`` there on CPU processes (`sharding_on_cpu`)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    if _LIFTED_ON_CPU:  # an earlier run's FSDP on CPU processes: the group's own type again (sharding_on_cpu)
        shared = PartialState._shared_state
        if shared.get("distributed_type") == DistributedType.FSDP:
            shared["distributed_type"] = DistributedType.MULTI_CPU
        _LIFTED_ON_CPU.clear()
