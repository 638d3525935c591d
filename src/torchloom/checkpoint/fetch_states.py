"""How a resumed epoch's loader starts again: the trained batches skipped by index (`skip_batches`), and the random
states that the look-ahead fetch of a training batch draws from, for an exact mid-epoch resume of data
whose ``__getitem__`` (or collate function) draws from Python's, numpy's or torch's global generator.

Accelerate's `accelerate.data_loader.DataLoaderShard` fetches one batch ahead: the call that yields batch i of an
epoch fetches batch i + 1 (its first call fetches batches 0 and 1). With ``num_workers=0`` that fetch runs in the
training process, between two training steps, and draws from the global generators. So a checkpoint after batch i
keeps, next to the random states at the checkpoint, the states right before batch i + 1 was fetched (`Watch`). A
resume skips the trained batches by index, and its batch sampler restores the states right before each of its
first two fetches (`resume_source`): batch i + 1 from the states of its fetch, batch i + 2 from the checkpoint's.
After an epoch's first batch (fetched with batch 0 in the loader's first call) the states kept are those before the
loader started, and the resume starts the loader again from there and fetches batch 0 once more without training it.

The epoch's data position (`torchloom.checkpoint.data_position.DataPosition`) drives both: it keeps a `Watch` in
every epoch and starts a resumed epoch from `resume_source`.

Cost per micro-batch: a copy of torch's CPU state (5 KB, about 2 µs). Python's and numpy's states (about 100 µs) are
kept only in an epoch whose first fetches moved them, or that continues a checkpoint that kept them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from accelerate.data_loader import SkipBatchSampler
from torch.utils.data import BatchSampler

from torchloom.checkpoint.random_states import random_states, set_random_states

__all__ = ["Watch", "drop", "resume_source", "skip_batches"]

#: Iterators over a sequence whose position can be set (their ``__reduce__`` / ``__setstate__``, as pickle uses them).
_SEEKABLE: tuple[type, ...] = (type(iter([])), type(iter(())), type(iter(range(0))))


def _cpu_states(full: bool) -> dict[str, Any]:
    """Torch's CPU state, and with ``full`` Python's and numpy's (`random_states`' format, without CUDA)."""
    if not full:
        return {"torch": torch.get_rng_state()}
    states = random_states()
    states.pop("cuda", None)
    return states


def _restore(states: Mapping[str, Any]) -> None:
    if "python" in states:
        set_random_states(states)
    else:
        torch.set_rng_state(states["torch"])


class Watch:
    """This process's states before the look-ahead fetch, in one epoch. Call `before_first` before the loader's
    first call (a loader started from the epoch's start), `after_first` after it, or `continued` after the first
    call of a resumed loader, and `before_next` before every later call; `state_dict` is what a checkpoint keeps."""

    def __init__(self, full: bool = False) -> None:
        self.full = full  # Python's and numpy's states too
        self._states: dict[str, Any] | None = None
        self._first = False  # the states are those before the loader started

    def before_first(self) -> None:
        self._states, self._first = _cpu_states(True), True

    def after_first(self) -> None:
        """Whether the loader's first call moved Python's or numpy's state: then the data draws from them."""
        if self.full or self._states is None:
            return
        now, then = _cpu_states(True), self._states
        numpy_moved = now["numpy"]["pos"] != then["numpy"]["pos"] or not torch.equal(
            now["numpy"]["keys"], then["numpy"]["keys"]
        )
        self.full = now["python"] != then["python"] or numpy_moved

    def continued(self, states: Mapping[str, Any]) -> None:
        """After a resumed loader's first call: the look-ahead fetch drew from the checkpoint's ``states``."""
        parts = ("python", "numpy", "torch") if self.full else ("torch",)
        self._states, self._first = {k: states[k] for k in parts}, False

    def before_next(self) -> None:
        self._states, self._first = _cpu_states(self.full), False

    def state_dict(self) -> dict[str, Any] | None:
        return None if self._states is None else {"states": self._states, "first": self._first}


class _Restoring:
    """A batch sampler that restores random states right before the fetches of the batches ``skip`` and
    ``skip + 1`` of the one it wraps (the first two that a `SkipBatchSampler` over it passes on; an
    `_IndexSkipBatchSampler` calls `before` itself)."""

    def __init__(self, inner: Any, skip: int, fetch: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
        self.inner, self.skip, self.fetch, self.saved = inner, skip, fetch, saved
        self.applied = False  # the checkpoint's states were restored before the second fetch

    def before(self, passed: int) -> None:
        """Before the batch ``passed`` (0-based) of those after the skipped ones is handed to the loader."""
        if passed == 0:
            _restore(self.fetch)
        elif passed == 1:
            set_random_states(self.saved)
            self.applied = True

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self.inner):
            self.before(index - self.skip)
            yield batch

    def __len__(self) -> int:
        return len(self.inner)


def resume_source(
    accelerator: Any, loader: Any, skip: int, fetch: Mapping[str, Any] | None, saved: Mapping[str, Any]
) -> tuple[Any, int, _Restoring | None]:
    """The iterable of a resumed epoch that skips its first ``skip`` batches, with ``fetch`` (a checkpoint's
    `Watch.state_dict`) and ``saved`` (its random states); return it, the batches it yields before the first to
    train (1 when it starts the loader again from the epoch's start, else 0) and its `_Restoring` sampler, if any
    (``None``: the loader cannot skip by index, and the data's draws are not restored)."""
    if fetch is not None and fetch["first"] and skip == 1:  # the look-ahead fetch was in the loader's first call
        _restore(fetch["states"])
        return loader, 1, None
    if fetch is None or fetch["first"]:  # nothing to restore batch by batch: drop the indices at once
        return skip_batches(accelerator, loader, skip), 0, None
    source = skip_batches(accelerator, loader, skip)
    for attribute in ("batch_sampler", "sampler"):
        sampler = getattr(source, attribute, None)
        if isinstance(sampler, _IndexSkipBatchSampler):  # drops the indices at once, restores as it passes them on
            sampler.restoring = _Restoring(sampler.batch_sampler, skip, fetch["states"], saved)
            return source, 0, sampler.restoring
        if isinstance(sampler, SkipBatchSampler):
            restoring = _Restoring(sampler.batch_sampler, skip, fetch["states"], saved)
            sampler.batch_sampler = restoring
            return source, 0, restoring
    return source, 0, None


def skip_batches(accelerator: Any, loader: Any, skip: int) -> Any:
    """The training loader without the first ``skip`` batches of its epoch (a resume inside an epoch).

    Accelerate's ``skip_first_batches``, which reads no sample of the skipped batches: its batch sampler draws them
    from the batch sampler and drops them, one batch of indices at a time. Where those batches are a plain
    ``BatchSampler`` over a sampler (one process), the skipped batches' indices are dropped from the sampler's
    order in one step instead (`_IndexSkipBatchSampler`): no batch is built, so a resume at 90 % of a long epoch
    starts as fast as one at 10 %. The batches that follow are the same."""
    skipped = accelerator.skip_first_batches(loader, skip)
    sampler: Any = getattr(skipped, "batch_sampler", None)
    if type(sampler) is SkipBatchSampler and type(sampler.batch_sampler) is BatchSampler:
        sampler.__class__ = _IndexSkipBatchSampler
    return skipped


class _IndexSkipBatchSampler(SkipBatchSampler):
    """Accelerate's ``SkipBatchSampler`` over a plain ``BatchSampler``: the first ``skip_batches x batch_size``
    indices of the sampler are dropped at once (C-level ``islice``), then the rest is cut into batches as
    ``BatchSampler`` cuts it (``drop_last`` included); ``restoring`` (a resume that restores random states around
    the look-ahead fetch) is told before each batch is passed on."""

    restoring: _Restoring | None = None

    def __iter__(self) -> Iterator[list[int]]:
        inner = self.batch_sampler
        indices = iter(inner.sampler)
        drop(indices, self.skip_batches * inner.batch_size)
        passed = 0
        while batch := list(itertools.islice(indices, inner.batch_size)):
            if len(batch) < inner.batch_size and inner.drop_last:
                return
            if self.restoring is not None:
                self.restoring.before(passed)
            passed += 1
            yield batch


def drop(iterator: Iterator[Any], count: int) -> None:
    """Consume the next ``count`` items of ``iterator``, as ``itertools.islice`` would, in time that does not grow
    with ``count`` where the items come from a list, a tuple or a range (a sampler's ``__iter__`` such as torch's
    ``RandomSampler``: ``yield from torch.randperm(n).tolist()``, and Accelerate's ``SeedableRandomSampler`` over
    it).

    A generator that delegates with ``yield from`` does nothing while the iterator it delegates to (its
    ``gi_yieldfrom``, down the chain) yields: taking an item from the outermost one takes the next of the
    innermost. Where the innermost is a list, tuple or range iterator, its position is moved forward at once
    (``__setstate__``) by as many items as it has left, or ``count``; then the chain is followed again (the
    generator may go on with another list, as ``RandomSampler`` does with ``num_samples > len(data)``). Other
    items (a generator not started yet, or one that yields item by item) are taken one by one, up to 256 at a
    time before the chain is looked at again.

    Raises:
        StopIteration: never; an iterator that ends before ``count`` items simply ends.
    """
    while count > 0:
        inner: Any = iterator
        while getattr(inner, "gi_yieldfrom", None) is not None:
            inner = inner.gi_yieldfrom
        left = inner.__length_hint__() if type(inner) in _SEEKABLE else 0
        if left:  # the chain stands in a sequence: move its position
            moved = min(left, count)
            inner.__setstate__(inner.__reduce__()[2] + moved)
            count -= moved
            continue
        # Not started, between two sequences, or any other iterator: a few items one by one (C-level islice)
        taken = len(list(itertools.islice(iterator, min(count, _STEP))))
        if taken < min(count, _STEP):
            return
        count -= taken


#: How many items `drop` takes one by one before it looks for a sequence to move in again.
_STEP = 256
