"""A checkpoint write that fails on rank 1 only (tests/test_atomic_writes.py): ``torchrun --nproc_per_node 2
write_failure.py OUT``. Rank 1's files cannot grow past 1,000 bytes during the save of step 2 (its random states
need about 8 kB); each rank writes ``result-<rank>.json`` with the error it got and what is left in the run's
checkpoint folder."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
from file_limits import file_size_limit
from resume_fit import ShuffleTask

import torchloom


class FailOnRank1:
    name = "test.fail_on_rank1"

    def __init__(self) -> None:
        self.error: BaseException | None = None

    @torchloom.hookimpl
    def on_train_step_end(self, accelerator, progress) -> None:
        if progress.global_step != 2:
            return
        limit = 1_000 if accelerator.process_index == 1 else 1 << 40
        with file_size_limit(limit):
            try:
                torchloom.save_checkpoint()
            except BaseException as exc:
                self.error = exc
        raise RuntimeError("stop here")


def main(out: Path) -> None:
    probe = FailOnRank1()
    engine = torchloom.Engine(plugins=[probe], output_dir=str(out / "run"), max_epochs=1)
    with contextlib.suppress(RuntimeError):  # "stop here"
        engine.fit(ShuffleTask(n=16))
    rank = torch.distributed.get_rank()
    checkpoints = out / "run" / "version_0" / "checkpoints"
    result = {
        "error": type(probe.error).__name__,
        "message": str(probe.error),
        "left": sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else [],
    }
    (out / f"result-{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
