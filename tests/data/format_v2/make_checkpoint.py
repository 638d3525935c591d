"""Writes the checkpoint kept in this folder (``out/``) and what its run did (``b.json``), with the code of the
revision it runs on: ``tests/test_checkpoint_format_compat.py`` resumes it with today's code.

It was written with the code of commit b738e6a (before issue 40 moved the core into folders and gave the
checkpoint one write and one load; format version 2, SHA-256 checksums):

    git worktree add --detach /tmp/base b738e6a
    cd tests/data/format_v2 && rm -rf out b.json && \\
        PYTHONPATH=/tmp/base/src:/tmp/base/plugins:../../mp python make_checkpoint.py

Run B of ``tests/mp/resume_fit.py``'s C11 case (`ShuffleTask`, 3 epochs of 5 batches) with a stateful plugin
(`Counted`), stopped right after its checkpoint at optimizer step 7 (epoch 1, after 2 of its batches; between two
logging steps, so the log buffer holds partial sums).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "mp"))

from resume_fit import ShuffleTask, _plain, fit  # noqa: E402

#: The run's settings (resume_fit.fit's defaults: max_epochs 3, log_every_n_steps 3, val_check_interval 4).
SAVE_AT = 7


class Counted:
    """A stateful plugin: the optimizer steps it saw and the sum of their losses' sign bits, a tensor."""

    name = "test.counted"

    def __init__(self) -> None:
        self.steps, self.total = 0, torch.zeros(2)

    def on_train_step_end(self, progress: Any) -> None:
        self.steps += 1
        self.total += torch.tensor([1.0, float(progress.global_step)])

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "total": self.total.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.total = state["steps"], state["total"].clone()


def main() -> None:
    out = HERE / "out"
    shutil.rmtree(out, ignore_errors=True)
    b = fit(ShuffleTask, out, [Counted()], save_at=[SAVE_AT])
    assert b.crashed, "run B never saved"
    checkpoint = Path(b.checkpoint).relative_to(out).as_posix()
    record = {
        "checkpoint": checkpoint,
        "ids": b.probe.ids,
        "steps": b.probe.steps,
        "history": _plain(list(b.engine.history)),
    }
    (HERE / "b.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
