"""Atomic writes: a file or a directory appears under its final name complete, or not at all.

One convention names everything in progress, next to its final path:

- ``.<name>.tmp-<pid>``: a directory being written by process ``<pid>`` (a checkpoint, an exported model), renamed
  to ``<name>`` when complete (`atomic_directory`);
- ``.<name>.tmp-<pid>-<8 hex digits>``: a private directory in which the file ``<name>`` is written
  (`write_atomically`):
  whatever temporary files the writer makes itself (safetensors writes ``.tmpXXXXXX`` files) stay inside it, and
  the finished file is moved into place with one ``os.replace``;
- ``.<name>.deleting-<pid>``: a directory renamed out of sight before it is removed (`delete_directory`);
- ``.in-use.tmp-<pid>``: an empty file in a directory that process ``<pid>`` works in (a run directory while its
  fit runs: `mark_in_use`), so that another process leaves what is in it alone (`in_use_elsewhere`).

A process killed at any moment leaves the old content or the new one under the final name, and at most one such
temporary entry, which `remove_orphans` removes once its process no longer runs (the next run in the same
``output_dir`` does; so does the next save into a data cache). Whether a process runs is known on this machine
only (`torchloom.rundir.liveness`): processes that share a directory from several machines are not told apart.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from torchloom.rundir.liveness import pid_alive

__all__ = [
    "TEMPORARY",
    "atomic_directory",
    "delete_directory",
    "in_use_elsewhere",
    "mark_in_use",
    "remove_orphans",
    "temporary_path",
    "write_atomically",
    "write_failure",
]

#: The name of an entry in progress: ``group(1)`` the final name, ``group(2)`` the writing process.
TEMPORARY = re.compile(r"\.(.+)\.(?:tmp|deleting)-(\d+)(?:-[0-9a-f]{8})?")
#: The name `mark_in_use` marks a directory with, as `temporary_path` spells it: ``.in-use.tmp-<pid>``.
_IN_USE = "in-use"


def temporary_path(path: str | os.PathLike[str], pid: int | None = None, unique: bool = False) -> Path:
    """The temporary name of ``path`` in progress in process ``pid`` (this one by default), next to it:
    ``.<name>.tmp-<pid>``, with a random ``-<8 hex digits>`` when ``unique`` (several writes of one name at once)."""
    final = Path(path)
    suffix = f"-{secrets.token_hex(4)}" if unique else ""
    return final.parent / f".{final.name}.tmp-{os.getpid() if pid is None else pid}{suffix}"


def write_atomically(path: str | os.PathLike[str], content: str | bytes | Callable[[str], object]) -> None:
    """Write the file ``path`` atomically: its old content or the new one is under its name, never half of it.

    The file is written inside a private temporary directory next to ``path``
    (``.<name>.tmp-<pid>-<8 hex digits>``), then moved into place with one ``os.replace``; a process killed
    half-way leaves only that directory, which the next run in the same ``output_dir`` removes. Use it for any
    file a plugin writes into a run directory.

    Args:
        path (`str` or `os.PathLike`): the file to write; its directory must exist.
        content (`str`, `bytes` or callable): the text (UTF-8) or bytes to write, or a function that writes the
            file at the path it is given (``lambda p: safetensors.torch.save_file(tensors, p)``); temporary files
            it makes itself beside that path stay in the private directory.

    Raises:
        OSError: the file cannot be written (and whatever ``content`` raises); nothing is left behind.
    """
    final = Path(path)
    staging = temporary_path(final, unique=True)
    os.mkdir(staging)
    try:
        target = staging / final.name
        if isinstance(content, str):
            target.write_text(content, encoding="utf-8")
        elif isinstance(content, bytes):
            target.write_bytes(content)
        else:
            content(str(target))
        os.replace(target, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(
    path: str | os.PathLike[str], pid: int | None = None, rename: bool = True, marker: str | None = None
) -> Iterator[Path]:
    """Build the directory ``path`` under its temporary name (`temporary_path` with ``pid``, this process's by
    default) and rename it into place when the block ends without an error; remove it when it raises.

    Several processes may write into one such directory (pass them the same ``pid``, the main process's);
    ``rename``: whether this process renames it (only the main one should). ``marker``: the temporary directory is
    created here, holding an empty file of that name until just before the rename, so that `remove_orphans` can tell
    it from anything else in a folder that is not torchloom's own once a killed process left it.

    Raises:
        FileExistsError: ``path`` exists already (the rename never replaces a directory).
    """
    final = Path(path)
    tmp = temporary_path(final, pid)
    try:
        if marker is not None:
            tmp.mkdir()
            (tmp / marker).touch()
        yield tmp
        if marker is not None:
            (tmp / marker).unlink(missing_ok=True)
        if rename and tmp.exists():
            if final.exists():
                raise FileExistsError(f"{str(final)!r} exists already")
            os.rename(tmp, final)  # the only step that makes it visible: all of it, or nothing
    except BaseException:
        if rename:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def delete_directory(path: str | os.PathLike[str]) -> None:
    """Remove the directory ``path``: renamed out of sight (``.<name>.deleting-<pid>``) first, so a deletion cut
    short never leaves something that looks complete under its name."""
    final = Path(path)
    hidden = final.parent / f".{final.name}.deleting-{os.getpid()}"
    os.rename(final, hidden)
    shutil.rmtree(hidden)


def mark_in_use(directory: str | os.PathLike[str], in_use: bool = True) -> None:
    """Mark ``directory`` as in use by this process (``in_use=False``: no longer): the empty file
    ``.in-use.tmp-<pid>`` in it. A process killed before it unmarks leaves the file, which `remove_orphans`
    removes (and `in_use_elsewhere` ignores) once the process no longer runs."""
    marker = temporary_path(Path(directory) / _IN_USE)
    if in_use:
        marker.touch()
    else:
        marker.unlink(missing_ok=True)


def in_use_elsewhere(directory: str | os.PathLike[str]) -> bool:
    """Whether another process that still runs marked ``directory`` in use (`mark_in_use`)."""
    root = Path(directory)
    for entry in root.glob(f".{_IN_USE}.tmp-*") if root.is_dir() else ():
        match = TEMPORARY.fullmatch(entry.name)
        if match is not None and int(match.group(2)) != os.getpid() and pid_alive(int(match.group(2))):
            return True
    return False


def remove_orphans(folder: str | os.PathLike[str], name: str | None = None, marker: str | None = None) -> list[str]:
    """Remove the temporary entries (files or directories, see the module docstring) in ``folder`` whose process
    no longer runs; return their names. Entries of running processes, and every other entry, are left alone.

    In a folder that is not torchloom's own (the parent of an exported model's folder, which may hold anything), give
    ``name`` and / or ``marker`` to remove fewer: only the temporary entries of the final name ``name`` (earlier
    attempts at the same path), and the temporary directories that hold a file ``marker`` (what a writer marks its
    temporary directory with while it writes: `atomic_directory`'s ``marker``)."""
    removed = []
    root = Path(folder)
    for entry in root.iterdir() if root.is_dir() else ():
        match = TEMPORARY.fullmatch(entry.name)
        if match is None or pid_alive(int(match.group(2))):
            continue
        if (name is not None or marker is not None) and not (
            match.group(1) == name or (marker is not None and entry.is_dir() and (entry / marker).is_file())
        ):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):  # another process removed it first
                entry.unlink()
        removed.append(entry.name)
    return removed


def write_failure(exc: BaseException, path: str | os.PathLike[str]) -> str | None:
    """One line saying why writing at ``path`` failed, when ``exc`` is a failed write: an `OSError` (its
    ``strerror``), safetensors' ``SafetensorError`` for an I/O error, or the `RuntimeError` torch's ``torch.save``
    raises when its file cannot be written (a full disk gives ``unexpected pos ...``); with the space left on that
    file system. ``None`` for any other exception (not a write failure: let it propagate as it is)."""
    text = str(exc).strip()
    if isinstance(exc, OSError):
        reason = exc.strerror or text or type(exc).__name__
    elif type(exc).__name__ == "SafetensorError" and "I/O error" in text:
        reason = re.sub(r"^.*I/O error: | \(os error \d+\)$", "", text)
    elif isinstance(exc, RuntimeError) and ("PytorchStreamWriter" in text or "inline_container" in text):
        reason = f"torch.save failed ({text.splitlines()[0]})"
    else:
        return None
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return reason
    return f"{reason} ({free:,} bytes free on that file system)"
