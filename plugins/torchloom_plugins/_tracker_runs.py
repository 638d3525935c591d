"""Which tracker runs a fit writes to, recorded so that a resumed fit continues the same W&B and MLflow runs.

A resumed fit has a run directory of its own (`torchloom.Resumed`), but a W&B or MLflow run is one curve on a
service: the resumed fit should extend the run the interrupted fit wrote, not start a second one. So the
``trackers`` plugin records, in ``<run_dir>/trackers.json`` (`TRACKERS_FILE`), the id of every tracker run it
started that can be continued (`CONTINUABLE`), with the highest step it logged; a fit resumed from a checkpoint of
that run reads the file of the checkpoint's run directory (the last link of ``resumed.chain``) and starts each of
those trackers with the same id (`continue_kwargs`):

- ``wandb``: ``wandb.init(id=<id>, resume="allow")``, W&B's own resume (offline, the resumed part is written to a
  new ``offline-run-*-<id>`` folder of the new run directory; ``wandb sync`` uploads both into the one run);
- ``mlflow``: ``mlflow.start_run(run_id=<id>)`` in the tracking store that run lives in (the recorded tracking
  URI, unless ``MLFLOW_TRACKING_URI`` is set).

The values the continued run already holds are not sent again (`Continued.holds`): the records carried over from
the earlier runs, and the values the resumed fit logs at steps up to the highest one the earlier run logged (a fit
that saved at step 7 and went on to step 9 logged steps 8 and 9, which a bitwise resume logs again with the same
values). A tracker started fresh (TensorBoard, which writes into the new run directory, or a tracker the earlier
run did not have) gets the carried-over records, as before. The user's own ``init_kwargs`` (an ``id``, a
``run_id``, ``resume``) and W&B's / MLflow's environment variables (``WANDB_RUN_ID``, ``MLFLOW_RUN_ID``) win.

Sources: W&B's "Resume a run" guide (``id`` + ``resume="allow"``); MLflow's ``start_run(run_id=...)``; the HF
Trainer's W&B callback, which resumes through ``WANDB_RUN_ID`` / ``WANDB_RESUME`` too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torchloom

__all__ = ["CONTINUABLE", "TRACKERS_FILE", "Continued", "continue_kwargs", "read_runs", "run_ids", "write_runs"]

#: The file of a run directory that names the tracker runs its fit wrote to (main process).
TRACKERS_FILE = "trackers.json"
#: The trackers whose run a resumed fit continues, and the environment variable that names a run instead.
CONTINUABLE = {"wandb": "WANDB_RUN_ID", "mlflow": "MLFLOW_RUN_ID"}


@dataclass(frozen=True)
class Continued:
    """A tracker run that a resumed fit continues: ``name`` (``wandb``, ``mlflow``), its ``run_id``, the MLflow
    ``tracking_uri`` it lives in (``None`` for W&B), and ``last_step``: the highest step the earlier runs logged
    to it (``None`` when the earlier run ended without recording it: killed before its teardown)."""

    name: str
    run_id: str
    tracking_uri: str | None = None
    last_step: int | None = None

    def holds(self, step: int, resumed_step: int) -> bool:
        """Whether the run already holds what the resumed fit logs at ``step``: a step up to the highest the earlier
        run logged (the resumed fit logs those again, with the same values). ``resumed_step`` is the checkpoint's
        step, used when the earlier run did not record its highest: then the resumed fit's values are all sent."""
        return self.last_step is not None and step <= max(self.last_step, resumed_step)


def read_runs(run_dir: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> dict[str, Continued]:
    """The tracker runs the run in ``run_dir`` wrote to, by tracker name (`TRACKERS_FILE`): the runs a fit resumed
    from one of its checkpoints continues. Empty when ``run_dir`` is ``None`` (a checkpoint outside a run
    directory), the file is missing or unreadable (a run from before it was written), and without the trackers
    the environment names a run for (``WANDB_RUN_ID``, ``MLFLOW_RUN_ID``: the user chose)."""
    if run_dir is None:
        return {}
    try:
        recorded = json.loads((Path(run_dir) / TRACKERS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    runs = {}
    for name, entry in (recorded.get("runs") or {}).items() if isinstance(recorded, dict) else ():
        if name not in CONTINUABLE or CONTINUABLE[name] in environ or not isinstance(entry, dict):
            continue
        run_id, uri, step = entry.get("run_id"), entry.get("tracking_uri"), entry.get("last_step")
        if isinstance(run_id, str) and run_id:
            runs[name] = Continued(
                name,
                run_id,
                uri if isinstance(uri, str) else None,
                step if isinstance(step, int) and not isinstance(step, bool) else None,
            )
    return runs


def continue_kwargs(init_kwargs: dict[str, dict[str, Any]], continued: Mapping[str, Continued]) -> set[str]:
    """Add to ``init_kwargs`` (per tracker, as ``accelerator.init_trackers`` takes them; changed in place) what
    continues each run of ``continued``, unless the user's own arguments name a run; return the names of the
    trackers that continue a run."""
    names = set()
    for name, run in continued.items():
        given = init_kwargs.setdefault(name, {})
        if name == "wandb" and "id" not in given and "resume_from" not in given and "fork_from" not in given:
            given.update(id=run.run_id, resume=given.get("resume", "allow"))
            names.add(name)
        elif name == "mlflow" and "run_id" not in given:
            given["run_id"] = run.run_id
            names.add(name)
        if not given:
            del init_kwargs[name]
    return names


def run_ids(trackers: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """The run of each started tracker that a resumed fit can continue (`CONTINUABLE`): ``{"run_id"}``, and for
    MLflow its ``tracking_uri``; read from Accelerate's tracker objects (``WandBTracker.run``,
    ``MLflowTracker.active_run``)."""
    runs: dict[str, dict[str, Any]] = {}
    for tracker in trackers:
        if tracker.name == "wandb" and getattr(tracker, "run", None) is not None:
            runs["wandb"] = {"run_id": tracker.run.id}
        elif tracker.name == "mlflow" and getattr(tracker, "active_run", None) is not None:
            import mlflow

            runs["mlflow"] = {"run_id": tracker.active_run.info.run_id, "tracking_uri": mlflow.get_tracking_uri()}
    return runs


def write_runs(run_dir: str, runs: Mapping[str, Mapping[str, Any]], last_step: int | None) -> None:
    """Write `TRACKERS_FILE` into ``run_dir`` (main process; atomically): the runs (`run_ids`) and, once known, the
    highest step logged to them (at the run's end; ``None`` while it runs)."""
    entries = {name: {**entry, "last_step": last_step} for name, entry in runs.items()}
    text = torchloom.utils.json_dumps({"runs": entries}, indent=1) + "\n"
    torchloom.utils.write_atomically(os.path.join(run_dir, TRACKERS_FILE), text)
