"""Where a fit is in its training data, recorded in samples of the global order, and where a resume continues.

An epoch's training data is one global order of samples: the sampler's permutation of the dataset (drawn from
the sampler's seed and the epoch) cut into batches of ``total_batch_size`` = the per-process batch size x the
processes, of which each process takes its own share. After ``k`` batches on every process the fit has
consumed the first ``k x total_batch_size`` samples of that order, whatever the batch size and the number of
processes. A checkpoint records that count (``samples_done``) together with what defines the order (`DataOrder`).

A resume continues exactly where the rule allows and refuses otherwise (`resume_point`):

- at the end of an epoch, the next epoch starts from its first sample: the data may have changed (another
  dataset size or batch size): nothing is skipped or repeated;
- inside an epoch, the rest of the epoch is the rest of the same order: the dataset size and the sampler
  (shuffled or not; length-grouped or not, and then with the same megabatch and row lengths) must be the
  checkpoint's (its seed is taken from the checkpoint), and the samples done must
  be a whole number of the new global batches (24 samples done continue as batches of 8 or 3, not of 5);
  otherwise the resume is refused with one `torchloom.CheckpointError` naming the change.

A sample is then never skipped and never trained twice in an epoch. (The HF Trainer and Accelerate's
``skip_first_batches`` count batches, which a new batch size or dataset makes point at other samples.)
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from accelerate.data_loader import SkipBatchSampler, get_sampler
from torch.utils.data import BatchSampler

__all__ = ["DataOrder", "data_order", "layout_problems", "position", "resume_point", "skip_batches"]


@dataclass(frozen=True)
class DataOrder:
    """What defines the global order of an epoch's training samples, and how it is cut into batches.

    Attributes:
        dataset_length (`int` or ``None``): samples in the dataset (``None``: an iterable dataset without a length).
        total_batch_size (`int` or ``None``): samples per batch over all processes (``None``: a batch sampler
            without a fixed size).
        batches_per_epoch (`int` or ``None``): batches per epoch on each process (under a batch limit, the
            batches the limit leaves: a limited epoch ends there).
        world_size (`int`): processes.
        sampler (`str`): the sampler's class (``RandomSampler`` shuffles, ``SequentialSampler`` does not).
        sampler_seed (`int` or ``None``): the seed the sampler draws each epoch's permutation from (``seed +
            epoch``; Accelerate's ``SeedableRandomSampler``), ``None`` when it has none.
        sampler_order (`dict` or ``None``): what else defines the sampler's order, from its ``order_settings()``
            (`torchloom.data.LengthGroupedSampler`: ``group_by_length``, the megabatch size, a hash of the rows'
            lengths); ``None`` for a sampler without one (and in checkpoints written before it was recorded).
    """

    dataset_length: int | None
    total_batch_size: int | None
    batches_per_epoch: int | None
    world_size: int
    sampler: str
    sampler_seed: int | None
    sampler_order: dict[str, Any] | None = None


def data_order(loader: Any, world_size: int, limit: int | None = None) -> DataOrder:
    """The `DataOrder` of a prepared training dataloader (an Accelerate ``DataLoaderShard``, or any DataLoader);
    ``limit``: the batches per epoch and process a batch limit leaves (``limit_train_batches``,
    ``overfit_batches``, ``fast_dev_run``), which ``batches_per_epoch`` then records: the epoch the fit trains."""
    sampler = get_sampler(loader)
    seed = getattr(sampler, "initial_seed", None)
    settings = sampler.order_settings() if callable(getattr(sampler, "order_settings", None)) else None
    return DataOrder(
        dataset_length=_length(getattr(loader, "dataset", None)),
        total_batch_size=_total_batch_size(loader, world_size),
        batches_per_epoch=_limited_length(_length(loader), limit),
        world_size=world_size,
        sampler=type(sampler).__name__,
        sampler_seed=seed if isinstance(seed, int) else None,
        sampler_order=settings,
    )


def position(epoch: int, batches_done: int, epoch_finished: bool, order: DataOrder) -> dict[str, Any]:
    """The data position a checkpoint records: the epoch, the batches done in it on each process, the samples of
    its global order done (``None`` when the batch size is not fixed), whether it is finished, and the order
    (``sampler_order`` only where the sampler has one)."""
    samples = None if order.total_batch_size is None else batches_done * order.total_batch_size
    if samples is not None and order.dataset_length is not None:
        samples = min(samples, order.dataset_length)  # a last, smaller batch
    recorded = asdict(order)
    if recorded["sampler_order"] is None:
        del recorded["sampler_order"]  # a sampler without order settings: as checkpoints recorded it before
    return {
        "epoch": epoch,
        "batches_done": batches_done,
        "samples_done": samples,
        "epoch_finished": epoch_finished,
        "order": recorded,
    }


def layout_problems(saved: dict[str, Any], order: DataOrder) -> list[str]:
    """Why a run whose training data has ``order`` cannot continue the epoch a checkpoint stopped in (empty:
    it can). ``saved`` is the checkpoint's `position`. The sampler's seed is not compared: a resumed fit takes
    the checkpoint's (with its random states), so every later epoch is drawn as in the run that saved it."""
    if saved.get("epoch_finished") or _epoch_done(saved):
        return []  # nothing of the epoch is left: the next one starts from its first sample, on any data
    before = saved.get("order") or {}
    now = asdict(order)
    epoch, samples, batches = saved.get("epoch"), saved.get("samples_done"), saved.get("batches_done")
    where = (
        f"it stopped after {samples} samples of epoch {epoch}"
        if samples is not None
        else f"it stopped after {batches} batches of epoch {epoch}"
    )
    changes = []
    for key, what in (("dataset_length", "the training dataset's size"), ("sampler", "the training sampler")):
        if before.get(key) != now[key]:
            changes.append(f"{what} changed from {before.get(key)} to {now[key]}")
    changes += _grouping_changes(before.get("sampler_order"), now["sampler_order"])
    if changes:
        return [
            f"{where}, and {' and '.join(changes)}, so the rest of that epoch's order is another one (samples would "
            "be skipped or trained twice); resume with the same training data, or from a checkpoint at "
            "the end of an epoch"
        ]
    new_total = order.total_batch_size
    if before.get("total_batch_size") == new_total and before.get("batches_per_epoch") == order.batches_per_epoch:
        return []
    if samples is None or new_total is None:
        return [
            f"{where}, and the batches changed (global batch size {before.get('total_batch_size')} -> {new_total}, "
            f"batches per epoch {before.get('batches_per_epoch')} -> {order.batches_per_epoch}) with a batch sampler "
            "of no fixed size, so the samples done cannot be counted in the new batches; resume with the same "
            "batches, or from a checkpoint at the end of an epoch"
        ]
    if samples % new_total:
        return [
            f"{where}, which is not a whole number of the new global batches of {new_total} samples (batch size "
            f"{new_total // order.world_size} x {order.world_size} process(es); it was "
            f"{before.get('total_batch_size')}), so the next batch would skip or repeat samples; resume with a "
            f"global batch size that divides {samples}, or from a checkpoint at the end of an epoch"
        ]
    return []


def resume_point(saved: dict[str, Any], order: DataOrder) -> tuple[int, int]:
    """``(epoch, batches to skip in it)`` where a run whose training data has ``order`` continues a checkpoint's
    position (`layout_problems` must have found none)."""
    epoch = saved["epoch"]
    if saved.get("epoch_finished"):
        return epoch + 1, 0
    if _epoch_done(saved):  # every sample trained; the epoch's end (its validation, on_train_epoch_end) is to come
        return epoch, order.batches_per_epoch if order.batches_per_epoch is not None else saved["batches_done"]
    samples = saved.get("samples_done")
    if samples is None or order.total_batch_size is None:  # no fixed batch size: the same batches, as counted
        return epoch, saved["batches_done"]
    return epoch, samples // order.total_batch_size


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
    ``BatchSampler`` cuts it (``drop_last`` included)."""

    def __iter__(self) -> Iterator[list[int]]:
        inner = self.batch_sampler
        indices = iter(inner.sampler)
        collections.deque(itertools.islice(indices, self.skip_batches * inner.batch_size), maxlen=0)
        while batch := list(itertools.islice(indices, inner.batch_size)):
            if len(batch) < inner.batch_size and inner.drop_last:
                return
            yield batch


def _grouping_changes(before: dict[str, Any] | None, now: dict[str, Any] | None) -> list[str]:
    """How the sampler's own order settings changed (``group_by_length``, its megabatch, the rows' lengths)."""
    before, now = before or {}, now or {}
    was, is_ = bool(before.get("group_by_length")), bool(now.get("group_by_length"))
    if was != is_:
        return [f"group_by_length changed from {was} to {is_}"]
    changes = []
    if before.get("megabatch") != now.get("megabatch"):
        changes.append(
            f"the length groups changed (megabatch of {before.get('megabatch')} rows -> {now.get('megabatch')}: "
            "another batch size)"
        )
    if before.get("lengths") != now.get("lengths"):
        changes.append("the rows' lengths changed (another tokenizer, max_length or data)")
    return changes


def _epoch_done(saved: dict[str, Any]) -> bool:
    """Every sample of the epoch was consumed (a step checkpoint after its last batch)."""
    length, samples = (saved.get("order") or {}).get("dataset_length"), saved.get("samples_done")
    return length is not None and samples is not None and samples >= length


def _limited_length(length: int | None, limit: int | None) -> int | None:
    if limit is None:
        return length
    return limit if length is None else min(length, limit)


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:  # an iterable dataset without a length
        return None


def _total_batch_size(loader: Any, world_size: int) -> int | None:
    """Samples per batch over all processes: Accelerate's ``total_batch_size``, else ``batch_size`` x processes."""
    try:
        total = loader.total_batch_size
    except (AttributeError, TypeError):  # a batch sampler without batch_size
        total = None
    if isinstance(total, int):
        return total
    size = getattr(loader, "batch_size", None)
    return size * world_size if isinstance(size, int) else None
