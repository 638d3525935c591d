"""How the example tests compare their runs with the recorded results (tests/example_results.py): exact to float
rounding on the recording CPU and torch, within the measured spread across CPU kernels elsewhere."""

from __future__ import annotations

import pytest

import example_results
from example_results import assert_reaches_recorded, tolerances

INTEL = {"cpu": "Intel(R) Xeon(R) Processor", "torch": "2.13.0+cpu", "cpus": 2, "python": "3.11.7"}
AMD = {**INTEL, "cpu": "AMD EPYC"}
RECORD = {
    "metrics": {"val/accuracy": 0.8913043478260869, "val/loss": 1.051297250001327},
    "environment": INTEL,
    "kernel_spread": {"kernels": ["default", "avx2", "avx512"], "metrics": {"val/accuracy": 0.0131, "val/loss": 0.009}},
}


@pytest.fixture
def machine(monkeypatch):
    def use(here, record=RECORD):
        monkeypatch.setattr(example_results, "recorded", lambda run_id: record)
        monkeypatch.setattr(example_results, "environment", lambda: here)

    return use


def test_on_the_recording_machine_only_float_rounding_is_allowed(machine) -> None:
    machine(INTEL)
    assert_reaches_recorded("r", {"val/accuracy": 0.8913043478260869, "val/loss": 1.051297250001327 * (1 + 9e-5)})
    with pytest.raises(AssertionError, match=r"recorded on this CPU .*float rounding only"):
        assert_reaches_recorded("r", {"val/accuracy": 0.8913043478260869, "val/loss": 1.050521})  # the AMD run


def test_another_torch_on_the_same_cpu_is_another_machine(machine) -> None:
    machine({**INTEL, "torch": "2.14.1+cpu"})
    assert_reaches_recorded("r", {"val/accuracy": 0.8913043478260869, "val/loss": 1.050521})


def test_on_another_cpu_the_values_stay_within_the_measured_spread(machine) -> None:
    machine(AMD)
    assert_reaches_recorded("r", {"val/accuracy": 0.9043478260869565, "val/loss": 1.0593958})  # 0.0130, 0.0081
    with pytest.raises(AssertionError, match=r"AMD EPYC.*within the spread.*off: \{'val/loss': 1.07\}"):
        assert_reaches_recorded("r", {"val/accuracy": 0.8913043478260869, "val/loss": 1.07})
    with pytest.raises(AssertionError, match=r"off: \{'val/accuracy': 0.87"):
        assert_reaches_recorded("r", {"val/accuracy": 0.87, "val/loss": 1.0513})


def test_without_a_measured_spread_another_cpu_gets_float_rounding_and_the_command_to_measure_it(machine) -> None:
    machine(AMD, {k: v for k, v in RECORD.items() if k != "kernel_spread"})
    with pytest.raises(AssertionError, match=r"\(none measured\).*--kernel-spread r"):
        assert_reaches_recorded("r", {"val/accuracy": 0.8913043478260869, "val/loss": 1.050521})


def test_a_missing_value_is_off(machine) -> None:
    machine(INTEL)
    with pytest.raises(AssertionError, match=r"off: \{'val/loss': None\}"):
        assert_reaches_recorded("r", {"val/accuracy": 0.8913043478260869})


def test_the_spread_never_tightens_float_rounding() -> None:
    record = {**RECORD, "kernel_spread": {"metrics": {"val/accuracy": 0.0, "val/loss": 0.0}}}
    allowed, _ = tolerances(record, AMD)
    assert allowed == {
        "val/accuracy": pytest.approx(0.8913043478260869e-4),
        "val/loss": pytest.approx(1.051297250001327e-4),
    }


def test_this_machine_is_described_as_results_py_records_it() -> None:
    here = example_results.environment()
    assert set(here) == set(INTEL) and here["cpus"] >= 1 and here["torch"].startswith("2.")
