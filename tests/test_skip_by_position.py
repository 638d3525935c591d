"""A resume skips the trained part of an epoch's order without walking it: `torchloom.checkpoint.fetch_states.drop`
moves a sampler's position in the list it yields from (``yield from torch.randperm(n).tolist()``), so a resume at
90 % of a long epoch starts as fast as one at 10 % (bench/checkpoint_io.py, part c). Exactly the items
``itertools.islice`` would consume are consumed, for every kind of iterator and every count."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from accelerate.data_loader import SeedableRandomSampler
from torch.utils.data import RandomSampler, SequentialSampler, SubsetRandomSampler

from torchloom.checkpoint.fetch_states import drop

DATA = list(range(1000))


def _nested() -> Iterator[int]:
    yield -1
    yield from _middle()
    yield -2


def _middle() -> Iterator[int]:
    yield from [10, 11, 12]
    yield 13
    yield from (14, 15)
    yield from range(16, 700)
    yield from map(int, "12345")


def _makers() -> dict[str, Any]:
    def seeded(sampler: Any) -> Any:
        def make() -> Iterator[int]:
            torch.manual_seed(7)
            return iter(sampler)

        return make

    generator = torch.Generator().manual_seed(3)
    return {
        "list": lambda: iter(DATA),
        "tuple": lambda: iter(tuple(DATA)),
        "range": lambda: iter(range(1000)),
        "map": lambda: map(int, DATA),
        "nested generators": _nested,
        "RandomSampler": seeded(RandomSampler(DATA)),
        "RandomSampler, more samples than data": seeded(RandomSampler(DATA, num_samples=2500)),
        "RandomSampler, replacement": seeded(RandomSampler(DATA, replacement=True, num_samples=777)),
        "RandomSampler, own generator": lambda: iter(RandomSampler(DATA, generator=generator.manual_seed(3))),
        "SeedableRandomSampler": lambda: iter(SeedableRandomSampler(DATA, data_seed=5)),
        "SequentialSampler": lambda: iter(SequentialSampler(DATA)),
        "SubsetRandomSampler": seeded(SubsetRandomSampler(DATA[::3])),
    }


@pytest.mark.parametrize("kind", list(_makers()))
@pytest.mark.parametrize("count", [0, 1, 2, 3, 4, 31, 32, 255, 256, 257, 999, 1000, 1001, 2499, 2500, 5000])
def test_drop_consumes_what_islice_consumes(kind, count):
    make = _makers()[kind]
    expected = make()
    for _ in itertools.islice(expected, count):
        pass
    rest = list(expected)  # before the next make(): a sampler draws its seed as it starts
    got = make()
    drop(got, count)
    assert list(got) == rest


def test_a_started_iterator_is_dropped_from_where_it_stands():
    expected, got = iter(SeedableRandomSampler(DATA, data_seed=1)), iter(SeedableRandomSampler(DATA, data_seed=1))
    assert [next(got) for _ in range(5)] == [next(expected) for _ in range(5)]
    drop(got, 600)
    drop(got, 0)
    drop(got, 394)
    assert list(got) == list(expected)[994:]


def test_a_sampler_is_not_walked_item_by_item():
    """The generator frames of the sampler are resumed a few times, not once per skipped index."""
    sampler = SeedableRandomSampler(list(range(100_000)), data_seed=0)
    iterator = iter(sampler)
    resumed = 0

    def count(frame: Any, event: str, arg: Any) -> Any:
        nonlocal resumed
        if event == "call" and frame.f_code.co_name == "__iter__":
            resumed += 1
        return None

    sys.settrace(count)
    try:
        drop(iterator, 90_000)
    finally:
        sys.settrace(None)
    assert resumed <= 2 * 256 + 4  # the first items one by one, then one move (islice would resume 180,000 times)
    torch_order = torch.randperm(100_000, generator=torch.Generator().manual_seed(0)).tolist()
    assert list(iterator) == torch_order[90_000:]
