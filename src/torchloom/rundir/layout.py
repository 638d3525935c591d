"""The layout of an ``output_dir``: its run directories ``version_N``, ordered by N (``version_10`` after
``version_2``), the ``latest`` link, and the folder of a run's checkpoints. One place for these names, so that every
reader (resume, predict, inspect, the next run's number, the orphan sweep) orders and recognises them alike."""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "CHECKPOINTS_DIR",
    "LATEST",
    "MODEL_CARD",
    "MODEL_DIR",
    "RESUMED_FILE",
    "RUN_DIR",
    "RUN_FILES",
    "SUMMARY_FILE",
    "is_run_dir",
    "run_directories",
]

#: A run directory's name: ``group(1)`` is its number.
RUN_DIR = re.compile(r"version_(\d+)")
#: The link in ``output_dir`` to the last completed fit.
LATEST = "latest"
#: The folder of a run directory that holds its checkpoints.
CHECKPOINTS_DIR = "checkpoints"
MODEL_DIR = "model"
"""The folder of a run directory that a completed fit saves its model in (``<run_dir>/model``, with the engine
setting ``save_model: true``); ``predict(ckpt_path=<run_dir>)`` and ``torchloom inspect`` read it."""
SUMMARY_FILE = "summary.json"
"""The file of a run directory with each logged value's last and best value and the run's timings, written at the
end of a completed ``fit`` or ``validate`` (by the ``progress`` plugin); ``torchloom inspect`` reads it."""
RESUMED_FILE = "resumed_from.json"
"""The file of a resumed fit's run directory that names what it continues: the checkpoint, the chain of runs before
it (oldest first) and what was carried over from them (written by the engine when the fit resumes); ``torchloom
inspect`` reads it."""
#: What a run directory holds from the moment its run started (at least one of them).
RUN_FILES = ("config.yaml", "metrics.jsonl", CHECKPOINTS_DIR)
#: The model card's file name, in the exported model's directory (a run's ``model/``).
MODEL_CARD = "torchloom_model.json"


def run_directories(output_dir: str | os.PathLike[str]) -> list[Path]:
    """The run directories of ``output_dir`` (``version_N`` folders), by N; empty when it is not a directory."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    runs = [(int(m.group(1)), p) for p in root.iterdir() if (m := RUN_DIR.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(runs)]


def is_run_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` looks like a run directory: it holds one of `RUN_FILES`."""
    root = Path(path)
    return root.is_dir() and any((root / name).exists() for name in RUN_FILES)
