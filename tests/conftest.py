"""Test configuration: offline, deterministic, and no plugin is enabled unless a test enables it; the quick subset
(``-m "not slow and not multiprocess"``, CONTRIBUTING.md) kept quick: a torchrun start in a test not marked
``multiprocess`` fails it, and a full run lists the unmarked tests slower than `QUICK_LIMIT_S`."""

from __future__ import annotations

import os

import pytest

import torchrun_util

#: A test not marked ``slow`` or ``multiprocess`` that takes longer (its call, on the 2-core machine) is listed at
#: the end of the run: mark it, or make it faster. Not a failure: a loaded machine is slower.
QUICK_LIMIT_S = 10.0
_slow_unmarked: list[tuple[float, str]] = []

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch):
    """No test leaks TORCHLOOM_* variables into another, nor the progress-bar variables the ``torchloom`` command
    sets for its process (`torchloom.utils.quiet_libraries`) when a test runs it in this one."""
    for var in ("TORCHLOOM_PLUGINS", "TORCHLOOM_TRACE_HOOKS"):
        monkeypatch.delenv(var, raising=False)
    for var in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):  # kept, restored afterwards
        if var in os.environ:
            monkeypatch.setenv(var, os.environ[var])
        else:
            monkeypatch.delenv(var, raising=False)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    torchrun_util.current_test = item  # before the fixtures, some of which start torchrun


def pytest_runtest_teardown(item: pytest.Item) -> None:
    torchrun_util.current_test = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    marked = {"slow", "multiprocess"} & set(report.keywords)
    if report.when == "call" and report.duration > QUICK_LIMIT_S and not marked:
        _slow_unmarked.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter) -> None:
    if _slow_unmarked:
        terminalreporter.section(f"tests over {QUICK_LIMIT_S:g} s not marked slow or multiprocess")
        for duration, nodeid in sorted(_slow_unmarked, reverse=True):
            terminalreporter.line(f"{duration:7.1f} s  {nodeid}")
