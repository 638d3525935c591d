"""A checkpoint written before the checkpoint's one write and one load (issue 40: commit b738e6a's code) still loads,
and its resume is bitwise an uninterrupted run of today's code.

``tests/data/format_v2/`` holds run B of the C11 case with a stateful plugin, stopped right after its checkpoint at
optimizer step 7 (mid-epoch: data generators, the look-ahead fetch's random states, partial log sums), and what B
did (``b.json``); ``make_checkpoint.py`` there wrote both with the old code. Here A runs uninterrupted and C resumes
B's checkpoint (a copy) with today's code: B then C is A, as in tests/test_resume.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from torchloom.checkpoint.manifest import FORMAT, read_manifest
from torchrun_util import MP_DIR

sys.path.insert(0, str(MP_DIR))

from resume_fit import ShuffleTask, _plain, fit, snapshot

DATA = Path(__file__).resolve().parent / "data" / "format_v2"
sys.path.insert(0, str(DATA))

from make_checkpoint import SAVE_AT, Counted  # noqa: E402


def test_a_checkpoint_of_the_previous_code_resumes_to_an_uninterrupted_run_bitwise(tmp_path) -> None:
    b = json.loads((DATA / "b.json").read_text())
    out = tmp_path / "out"
    shutil.copytree(DATA / "out", out)
    checkpoint = out / b["checkpoint"]
    manifest = read_manifest(checkpoint)
    assert (manifest["format"], manifest["version"], manifest["global_step"]) == (FORMAT, 2, SAVE_AT)  # SHA-256
    a_counted, c_counted = Counted(), Counted()
    a = fit(ShuffleTask, tmp_path / "a", [a_counted])
    c = fit(ShuffleTask, out, [c_counted], ckpt_path=str(checkpoint))
    assert not a.crashed and not c.crashed and c.engine.resumed_from == str(checkpoint)
    assert [s["step"] for s in c.probe.steps] == list(range(SAVE_AT + 1, 16))  # continued, not started over
    assert b["ids"] + c.probe.ids == a.probe.ids
    assert b["steps"] + c.probe.steps == a.probe.steps
    assert b["history"] + _plain(list(c.engine.history)) == _plain(list(a.engine.history))
    assert snapshot(c.engine) == snapshot(a.engine)
    assert c_counted.steps == a_counted.steps and torch.equal(c_counted.total, a_counted.total)
