"""The one mapping a checkpoint is written from and loaded into, as Lightning Fabric's ``save`` / ``load`` take it:
``{name: stateful}``, where ``stateful`` has ``state_dict()`` and ``load_state_dict(state)``.

`torchloom.checkpoint.store.write` and `torchloom.checkpoint.store.load` dispatch on the kind of each entry:

- **a plugin** (any other object with both methods; its name, a file name without ``/``, is the mapping's key):
  ``plugins/<name>.json`` / ``.safetensors`` (`torchloom.checkpoint.plugin_state`), written by the main process,
  its ``state_dict()`` called and checked on every process.
- **`Part`**: one of the engine's stateful objects (its key holds a ``/``, so that no plugin name can take it) and
  where its parts go: ``state_dict()``, the main process's, into ``engine/<main>``; ``process_state_dict()``, each
  process's own (as `torchloom._fit_state.FitState` marks its per-process fields), into
  ``engine/process_<rank>/<process>``. Parts naming the same file share it (their keys must differ: `merged`), and
  ``load_state_dict`` receives its file(s) merged, the process's part over the main one: an entry ignores the keys
  that are not its own. Loaded in the mapping's order, after everything else.
- **`Files`** (a protocol): an entry that writes and reads a folder of its own, on every process (collectives
  allowed), and says which of its tensors must be finite. `AccelerateFiles` is one: the model, optimizer and loss
  scaler in Accelerate's ``save_state`` files (and, where the processes' copies differ, each process's own copy:
  `torchloom.checkpoint.replicas`); under FSDP2 the model and optimizer are Accelerate's DCP shards (or, with
  ``FULL_STATE_DICT``, its gathered files), and a checkpoint of another layout (FSDP2 on another number of
  processes or without FSDP, DDP into FSDP2) is loaded by the same entry through ``torch.distributed.checkpoint``
  (`torchloom.checkpoint.layouts`).

The engine's mapping (`torchloom._loop.FitLoop`) holds `AccelerateFiles`, the scheduler, `FitState`, the data
position (`torchloom.checkpoint.data_position.DataPosition`), the log buffer, `RandomStates` and every stateful
plugin; its files are the checkpoint format described in `torchloom.checkpoint.store`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from torchloom._guards import listing, nonfinite_parts, state_tensors
from torchloom.checkpoint.layouts import LAYOUT_FILES, LAYOUT_NAMES, load_across_layouts, run_layout, saved_layout
from torchloom.checkpoint.plugin_state import _encode, _state_of
from torchloom.checkpoint.random_states import random_states, set_random_states
from torchloom.checkpoint.replicas import REPLICA, load_replica, replica_state
from torchloom.checkpoint.reshard import merged_log_state, saved_layout_of
from torchloom.errors import CheckpointError, TaskError
from torchloom.rundir.adapter_format import (
    TrainableOnly,
    has_adapter,
    load_sharded_trainable,
    save_sharded_trainable,
    sharded_adapter,
)

__all__ = [
    "AccelerateFiles",
    "Files",
    "LogBufferState",
    "Part",
    "RandomStates",
    "Sorted",
    "checked_states",
    "holding",
    "merged",
    "process_files",
    "sort_entries",
    "without_zip_crc32",
]

#: The random-state pickle Accelerate's ``save_state`` writes for each process; a checkpoint keeps none (the
#: states are in ``engine/process_<rank>/``).
ACCELERATE_RANDOM_STATES = "random_states_{}.pkl"


@dataclass(frozen=True)
class Part:
    """An engine entry of the mapping: ``obj`` (``state_dict()``, ``load_state_dict(state)``, and with ``process``
    ``process_state_dict()``) and the files its parts go to.

    Attributes:
        obj: the stateful object.
        main (`str` or ``None``): the stem under ``engine/`` of its ``state_dict()`` (the main process's part;
            ``None``: it has none).
        process (`str` or ``None``): the stem under ``engine/process_<rank>/`` of its ``process_state_dict()`` (each
            process's own part; ``None``: it has none).
    """

    obj: Any
    main: str | None = None
    process: str | None = None


@runtime_checkable
class Files(Protocol):
    """An entry that writes and reads a folder of its own (``folder``) on every process.

    ``process``: the stem under ``engine/process_<rank>/`` of its process part, written when ``process_state_dict()``
    returns one (not ``None``) and loaded when the checkpoint holds it. ``finite_parts()``: ``[(what, tensors)]``
    that a checkpoint must hold finite (`torchloom._guards.nonfinite_parts`). ``required(manifest)``: the files
    (relative to the checkpoint) a load of the checkpoint of ``manifest`` needs. ``check_folder`` raises
    `CheckpointError` before anything is loaded; ``load_files`` loads (with ``load_optimizer`` false the optimizer
    keeps its fresh state) with the process part.
    """

    folder: str
    process: str

    def finite_parts(self) -> list[tuple[str, list[torch.Tensor]]]: ...

    def process_state_dict(self) -> dict[str, Any] | None: ...

    def required(self, manifest: Mapping[str, Any]) -> list[str]: ...

    def write_files(self, directory: Path) -> None: ...

    def check_folder(self, directory: Path) -> None: ...

    def load_files(self, directory: Path, *, load_optimizer: bool, process_state: Mapping[str, Any] | None) -> None: ...


@dataclass(frozen=True)
class Sorted:
    """A mapping sorted by kind (`sort_entries`): its `Files` entries, its `Part` entries and its plugins, each in
    the mapping's order, by name."""

    files: dict[str, Files]
    parts: dict[str, Part]
    plugins: dict[str, Any]

    def model_files(self) -> AccelerateFiles:
        """The `AccelerateFiles` entry: the model and optimizer the manifest and the compatibility check describe.

        Raises:
            ValueError: the mapping has none, or several.
        """
        found = [entry for entry in self.files.values() if isinstance(entry, AccelerateFiles)]
        if len(found) != 1:
            raise ValueError(f"a checkpoint's mapping needs one AccelerateFiles entry; it has {len(found)}")
        return found[0]

    def stems(self, which: str) -> dict[str, list[Part]]:
        """``{stem: the parts written there}``: under ``engine/`` (``which="main"``) or ``engine/process_<rank>/``
        (``"process"``), in the mapping's order."""
        stems: dict[str, list[Part]] = {}
        for part in self.parts.values():
            stem = getattr(part, which)
            if stem is not None:
                stems.setdefault(stem, []).append(part)
        return stems

    def states(self, which: str) -> dict[str, dict[str, Any]]:
        """``{stem: its state}``: the parts' ``state_dict()`` (``which="main"``) or ``process_state_dict()``
        (``"process"``), merged by file (`merged`)."""
        method = "state_dict" if which == "main" else "process_state_dict"
        return {
            stem: merged(stem, [getattr(part.obj, method)() for part in parts])
            for stem, parts in self.stems(which).items()
        }


def sort_entries(stateful: Mapping[str, Any]) -> Sorted:
    """Sort ``stateful`` by the kind of each entry.

    Raises:
        ValueError: a name with ``/`` that is no `Part` or `Files` entry, or a `Part` / `Files` named without one.
    """
    files: dict[str, Files] = {}
    parts: dict[str, Part] = {}
    plugins: dict[str, Any] = {}
    for name, entry in stateful.items():
        engine = isinstance(entry, Part | Files)
        if engine != ("/" in name):
            raise ValueError(f"checkpoint entry {name!r}: the engine's entries, and only they, have a '/' in the name")
        if isinstance(entry, Part):
            parts[name] = entry
        elif isinstance(entry, Files):
            files[name] = entry
        else:
            plugins[name] = entry
    return Sorted(files, parts, plugins)


def merged(name: str, states: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The state of file ``name``: the parts written there, merged.

    Raises:
        ValueError: two parts hold the same key.
    """
    state: dict[str, Any] = {}
    for part in states:
        shared = state.keys() & part.keys()
        if shared:
            raise ValueError(f"checkpoint file {name!r}: two entries hold {sorted(shared)}")
        state.update(part)
    return state


def checked_states(
    entries: Sorted,
    accelerator: Any,
    step: int,
    nonfinite_loss: str = "error",
    skipped: list[int] | None = None,
    *,
    own: bool,
) -> list[tuple[str, Any, dict[str, torch.Tensor]]] | None:
    """Every plugin's state, called once on every process (`torchloom.checkpoint.plugin_state.encode_plugin_state`:
    host copies on the main process, ``own`` as there), after the check that the checkpoint of optimizer step
    ``step`` about to be written is finite: the `Files` entries' `finite_parts` (the model's floating parameters,
    every floating tensor of the optimizer's state) and every floating tensor of each plugin's state, on every
    process (`torchloom._guards.nonfinite_parts`: one fused flag per part, one all-reduce, one host read; a save
    syncs anyway). Return ``None`` when the save must be skipped.

    A non-finite part stops the fit under ``nonfinite_loss="error"`` (`EngineConfig.nonfinite_loss`; raised on every
    process alike); under ``"skip"`` / ``"ignore"`` nothing is written: the step is added to ``skipped`` (the fit's
    list), and the first skip of a fit warns (main process). Either way no checkpoint is written, so retention never
    counts it.

    Raises:
        TaskError: a part is not finite and ``nonfinite_loss`` is ``"error"``; the message names the parts
            (``model weights``, ``optimizer state``, ``plugin 'ema' state``) and the global step.
        PluginError: a plugin's ``state_dict()`` returned something outside the state contract.
    """
    main = accelerator.is_main_process
    states = [(name, _state_of(name, plugin, "to save its state")) for name, plugin in entries.plugins.items()]
    parts: list[tuple[str, list[torch.Tensor]]] = [p for entry in entries.files.values() for p in entry.finite_parts()]
    parts += [(f"plugin {name!r} state", list(state_tensors(state))) for name, state in states]
    bad = nonfinite_parts(parts, accelerator)
    if bad:
        what = listing(bad)
        verb = "is" if len(bad) == 1 else "are"
        if nonfinite_loss == "error":
            raise TaskError(
                f"the checkpoint of optimizer step {step} is not saved: its {what} {verb} not finite (NaN or "
                "infinite values); stopping, nothing of it is written and the earlier checkpoints are kept. A "
                "non-finite gradient since the last check is the usual cause: lower the learning rate, clip "
                "gradients (grad_clip), check the data and the loss; log_every_n_steps=1 narrows down the step. "
                "With the engine setting nonfinite_loss 'skip' or 'ignore' such a checkpoint is skipped instead"
            )
        skipped = skipped if skipped is not None else []
        if main and not skipped:
            from torchloom._warn import warn

            warn(
                f"nonfinite_loss={nonfinite_loss!r}: the checkpoint of optimizer step {step} is not written: "
                f"its {what} {verb} not finite (NaN or infinite values); the earlier checkpoints are kept. Later "
                "checkpoints of non-finite state in this fit are skipped too, without another warning",
            )
        skipped.append(step)
        return None
    return [(name, *_encode(name, state, copy=main, own=own)) for name, state in states]


class _Named:
    """A state in `torchloom.checkpoint.plugin_state`'s format under a name: a file of the engine's entries."""

    def __init__(self, name: str, state: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]):
        self.name, self.state_dict, self.load_state_dict = name, state, load


def holding(name: str, state: dict[str, Any]) -> _Named:
    """A file of ``state`` (already taken) under ``name``, to write."""
    return _Named(name, lambda: state, _no_load)


def process_files(entries: Sorted, files: bool = True) -> list[_Named]:
    """This process's files under ``engine/process_<rank>/``: its parts' (with its random states as they are now)
    and with ``files`` the `Files` entries' own, if any (a replica; an asynchronous save writes none)."""
    mine = [holding(stem, state) for stem, state in entries.states("process").items()]
    for entry in entries.files.values() if files else ():
        state = entry.process_state_dict()
        if state is not None:
            mine.append(holding(entry.process, state))
    return mine


def _no_load(state: dict[str, Any]) -> None:  # pragma: no cover - never called on save
    raise AssertionError


# -------------------------------------------------------------------------------------------- the engine's entries


class RandomStates:
    """This process's random states (Python, numpy, torch, CUDA: `torchloom.checkpoint.random_states`), a process
    part: ``{"random_states": ...}``; loading restores them (the data position restores them once more after a
    resumed epoch's loader started)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def process_state_dict(self) -> dict[str, Any]:
        return {"random_states": random_states()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raises: CheckpointError: the states are not what `random_states` returns."""
        set_random_states(state["random_states"])


class LogBufferState:
    """The partial sums of the values logged since the last logging step (`torchloom._logbuffer`), a process part:
    ``{"log_buffer": ...}``. Resumed on another number of processes, each process takes the sums of every saved
    process merged (`reshard`)."""

    def __init__(self, buffer: Any, device: Any) -> None:
        self.buffer, self.device = buffer, device

    def state_dict(self) -> dict[str, Any]:
        return {}

    def process_state_dict(self) -> dict[str, Any]:
        return {"log_buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.buffer.load_state_dict(state["log_buffer"], self.device)

    def reshard(self, saved: list[Mapping[str, Any]], rank: int) -> dict[str, Any]:
        """This process's part of a checkpoint of ``len(saved)`` processes (their parts) on another number."""
        return {"log_buffer": merged_log_state([state["log_buffer"] for state in saved], rank)}


class AccelerateFiles:
    """The model, the optimizer and the fp16 loss scaler in ``accelerate/``, as `accelerate.Accelerator.save_state`
    writes them (of a model with an adapter injected in place, only its trainable parameters:
    `torchloom.rundir.adapter_format.TrainableOnly`; sharded by FSDP, the adapter gathered into
    ``model.safetensors`` and the optimizer's shards: `torchloom.rundir.adapter_format.save_sharded_trainable`),
    and with ``replicas`` (processes whose copies differ) each process's own copy in
    ``engine/process_<rank>/replica`` (`torchloom.checkpoint.replicas`).

    Args:
        accelerator (`accelerate.Accelerator`), model (`torch.nn.Module`), optimizer: the prepared run's.
        replicas (`bool`): write each process's copy too.
    """

    folder, process = "accelerate", REPLICA

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any, replicas: bool = False) -> None:
        self.accelerator, self.model, self.optimizer, self.replicas = accelerator, model, optimizer, replicas

    def finite_parts(self) -> list[tuple[str, list[torch.Tensor]]]:
        """The model's parameters and every tensor of the optimizer's state."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        optimizer_state = [v for entry in getattr(inner, "state", {}).values() for v in state_tensors(entry)]
        return [("model weights", list(self.model.parameters())), ("optimizer state", optimizer_state)]

    def process_state_dict(self) -> dict[str, Any] | None:
        """This process's copy (`torchloom.checkpoint.replicas.replica_state`) with ``replicas``, else ``None``."""
        return replica_state(self.accelerator, self.model, self.optimizer) if self.replicas else None

    def required(self, manifest: Mapping[str, Any]) -> list[str]:
        """The model and optimizer files a load of the checkpoint of ``manifest`` reads: Accelerate's whole-model
        files in this run's whole layout; a DCP folder's ``.metadata`` or FSDP2's gathered files where they are
        loaded into another layout (`torchloom.checkpoint.layouts`); none for shards Accelerate reads in the layout
        they were written in (their names depend on the processes); and the loss scaler's, if any."""
        from accelerate.utils import DistributedType

        accelerator = self.accelerator
        stored, layout = saved_layout_of(manifest), run_layout(accelerator)
        names = []
        if sharded_adapter(accelerator, self.model):  # the adapter, gathered: one file (the optimizer: shards)
            names.append("accelerate/model.safetensors")
        elif stored is not None and layout is not None and stored != layout:
            model_file, optimizer_file = LAYOUT_FILES[stored]
            if stored == "fsdp_sharded":
                model_file, optimizer_file = f"{model_file}/.metadata", f"{optimizer_file}/.metadata"
            names += [f"accelerate/{model_file}", f"accelerate/{optimizer_file}"]
        elif accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            names += ["accelerate/model.safetensors", "accelerate/optimizer.bin"]
        return names + (["accelerate/scaler.pt"] if accelerator.scaler is not None else [])

    def write_files(self, directory: Path) -> None:
        """``save_state`` into ``directory`` (every process), without its pickle of random states."""
        accelerator = self.accelerator
        if sharded_adapter(accelerator, self.model):  # FSDP: the adapter alone, not the base's shards
            save_sharded_trainable(accelerator, self.model, self.optimizer, directory)
            return
        with TrainableOnly(accelerator), without_zip_crc32():  # an adapted model: its adapter only, not its base
            accelerator.save_state(str(directory), safe_serialization=True)
        (directory / ACCELERATE_RANDOM_STATES.format(accelerator.process_index)).unlink(missing_ok=True)

    def check_folder(self, directory: Path) -> None:
        """Raises: CheckpointError: ``directory`` holds a pickle of random states (Accelerate's ``load_state`` would
        unpickle it, or skip it in silence if refused)."""
        pickled = sorted(p.name for p in directory.glob(ACCELERATE_RANDOM_STATES.format("*")))
        if pickled:
            raise CheckpointError(
                f"checkpoint {str(directory.parent)!r} holds a pickle of random states (accelerate/{pickled[0]}), "
                "which a torchloom checkpoint never writes (its random states are in engine/process_<rank>/); "
                "refused without loading it"
            )

    def load_files(self, directory: Path, *, load_optimizer: bool, process_state: Mapping[str, Any] | None) -> None:
        """``load_state`` from ``directory``, then this process's copy (``process_state``, if any); with
        ``load_optimizer`` false the optimizer keeps its fresh state (``reset_optimizer``). A checkpoint of another
        layout than the run's (`torchloom.checkpoint.layouts.run_layout`: FSDP2 shards on one process or DDP, a
        DDP checkpoint in an FSDP2 run) is loaded with `torchloom.checkpoint.layouts.load_across_layouts` instead.

        Raises:
            CheckpointError: a file Accelerate needs is missing, or a file holds more than tensors and plain values;
                a checkpoint of another layout that does not fit the run, or of a model with an adapter.
        """
        accelerator, optimizer = self.accelerator, self.optimizer
        if sharded_adapter(accelerator, self.model):  # FSDP: the adapter into the shards, the base kept
            load_sharded_trainable(accelerator, self.model, optimizer, directory, load_optimizer=load_optimizer)
            return
        stored, layout = saved_layout(directory), run_layout(accelerator)
        if stored is not None and layout is not None and stored != layout:
            self._load_other_layout(directory, stored, load_optimizer=load_optimizer)
            if process_state is not None:
                load_replica(process_state, accelerator, self.model, optimizer, load_optimizer=load_optimizer)
            return
        fresh_optimizer = None if load_optimizer else copy.deepcopy(optimizer.state_dict())
        root = str(directory.parent)
        try:
            with TrainableOnly(accelerator):  # an adapted model: its adapter is loaded, the frozen base kept
                accelerator.load_state(str(directory))
        except FileNotFoundError as exc:
            raise CheckpointError(
                f"checkpoint {root!r} is incomplete: Accelerate needs {exc.filename or exc}, which it does not hold"
            ) from None
        except Exception as exc:
            if type(exc).__name__ == "UnpicklingError" or "weights_only" in str(exc):
                raise CheckpointError(
                    f"checkpoint {root!r}: a file under accelerate/ holds objects other than tensors and plain "
                    f"values; refused without loading it ({type(exc).__name__}: {str(exc).splitlines()[0]})"
                ) from None
            raise
        if process_state is not None:  # this process's own copy (LocalSGD between two averages)
            load_replica(process_state, accelerator, self.model, optimizer, load_optimizer=fresh_optimizer is None)
        if fresh_optimizer is not None:
            optimizer.load_state_dict(fresh_optimizer)

    def _load_other_layout(self, directory: Path, stored: str, *, load_optimizer: bool) -> None:
        """The model and optimizer (and the loss scaler) of a checkpoint of layout ``stored``, another than the
        run's (`torchloom.checkpoint.layouts.load_across_layouts`).

        Raises:
            CheckpointError: the model carries an adapter (its checkpoint holds the adapter only; loaded in the
                layout it was written in), or the state does not fit.
        """
        accelerator = self.accelerator
        if has_adapter(accelerator.unwrap_model(self.model)):
            raise CheckpointError(
                f"cannot resume from checkpoint {str(directory.parent)!r}: it holds {LAYOUT_NAMES[stored]} of a model "
                f"with an adapter, and this run's layout is {LAYOUT_NAMES.get(str(run_layout(accelerator)))}; an "
                "adapter's checkpoint loads only in the layout it was written in (the same parallelism)"
            )
        load_across_layouts(
            directory,
            stored,
            accelerator=accelerator,
            model=self.model,
            optimizer=self.optimizer,
            load_optimizer=load_optimizer,
        )
        scaler = directory / "scaler.pt"
        if accelerator.scaler is not None and scaler.is_file():
            accelerator.scaler.load_state_dict(torch.load(scaler, map_location="cpu", weights_only=True))


@contextlib.contextmanager
def without_zip_crc32() -> Iterator[None]:
    """``torch.save`` without the CRC-32 of each record of its zip archive, while Accelerate writes the files it
    writes with it (``optimizer.bin``, ``scheduler.bin``, ``scaler.pt``); the setting is process-wide and restored
    after (`torch.serialization.set_crc32_options`, torch >= 2.6; a no-op before). The manifest's checksum of every
    file already detects any change, and the CRC costs more than the write itself: AdamW's 100 MB of state in 0.13 s
    with it, 0.05 s without, as fast as ``safetensors``. ``torch.load`` reads such an archive as any other."""
    setter = getattr(torch.serialization, "set_crc32_options", None)
    if setter is None:
        yield
        return
    previous = torch.serialization.get_crc32_options()
    setter(False)
    try:
        yield
    finally:
        setter(previous)
