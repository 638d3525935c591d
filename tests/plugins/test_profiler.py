"""The ``profiler`` plugin: the schedule counts optimizer steps (also under gradient accumulation), each cycle writes
a Chrome trace and a table of the top operations into the run directory, the profiler stops after the last cycle,
only the main process profiles unless ``all_ranks`` (2 processes), and bad settings are one error."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest

import torchloom
from torchloom.testing import tiny_fit
from torchloom_plugins.profiler import Profiler
from torchrun_util import torchrun

STEPS_PER_EPOCH = 8  # TinyTask: 32 samples in micro-batches of 4


def _events(path: str) -> collections.Counter:
    return collections.Counter(event.get("name") for event in json.loads(Path(path).read_text())["traceEvents"])


def _profiler_steps(events: collections.Counter) -> list[int]:
    return sorted(int(m.group(1)) for name in events if (m := re.fullmatch(r"ProfilerStep#(\d+)", str(name))))


def test_each_cycle_writes_a_trace_of_its_active_optimizer_steps_and_a_table(tmp_path):
    """wait 1, warmup 1, active 2, repeat 2 over 8 steps: cycles of 4 steps, the active ones 2, 3 and 6, 7."""
    profiler = Profiler(wait=1, warmup=1, active=2, repeat=2, row_limit=5)
    engine = tiny_fit([profiler], max_epochs=1, output_dir=str(tmp_path))
    folder = Path(engine.run_dir) / "profiler"
    assert sorted(p.name for p in folder.iterdir()) == [
        "ops-rank0-cycle1.txt",
        "ops-rank0-cycle2.txt",
        "trace-rank0-cycle1.json",
        "trace-rank0-cycle2.json",
    ]
    for cycle, active in ((1, [2, 3]), (2, [6, 7])):
        events = _events(str(folder / f"trace-rank0-cycle{cycle}.json"))
        assert _profiler_steps(events) == active
        assert events["Optimizer.step#SGD.step"] == 2  # one per active optimizer step
    table = (folder / "ops-rank0-cycle1.txt").read_text()
    assert "Self CPU" in table and "# of Calls" in table
    rows = [line for line in table.splitlines() if line and not line.startswith("-") and "Name" not in line]
    assert len(rows) == 5 + 1  # row_limit rows, then the "Self CPU time total" line
    assert profiler._profiler is None and profiler.steps == STEPS_PER_EPOCH  # stopped after the last cycle


def test_a_profiler_step_is_an_optimizer_step_under_accumulation(tmp_path):
    """4 micro-batches per optimizer step: 2 steps per epoch, 2 epochs; wait 0, warmup 1, active 2: the steps 1 and
    2, two optimizer steps of 4 micro-batches each (a schedule counted in micro-batches would hold one)."""
    profiler = Profiler(wait=0, warmup=1, active=2)
    engine = tiny_fit([{"grad_accum": {"steps": 4}}, profiler], max_epochs=2, output_dir=str(tmp_path))
    (trace,) = [p for p in profiler.written if p.endswith(".json")]
    events = _events(trace)
    assert _profiler_steps(events) == [1, 2]
    assert events["Optimizer.step#SGD.step"] == 2
    assert events["enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"] >= 8
    assert engine.progress.global_step == profiler.steps == 4


def test_a_fit_shorter_than_the_active_phase_writes_what_it_recorded(tmp_path):
    profiler = Profiler(wait=0, warmup=1, active=20)
    tiny_fit([profiler], max_epochs=1, output_dir=str(tmp_path))
    (trace,) = [p for p in profiler.written if p.endswith(".json")]
    # steps 1 to 7 (0 is the warm-up), then what follows the last one until training ends (its validation)
    assert _profiler_steps(_events(trace)) == list(range(1, STEPS_PER_EPOCH + 1))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"active": 0}, "setting 'active' = 0; expected an integer >= 1"),
        ({"wait": -1}, "setting 'wait' = -1; expected an integer >= 0"),
        ({"repeat": 0}, "setting 'repeat' = 0; expected an integer >= 1"),
        ({"row_limit": 0}, "setting 'row_limit' = 0; expected an integer >= 1"),
    ],
)
def test_bad_settings_are_one_clear_error(settings, message):
    with pytest.raises(torchloom.ConfigError, match=f"plugin 'profiler': {message}"):
        torchloom.enable_plugins({"profiler": settings})


@pytest.mark.multiprocess
@pytest.mark.slow
def test_only_the_main_process_profiles_unless_all_ranks(tmp_path):
    ranks = torchrun("profiler_fit.py", tmp_path)
    assert [r["main"] for r in ranks] == [["trace-rank0-cycle1.json"], []]
    assert [r["all"] for r in ranks] == [["trace-rank0-cycle1.json"], ["trace-rank1-cycle1.json"]]
    assert [r["steps"] for r in ranks] == [4, 4]  # every rank counts; only the profiling ones step a profiler
