"""The Accelerator of a run and the lifetime of the process group.

Everything here touches Accelerate's per-process state: merging the plugins' ``Accelerator`` settings,
resetting the singletons that one run leaves behind for the next, joining several CPU processes into one gloo
group, and releasing the process group when the process ends.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DataLoaderConfiguration, str_to_bool

from torchloom.config import EngineConfig
from torchloom.errors import ConfigError, PluginError
from torchloom.plugins import HookRelay

__all__ = ["LIST_KWARGS", "build_accelerator", "note_run_failed"]


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
    # AcceleratorState is a per-process singleton: clear the previous run's settings (mixed precision,
    # accumulation) so that several engines can run one after another in one process. The process group
    # (PartialState) is kept.
    reset_accelerate_state()
    try:
        accelerator = Accelerator(**kwargs)
    except (TypeError, ValueError) as exc:
        who = ", ".join(f"{k} from {owners[k]!r}" for k in kwargs if k in owners)
        raise ConfigError(f"cannot build the Accelerator ({who or 'defaults'}): {exc}") from None
    if accelerator.num_processes > 1:
        _release_process_group_at_exit()
    return accelerator


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
    registered loaders); the process group (``PartialState``) is kept."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
