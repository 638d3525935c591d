"""Checkpoints: the whole state of a fit at an optimizer-step boundary, written atomically, loaded without running code.

A checkpoint directory (``<run_dir>/checkpoints/step-00000120``) holds:

- ``accelerate/``: what `accelerate.Accelerator.save_state` writes: the model weights (``model.safetensors``, or
  the sharded files of FSDP / DeepSpeed; of a model with an adapter injected in place, such as the ``peft``
  plugin's LoRA, only its trainable parameters: `torchloom.rundir.adapter_format.TrainableOnly`), the optimizer state
  (``optimizer.bin``) and the fp16 loss scaler (``scaler.pt``). Accelerate reads them back with
  ``torch.load(weights_only=True)``, and no custom object is ever registered with it, so none of these files can
  run code when loaded. The pickle of random states that ``save_state`` also writes (``random_states_<rank>.pkl``)
  is removed: the random states are the engine's.
- ``engine/``: the engine's counters, the data position (the epoch, the samples of its global order consumed,
  and what defines that order: see `torchloom.checkpoint.data_position`), and the learning-rate scheduler's state; in
  ``engine/process_<rank>/`` what is each process's own: its random states (Python, numpy, torch, CUDA), the
  partial sums of the values logged since the last logging step, and the states of the generators its data
  loader draws from as an epoch starts, as the epoch to resume in started, and inside an epoch its random states
  before the look-ahead fetch of the next batch (`torchloom.checkpoint.fetch_states`): JSON and safetensors
  (`torchloom.checkpoint.plugin_state`), read without pickle. With several processes whose copies of the model differ (a
  plugin with ``divergent_replicas``: LocalSGD, DiLoCo), also that process's own parameters, optimizer state and loss
  scaler (``replica``, `torchloom.checkpoint.replicas`), which it loads over Accelerate's main-process files.
  Resumed on another number of processes, each process loads saved process ``rank mod W``'s part, with the
  partial log sums merged over all of them (`torchloom.checkpoint.reshard`).
- ``plugins/``: the ``state_dict`` of every stateful plugin (LocalSGD's counter, early stopping, EMA weights,
  metric bests): JSON and safetensors.
- ``manifest.json``, written last: the format and version, the step, the data position, the world size, the
  model's parameter names and shapes and its count of trainable parameters, its adapter
  (`torchloom.rundir.adapter_format.describe`: method, rank, adapted modules, the base's class and SHA-256; ``None``
  without one), the optimizer's class, the stateful plugins, the logged values, the whole training up to it
  (``training``: the ``metrics.jsonl`` records written, the samples, the training and wall time, the runs its run
  continued; see `torchloom.checkpoint.lineage`), and every file with its size and SHA-256.

Atomic: every process writes into ``.step-00000120.tmp-<pid>`` next to the final name; when all are done the
main process writes the manifest and renames the directory into place in one ``os.rename``. A process killed
at any moment leaves either the complete checkpoint or a temporary directory, which the next run started in
the same ``output_dir`` removes (its writer is gone). Loading refuses any file the manifest does not list, any
file whose size or hash changed, and any pickle that holds more than tensors and plain values.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType, broadcast_object_list

from torchloom._guards import listing, nonfinite_parts, state_tensors
from torchloom.checkpoint import scan as _scan
from torchloom.checkpoint.data_position import DataOrder, layout_problems
from torchloom.checkpoint.manifest import FORMAT as FORMAT
from torchloom.checkpoint.manifest import MANIFEST, manifest_base, publish, read_manifest
from torchloom.checkpoint.manifest import VERSION as VERSION
from torchloom.checkpoint.manifest import verify_files as verify_files
from torchloom.checkpoint.plugin_state import (
    _encode,
    _state_of,
    _stateful,
    load_plugin_state,
    save_plugin_state,
    write_plugin_state,
)
from torchloom.checkpoint.random_states import random_states, set_random_states
from torchloom.checkpoint.replicas import REPLICA, divergent, load_replica, replica_state
from torchloom.checkpoint.reshard import merged_log_state, reshard_problems, source_rank
from torchloom.errors import CheckpointError, RunFileError, TaskError
from torchloom.rundir import atomic
from torchloom.rundir.adapter_format import TrainableOnly, describe, resume_problems
from torchloom.rundir.atomic import temporary_path
from torchloom.rundir.layout import CHECKPOINTS_DIR, is_run_dir, run_directories

__all__ = [
    "CHECKPOINTS_DIR",
    "MANIFEST",
    "SaveRequest",
    "claim_directory",
    "delete_checkpoint",
    "find_checkpoint",
    "list_checkpoints",
    "read_manifest",
    "write_checkpoint",
]

#: The random-state pickle Accelerate's ``save_state`` writes for each process; a checkpoint keeps none (the
#: states are in ``engine/process_<rank>/``).
_ACCELERATE_RANDOM_STATES = "random_states_{}.pkl"
_UNCHECKED: Any = object()  # check_compatible: an argument not to compare

# ---------------------------------------------------------------------------------------------------- writing


class _Named:
    """A state in `torchloom.checkpoint.plugin_state`'s format under a name: the engine's own state, the scheduler's."""

    def __init__(self, name: str, state: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]):
        self.name, self.state_dict, self.load_state_dict = name, state, load


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """What a checkpoint is written from, the same for a synchronous save (`write_checkpoint`) and an asynchronous
    one (`torchloom.checkpoint.async_save.start_async_save`): the run's objects and the states at the save point.

    ``engine_state`` is the main process's; ``process_state`` (each process's own: its partial log sums, its
    data generators) is written by every process, with its random states (`random_states`), to
    ``engine/process_<rank>/``, and `load_checkpoint` merges it into the engine state of the same process; so is
    its replica (`torchloom.checkpoint.replicas`) when several processes run a plugin with ``divergent_replicas``.
    ``training`` (the main process's, `torchloom.checkpoint.lineage.training_record`) is the manifest's ``training``:
    the whole training up to the checkpoint, which a resumed fit carries over.

    ``nonfinite_loss`` (`EngineConfig.nonfinite_loss`) says what a save of non-finite state does
    (`checked_plugin_states`): ``"error"`` raises, ``"skip"`` / ``"ignore"`` write nothing and warn; ``skipped``
    (the fit's list) collects the global steps of the saves skipped so, and only the first of a fit warns.
    """

    accelerator: Any
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    plugins: Iterable[Any]
    engine_state: dict[str, Any]
    metrics: Mapping[str, float]
    agreement: Any
    process_state: dict[str, Any] | None = None
    training: Mapping[str, Any] | None = None
    nonfinite_loss: str = "error"
    skipped: list[int] | None = None

    def engine_parts(self) -> list[_Named]:
        """The main process's files under ``engine/``: the engine's state and the scheduler's, if any."""
        own = [_Named("engine", lambda: self.engine_state, _no_load)]
        if self.scheduler is not None:
            own.append(_Named("lr_scheduler", self.scheduler.state_dict, _no_load))
        return own

    def process_part(self) -> _Named:
        """This process's own state under ``engine/process_<rank>/``, with its random states as they are now (what
        ``save_state`` would pickle)."""
        state = {**(self.process_state or {}), "random_states": random_states()}
        return _Named("process", lambda: state, _no_load)

    def manifest_base(self) -> dict[str, Any]:
        """The manifest of the checkpoint, but its ``files`` and ``plugins``
        (`torchloom.checkpoint.manifest.manifest_base`)."""
        return manifest_base(
            self.accelerator, self.model, self.optimizer, self.engine_state, self.metrics, self.training, self.plugins
        )


def claim_directory(directory: str, accelerator: Any) -> tuple[Path, Path]:
    """The final path of a new checkpoint and the temporary directory next to it that every process writes into
    (the main process's, named after its pid, which it broadcasts). Every process calls it, at the same point.

    Raises:
        CheckpointError: ``directory`` exists (on every process).
    """
    final = Path(directory)
    message: list[Any] = [None, os.getpid()]
    if accelerator.is_main_process and final.exists():
        message[0] = f"checkpoint directory {str(final)!r} already exists; checkpoints are never overwritten"
    if accelerator.num_processes > 1:
        broadcast_object_list(message)  # every process writes into the main process's temporary directory
    if message[0] is not None:
        raise CheckpointError(message[0])
    return final, temporary_path(final, pid=message[1])


def write_checkpoint(directory: str, request: SaveRequest) -> str | None:
    """Write a checkpoint of ``request`` into ``directory`` atomically (every process calls this); return its path,
    or ``None`` when the state is not finite and ``request.nonfinite_loss`` is ``"skip"`` / ``"ignore"`` (nothing
    written, a warning: `checked_plugin_states`).

    Raises:
        TaskError: the model weights, the optimizer state or a plugin's state hold NaN or inf on some process
            (``nonfinite_loss="error"``): on every process, before anything is written.
        CheckpointError: ``directory`` exists.
        RunFileError: the files cannot be written (temporary files are removed).
    """
    accelerator, model, optimizer = request.accelerator, request.model, request.optimizer
    main = accelerator.is_main_process
    plugins = list(request.plugins)
    encoded = checked_plugin_states(request, plugins, own=False)
    if encoded is None:
        return None
    final, tmp = claim_directory(directory, accelerator)
    mine = [request.process_part()]  # and its replica, if any
    if accelerator.num_processes > 1 and divergent(plugins):
        mine.append(_Named(REPLICA, lambda: replica_state(accelerator, model, optimizer), _no_load))
    try:
        # The processes agree on the outcome (`RankAgreement.first`): a write that failed on one fails on all
        failure = request.agreement.first(_write_parts(tmp, request, encoded, mine))
        if failure is None and main:  # every process's files are complete
            failure = publish(tmp, final, request.manifest_base())
        if accelerator.num_processes > 1:  # no process goes on before the checkpoint exists (or failed)
            answer = [failure]
            broadcast_object_list(answer)
            failure = answer[0]
        if failure is not None:
            raise RunFileError(f"cannot write checkpoint {str(final)!r}: {failure}")
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left on a full disk
        raise
    return str(final)


def checked_plugin_states(
    request: SaveRequest, plugins: list[Any], *, own: bool
) -> list[tuple[str, Any, dict[str, torch.Tensor]]] | None:
    """Every stateful plugin's state, called once on every process
    (`torchloom.checkpoint.plugin_state.encode_plugin_state`: host copies on the main process, ``own`` as there), after
    the check that the checkpoint about to be written is finite: the model's floating parameters, every floating tensor
    of the optimizer's state and of each plugin's state, on every process (`torchloom._guards.nonfinite_parts`: one
    fused flag per part, one all-reduce, one host read; a save syncs anyway). Return ``None`` when the save must be
    skipped.

    A non-finite part stops the fit under ``request.nonfinite_loss="error"`` (raised on every process alike);
    under ``"skip"`` / ``"ignore"`` nothing is written: the step is added to ``request.skipped``, and the first skip
    of a fit warns (main process). Either way no checkpoint is written, so retention never counts it.

    Raises:
        TaskError: a part is not finite and ``request.nonfinite_loss`` is ``"error"``; the message names the
            parts (``model weights``, ``optimizer state``, ``plugin 'ema' state``) and the global step.
        PluginError: a plugin's ``state_dict()`` returned something outside the state contract.
    """
    accelerator = request.accelerator
    main = accelerator.is_main_process
    states = [(name, _state_of(name, plugin, "to save its state")) for name, plugin in _stateful(plugins)]
    inner = getattr(request.optimizer, "optimizer", request.optimizer)
    optimizer_state = [v for entry in getattr(inner, "state", {}).values() for v in state_tensors(entry)]
    parts: list[tuple[str, list[torch.Tensor]]] = [
        ("model weights", list(request.model.parameters())),
        ("optimizer state", optimizer_state),
        *((f"plugin {name!r} state", list(state_tensors(state))) for name, state in states),
    ]
    bad = nonfinite_parts(parts, accelerator)
    if bad:
        step = int(request.engine_state["global_step"])
        what = listing(bad)
        verb = "is" if len(bad) == 1 else "are"
        if request.nonfinite_loss == "error":
            raise TaskError(
                f"the checkpoint of optimizer step {step} is not saved: its {what} {verb} not finite (NaN or "
                "infinite values); stopping, nothing of it is written and the earlier checkpoints are kept. A "
                "non-finite gradient since the last check is the usual cause: lower the learning rate, clip "
                "gradients (grad_clip), check the data and the loss; log_every_n_steps=1 narrows down the step. "
                "With the engine setting nonfinite_loss 'skip' or 'ignore' such a checkpoint is skipped instead"
            )
        skipped = request.skipped if request.skipped is not None else []
        if main and not skipped:
            from torchloom._warn import warn

            warn(
                f"nonfinite_loss={request.nonfinite_loss!r}: the checkpoint of optimizer step {step} is not written: "
                f"its {what} {verb} not finite (NaN or infinite values); the earlier checkpoints are kept. Later "
                "checkpoints of non-finite state in this fit are skipped too, without another warning",
            )
        skipped.append(step)
        return None
    return [(name, *_encode(name, state, copy=main, own=own)) for name, state in states]


@contextlib.contextmanager
def without_zip_crc32() -> Iterator[None]:
    """``torch.save`` without the CRC-32 of each record of its zip archive, while Accelerate writes the files it
    writes with it (``optimizer.bin``, ``scheduler.bin``, ``scaler.pt``); the setting is process-wide and restored
    after (`torch.serialization.set_crc32_options`, torch >= 2.6; a no-op before). The manifest's SHA-256 of every
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


def _write_parts(
    tmp: Path, request: SaveRequest, encoded: list[tuple[str, Any, dict[str, torch.Tensor]]], mine: list[_Named]
) -> str | None:
    """Write this process's files of a checkpoint into ``tmp`` (``mine``: its own, in ``engine/process_<rank>/``);
    return why a write failed (`atomic.write_failure`), ``None`` when all were written; ``encoded``: the plugins'
    states (`checked_plugin_states`). Any other error propagates: it happens on every rank."""
    accelerator = request.accelerator
    main = accelerator.is_main_process
    try:
        with TrainableOnly(accelerator), without_zip_crc32():  # an adapted model: its adapter only, not its base
            accelerator.save_state(str(tmp / "accelerate"), safe_serialization=True)
        (tmp / "accelerate" / _ACCELERATE_RANDOM_STATES.format(accelerator.process_index)).unlink(missing_ok=True)
        if main:
            write_plugin_state(encoded, tmp / "plugins")
        save_plugin_state(request.engine_parts(), tmp / "engine", is_main_process=main)
        save_plugin_state(mine, tmp / "engine" / f"process_{accelerator.process_index}")
    except Exception as exc:
        failure = atomic.write_failure(exc, tmp)
        if failure is None:
            raise
        return failure if accelerator.num_processes == 1 else f"process {accelerator.process_index}: {failure}"
    return None


def _no_load(state: dict[str, Any]) -> None:  # pragma: no cover - never called on save
    raise AssertionError


# ---------------------------------------------------------------------------------------------------- reading


def list_checkpoints(path: str | os.PathLike[str]) -> list[str]:
    """The complete checkpoints (those with a manifest) under ``path``, oldest first.

    ``path`` may be a run directory (``<output_dir>/version_N``) or an ``output_dir``; the order is by run
    (``version_N``) and then by global step, an end-of-epoch checkpoint after a step checkpoint of the same step.
    """
    root = Path(path)
    runs = [root] if (root / CHECKPOINTS_DIR).is_dir() else run_directories(root)
    return [str(candidate) for run in runs for candidate, _ in _run_checkpoints(run)]


def _run_checkpoints(run: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The complete checkpoints of the run directory ``run`` with their manifests, in `list_checkpoints`' order."""
    entries = []
    for candidate in (run / CHECKPOINTS_DIR).glob("*") if (run / CHECKPOINTS_DIR).is_dir() else ():
        if candidate.name.startswith(".") or not (candidate / MANIFEST).is_file():
            continue
        try:
            manifest = read_manifest(candidate)
        except CheckpointError:
            continue
        position = manifest.get("position") or {}
        entries.append((manifest.get("global_step", -1), bool(position.get("epoch_finished")), candidate, manifest))
    entries.sort(key=lambda entry: entry[:3])
    return [(candidate, manifest) for *_, candidate, manifest in entries]


def find_checkpoint(path: str | os.PathLike[str]) -> str:
    """Resolve what ``fit``'s ``--resume`` / ``ckpt_path`` names to one checkpoint directory (its messages say
    "cannot resume"; ``predict``'s ``ckpt_path`` is resolved by ``torchloom.rundir.export.resolve_weights``).

    Args:
        path (`str` or `os.PathLike`): a checkpoint directory; a run directory (its latest checkpoint); or an
            ``output_dir`` (the latest checkpoint of its latest run that has one).

    Raises:
        CheckpointError: ``path`` does not exist or holds no complete checkpoint; or the latest checkpoint there is
            unusable (an unreadable manifest, another format version: `torchloom.checkpoint.scan`), whether or not
            an older one is usable: the message names each such checkpoint and why, and never resumes from an older
            one in silence.
    """
    root = Path(path)
    if (root / MANIFEST).is_file():
        return str(root)
    expected = (
        f"expected a checkpoint (a directory with {MANIFEST}, as <run_dir>/{CHECKPOINTS_DIR}/step-00000040), a run "
        "directory or an output_dir whose runs have one"
    )
    if not root.exists():
        raise CheckpointError(f"cannot resume from {str(root)!r}: no such file or directory; {expected}")
    scan = _scan.scan_checkpoints(root) if root.is_dir() else None  # the unusable ones too (named, never skipped)
    refusal = scan.refusal(f"cannot resume from {str(root)!r}", hint=_scan.RESUME_HINT) if scan else None
    if refusal is not None:
        raise CheckpointError(refusal)
    found = [str(candidate) for candidate, _ in scan.usable] if scan else []
    if not found:
        if root.suffix == ".safetensors" or (root / "model.safetensors").is_file():
            raise CheckpointError(
                f"cannot resume from {str(root)!r}: it holds weights only (an exported model or a .safetensors "
                f"file), and a resume also needs the optimizer, the counters and the data position; {expected}. To "
                "start a new fit from these weights, load them in configure_model (TaskModule.load_model)"
            )
        if not root.is_dir():
            problem = "it is a file, not a checkpoint directory"
        elif is_run_dir(root):
            problem = (
                f"the run directory has no complete checkpoint (the 'checkpoint' plugin writes {CHECKPOINTS_DIR}/)"
            )
        else:
            problem = "the directory holds no complete checkpoint, nor runs that have one"
        raise CheckpointError(f"cannot resume from {str(root)!r}: {problem}; {expected}")
    return found[-1]


def check_compatible(
    manifest: Mapping[str, Any],
    *,
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    reset_optimizer: bool,
    plugins: Iterable[Any] | None = None,
    scheduler: Any = _UNCHECKED,
    data: DataOrder | None = None,
) -> bool:
    """Compare a checkpoint with the run about to load it; return whether to load the optimizer's state.

    ``plugins`` (the run's plugins), ``scheduler`` (the run's, or ``None``) and ``data`` (the `DataOrder` of the
    run's training data, see `torchloom.checkpoint.data_position.layout_problems`) are compared when given.

    Raises:
        CheckpointError: another number of processes where the state cannot be re-sharded
            (`torchloom.checkpoint.reshard.reshard_problems`), other parameter names or shapes, another optimizer
            class without ``reset_optimizer``, another set of stateful plugins, a learning-rate scheduler on
            one side only, or training data in which the checkpoint's epoch cannot be continued exactly: one
            message listing what differs.
    """
    problems = []
    problems = reshard_problems(manifest, accelerator.num_processes, accelerator.distributed_type)
    saved = {k: tuple(v) for k, v in (manifest.get("model") or {}).get("parameters", {}).items()}
    current = {name: tuple(p.shape) for name, p in accelerator.unwrap_model(model).named_parameters()}
    adapter = resume_problems(manifest.get("adapter"), describe(accelerator.unwrap_model(model)))
    if adapter:  # named as what differs (base, rank, targets), not as the parameter shapes that follow from it
        problems += adapter
    elif saved != current:
        diffs = [f"{n}: saved {list(saved[n])}, now {list(current[n])}" for n in saved.keys() & current.keys()]
        diffs = sorted(d for d in diffs if (n := d.split(":")[0]) and saved[n] != current[n])
        diffs += [f"{n}: only in the checkpoint" for n in sorted(saved.keys() - current.keys())]
        diffs += [f"{n}: only in this model" for n in sorted(current.keys() - saved.keys())]
        shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        problems.append(f"the model's parameters differ ({shown})")
    saved_optimizer = (manifest.get("optimizer") or {}).get("class")
    inner = getattr(optimizer, "optimizer", optimizer)
    load_optimizer = True
    if saved_optimizer != type(inner).__name__:
        if reset_optimizer:
            load_optimizer = False
        else:
            problems.append(
                f"its optimizer is {saved_optimizer}, this run's is {type(inner).__name__} (pass reset_optimizer=True, "
                "or --reset_optimizer, to start the new optimizer with fresh state)"
            )
    if plugins is not None:
        saved_plugins, enabled = sorted(manifest.get("plugins") or []), sorted(name for name, _ in _stateful(plugins))
        if saved_plugins != enabled:
            problems.append(
                f"its stateful plugins are {', '.join(map(repr, saved_plugins)) or 'none'}, this run's are "
                f"{', '.join(map(repr, enabled)) or 'none'} (enable the same stateful plugins)"
            )
    if scheduler is not _UNCHECKED:
        saved_scheduler = "engine/lr_scheduler.json" in (manifest.get("files") or {})
        if saved_scheduler != (scheduler is not None):
            problems.append(
                "it holds a learning-rate scheduler's state and this run has no scheduler"
                if saved_scheduler
                else "this run has a learning-rate scheduler and the checkpoint holds none"
            )
    if data is not None:  # on another number of processes too: the position is in samples of the global order
        problems += layout_problems(manifest.get("position") or {}, data)
    if problems:
        raise CheckpointError("cannot resume from checkpoint: " + "; ".join(problems))
    return load_optimizer and not reset_optimizer


def load_checkpoint(
    directory: str,
    *,
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    plugins: Iterable[Any],
    reset_optimizer: bool = False,
    data: DataOrder | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load a checkpoint into a prepared run (every process); return ``(engine_state, manifest)``, the engine
    state with this process's own part (``engine/process_<rank>/``) merged in.

    This process's random states are restored too (``engine_state["random_states"]``); the engine restores them
    once more after the resumed epoch's first batch is drawn, so that starting the data loader does not shift
    them. Accelerate's gradient-accumulation micro-step counter is not restored: a checkpoint is always at the
    end of an accumulation window, where it starts again from 0.

    Raises:
        CheckpointError: not a checkpoint, incompatible with this run (`check_compatible`: also another set of
            stateful plugins, a scheduler on one side only, or training data ``data`` that cannot continue the
            checkpoint's epoch), altered files, or a file that cannot be loaded safely.
        PluginError: a plugin's saved state does not match its files, or the plugin rejects it.
    """
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    load_optimizer = check_compatible(
        manifest,
        accelerator=accelerator,
        model=model,
        optimizer=optimizer,
        reset_optimizer=reset_optimizer,
        plugins=plugins,
        scheduler=scheduler,
        data=data,
    )
    root = Path(directory)
    _check_complete(root, manifest, accelerator, plugins, scheduler)
    pickled_states = sorted(p.name for p in (root / "accelerate").glob(_ACCELERATE_RANDOM_STATES.format("*")))
    if pickled_states:  # Accelerate's load_state would try to unpickle it, and skip it in silence if refused
        raise CheckpointError(
            f"checkpoint {str(root)!r} holds a pickle of random states (accelerate/{pickled_states[0]}), which a "
            "torchloom checkpoint never writes (its random states are in engine/process_<rank>/); refused without "
            "loading it"
        )
    states: dict[str, dict[str, Any]] = {}

    def keep(name: str) -> Callable[[dict[str, Any]], None]:
        return lambda state: states.__setitem__(name, state)

    own = [_Named("engine", dict, keep("engine"))]
    if scheduler is not None:
        own.append(_Named("lr_scheduler", scheduler.state_dict, keep("lr_scheduler")))
    load_plugin_state(own, root / "engine")  # read and checked before anything of the run changes
    saved_processes, rank = int(manifest.get("world_size") or 1), accelerator.process_index
    source = source_rank(rank, saved_processes)  # this process's own part: its own, or another's (re-sharded)
    replica = f"engine/process_{rank}/{REPLICA}.json" in (manifest.get("files") or {})  # same number only
    for index in range(saved_processes) if saved_processes != accelerator.num_processes else [source]:
        process_dir = root / "engine" / f"process_{index}"
        if not process_dir.is_dir():
            raise CheckpointError(
                f"checkpoint {str(root)!r} holds no state of process {index} "
                f"(engine/process_{index}/: its random states and data generators)"
            )
        own_files = [_Named("process", dict, keep(f"process_{index}"))]  # its own part (and its replica)
        own_files += [_Named(REPLICA, dict, keep(REPLICA))] if replica and index == rank else []
        load_plugin_state(own_files, process_dir)
    states["process"] = dict(states[f"process_{source}"])
    if saved_processes != accelerator.num_processes:  # the interval's partial sums over every saved process
        logged = [states[f"process_{i}"]["log_buffer"] for i in range(saved_processes)]
        states["process"]["log_buffer"] = merged_log_state(logged, rank)
    load_plugin_state(plugins, root / "plugins")  # every file checked before any plugin's load_state_dict
    fresh_optimizer = None if load_optimizer else copy.deepcopy(optimizer.state_dict())
    try:
        with TrainableOnly(accelerator):  # an adapted model: its adapter is loaded, the frozen base kept
            accelerator.load_state(str(root / "accelerate"))
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"checkpoint {str(root)!r} is incomplete: Accelerate needs {exc.filename or exc}, which it does not hold"
        ) from None
    except Exception as exc:
        if type(exc).__name__ == "UnpicklingError" or "weights_only" in str(exc):
            raise CheckpointError(
                f"checkpoint {str(root)!r}: a file under accelerate/ holds objects other than tensors and plain "
                f"values; refused without loading it ({type(exc).__name__}: {str(exc).splitlines()[0]})"
            ) from None
        raise
    if replica:  # this process's own copy, where the processes' copies differ (LocalSGD between two averages)
        load_replica(states[REPLICA], accelerator, model, optimizer, load_optimizer=fresh_optimizer is None)
    if fresh_optimizer is not None:
        optimizer.load_state_dict(fresh_optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(states["lr_scheduler"])
    engine_state = {**states["engine"], **states["process"]}
    set_random_states(engine_state["random_states"])
    return engine_state, manifest


def _check_complete(root: Path, manifest: Mapping[str, Any], accelerator: Any, plugins: Any, scheduler: Any) -> None:
    """Raise if the manifest lacks a file this run loads (a manifest edited to drop one, with the file)."""
    saved_processes = int(manifest.get("world_size") or 1)
    ranks = range(saved_processes) if saved_processes != accelerator.num_processes else [accelerator.process_index]
    required = ["engine/engine", *(f"engine/process_{rank}/process" for rank in ranks)]
    required += ["engine/lr_scheduler"] if scheduler is not None else []
    required += [f"plugins/{name}" for name, _ in _stateful(plugins)]
    names = [f"{stem}.{suffix}" for stem in required for suffix in ("json", "safetensors")]
    if accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        names += ["accelerate/model.safetensors", "accelerate/optimizer.bin"]  # FSDP / DeepSpeed shard theirs
    names += ["accelerate/scaler.pt"] if accelerator.scaler is not None else []
    missing = [name for name in names if name not in (manifest.get("files") or {})]
    if missing:
        raise CheckpointError(
            f"checkpoint {str(root)!r} is incomplete: it lacks {', '.join(missing)}, which this run loads (its "
            "manifest lists no such file)"
        )


# ------------------------------------------------------------------------------------------------ files


def remove_orphans(run_dir: str | os.PathLike[str]) -> None:
    """Remove the temporary directories that a killed save or deletion left in ``<run_dir>/checkpoints`` (their
    process no longer runs; see `torchloom.rundir.atomic`)."""
    atomic.remove_orphans(Path(run_dir) / CHECKPOINTS_DIR)


def delete_checkpoint(directory: str | os.PathLike[str]) -> None:
    """Delete a checkpoint directory: first renamed out of sight, then removed, so that a deletion cut short
    never leaves something that looks like a complete checkpoint. Call it on the main process only.

    Raises:
        CheckpointError: ``directory`` is not a checkpoint (it has no manifest).
        OSError: it cannot be renamed or removed.
    """
    path = Path(directory)
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"delete_checkpoint({str(path)!r}): not a checkpoint (no {MANIFEST}); nothing deleted")
    atomic.delete_directory(path)
