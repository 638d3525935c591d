"""A pytest plugin for mutmut's stats run (``-p subprocess_hits`` in pyproject's ``[tool.mutmut]``): the mutated
functions that the processes a test started called (recorded by tools/mutation/sitecustomize.py in the file named by
``TORCHLOOM_MUTATION_HITS``) count as called by that test, so mutmut selects the test for their mutants.

Outside the stats run it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest

HITS = "TORCHLOOM_MUTATION_HITS"


def _stats_run() -> bool:
    from mutmut.mutation.trampoline import get_mutant_under_test

    return get_mutant_under_test() == "stats"


def pytest_configure(config: pytest.Config) -> None:
    if not _stats_run():
        return
    fd, path = tempfile.mkstemp(prefix="torchloom-mutation-hits-", suffix=".txt")
    os.close(fd)
    os.environ[HITS] = path

    def cleanup() -> None:
        os.environ.pop(HITS, None)
        with contextlib.suppress(OSError):
            os.unlink(path)

    config.add_cleanup(cleanup)


@pytest.hookimpl(tryfirst=True)  # before mutmut's own teardown hook, which assigns the recorded names to the test
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    path = os.environ.get(HITS)
    if not path or not _stats_run():
        return
    from mutmut.state import state

    with open(path, "r+", encoding="utf-8") as f:
        names = set(f.read().split())
        f.seek(0)
        f.truncate()
    state()._stats.update(names)
