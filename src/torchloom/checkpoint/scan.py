"""`scan_checkpoints`: every checkpoint under a run directory or an ``output_dir``, the usable and the unusable, so
that "no checkpoint" and "checkpoints, none usable" are told apart wherever the latest checkpoint is picked (a fit's
``ckpt_path="auto"`` / ``--resume``, ``validate`` / ``predict``'s ``ckpt_path``, ``torchloom inspect``).

A checkpoint is any directory in ``<run_dir>/checkpoints/`` whose name does not start with ``.`` (the temporary
directories of a save or a deletion in progress do). It is *usable* when its ``manifest.json`` reads and is of this
torchloom's format and version (`torchloom.checkpoint.manifest.read_manifest`); otherwise *unusable*, with the reason:
no manifest, a truncated or damaged one, another format or version. The files' hashes are not checked here (loading
the one picked checks them).

A checkpoint is written atomically (its manifest last, then renamed into place), so an unusable one was damaged or
changed after it was written, or comes from another torchloom version: resuming past it, from an older one, would
silently drop training; the pickers refuse instead and name it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from torchloom.checkpoint.manifest import MANIFEST, read_manifest
from torchloom.errors import CheckpointError
from torchloom.rundir.layout import CHECKPOINTS_DIR, run_directories

__all__ = ["CheckpointScan", "Unusable", "scan_checkpoints"]

#: The name the engine gives a checkpoint (``step-00000120``, ``step-00000120-epoch-end``): its step and kind.
_NAME = re.compile(r"step-(\d+)(-epoch-end)?")


@dataclasses.dataclass(frozen=True)
class Unusable:
    """A checkpoint directory that cannot be resumed from or loaded: ``path`` and ``reason``."""

    path: str
    reason: str
    _key: tuple[int, float, bool] = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class CheckpointScan:
    """What `scan_checkpoints` found.

    Attributes:
        usable (`list[tuple[pathlib.Path, dict]]`): the usable checkpoints with their manifests, oldest first
            (`torchloom.checkpoint.store.list_checkpoints`' order: by run, then by global step, an end-of-epoch
            checkpoint after a step checkpoint of the same step).
        unusable (`list[Unusable]`): the unusable ones, in the same order (one whose step its name does not tell
            is taken as the newest of its run).
    """

    usable: list[tuple[Path, dict[str, Any]]]
    unusable: list[Unusable]
    _usable_keys: list[tuple[int, float, bool]] = dataclasses.field(repr=False)

    @property
    def newer_unusable(self) -> list[Unusable]:
        """The unusable checkpoints at least as new as the newest usable one (all of them when none is usable):
        those that a pick of the latest checkpoint would have taken."""
        if not self.usable:
            return list(self.unusable)
        newest = self._usable_keys[-1]
        return [entry for entry in self.unusable if entry._key >= newest]

    def ordered(self) -> list[tuple[str, dict[str, Any] | None, str | None]]:
        """Every checkpoint, usable or not, oldest first: ``(path, manifest, None)`` or ``(path, None, reason)``."""
        entries: list[tuple[tuple[int, float, bool], int, str, dict[str, Any] | None, str | None]] = [
            (key, 0, str(candidate), manifest, None)
            for key, (candidate, manifest) in zip(self._usable_keys, self.usable, strict=True)
        ]
        entries += [(entry._key, 1, entry.path, None, entry.reason) for entry in self.unusable]
        entries.sort(key=lambda entry: entry[:3])
        return [(path, manifest, reason) for _, _, path, manifest, reason in entries]

    def refusal(self, where: str, *, newest_only: bool = True, hint: str = "") -> str | None:
        """The message of a pick of the latest checkpoint that must be refused, ``None`` when it need not be.

        Args:
            where (`str`): what is refused (``"cannot resume from 'runs/x'"``).
            newest_only (`bool`): refuse only for `newer_unusable` ones; False: for any unusable one (a pick by a
                recorded value, which an unreadable manifest hides).
            hint (`str`): what else the user can do, appended.
        """
        bad = self.newer_unusable if newest_only else self.unusable
        if not bad:
            return None
        count = f"{len(bad)} checkpoint{'s' if len(bad) != 1 else ''}"
        listed = "; ".join(f"{entry.path}: {entry.reason}" for entry in bad)
        if self.usable:
            older = str(self.usable[-1][0])
            what = (
                f"{count} newer than the newest usable one ({older}) cannot be used"
                if newest_only
                else f"{count} cannot be read, so which is best cannot be told"
            )
        else:
            what, older = f"{count} found, none usable", ""
        them = "it" if len(bad) == 1 else "them"
        then = f" to use {older}" if older and newest_only else ""
        return f"{where}: {what} ({listed}); move {them} out of checkpoints/ (or delete {them}){then}{hint}"


def scan_checkpoints(path: str | os.PathLike[str]) -> CheckpointScan:
    """Every checkpoint under ``path``: a run directory (``<output_dir>/version_N``, its ``checkpoints/``) or an
    ``output_dir`` (its runs, by N); nothing when it holds neither. Reads only the manifests.

    Raises:
        CheckpointError: a ``checkpoints/`` folder that cannot be listed (no permission).
    """
    root = Path(path)
    runs = [root] if (root / CHECKPOINTS_DIR).is_dir() else run_directories(root)
    usable: list[tuple[tuple[int, float, bool], str, Path, dict[str, Any]]] = []
    unusable: list[Unusable] = []
    for index, run in enumerate(runs):
        folder = run / CHECKPOINTS_DIR
        try:  # a folder that cannot be listed is not "no checkpoint"
            listed = sorted(folder.iterdir()) if folder.is_dir() else []
        except OSError as exc:
            raise CheckpointError(f"cannot list the checkpoints in {str(folder)!r}: {exc}") from None
        for candidate in listed:
            if candidate.name.startswith(".") or not candidate.is_dir():
                continue
            try:
                manifest = read_manifest(candidate)
            except CheckpointError as exc:
                named = _NAME.fullmatch(candidate.name)
                key = (index, float(named.group(1)), bool(named.group(2))) if named else (index, float("inf"), True)
                unusable.append(Unusable(str(candidate), _reason(exc, candidate), key))
                continue
            position = manifest.get("position") or {}
            step = manifest.get("global_step", -1)
            key = (index, float(step) if isinstance(step, int) else -1.0, bool(position.get("epoch_finished")))
            usable.append((key, candidate.name, candidate, manifest))
    usable.sort(key=lambda entry: entry[:2])
    unusable.sort(key=lambda entry: (entry._key, entry.path))
    return CheckpointScan(
        [(candidate, manifest) for _, _, candidate, manifest in usable], unusable, [entry[0] for entry in usable]
    )


def _reason(exc: CheckpointError, candidate: Path) -> str:
    """`read_manifest`'s message, without the path it repeats."""
    if not (candidate / MANIFEST).exists():
        return f"it has no {MANIFEST} (not written by a completed save, or its manifest was removed)"
    text = str(exc)
    for shown in (repr(str(candidate / MANIFEST)), repr(str(candidate))):
        text = text.replace(shown, MANIFEST if shown.endswith(f"{MANIFEST}'") else "it")
    return text


#: What a refused resume can do instead (`CheckpointScan.refusal`'s ``hint`` for ``fit``).
RESUME_HINT = (
    "; or resume from a checkpoint named explicitly (ckpt_path=PATH, --resume PATH), or fit without ckpt_path "
    "(without --resume) to start a new training"
)
