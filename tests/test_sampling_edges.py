"""torchloom.data.sampling at its edges: the megabatch size where the HF Trainer makes it one batch, no row or one
row, lengths of an unsigned dtype, the sampler's default seed and what it records for a checkpoint. Fast, CPU."""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import pytest
import torch
from transformers.trainer_pt_utils import get_length_grouped_indices

from torchloom.data import LengthGroupedSampler, length_grouped_indices
from torchloom.data.sampling import MEGABATCH_MULT, megabatch_size


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 200) for _ in range(n)]


@pytest.mark.parametrize(
    ("n", "batch_size", "expected"),
    [(0, 8, 8), (20, 8, 8), (31, 8, 8), (32, 8, 8), (64, 8, 16), (100, 4, 24), (800, 4, 200), (10_000, 4, 200)],
)
def test_the_megabatch_is_a_quarter_of_the_rows_in_whole_batches_between_one_batch_and_fifty(
    n, batch_size, expected
) -> None:
    assert MEGABATCH_MULT == 50
    assert megabatch_size(n, batch_size) == expected


@pytest.mark.parametrize(("n", "batch_size", "seed"), [(20, 8, 0), (31, 8, 2), (9, 4, 5), (2, 1, 0)])
def test_fewer_rows_than_four_batches_group_in_megabatches_of_one_batch_as_the_hf_trainer_does(
    n, batch_size, seed
) -> None:
    lengths = _lengths(n, seed)
    expected = get_length_grouped_indices(lengths, batch_size, generator=torch.Generator().manual_seed(seed))
    assert length_grouped_indices(lengths, batch_size, seed) == expected


def test_no_row_gives_an_empty_order_and_one_row_gives_itself() -> None:
    assert length_grouped_indices([], 4, 0) == []
    assert length_grouped_indices([7], 4, 0) == [0]
    assert list(LengthGroupedSampler([7], 4)) == [0]


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.int32])
def test_lengths_of_any_integer_dtype_order_as_python_ints_do(dtype) -> None:
    # -lengths of an unsigned array wraps around (-0 stays 0, the smallest): an empty row must still come last
    lengths = [0 if i % 10 == 0 else n for i, n in enumerate(_lengths(300, 1))]
    expected = length_grouped_indices(lengths, 4, 3)
    assert length_grouped_indices(np.asarray(lengths, dtype=dtype), 4, 3) == expected
    assert list(LengthGroupedSampler(np.asarray(lengths, dtype=dtype), 4, seed=3)) == expected


def test_the_default_seed_is_zero() -> None:
    lengths = _lengths(200)
    sampler = LengthGroupedSampler(lengths, 4)
    assert sampler.initial_seed == 0 and sampler.epoch == 0
    assert list(sampler) == length_grouped_indices(lengths, 4, 0)


def test_order_settings_name_the_megabatch_and_a_hash_of_the_lengths_as_little_endian_int64() -> None:
    lengths = _lengths(100)
    digest = hashlib.sha256(struct.pack(f"<{len(lengths)}q", *lengths)).hexdigest()[:16]
    settings = LengthGroupedSampler(lengths, 4, seed=9).order_settings()
    assert settings == {"group_by_length": True, "megabatch": 24, "lengths": digest}
    # the same lengths in another dtype, or another seed: the same settings; other lengths: another hash
    assert LengthGroupedSampler(np.asarray(lengths, dtype=np.uint16), 4).order_settings() == settings
    other = LengthGroupedSampler([*lengths[:-1], lengths[-1] + 1], 4).order_settings()
    assert other["lengths"] != digest and len(other["lengths"]) == 16
