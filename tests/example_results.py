"""The examples' recorded results (``examples/results.json``, written by ``python examples/results.py``), for the
example tests to check that their own runs still reach them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RESULTS = EXAMPLES / "results.json"
#: Float rounding alone, on the CPU and torch the run was recorded with (4 significant digits).
SAME_MACHINE_REL = 1e-4


def recorded(run_id: str) -> dict[str, Any]:
    """The recorded run ``run_id`` (``"fashion_mnist/test_slice"``)."""
    return json.loads(RESULTS.read_text(encoding="utf-8"))["runs"][run_id]


def environment() -> dict[str, Any]:
    """This machine's CPU, torch and Python, as ``examples/results.py`` records them."""
    spec = importlib.util.spec_from_file_location("example_results_script", EXAMPLES / "results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.environment()


def tolerances(record: dict[str, Any], here: dict[str, Any]) -> tuple[dict[str, float], str]:
    """How far each recorded value of ``record`` may be from a run on the machine ``here`` describes, and why:
    float rounding (relative `SAME_MACHINE_REL`) on the CPU and torch it was recorded with; elsewhere, the largest
    distance measured under the other vector kernels (``kernel_spread``, by ``examples/results.py
    --kernel-spread``), at least that rounding."""
    rounding = {name: SAME_MACHINE_REL * abs(value) for name, value in record["metrics"].items()}
    made_on = record["environment"]
    if all(made_on.get(key) == here.get(key) for key in ("cpu", "torch")):
        return rounding, f"recorded on this CPU ({here['cpu']}) and torch {here['torch']}: float rounding only"
    spread = record.get("kernel_spread", {}).get("metrics", {})
    allowed = {name: max(limit, spread.get(name, 0.0)) for name, limit in rounding.items()}
    return allowed, (
        f"recorded on {made_on.get('cpu')} with torch {made_on.get('torch')}, run on {here.get('cpu')} with torch "
        f"{here.get('torch')}: within the spread measured across CPU kernels {spread or '(none measured)'}"
    )


def assert_reaches_recorded(run_id: str, metrics: dict[str, float]) -> None:
    """Every recorded validation value of ``run_id`` equals the run's own, within `tolerances`; on a mismatch, say
    how to record the new values."""
    record = recorded(run_id)
    allowed, why = tolerances(record, environment())
    got = {name: metrics.get(name) for name in record["metrics"]}
    off = {
        name: value
        for name, value in got.items()
        if value is None or not abs(value - record["metrics"][name]) <= allowed[name]
    }
    assert not off, (
        f"{run_id} now reaches {got}, examples/results.json has {record['metrics']} ({why}; off: {off}): if the "
        f"change is meant to move it, run `python examples/results.py {run_id}` (and the runs its page quotes) and "
        f"update the page; if only the CPU moved it, `python examples/results.py --kernel-spread {run_id}` measures "
        "how far other CPU kernels move it"
    )
