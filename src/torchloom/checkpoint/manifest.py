"""A checkpoint's manifest (``manifest.json``): written last, with every file's size and checksum, as the step that
publishes the checkpoint with one ``os.rename`` (`claim_directory` at the start of a write, `publish`,
`manifest_base`, `file_entries`); read and checked before anything of a checkpoint is loaded (`read_manifest`,
`verify_files`). What a checkpoint holds and how it is written and loaded is `torchloom.checkpoint.store`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list

from torchloom._strict_json import json_dumps
from torchloom.errors import CheckpointError
from torchloom.rundir import atomic
from torchloom.rundir.adapter_format import base_class, describe
from torchloom.rundir.atomic import temporary_path

__all__ = [
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "claim_directory",
    "file_entries",
    "manifest_base",
    "publish",
    "ranking",
    "read_manifest",
    "verify_files",
]

#: Version 2: the data position in samples of the global order with what defines that order, and the random
#: states in the process's engine state (no pickle). Version 3: each file's checksum is its XXH3-128 (``xxh3_128``,
#: the xxhash library, which ``datasets`` also uses), about five times as fast to compute as SHA-256 here; version 2
#: files carry their SHA-256 and still load.
FORMAT, VERSION = "torchloom.checkpoint", 3
#: The versions this torchloom reads: the files of a version 2 manifest are checked against their SHA-256.
READABLE = (2, 3)
#: The checksums a manifest's file entry may hold (the key names it): what this torchloom writes, then version 2's.
CHECKSUMS = ("xxh3_128", "sha256")
MANIFEST = "manifest.json"

# ---------------------------------------------------------------------------------------------------- writing


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


def publish(tmp: Path, final: Path, base: dict[str, Any], known: Mapping[str, Any] | None = None) -> str | None:
    """Make the complete temporary directory ``tmp`` the checkpoint ``final`` (the main process, once every
    process's files are written): the manifest (``base``, `manifest_base`, with every file's size and checksum:
    those in ``known`` as given, the others computed), written last, everything synced, then one ``os.rename``.
    Return why a write failed (`atomic.write_failure`), ``None`` once the checkpoint exists."""
    try:
        manifest = {**base, "files": file_entries(tmp, known), "plugins": _plugin_names(tmp)}
        (tmp / MANIFEST).write_text(json_dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        _fsync_tree(tmp)
        os.rename(tmp, final)  # the only step that makes it visible: all of it, or nothing
        _fsync_dir(final.parent)
    except Exception as exc:
        failure = atomic.write_failure(exc, tmp)
        if failure is None:
            raise
        return failure
    return None


def file_entries(root: Path, known: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every file under ``root`` (relative, POSIX) with its size and checksum, as a manifest lists them; those in
    ``known`` (already hashed by their writer) are taken from it, the others hashed and synced (`hash_and_sync`)."""
    paths = {
        name: path
        for path in sorted(root.rglob("*"))
        if path.is_file() and (name := path.relative_to(root).as_posix()) != MANIFEST
    }
    hashed = hash_and_sync([path for name, path in paths.items() if not (known or {}).get(name)])
    return {name: (known or {}).get(name) or hashed[path] for name, path in paths.items()}


def hash_and_sync(paths: Iterable[Path]) -> dict[Path, dict[str, Any]]:
    """``{"bytes", "xxh3_128"}`` of each file of ``paths``, each also ``fsync``-ed. The checksums and the syncs run
    at once, in threads (xxhash and ``os.fsync`` release the GIL): each file is hashed from the page cache
    (`_digest`: what the writer just wrote, mapped, not copied) while the disk takes its data."""
    ordered = sorted(paths, key=lambda p: p.stat().st_size, reverse=True)
    if not ordered:
        return {}
    with ThreadPoolExecutor(max_workers=2 * len(ordered)) as pool:
        syncs = [pool.submit(_fsync_file, path) for path in ordered]
        digests = list(pool.map(lambda path: _digest(path, "xxh3_128"), ordered))
        for sync in syncs:
            sync.result()
    return {path: {"bytes": size, "xxh3_128": digest} for path, (digest, size) in zip(ordered, digests)}


def hash_in_background(root: Path) -> Future[dict[str, dict[str, Any]]]:
    """Start `hash_and_sync` of every file under ``root`` now, in a thread; the future's result maps each file's
    name relative to ``root`` (POSIX) to its entry, as `publish`'s ``known`` takes it. A synchronous save starts it
    as soon as the large files are written, so the disk takes them while the process checks the state and writes
    the small files."""
    paths = [path for path in sorted(root.rglob("*")) if path.is_file()]
    thread = ThreadPoolExecutor(max_workers=1)
    future = thread.submit(lambda: {p.relative_to(root).as_posix(): e for p, e in hash_and_sync(paths).items()})
    thread.shutdown(wait=False)  # the submitted task still runs; the thread ends with it
    return future


def _fsync_file(path: Path) -> None:
    with path.open("rb") as file:
        os.fsync(file.fileno())


def _digest(path: Path, kind: str) -> tuple[str, int]:
    """The checksum ``kind`` (one of `CHECKSUMS`) of the file ``path`` and its size in bytes: the file is mapped
    into memory (``mmap``) and hashed in one call, about eight times as fast as reading it in chunks."""
    digest = _new_digest(kind)
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size:
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
                digest.update(view)
    return digest.hexdigest(), size


def _plugin_names(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "plugins").glob("*.json")) if (root / "plugins").is_dir() else []


def manifest_base(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    engine_state: dict[str, Any],
    metrics: Mapping[str, float],
    training: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The manifest of a checkpoint of this state, but its ``files`` and ``plugins`` (`publish` adds them) and its
    ``ranking`` (`torchloom.checkpoint.store.write` adds it: `ranking`)."""
    from torchloom._version import __version__
    from torchloom.checkpoint.layouts import run_layout

    unwrapped = accelerator.unwrap_model(model)
    inner = getattr(optimizer, "optimizer", optimizer)
    return {
        "format": FORMAT,
        "version": VERSION,
        "torchloom_version": __version__,
        "global_step": engine_state["global_step"],
        "epoch": engine_state["position"]["epoch"],
        "position": engine_state["position"],
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "mixed_precision": str(accelerator.mixed_precision),
        "layout": run_layout(accelerator),
        "model": {
            "class": f"{base_class(unwrapped).__module__}.{base_class(unwrapped).__qualname__}",
            "parameters": {name: list(p.shape) for name, p in unwrapped.named_parameters()},
            "trainable_parameters": sum(p.numel() for p in unwrapped.parameters() if p.requires_grad),
        },
        "adapter": describe(unwrapped),
        "optimizer": {"class": type(inner).__name__, "param_groups": [len(g["params"]) for g in inner.param_groups]},
        "metrics": {k: v for k, v in metrics.items()},
        "training": dict(training or {}),
    }


def ranking(plugins: Iterable[Any]) -> dict[str, str] | None:
    """``{"monitor", "mode"}``: the first of ``plugins`` to declare a ``checkpoint_ranking`` (`torchloom.Plugin`: the
    logged value that ranks the checkpoints, and whether lower or higher is better); ``None`` when none does."""
    for plugin in plugins:
        declared = getattr(plugin, "checkpoint_ranking", None)
        if declared is not None:
            monitor, mode = declared
            return {"monitor": str(monitor), "mode": str(mode)}
    return None


# ---------------------------------------------------------------------------------------------------- reading


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check the ``manifest.json`` of a checkpoint directory.

    Raises:
        CheckpointError: no manifest (not a checkpoint, or an incomplete one), or one of another format or version.
    """
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{str(directory)!r} is not a complete torchloom checkpoint: it has no {MANIFEST}"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{str(path)!r} is not a torchloom checkpoint manifest")
    if manifest.get("version") not in READABLE or type(manifest.get("version")) is not int:
        from torchloom._version import __version__

        raise CheckpointError(
            f"{str(path)!r} is checkpoint format version {manifest.get('version')!r}; this torchloom "
            f"({__version__}) reads versions {', '.join(map(str, READABLE))}"
        )
    return manifest


def verify_files(directory: str | os.PathLike[str], manifest: Mapping[str, Any]) -> None:
    """Check that ``directory`` holds exactly the files its manifest lists, each of the listed size and checksum
    (``xxh3_128``; ``sha256`` in a version 2 manifest).

    Symbolic links are followed (a checkpoint copied with ``cp -rs``, or with linked folders, is read through
    them): what they point to is what is checked.

    Raises:
        CheckpointError: a file is missing (or a link to nothing), was added (a planted pickle, say) or changed
            since it was written.
    """
    root = Path(directory)
    listed = manifest.get("files") or {}
    present = set(_files(root)) - {MANIFEST}
    extra = sorted(present - set(listed))
    if extra:
        raise CheckpointError(
            f"checkpoint {str(root)!r} holds files its manifest does not list: {', '.join(extra)}; refused (a "
            "checkpoint is loaded only as written)"
        )
    for name, entry in listed.items():
        path = root / name
        if not path.is_file():
            what = (
                f"{name} is a symbolic link to {os.readlink(path)!r}, which does not exist"
                if path.is_symlink()
                else f"{name} is missing"
            )
            raise CheckpointError(f"checkpoint {str(root)!r} is incomplete: {what}")
        kind = next((key for key in CHECKSUMS if key in entry), None)
        if kind is None:
            raise CheckpointError(
                f"checkpoint {str(root)!r}: its manifest lists {name} without a checksum (expected one of "
                f"{', '.join(CHECKSUMS)}); refused"
            )
        if path.stat().st_size != entry.get("bytes") or _digest(path, kind)[0] != entry[kind]:
            raise CheckpointError(
                f"checkpoint {str(root)!r}: {name} changed since the checkpoint was written (size or {kind} "
                "differs from its manifest); refused"
            )


def _files(root: Path) -> list[str]:
    """Every file under ``root`` (relative, POSIX), following links to folders (each real folder once)."""
    found, seen = [], set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree
            dirs.clear()
            continue
        seen.add(real)
        for name in files:
            found.append((Path(folder) / name).relative_to(root).as_posix())
    return found


# ------------------------------------------------------------------------------------------------ files


def _new_digest(kind: str) -> Any:
    """A new hash object of checksum ``kind`` (one of `CHECKSUMS`), with ``update`` and ``hexdigest``."""
    if kind == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    return hashlib.sha256()


def _fsync_tree(root: Path) -> None:
    """Sync what `file_entries` left unsynced before the rename: the manifest and every folder (each file was synced
    as it was hashed, by `hash_and_sync` here or by its writer)."""
    with (root / MANIFEST).open("rb") as file:
        os.fsync(file.fileno())
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system syncs directories
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
