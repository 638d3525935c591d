"""The quick subset (``-m "not slow and not multiprocess"``, CONTRIBUTING.md) stays free of torchrun: a test that
starts it without the ``multiprocess`` mark fails before anything starts (tests/conftest.py, torchrun_util)."""

from __future__ import annotations

from pathlib import Path

import pytest

import torchrun_util


def test_a_torchrun_start_in_a_test_not_marked_multiprocess_fails_before_it_starts(request, tmp_path: Path) -> None:
    assert torchrun_util.current_test is request.node
    with pytest.raises(AssertionError, match=r"test_suite_markers.py::.* starts torchrun core_fit.py: mark it"):
        torchrun_util.torchrun("core_fit.py", tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiprocess
def test_a_test_marked_multiprocess_may_start_it(request) -> None:
    assert torchrun_util.current_test is request.node
    torchrun_util.require_multiprocess_marker("torchrun")
