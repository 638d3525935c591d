"""Checkpoints bounded over the runs of one ``output_dir`` (`prune_checkpoints`): what the ``checkpoint`` plugin's
``keep_across_runs`` applies after each save, as the HF Trainer's ``save_total_limit`` bounds one output directory;
and over the runs one training continues (`prune_lineage`): what its ``keep_last`` applies to a resumed fit, so that a
job preempted and resumed any number of times keeps ``keep_last`` checkpoints in all.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from torchloom.checkpoint.lineage import Resumed, lineage_checkpoints, lineage_scores, recorded_score
from torchloom.checkpoint.store import MANIFEST, _run_checkpoints, delete_checkpoint
from torchloom.errors import CheckpointError
from torchloom.monitor import Monitor
from torchloom.rundir import atomic
from torchloom.rundir.layout import CHECKPOINTS_DIR, run_directories

__all__ = ["lineage_checkpoints", "lineage_scores", "prune_checkpoints", "prune_lineage", "recorded_score"]

# lineage_checkpoints, lineage_scores and recorded_score live in torchloom.checkpoint.lineage (a resumed fit's runs)


def prune_checkpoints(
    output_dir: str | os.PathLike[str],
    keep: int,
    *,
    spare: Iterable[str | os.PathLike[str]] = (),
    monitor: str | None = None,
    mode: str = "min",
    keep_best: int = 1,
) -> list[str]:
    """Delete the oldest complete checkpoints of the run directories of ``output_dir`` (its ``version_N``, as
    `list_checkpoints` orders them: by run, then by step) beyond the newest ``keep``. Call it on the main process
    only. Return the checkpoints deleted, oldest first.

    Never deleted, whatever their age: the checkpoints named in ``spare`` (the one a fit resumed from, the best ones
    it keeps); with ``monitor``, the ``keep_best`` best by the value of ``monitor`` each manifest recorded
    (``mode`` ``"min"`` or ``"max"``; NaN is never the best, an earlier checkpoint wins a tie); and every checkpoint
    of a run directory that another running process marked in use (a fit still running there: see
    `torchloom.rundir.atomic.mark_in_use`). Nothing outside ``output_dir``'s own run directories is touched (a
    ``version_N`` that is a link to elsewhere is left alone). Each deletion is `delete_checkpoint`'s: renamed out
    of sight, then removed; one that another process deleted first is skipped.

    Raises:
        ValueError: ``keep`` or ``keep_best`` below 1, or an unknown ``mode``.
        OSError: a checkpoint cannot be renamed or removed.
    """
    if keep < 1 or keep_best < 1 or mode not in Monitor.MODES:
        raise ValueError(f"prune_checkpoints: keep={keep!r}, keep_best={keep_best!r}, mode={mode!r}")
    root = Path(output_dir).resolve()
    runs = [run for run in run_directories(root) if not run.is_symlink() and run.resolve().parent == root]
    found = [  # a link to a checkpoint elsewhere (the checkpoint, or its checkpoints/ folder) is not this output_dir's
        (candidate, manifest, run)
        for run in runs
        for candidate, manifest in _run_checkpoints(run)
        if not candidate.is_symlink() and candidate.resolve() == run / CHECKPOINTS_DIR / candidate.name
    ]
    kept = {candidate for candidate, _, _ in found[-keep:]}
    kept |= {Path(path).resolve() for path in spare}
    if monitor is not None:
        scored: list[tuple[float, Path]] = []
        records: dict[str, list[dict[str, Any]]] = {}
        for candidate, manifest, _ in found:
            value = recorded_score(candidate, manifest, monitor, records)
            if value is not None:
                scored.append((value, candidate))
        scored.sort(key=lambda entry: entry[0], reverse=mode == "max")  # stable: the earlier one first on a tie
        kept |= {candidate for _, candidate in scored[:keep_best]}
    busy = {run for run in runs if atomic.in_use_elsewhere(run)}
    deleted = []
    for candidate, _, run in found:
        if candidate in kept or run in busy:
            continue
        try:
            delete_checkpoint(candidate)
        except (CheckpointError, FileNotFoundError):  # deleted by another process meanwhile
            continue
        deleted.append(str(candidate))
    return deleted


def prune_lineage(
    resumed: Resumed,
    keep: int,
    newer: Sequence[str | os.PathLike[str]],
    *,
    output_dir: str | os.PathLike[str] | None = None,
    spare: Iterable[str | os.PathLike[str]] = (),
) -> list[str]:
    """Delete the checkpoints of the runs a resumed fit continues (`lineage_checkpoints`, of ``output_dir``'s own
    runs when given) that are not among the newest ``keep`` of the whole training: those, then ``newer`` (the fit's
    own checkpoints, oldest first; only those that are complete are counted, so the newest complete checkpoint of
    the training is never deleted). Call it on the main process only. Return the checkpoints deleted, oldest first.

    This is how the ``checkpoint`` plugin's ``keep_last`` counts the training rather than the run: a job preempted
    and resumed any number of times (``torchloom fit --resume auto``) keeps at most ``keep`` checkpoints, plus the
    one it resumed from while it runs (the plugin spares it until training ends) and the best it keeps by
    ``monitor``: pass those in ``spare``. Never deleted: those in ``spare``, those of another ``output_dir``, and
    those of a run directory that another running process marked in use.

    Raises:
        ValueError: ``keep`` below 1.
        OSError: a checkpoint cannot be renamed or removed.
    """
    if keep < 1:
        raise ValueError(f"prune_lineage: keep={keep!r}")
    earlier = lineage_checkpoints(resumed, output_dir)
    complete = [str(p) for p in newer if (Path(p) / MANIFEST).is_file()]  # one gone or never complete: not counted
    kept = {os.path.realpath(p) for p in [*earlier, *complete][-keep:]}
    kept |= {os.path.realpath(p) for p in spare}
    deleted = []
    for candidate in earlier:
        run = Path(candidate).parent.parent
        if os.path.realpath(candidate) in kept or atomic.in_use_elsewhere(run):
            continue
        try:
            delete_checkpoint(candidate)
        except (CheckpointError, FileNotFoundError):  # deleted by another process meanwhile
            continue
        deleted.append(candidate)
    return deleted
