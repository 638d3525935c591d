"""Asynchronous checkpoint saves: the state copied once to host memory at the save point, written by a thread.

`start_async_save` is `torchloom.checkpoint.store.write` cut in two. On the main thread, at the save point
(every process, as for a synchronous save): the check that the checkpoint does not exist (the one broadcast),
then one host copy of everything a synchronous save writes: the model's state (Accelerate's ``get_state_dict``,
through the same save-state pre-hooks, so an adapter is saved alone), every optimizer's and scheduler's
``state_dict``, the loss scaler's, the engine's and every stateful plugin's state, this process's random states
and data position. Each tensor storage is copied once (tied weights stay tied), into memory that nothing live
shares, so training may go on at once. A thread then writes those copies into the checkpoint's temporary
directory in the layout of the synchronous save (Accelerate's own ``save_accelerator_state``, given the copies),
and hashes and syncs the files it wrote; it runs no collective and no plugin code.

`PendingCheckpoint.result` finishes it, on the main thread of every process at the same point (the next save, the
end of training): it waits for the thread, the processes agree on the outcome (`RankAgreement.first`), and the
main process writes the manifest and renames the directory into place exactly as the synchronous save does. Until
then the checkpoint is a temporary directory: a crash at any moment leaves the previous checkpoint the latest.
An error of the thread is kept and raised by `result`, on every process. `PendingCheckpoint.abandon` waits for the
thread without a collective and removes the temporary directory (a fit that failed on several processes).

Only models that Accelerate saves as one state dict are supported (one process, DDP): FSDP and DeepSpeed save
their shards with collectives of their own (`check_supported`).
"""

from __future__ import annotations

import copy
import io
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType, broadcast_object_list

from torchloom.checkpoint.entries import (
    ACCELERATE_RANDOM_STATES,
    Sorted,
    checked_states,
    holding,
    process_files,
    without_zip_crc32,
)
from torchloom.checkpoint.manifest import MANIFEST, _fsync_dir, claim_directory, hash_and_sync, publish
from torchloom.checkpoint.plugin_state import encode_plugin_state, write_plugin_state
from torchloom.errors import CheckpointError, RunFileError
from torchloom.parallel.dtensors import is_dtensor
from torchloom.rundir import atomic
from torchloom.rundir.adapter_format import TrainableOnly

__all__ = ["UNSUPPORTED", "PendingCheckpoint", "check_supported", "copy_state", "start_async_save"]

#: The distributed types whose model Accelerate saves with collectives of its own (shards): not supported.
UNSUPPORTED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)
#: The files under ``accelerate/`` that only the main process writes (the others write ``scaler.pt`` too).
_MAIN_ONLY = ("model", "optimizer", "scheduler", "sampler")


class PendingCheckpoint:
    """A checkpoint being written in the background (`torchloom.save_checkpoint_async`).

    Attributes:
        path (`str`): where the checkpoint will be once `result` has returned.

    Example (a plugin of your own; the ``checkpoint`` plugin's ``async_save`` does this):

    .. code-block:: python

        @torchloom.hookimpl
        def on_train_step_end(self, progress):
            if progress.global_step % 1000 == 0:
                if self.pending is not None:
                    self.pending.result()  # every process, at the same point: the previous one is complete
                self.pending = torchloom.save_checkpoint_async()
    """

    def __init__(self, path: str, writer: _Writer | None = None) -> None:
        self.path = path
        self._writer = writer
        self._error: BaseException | None = None
        self._settled = writer is None  # a checkpoint that exists already: nothing to wait for

    @property
    def settled(self) -> bool:
        """Whether `result` or `abandon` has finished with it (complete, failed or abandoned)."""
        return self._settled

    def done(self) -> bool:
        """Whether the background write has finished (the checkpoint exists only once `result` returned)."""
        return self._writer is None or not self._writer.thread.is_alive()

    def result(self) -> str:
        """Wait for the background write, then make the checkpoint complete; return its path. Every process calls
        it at the same point (the outcome is agreed over them); calling it again returns at once (or raises the
        same error again).

        Raises:
            RunFileError: the files could not be written on some process (the disk is full, ...) or the thread
                raised (the error is its ``__cause__``); nothing is left under the final name, the previous
                checkpoints are untouched, and every process raises.
        """
        if self._settled:
            if self._error is not None:
                raise self._error
            return self.path
        writer = self._writer
        assert writer is not None
        writer.thread.join()
        self._settled = True
        try:
            self._finish(writer)
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._writer = None  # the host copies are freed with it
        return self.path

    def abandon(self) -> None:
        """Wait for the background write without any collective, and remove what it wrote (the main process):
        the checkpoint is never made complete. For a fit that failed, where the processes cannot agree."""
        writer, self._writer = self._writer, None
        if self._settled or writer is None:
            return
        self._settled = True
        self._error = CheckpointError(f"checkpoint {self.path!r} was abandoned before it was complete")
        writer.thread.join()
        if writer.main:
            shutil.rmtree(writer.tmp, ignore_errors=True)

    def _finish(self, writer: _Writer) -> None:
        failure = writer.failure
        if failure is None and writer.error is not None:
            failure = f"{type(writer.error).__name__}: {writer.error}"
        if writer.num_processes > 1:
            failure = writer.agreement.first(failure)  # a write that failed on one process fails on all
        if failure is None and writer.main:
            try:
                failure = publish(writer.tmp, Path(self.path), writer.base, writer.known)
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
                writer.error = writer.error or exc
        if writer.num_processes > 1:  # no process goes on before the checkpoint exists (or failed)
            answer = [failure]
            broadcast_object_list(answer)
            failure = answer[0]
        if failure is not None:
            if writer.main:
                shutil.rmtree(writer.tmp, ignore_errors=True)
            raise RunFileError(
                f"cannot write checkpoint {self.path!r} (in the background): {failure}"
            ) from writer.error


class _Frozen:
    """A copied ``state_dict`` where Accelerate's writer expects its object (an optimizer, a scheduler)."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state


class _Writer:
    """What the thread writes, and what it found: the copies, where they go, and the outcome."""

    def __init__(self, tmp: Path, accelerator: Any, agreement: Any) -> None:
        self.tmp, self.agreement = tmp, agreement
        self.main, self.num_processes = bool(accelerator.is_main_process), int(accelerator.num_processes)
        self.process_index = int(accelerator.process_index)
        self.save_on_each_node = bool(accelerator.project_configuration.save_on_each_node)
        self.base: dict[str, Any] = {}
        self.parts: dict[str, Any] = {}
        self.known: dict[str, Any] = {}  # file -> {"bytes", "xxh3_128"}: those this process wrote, hashed
        self.failure: str | None = None  # a failed write (`atomic.write_failure`)
        self.error: BaseException | None = None  # what the thread raised
        self.thread = threading.Thread(target=self._run, name=f"torchloom-async-save-{tmp.name}", daemon=True)

    def _run(self) -> None:
        try:
            write_parts(self)
        except BaseException as exc:  # kept for the main thread: never lost in the thread
            self.failure = atomic.write_failure(exc, self.tmp)
            self.error = exc
        finally:
            self.parts = {}  # the host copies: freed as soon as they are written


def check_supported(accelerator: Any) -> None:
    """Raise when the run's model cannot be saved asynchronously (FSDP, DeepSpeed, Megatron-LM, XLA).

    Raises:
        CheckpointError: naming the distributed type.
    """
    if accelerator.distributed_type in UNSUPPORTED:
        raise CheckpointError(
            "an asynchronous checkpoint save supports one process and DDP; this run is "
            f"{accelerator.distributed_type}, which saves its shards with collectives of its own: save "
            "synchronously (async_save: false)"
        )


def start_async_save(
    directory: str,
    entries: Sorted,
    main_states: dict[str, dict[str, Any]],
    base: Callable[[], dict[str, Any]],
    *,
    agreement: Any,
    step: int,
    nonfinite_loss: str = "error",
    skipped: list[int] | None = None,
) -> PendingCheckpoint | None:
    """Copy the state of a checkpoint of ``entries`` into host memory and start writing it in a thread (every
    process, at the same point, as `torchloom.checkpoint.store.write`, whose asynchronous half this is:
    ``main_states`` are its parts' main states by file, ``base`` the manifest's start); return at once. The state is
    first checked finite, before anything is copied (`torchloom.checkpoint.entries.checked_states`): ``None`` when
    it is not and ``nonfinite_loss`` is ``"skip"`` / ``"ignore"`` (nothing written, a warning).

    Raises:
        TaskError: the model weights, the optimizer state or a plugin's state are not finite on some process
            (``nonfinite_loss="error"``): on every process, before anything is copied or written.
        CheckpointError: ``directory`` exists; the run's model cannot be saved this way (`check_supported`).
        PluginError: a plugin's ``state_dict()`` returned something outside the state contract.
    """
    accelerator = entries.model_files().accelerator
    check_supported(accelerator)
    encoded = checked_states(entries, accelerator, step, nonfinite_loss, skipped, own=True)
    if encoded is None:
        return None
    final, tmp = claim_directory(directory, accelerator)
    writer = _Writer(tmp, accelerator, agreement)
    main = writer.main
    (writer.tmp / "accelerate").mkdir(parents=True, exist_ok=True)
    try:
        writer.parts = snapshot(writer, entries, main_states, encoded)
        if main:
            writer.base = base()
    except BaseException:
        if main:
            shutil.rmtree(writer.tmp, ignore_errors=True)
        raise
    writer.thread.start()
    return PendingCheckpoint(str(final), writer)


def snapshot(
    writer: _Writer,
    entries: Sorted,
    main_states: dict[str, dict[str, Any]],
    plugins: list[tuple[str, Any, dict[str, torch.Tensor]]],
) -> dict[str, Any]:
    """The host copies of everything this process's part of the checkpoint holds (main thread); ``plugins``: the
    plugins' states already encoded (`torchloom.checkpoint.entries.checked_states`)."""
    accelerator = entries.model_files().accelerator
    # The processes that Accelerate's `save` writes on: the main one (each node's with save_on_each_node)
    shared = accelerator.is_local_main_process if writer.save_on_each_node else accelerator.is_main_process
    weights = [accelerator.get_state_dict(m, unwrap=False) for m in accelerator._models]
    with TrainableOnly(accelerator):  # an adapted model: its adapter only, as the synchronous save writes it
        for hook in accelerator._save_model_state_pre_hook.values():
            hook(accelerator._models, weights, str(writer.tmp / "accelerate"))
    for i, obj in enumerate(accelerator._custom_objects):  # torchloom registers none; written now, as save_state does
        from accelerate.checkpointing import save_custom_state

        save_custom_state(obj, writer.tmp / "accelerate", i, save_on_each_node=writer.save_on_each_node)
    storages: dict[Any, torch.UntypedStorage] = {}
    parts: dict[str, Any] = {
        "weights": [copy_state(w, storages) for w in weights] if shared else [],
        "optimizers": [copy_state(o.state_dict(), storages) for o in accelerator._optimizers] if shared else [],
        "schedulers": [copy_state(s.state_dict(), storages) for s in accelerator._schedulers] if shared else [],
        "scaler": None if accelerator.scaler is None else copy_state(accelerator.scaler.state_dict(), storages),
        "loaders": _loader_files(accelerator, shared),
        "step": accelerator.step,
    }
    main = writer.main
    own = [holding(stem, state) for stem, state in main_states.items()]
    parts["plugins"] = plugins
    parts["engine"] = encode_plugin_state(own, is_main_process=main, own=True)
    parts["process"] = encode_plugin_state(process_files(entries, files=False), own=True)
    return parts


def _loader_files(accelerator: Any, shared: bool) -> list[tuple[str, bytes]]:
    """The data loaders' files that Accelerate's ``save_accelerator_state`` writes (a seedable sampler of an
    iterable dataset, a stateful loader's state), serialised now: they describe live objects."""
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

    files = []
    for i, loader in enumerate(accelerator._dataloaders):
        if shared and isinstance(loader.dataset, IterableDatasetShard):
            sampler = loader.get_sampler()
            if isinstance(sampler, SeedableRandomSampler):
                files.append(("sampler.bin" if i == 0 else f"sampler_{i}.bin", _torch_bytes(sampler)))
        if getattr(loader, "use_stateful_dataloader", False):
            name = "dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin"
            files.append((name, _torch_bytes(loader.state_dict())))
    return files


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def copy_state(obj: Any, storages: dict[Any, torch.UntypedStorage]) -> Any:
    """A copy of a state (dicts, lists, tuples of tensors and plain values) that shares memory with nothing live:
    every tensor on the CPU, each storage copied once (``storages``: storage -> its copy), so that tensors that
    shared one (tied weights) share its copy, as a synchronous save would have seen them."""
    if isinstance(obj, torch.Tensor):
        return _copy_tensor(obj, storages)
    if isinstance(obj, dict):
        copied = copy.copy(obj)  # the same type (an OrderedDict stays one: Accelerate cleans its aliases)
        for key, value in obj.items():
            copied[key] = copy_state(value, storages)
        return copied
    if isinstance(obj, list):
        return [copy_state(value, storages) for value in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(copy_state(value, storages) for value in obj)
    return copy.deepcopy(obj)


def _copy_tensor(tensor: torch.Tensor, storages: dict[Any, torch.UntypedStorage]) -> torch.Tensor:
    """A host copy of ``tensor`` (see `copy_state`).

    Raises:
        CheckpointError: ``tensor`` is a DTensor (a shard of a sharded model: `check_supported` refuses such a run
            first; copying the shard alone would write a part of the value as the whole).
    """
    t = tensor.detach()
    if is_dtensor(t):
        raise CheckpointError(
            "an asynchronous checkpoint save cannot copy a sharded (DTensor) value: only the main process writes "
            "the model and optimizer files, and its shard is not the whole value; save synchronously "
            "(async_save: false)"
        )
    if t.layout != torch.strided or (type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)):
        return t.clone().cpu()  # a sparse or subclassed tensor: copied alone
    storage = t.untyped_storage()
    key = (storage.device, storage.data_ptr(), storage.nbytes())
    host = storages.get(key)
    if host is None:
        host = torch.empty(storage.nbytes(), dtype=torch.uint8).untyped_storage()
        host.copy_(storage)
        storages[key] = host
    copied = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
    return copied


def write_parts(writer: _Writer) -> None:
    """Write this process's files of the checkpoint from its copies (the thread): what the synchronous save writes,
    in the same layout; hash and sync those that only this process writes. No collective, no plugin code."""
    from accelerate.checkpointing import save_accelerator_state

    parts, tmp = writer.parts, writer.tmp
    scaler = None if parts["scaler"] is None else _Frozen(parts["scaler"])
    with without_zip_crc32():  # the manifest's checksum covers every file (checkpoint.without_zip_crc32)
        save_accelerator_state(
            str(tmp / "accelerate"),
            parts["weights"],
            [_Frozen(state) for state in parts["optimizers"]],
            [_Frozen(state) for state in parts["schedulers"]],
            [],
            writer.process_index,
            parts["step"],
            scaler,
            save_on_each_node=writer.save_on_each_node,
            safe_serialization=True,
        )
    (tmp / "accelerate" / ACCELERATE_RANDOM_STATES.format(writer.process_index)).unlink(missing_ok=True)
    for name, data in parts["loaders"]:
        atomic.write_atomically(tmp / "accelerate" / name, data)
    if writer.main:
        write_plugin_state(parts["plugins"], tmp / "plugins")
        write_plugin_state(parts["engine"], tmp / "engine")
    process_dir = tmp / "engine" / f"process_{writer.process_index}"
    write_plugin_state(parts["process"], process_dir)
    mine = [p for p in process_dir.rglob("*") if p.is_file()]
    if writer.main:
        mine += [
            p for p in (tmp / "accelerate").glob("*") if p.name.startswith(_MAIN_ONLY) or writer.num_processes == 1
        ]
        mine += [p for folder in ("plugins", "engine") for p in (tmp / folder).glob("*") if p.is_file()]
    for path, entry in hash_and_sync(mine).items():
        writer.known[path.relative_to(tmp).as_posix()] = entry
    for folder in {p.parent for p in mine}:
        _fsync_dir(folder)
    assert MANIFEST not in writer.known
