"""The examples' recorded results (``examples/results.json``, written by ``python examples/results.py``), for the
example tests to check that their own runs still reach them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "examples" / "results.json"


def recorded(run_id: str) -> dict[str, Any]:
    """The recorded run ``run_id`` (``"fashion_mnist/test_slice"``)."""
    return json.loads(RESULTS.read_text(encoding="utf-8"))["runs"][run_id]


def assert_reaches_recorded(run_id: str, metrics: dict[str, float]) -> None:
    """Every recorded validation value of ``run_id`` equals the run's own (4 significant digits: float rounding
    differs across CPU kernels); on a mismatch, say how to record the new values."""
    expected = recorded(run_id)["metrics"]
    got = {name: metrics.get(name) for name in expected}
    assert got == pytest.approx(expected, rel=1e-4), (
        f"{run_id} now reaches {got}, examples/results.json has {expected}: if the change is meant to move it, run "
        f"`python examples/results.py {run_id}` (and the runs its page quotes) and update the page"
    )
