"""How the checkpoint in this folder was made: with torchloom at commit b738e6a (before the core moved into folders,
issue 40), checkpoint format version 2.

    git worktree add --detach /tmp/old b738e6a
    PYTHONPATH=/tmp/old/src:/tmp/old/plugins python tests/data/checkpoint_format_2/make.py /tmp/out

It fits `TinyTask` for 6 optimizer steps with a checkpoint every 3; ``step-00000003`` is that run's checkpoint at
step 3, and ``final_model.safetensors`` the model of its checkpoint at step 6 (what the uninterrupted run ends
with). `tests/test_checkpoint_compat.py` resumes the first with the current code and expects the second, bitwise.
"""

from __future__ import annotations

import pathlib
import sys

import torchloom
from torchloom.testing import TinyTask

#: The run, as the test repeats it.
SETTINGS = {"max_steps": 6, "seed": 0, "log_every_n_steps": 1}
CHECKPOINT = {"every_n_steps": 3, "every_n_epochs": None}

if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    engine = torchloom.Engine(
        plugins=[{"checkpoint": CHECKPOINT}], default_plugins=False, output_dir=str(out / "run"), **SETTINGS
    )
    engine.fit(TinyTask(n=32, batch_size=4))
    print(sorted(p.name for p in (out / "run" / "version_0" / "checkpoints").iterdir()))
