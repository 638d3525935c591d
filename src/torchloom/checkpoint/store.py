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
  partial log sums merged over all of them (`torchloom.checkpoint.reshard`); the model and optimizer of another
  layout (FSDP2 shards on one process or DDP, a DDP checkpoint in FSDP2) through ``torch.distributed.checkpoint``
  (`torchloom.checkpoint.layouts`).
- ``plugins/``: the ``state_dict`` of every stateful plugin (LocalSGD's counter, early stopping, EMA weights,
  metric bests): JSON and safetensors.
- ``manifest.json``, written last: the format and version, the step, the data position, the world size, the
  layout of the model's files (`torchloom.checkpoint.layouts.run_layout`), the
  model's parameter names and shapes and its count of trainable parameters, its adapter
  (`torchloom.rundir.adapter_format.describe`: method, rank, adapted modules, the base's class and SHA-256; ``None``
  without one), the optimizer's class, the stateful plugins, the logged values, the whole training up to it
  (``training``: the ``metrics.jsonl`` records written, the samples, the training and wall time, the runs its run
  continued; see `torchloom.checkpoint.lineage`), and every file with its size and checksum (XXH3-128; SHA-256
  in format 2).

What a checkpoint holds is one mapping, ``{name: stateful}`` (`torchloom.checkpoint.entries`: the engine's parts,
the files Accelerate writes, the plugins), written by `write` (synchronously, or in the background:
`torchloom.checkpoint.async_save`) and loaded by `load`; the files above are where its entries go.

Atomic: every process writes into ``.step-00000120.tmp-<pid>`` next to the final name; when all are done the
main process writes the manifest and renames the directory into place in one ``os.rename``. A process killed
at any moment leaves either the complete checkpoint or a temporary directory, which the next run started in
the same ``output_dir`` removes (its writer is gone). Loading refuses any file the manifest does not list, any
file whose size or hash changed, and any pickle that holds more than tensors and plain values.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list

from torchloom.checkpoint import scan as _scan
from torchloom.checkpoint.async_save import PendingCheckpoint, start_async_save
from torchloom.checkpoint.compat import check_compatible, check_complete
from torchloom.checkpoint.entries import Sorted, _Named, checked_states, holding, merged, process_files, sort_entries
from torchloom.checkpoint.entries import without_zip_crc32 as without_zip_crc32
from torchloom.checkpoint.manifest import FORMAT as FORMAT
from torchloom.checkpoint.manifest import (
    MANIFEST,
    claim_directory,
    hash_in_background,
    manifest_base,
    publish,
    read_manifest,
)
from torchloom.checkpoint.manifest import VERSION as VERSION
from torchloom.checkpoint.manifest import verify_files as verify_files
from torchloom.checkpoint.plugin_state import load_plugin_state, save_plugin_state, write_plugin_state
from torchloom.checkpoint.reshard import source_rank
from torchloom.errors import CheckpointError, RunFileError, TaskError
from torchloom.rundir import atomic
from torchloom.rundir.layout import CHECKPOINTS_DIR, is_run_dir, run_directories

__all__ = [
    "CHECKPOINTS_DIR",
    "MANIFEST",
    "delete_checkpoint",
    "find_checkpoint",
    "list_checkpoints",
    "load",
    "read_manifest",
    "write",
]

# ---------------------------------------------------------------------------------------------------- writing


def write(
    directory: str,
    stateful: Mapping[str, Any],
    *,
    accelerator: Any,
    agreement: Any,
    metrics: Mapping[str, float],
    training: Mapping[str, Any] | None = None,
    ranking: Mapping[str, str] | None = None,
    nonfinite_loss: str = "error",
    skipped: list[int] | None = None,
    asynchronous: bool = False,
) -> str | PendingCheckpoint | None:
    """Write a checkpoint of ``stateful`` (`torchloom.checkpoint.entries`) into ``directory`` atomically (every
    process calls this, at the same point); return its path (``asynchronous``: a `PendingCheckpoint` at once, the
    files written by a thread: `torchloom.checkpoint.async_save`), or ``None`` when the state is not finite and
    ``nonfinite_loss`` is ``"skip"`` / ``"ignore"`` (nothing written, a warning; ``skipped`` collects the step:
    `torchloom.checkpoint.entries.checked_states`).

    ``engine/engine``'s state holds the step and the data position the manifest records; ``metrics`` (the latest
    logged values) and ``training`` (`torchloom.checkpoint.lineage.training_record`: the whole training up to the
    checkpoint) are the manifest's too, and so is ``ranking`` (`torchloom.checkpoint.manifest.ranking`: the logged
    value the enabled plugins rank checkpoints by, which ``ckpt_path="best"`` reads; ``None``: none declares one).

    Raises:
        TaskError: the model weights, the optimizer state or a plugin's state hold NaN or inf on some process
            (``nonfinite_loss="error"``): on every process, before anything is written.
        CheckpointError: ``directory`` exists; ``asynchronous`` for a model that cannot be saved so.
        PluginError: a plugin's ``state_dict()`` returned something outside the state contract.
        RunFileError: the files cannot be written (temporary files are removed).
    """
    entries = sort_entries(stateful)
    main_states = entries.states("main")
    files = entries.model_files()

    def base() -> dict[str, Any]:
        return {
            **manifest_base(accelerator, files.model, files.optimizer, main_states["engine"], metrics, training),
            "ranking": dict(ranking) if ranking is not None else None,
        }

    step = int(main_states["engine"]["global_step"])
    if asynchronous:
        return start_async_save(
            directory,
            entries,
            main_states,
            base,
            agreement=agreement,
            step=step,
            nonfinite_loss=nonfinite_loss,
            skipped=skipped,
        )
    main = accelerator.is_main_process
    final, tmp = claim_directory(directory, accelerator)
    mine = process_files(entries)  # with this process's random states as they are now
    hashing: Future[dict[str, Any]] | None = None
    try:
        # The processes agree on the outcome (`RankAgreement.first`): a write that failed on one fails on all
        failure = agreement.first(_write_parts(tmp, lambda: _write_files(entries, tmp), accelerator))
        if failure is None:
            if main:  # the disk takes the large files while the state is checked
                hashing = hash_in_background(tmp)
            try:  # decided alike on every process (one all-reduce): each leaves once the files are gone
                encoded = checked_states(entries, accelerator, step, nonfinite_loss, skipped, own=False)
            except TaskError:
                _discard(tmp, hashing, main, accelerator)
                raise
            if encoded is None:  # a skipped save: nothing is published
                _discard(tmp, hashing, main, accelerator)
                return None
            states = (main_states, mine)
            written = _write_parts(tmp, lambda: _write_states(entries, tmp, states, encoded, accelerator), accelerator)
            failure = agreement.first(written)
        if failure is None and main:  # every process's files are complete
            failure = publish(tmp, final, base(), hashing.result() if hashing is not None else None)
        if accelerator.num_processes > 1:  # no process goes on before the checkpoint exists (or failed)
            answer = [failure]
            broadcast_object_list(answer)
            failure = answer[0]
        if failure is not None:
            raise RunFileError(f"cannot write checkpoint {str(final)!r}: {failure}")
    except BaseException:
        _discard(tmp, hashing, main)  # nothing half-written is left on a full disk
        raise
    return str(final)


def _discard(tmp: Path, hashing: Future[Any] | None, main: bool, accelerator: Any = None) -> None:
    """Remove the temporary directory of a checkpoint that is not published (main process), once the thread that
    hashes its files (if any) is done with them. With ``accelerator`` (an outcome every process reached at the same
    point) every process waits until it is removed, so that none returns while it is still there."""
    if hashing is not None:
        wait([hashing])
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    if accelerator is not None and accelerator.num_processes > 1:
        accelerator.wait_for_everyone()


def _write_files(entries: Sorted, tmp: Path) -> None:
    """The `Files` entries' files (the model and the optimizer state: the large ones)."""
    for entry in entries.files.values():
        entry.write_files(tmp / entry.folder)


def _write_states(
    entries: Sorted,
    tmp: Path,
    engine: tuple[dict[str, dict[str, Any]], list[_Named]],
    encoded: list[tuple[str, Any, dict[str, torch.Tensor]]],
    accelerator: Any,
) -> None:
    """The plugins' states (``encoded``, `checked_states`: main process) and the engine's (``engine``: the main
    states by file and this process's files, `process_files`)."""
    main_states, mine = engine
    main = accelerator.is_main_process
    if main:
        write_plugin_state(encoded, tmp / "plugins")
    own = [holding(stem, state) for stem, state in main_states.items()]
    save_plugin_state(own, tmp / "engine", is_main_process=main)
    save_plugin_state(mine, tmp / "engine" / f"process_{accelerator.process_index}")


def _write_parts(tmp: Path, writing: Callable[[], None], accelerator: Any) -> str | None:
    """Run ``writing`` (this process's files of a checkpoint, into ``tmp``); return why a write failed
    (`atomic.write_failure`), ``None`` when all were written. Any other error propagates: it happens on every
    rank."""
    try:
        writing()
    except Exception as exc:
        failure = atomic.write_failure(exc, tmp)
        if failure is None:
            raise
        return failure if accelerator.num_processes == 1 else f"process {accelerator.process_index}: {failure}"
    return None


# ---------------------------------------------------------------------------------------------------- loading


def load(
    directory: str, stateful: Mapping[str, Any], *, accelerator: Any, reset_optimizer: bool = False
) -> dict[str, Any]:
    """Load the checkpoint in ``directory`` into ``stateful`` (every process; the mapping `write` took, of a prepared
    run); return its manifest.

    Everything is read and checked before anything of the run changes; then the plugins are loaded (their
    ``load_state_dict``, in order), the `Files` entries (Accelerate's ``load_state``, this process's replica), and
    the engine's parts in the mapping's order, each with its files merged (this process's part: its own, or on
    another number of processes saved process ``rank mod W``'s, `torchloom.checkpoint.reshard`). Accelerate's
    gradient-accumulation micro-step counter is not restored: a checkpoint is always at the end of an accumulation
    window, where it starts again from 0.

    Raises:
        CheckpointError: not a checkpoint, incompatible with this run (`torchloom.checkpoint.compat`: also another
            set of stateful plugins, a scheduler on one side only, or training data that cannot continue the
            checkpoint's epoch), altered or missing files, or a file that cannot be loaded safely.
        PluginError: a plugin's saved state does not match its files, or the plugin rejects it.
    """
    entries = sort_entries(stateful)
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    files, main_stems = entries.model_files(), entries.stems("main")
    more = [problem for part in entries.parts.values() for problem in _problems(part.obj, manifest)]
    load_optimizer = check_compatible(
        manifest,
        accelerator=accelerator,
        model=files.model,
        optimizer=files.optimizer,
        reset_optimizer=reset_optimizer,
        plugins=list(entries.plugins),
        scheduler="lr_scheduler" in main_stems,
        more=more,
    )
    root = Path(directory)
    check_complete(root, manifest, _required(entries, manifest, accelerator))
    for entry in entries.files.values():
        entry.check_folder(root / entry.folder)
    main_states, process_state, own = _read_engine(root, entries, manifest, accelerator)
    load_plugin_state(list(entries.plugins.values()), root / "plugins")  # every file checked before any load_state_dict
    for entry in entries.files.values():
        entry.load_files(root / entry.folder, load_optimizer=load_optimizer, process_state=own.get(entry.process))
    for part in entries.parts.values():
        state = {**(main_states[part.main] if part.main else {}), **(process_state if part.process else {})}
        part.obj.load_state_dict(state)
    return manifest


def _problems(obj: Any, manifest: Mapping[str, Any]) -> list[str]:
    """Why the part ``obj`` cannot continue the checkpoint (its ``problems(manifest)``, if it has one)."""
    problems = getattr(obj, "problems", None)
    return list(problems(manifest)) if callable(problems) else []


def _required(entries: Sorted, manifest: Mapping[str, Any], accelerator: Any) -> list[str]:
    """The files this run loads: the engine's (this process's part: of every saved process on another number of
    processes), the plugins' and those the `Files` entries name."""
    saved_processes = int(manifest.get("world_size") or 1)
    ranks = range(saved_processes) if saved_processes != accelerator.num_processes else [accelerator.process_index]
    stems = [f"engine/{stem}" for stem in entries.stems("main")]
    stems += [f"engine/process_{rank}/{stem}" for rank in ranks for stem in entries.stems("process")]
    stems += [f"plugins/{name}" for name in entries.plugins]
    names = [f"{stem}.{suffix}" for stem in stems for suffix in ("json", "safetensors")]
    return names + [name for entry in entries.files.values() for name in entry.required(manifest)]


def _read_engine(
    root: Path, entries: Sorted, manifest: Mapping[str, Any], accelerator: Any
) -> tuple[dict[str, dict[str, Any]], dict[str, Any], dict[str, dict[str, Any]]]:
    """Read and check the engine's files: ``(main states by stem, this process's part merged, this process's own
    files by stem)`` (the last: the `Files` entries' process parts it saved, such as a replica).

    Raises:
        CheckpointError: a saved process's folder is missing.
        PluginError: a file is not what the entries expect.
    """
    states: dict[str, dict[str, Any]] = {}

    def keep(name: str) -> Callable[[dict[str, Any]], None]:
        return lambda state: states.__setitem__(name, state)

    load_plugin_state([_Named(stem, dict, keep(stem)) for stem in entries.stems("main")], root / "engine")
    main_states = dict(states)
    saved_processes, rank = int(manifest.get("world_size") or 1), accelerator.process_index
    source = source_rank(rank, saved_processes)  # this process's own part: its own, or another's (re-sharded)
    listed = manifest.get("files") or {}
    own_stems = [e.process for e in entries.files.values() if f"engine/process_{rank}/{e.process}.json" in listed]
    parts: dict[int, dict[str, Any]] = {}
    own: dict[str, dict[str, Any]] = {}
    for index in range(saved_processes) if saved_processes != accelerator.num_processes else [source]:
        process_dir = root / "engine" / f"process_{index}"
        if not process_dir.is_dir():
            raise CheckpointError(
                f"checkpoint {str(root)!r} holds no state of process {index} "
                f"(engine/process_{index}/: its random states and data generators)"
            )
        states.clear()
        named = [_Named(stem, dict, keep(stem)) for stem in entries.stems("process")]
        named += [_Named(stem, dict, keep(stem)) for stem in own_stems] if index == rank else []
        load_plugin_state(named, process_dir)
        parts[index] = merged(f"engine/process_{index}", [states[stem] for stem in entries.stems("process")])
        own.update({stem: states[stem] for stem in own_stems} if index == rank else {})
    process_state = dict(parts[source])
    if saved_processes != accelerator.num_processes:  # e.g. the interval's partial log sums over every process
        for part in entries.parts.values():
            if part.process and callable(getattr(part.obj, "reshard", None)):
                process_state.update(part.obj.reshard([parts[i] for i in range(saved_processes)], rank))
    return main_states, process_state, own


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
