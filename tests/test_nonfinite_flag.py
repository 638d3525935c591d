"""The finite check of a checkpoint's tensors (`torchloom._guards.nonfinite_parts`) finds every NaN and infinity in
every floating and complex dtype, and flags nothing finite, however large: it reads a tensor's minimum and maximum
(``torch.aminmax``) where the dtype allows, a plain ``isfinite`` elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from torchloom._guards import nonfinite_parts

ONE_PROCESS = SimpleNamespace(device=torch.device("cpu"), num_processes=1)
FLOATING = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _flags(*tensors: torch.Tensor) -> list[str]:
    return nonfinite_parts([(f"t{i}", [t]) for i, t in enumerate(tensors)], ONE_PROCESS)


@pytest.mark.parametrize("dtype", FLOATING)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 37, 99])  # the first, a middle and the last element
def test_every_nan_and_infinity_is_found(dtype, bad, where):
    values = torch.linspace(-2, 2, 100, dtype=dtype)
    values[where] = bad
    assert _flags(torch.ones(3, dtype=dtype), values.reshape(4, 25)) == ["t1"]


@pytest.mark.parametrize("dtype", FLOATING)
def test_the_largest_finite_values_are_finite(dtype):
    """A check that sums (or squares) would overflow here."""
    top = torch.finfo(dtype).max
    values = torch.full((1000,), top, dtype=dtype)
    values[::2] = -top
    assert (
        _flags(values, torch.full((1000,), top, dtype=dtype), torch.tensor([torch.finfo(dtype).tiny], dtype=dtype))
        == []
    )


@pytest.mark.parametrize("part", ["real", "imag"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_complex_tensors_are_checked_in_both_parts(part, bad):
    values = torch.zeros(8, dtype=torch.complex64)
    good = values.clone()
    setattr(values[3:4], part, torch.tensor([bad]))
    assert _flags(good, values) == ["t1"]


@pytest.mark.skipif(not hasattr(torch, "float8_e5m2"), reason="no float8 in this torch")
def test_a_dtype_without_aminmax_is_still_checked():
    values = torch.zeros(8).to(torch.float8_e5m2)
    assert _flags(values) == []
    values[5] = float("inf")
    assert _flags(values) == ["t0"]


def test_integer_and_empty_tensors_are_skipped_and_parts_keep_their_order():
    parts = [
        ("ints", [torch.arange(5)]),
        ("empty", [torch.empty(0)]),
        ("nan", [torch.ones(2), torch.tensor([float("nan")])]),
        ("none", []),
        ("inf", [torch.tensor([float("inf")])]),
    ]
    assert nonfinite_parts(parts, ONE_PROCESS) == ["nan", "inf"]
