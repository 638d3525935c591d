"""A training in several runs: what a resumed fit continues, and what a checkpoint records for the next resume.

A fit killed and resumed twice is one training in three run directories; each keeps only what its own process
wrote, and the last one is also complete:

- a checkpoint's manifest records ``training`` (`training_record`): the ``metrics.jsonl`` records written up to
  it, the whole training's samples and times up to it, and the chain of runs its own run continued;
- a fit resumed from it (`FitLoop.resume`) builds a `Resumed` (`read_resumed`): the chain, oldest first, ending
  with the checkpoint's run; the records of that run's ``metrics.jsonl`` written before the checkpoint was saved
  (its first ``records`` lines: the earlier runs' carried-over records, then that run's own), each marked with
  ``carried_over_from``; and the totals. The main process writes the records at the top of the new run's
  ``metrics.jsonl`` and the chain to ``<run_dir>/resumed_from.json`` (`write_resumed`), before ``on_fit_start``,
  which gets the `Resumed` (the ``trackers`` plugin writes the records to its trackers at their steps, the
  ``progress`` summary counts the whole training).

Counting records rather than steps is what makes the carried-over part exact: after a checkpoint at step 40 the
run that saved it may still log at step 40 (the epoch's validation), and the resumed fit logs that again.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchloom._strict_json import json_dumps, read_number
from torchloom._warn import warn as warn_at_caller
from torchloom.checkpoint.manifest import read_manifest
from torchloom.checkpoint.store import _run_checkpoints
from torchloom.errors import CheckpointError, RunFileError, TorchloomError
from torchloom.rundir.atomic import write_atomically
from torchloom.rundir.layout import CHECKPOINTS_DIR, RESUMED_FILE

__all__ = [
    "CARRIED_OVER",
    "Resumed",
    "lineage_checkpoints",
    "lineage_scores",
    "read_chain",
    "read_records",
    "read_resumed",
    "recorded_score",
    "training_record",
    "write_resumed",
]

#: The key of a ``metrics.jsonl`` record carried over from an earlier run: that run's directory.
CARRIED_OVER = "carried_over_from"
#: The keys of a record that are not logged values.
_NOT_VALUES = ("step", "epoch", CARRIED_OVER)


@dataclass(frozen=True)
class Resumed:
    """What a resumed fit continues: the ``resumed`` argument of ``on_fit_start`` (``None`` for a fit that starts
    from scratch). The same on every process. Do not mutate.

    Attributes:
        checkpoint (`str`): the checkpoint the fit resumed from, as ``ckpt_path`` / ``--resume`` named it.
        global_step (`int`): its optimizer step: the fit goes on from the next one.
        chain (`tuple[dict, ...]`): the runs this fit continues, oldest first: ``{"run_dir", "checkpoint",
            "global_step"}`` each, the run directory (``None`` for a checkpoint outside a run directory) and the
            checkpoint of it that the next run resumed from. The last is ``checkpoint``'s run.
        records (`tuple[dict, ...]`): the ``metrics.jsonl`` records of those runs up to the checkpoint (``step``,
            ``epoch``, ``carried_over_from``: the run directory that logged it, then the logged values), oldest
            first: what the fit's ``metrics.jsonl`` starts with.
        samples (`int` or ``None``): training samples of the whole training up to the checkpoint (each batch's
            size on the main process times the processes); ``None`` when a batch had no size or the checkpoint
            does not record it.
        train_time_s (`float`): seconds of training up to the checkpoint, over the runs (validation excluded).
        wall_time_s (`float`): seconds from the start of each run's ``fit`` to its checkpoint, over the runs.
    """

    checkpoint: str
    global_step: int
    chain: tuple[dict[str, Any], ...] = ()
    records: tuple[dict[str, Any], ...] = ()
    samples: int | None = 0
    train_time_s: float = 0.0
    wall_time_s: float = 0.0

    def logged(self) -> list[tuple[int, int, dict[str, float]]]:
        """``(step, epoch, values)`` of each carried-over record: what ``on_log`` received in the earlier runs."""
        return [(r["step"], r["epoch"], {k: v for k, v in r.items() if k not in _NOT_VALUES}) for r in self.records]

    def scores(self, monitor: str, output_dir: str | os.PathLike[str] | None = None) -> dict[str, float]:
        """The value of ``monitor`` each checkpoint of the runs this fit continues was saved with (its manifest's,
        else the latest of the records written up to it), by path, oldest first; those with none (or NaN) left
        out. With ``output_dir``, only the checkpoints of its own runs. The ``checkpoint`` plugin ranks them with
        its own so that ``keep_best`` keeps the best of the whole training (`lineage_scores`).
        """
        return lineage_scores(self, monitor, output_dir)


def training_record(
    resumed: Resumed | None, records: int, samples: int | None, train_time_s: float, wall_time_s: float
) -> dict[str, Any]:
    """The ``training`` entry of a checkpoint's manifest: the whole training up to the checkpoint. ``records``,
    ``samples`` and the times are this run's own (its records: ``engine.history``); ``resumed`` adds the earlier
    runs'."""
    before = resumed or Resumed("", 0)
    total_samples = None if samples is None or before.samples is None else before.samples + samples
    return {
        "records": len(before.records) + records,
        "samples": total_samples,
        "train_time_s": before.train_time_s + train_time_s,
        "wall_time_s": before.wall_time_s + wall_time_s,
        "resumed_from": list(before.chain),
    }


def read_resumed(checkpoint: str, manifest: Mapping[str, Any], warn: bool = True) -> Resumed:
    """The `Resumed` of a fit that resumes from ``checkpoint`` (whose manifest is ``manifest``): its run's first
    ``training.records`` records (a checkpoint written before they were counted: those up to its step), marked.

    Warns (with ``warn``: on the main process) when fewer records are found than the checkpoint counted: its run's
    ``metrics.jsonl`` was cut or deleted, or the checkpoint was moved out of its run directory.
    """
    step = int(manifest.get("global_step", 0))
    training = manifest.get("training") or {}
    run_dir = _run_dir_of(checkpoint)
    count = training.get("records")
    found = read_records(Path(run_dir) / "metrics.jsonl") if run_dir is not None else []
    kept = found[:count] if isinstance(count, int) else [r for r in found if r.get("step", step + 1) <= step]
    if warn and isinstance(count, int) and len(kept) < count:
        where = (
            f"its run's metrics.jsonl holds {len(kept)} of the {count} records written up to it"
            if run_dir is not None
            else f"it is not in a run directory (<run_dir>/{CHECKPOINTS_DIR}/<name>), so none of the {count} "
            "records written up to it can be read"
        )
        warn_at_caller(
            f"resuming from {checkpoint!r}: {where}; the new run's metrics.jsonl carries over only those found",
        )
    records: list[dict[str, Any]] = []
    for record in kept:
        marked = {"step": record.get("step"), "epoch": record.get("epoch"), CARRIED_OVER: run_dir}
        marked.update((k, v) for k, v in record.items() if k not in ("step", "epoch"))
        records.append(marked)
    chain = [dict(link) for link in training.get("resumed_from") or []]
    chain.append({"run_dir": run_dir, "checkpoint": checkpoint, "global_step": step})
    samples = training.get("samples", None)
    return Resumed(
        checkpoint=checkpoint,
        global_step=step,
        chain=tuple(chain),
        records=tuple(records),
        samples=samples if isinstance(samples, int) else None,
        train_time_s=float(training.get("train_time_s", 0.0)),
        wall_time_s=float(training.get("wall_time_s", 0.0)),
    )


def write_resumed(run_dir: str, resumed: Resumed) -> None:
    """Write what a resumed fit continues into its new ``run_dir`` (main process, before anything is logged):
    the carried-over records as the first lines of ``metrics.jsonl``, and ``resumed_from.json`` (the checkpoint,
    the chain oldest first, the totals carried over). Both atomically.

    Raises:
        RunFileError: a file cannot be written.
    """
    lines = "".join(json_dumps(record) + "\n" for record in resumed.records)
    lineage = {
        "checkpoint": resumed.checkpoint,
        "global_step": resumed.global_step,
        "chain": list(resumed.chain),
        "carried_over": {
            "records": len(resumed.records),
            "samples": resumed.samples,
            "train_time_s": resumed.train_time_s,
            "wall_time_s": resumed.wall_time_s,
        },
    }
    files = {"metrics.jsonl": lines, RESUMED_FILE: json_dumps(lineage, indent=1) + "\n"}
    for name, text in files.items():
        path = os.path.join(run_dir, name)
        try:
            write_atomically(path, text)
        except OSError as exc:
            raise RunFileError(f"cannot write {path!r}: {exc.strerror or exc}") from exc


def read_chain(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]] | None:
    """The chain of runs that the run in ``run_dir`` continues, oldest first (its ``resumed_from.json``); ``None``
    for a run that did not resume, or whose file cannot be read."""
    try:
        lineage = json.loads((Path(run_dir) / RESUMED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    chain = lineage.get("chain") if isinstance(lineage, dict) else None
    return [dict(link) for link in chain if isinstance(link, dict)] if isinstance(chain, list) else None


def lineage_checkpoints(resumed: Resumed, output_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """The complete checkpoints of the runs a resumed fit continues (``resumed.chain``), oldest first: of each run,
    those up to the step the next run resumed from (a checkpoint after it is of a branch that no run continued).
    With ``output_dir``, only runs that are its own ``version_N`` directories (not links to runs elsewhere). A link
    outside a run directory, or to a run directory that is gone, adds none."""
    root = Path(output_dir).resolve() if output_dir is not None else None
    found = []
    for link in resumed.chain:
        run_dir, step = link.get("run_dir"), link.get("global_step")
        if not isinstance(run_dir, str) or not isinstance(step, int) or not os.path.isdir(run_dir):
            continue
        run = Path(run_dir)
        if root is not None and (run.is_symlink() or run.resolve().parent != root):
            continue  # another output_dir's run (the fit resumed from it), or one linked in: never touched
        for candidate, manifest in _run_checkpoints(run):
            if manifest.get("global_step", -1) <= step and not candidate.is_symlink():
                found.append(str(candidate))
    return found


def recorded_score(
    checkpoint: str | os.PathLike[str],
    manifest: Mapping[str, Any],
    monitor: str,
    records: dict[str, list[dict[str, Any]]] | None = None,
) -> float | None:
    """The value of ``monitor`` a checkpoint was saved with, as the ``checkpoint`` plugin scored it: the value its
    manifest recorded (the latest logged one at the save), else (a resumed run's checkpoint saved before the value
    was logged again in that run) the latest value among the records written up to it (its run's
    ``metrics.jsonl``, whose first lines are the records carried over from the runs it continued). ``None`` when
    there is none, or it is NaN (never the best). ``records``: a cache of the runs' records, by run directory."""
    value = (manifest.get("metrics") or {}).get(monitor)
    if not _is_number(value):
        training = manifest.get("training") or {}
        count = training.get("records")
        run = os.path.dirname(os.path.dirname(os.path.normpath(str(checkpoint))))
        if not isinstance(count, int) or os.path.basename(os.path.dirname(str(checkpoint))) != CHECKPOINTS_DIR:
            return None
        if records is None or run not in records:
            try:
                found = read_records(Path(run) / "metrics.jsonl")
            except RunFileError:
                found = []
            if records is not None:
                records[run] = found
        else:
            found = records[run]
        value = next((r[monitor] for r in reversed(found[:count]) if _is_number(r.get(monitor))), None)
    return None if value is None or math.isnan(value) else float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def lineage_scores(
    resumed: Resumed, monitor: str, output_dir: str | os.PathLike[str] | None = None
) -> dict[str, float]:
    """The recorded score (`recorded_score`) of each checkpoint of the runs a resumed fit continues
    (`lineage_checkpoints`), oldest first; those without one are left out. What the ``checkpoint`` plugin ranks
    together with its own checkpoints' scores, so that ``keep_best`` keeps the best of the whole training (as an
    uninterrupted fit does), not of the last run only."""
    records: dict[str, list[dict[str, Any]]] = {}
    scores = {}
    for candidate in lineage_checkpoints(resumed, output_dir):
        try:
            manifest = read_manifest(candidate)
        except CheckpointError:
            continue
        score = recorded_score(candidate, manifest, monitor, records)
        if score is not None:
            scores[candidate] = score
    return scores


def _run_dir_of(checkpoint: str) -> str | None:
    """The run directory a checkpoint is in (``<run_dir>/checkpoints/<name>``), as the path names it."""
    parent = os.path.dirname(os.path.normpath(checkpoint))
    return os.path.dirname(parent) if os.path.basename(parent) == CHECKPOINTS_DIR else None


def read_records(path: Path, error: type[TorchloomError] = RunFileError, prefix: str = "") -> list[dict[str, Any]]:
    """The complete JSON lines of a run's ``metrics.jsonl`` (a partial last line, left by a killed process, is
    skipped), the strings ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"`` read back as floats; none when the file is
    missing. The one reader of the file for resuming (`read_resumed`) and for ``torchloom inspect``.

    Raises:
        error: the file exists but cannot be read (``RunFileError`` by default; ``inspect`` passes `ConfigError`),
            its message ``prefix`` + ``cannot read '<path>': <reason>``.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise error(f"{prefix}cannot read {str(path)!r}: {exc.strerror or exc}") from exc
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append({k: read_number(v) for k, v in record.items()})
    return records
