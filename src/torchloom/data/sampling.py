"""Length-grouped sampling (``group_by_length``): batches of rows of similar length, in a seeded random order.

Padding a batch to its longest row wastes the compute of every pad token; grouping rows of similar length into
the same batch saves most of it. `length_grouped_indices` is the HF Trainer's ``get_length_grouped_indices``: the
rows are permuted at random, the permutation is cut into megabatches of ``50 x batch_size`` rows (fewer for a
small dataset: at least 4 megabatches), each megabatch is sorted by length, longest first, and the longest row of
all is swapped to the very first place (an out-of-memory error comes in the first step, not hours later).

`LengthGroupedSampler` draws that order for epoch ``e`` from ``initial_seed + e``, as Accelerate's seedable
sampler draws a shuffle, so the order is a function of (seed, epoch, lengths, batch size) only and is the same on
every process. Under `torchloom.Engine` its ``initial_seed`` is the engine's ``seed`` (as for ``shuffle=True``);
Accelerate shards it across processes as it shards any sampler (each process takes every ``num_processes``-th
batch of ``batch_size``), so the global batch ``k`` is the order's samples ``k x total_batch_size`` onwards, and a
checkpoint's position (`torchloom.checkpoint.data_position`) and its exact mid-epoch resume apply unchanged. A
checkpoint records the sampler (``LengthGroupedSampler``) and `LengthGroupedSampler.order_settings` (the megabatch size
and a hash of the lengths): resuming an epoch with any of them changed is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = ["MEGABATCH_MULT", "LengthGroupedSampler", "length_grouped_indices", "megabatch_size"]

#: Batches per megabatch (the HF Trainer's default).
MEGABATCH_MULT = 50


def megabatch_size(n: int, batch_size: int) -> int:
    """Rows per megabatch for ``n`` rows: ``50 x batch_size``, or fewer so that there are 4 megabatches (at least
    ``batch_size``), as the HF Trainer chooses."""
    return max(min(n // (batch_size * 4), MEGABATCH_MULT), 1) * batch_size


def length_grouped_indices(lengths: Sequence[int] | np.ndarray, batch_size: int, seed: int) -> list[int]:
    """A permutation of ``range(len(lengths))`` whose consecutive runs of ``batch_size`` rows have similar lengths.

    Random (drawn from ``seed`` with a `torch.Generator`), cut into megabatches (`megabatch_size`), each sorted by
    length, longest first (ties in the random order), and the longest row of all put first.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        return []
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    size = megabatch_size(n, batch_size)
    megabatches = []
    for start in range(0, n, size):
        chunk = order[start : start + size]
        megabatches.append(chunk[np.argsort(-lengths[chunk], kind="stable")])
    longest = int(np.argmax([lengths[m[0]] for m in megabatches]))  # the first of the megabatches' longest
    megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return np.concatenate(megabatches).tolist()


class LengthGroupedSampler(Sampler[int]):
    """Sample rows in `length_grouped_indices` order, drawn for epoch ``e`` from ``initial_seed + e``.

    Args:
        lengths (`Sequence[int]`): the length (tokens) of every row of the dataset.
        batch_size (`int`): the per-process batch size the rows are grouped for.
        seed (`int`, defaults to 0): ``initial_seed``; `torchloom.Engine` sets it to its ``seed``.

    Attributes:
        initial_seed (`int`): the seed of epoch 0 (epoch ``e`` draws from ``initial_seed + e``).
        epoch (`int`): the epoch the next iteration draws (`set_epoch`; advanced by one after each full pass, so
            a plain DataLoader reshuffles every epoch too).
    """

    #: `torchloom.Engine` seeds it with its own ``seed`` (Accelerate replaces only a `RandomSampler` with its
    #: seedable one).
    engine_seeded = True

    def __init__(self, lengths: Sequence[int] | np.ndarray, batch_size: int, seed: int = 0) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size, self.initial_seed, self.epoch = batch_size, seed, 0

    def __len__(self) -> int:
        return len(self.lengths)

    def set_epoch(self, epoch: int) -> None:
        """Draw epoch ``epoch``'s order next (Accelerate's ``DataLoaderShard.set_epoch`` calls it every epoch)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        yield from length_grouped_indices(self.lengths, self.batch_size, self.initial_seed + self.epoch)
        self.set_epoch(self.epoch + 1)

    def order_settings(self) -> dict[str, Any]:
        """What defines the order besides the seed, for a checkpoint's `DataOrder`: the megabatch size and a hash
        of the lengths (another ``max_length`` or tokenizer gives other lengths, so another order)."""
        digest = hashlib.sha256(self.lengths.astype("<i8").tobytes()).hexdigest()[:16]
        megabatch = megabatch_size(len(self.lengths), self.batch_size)
        return {"group_by_length": True, "megabatch": megabatch, "lengths": digest}
