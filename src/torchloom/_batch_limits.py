"""The quick-debug batch limits of a run: which setting limits the training and the validation batches of an epoch
(``fast_dev_run``, ``overfit_batches``, ``limit_train_batches``, ``limit_val_batches``), the per-process count it
comes to on a dataloader, and the loader copy ``overfit_batches`` trains and validates on.

A limit is a count of batches (an ``int``) or a fraction of an epoch's batches (a ``float`` in (0, 1], rounded
down), of the batches per process: every process has the same number of batches (`check_same_length`), so every
process stops at the same batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from torchloom.errors import ConfigError

__all__ = ["Limit", "limited", "overfit_loader", "resolve", "train_limit", "val_limit"]

#: ``(setting name, value)``: the setting that limits the batches, and its value.
Limit = tuple[str, int | float]


def train_limit(config: Any) -> Limit | None:
    """The setting that limits a fit's training batches per epoch, if any."""
    if config.fast_dev_run_batches is not None:
        return "fast_dev_run", config.fast_dev_run_batches
    if config.overfit_batches is not None:
        return "overfit_batches", config.overfit_batches
    if config.limit_train_batches is not None:
        return "limit_train_batches", config.limit_train_batches
    return None


def val_limit(config: Any, stage: str) -> Limit | None:
    """The setting that limits every validation pass of a ``stage`` call, if any (``overfit_batches``: a fit's
    validation runs on its training batches, as many as it trains on)."""
    if config.fast_dev_run_batches is not None:
        return "fast_dev_run", config.fast_dev_run_batches
    if config.overfit_batches is not None and stage == "fit":
        return "overfit_batches", config.overfit_batches
    if config.limit_val_batches is not None:
        return "limit_val_batches", config.limit_val_batches
    return None


def resolve(limit: Limit | None, length: int | None, what: str) -> int | None:
    """The batches per process that ``limit`` leaves of a dataloader of ``length`` batches per process (``None``:
    no limit, or a fraction of 1.0 with no length to apply it to).

    Raises:
        ConfigError: a fraction below 1.0 of a dataloader without a length, or one that leaves no batch.
    """
    if limit is None:
        return None
    name, value = limit
    if isinstance(value, float):
        if value >= 1.0:
            return None
        if length is None:
            raise ConfigError(
                f"engine: setting {name!r} = {value!r}: a fraction of the {what} batches needs a {what} dataloader "
                "with a length (this one is an iterable dataset without one); expected an integer number of batches"
            )
        count = int(length * value)
        if count < 1:
            raise ConfigError(
                f"engine: setting {name!r} = {value!r} of the {length} {what} batches per process is no batch; "
                f"expected a fraction >= {1 / length:.4g} (one batch) or an integer number of batches"
            )
        return count
    return value if length is None else min(value, length)


def limited(loader: Any, count: int | None, start: int = 0, end_of_data: bool = False) -> Iterator[Any]:
    """The batches of ``loader`` (already iterated up to batch ``start``) until batch ``count`` of the epoch.

    ``end_of_data``: mark the last batch of the limit as the end of the dataloader for Accelerate (its
    ``end_of_dataloader``; its remainder unknown, so ``gather_for_metrics`` drops nothing), so that a gradient
    accumulation window open there ends with an optimizer step, as at the end of a whole epoch; then the
    loader is unregistered from Accelerate's gradient state (its iteration is abandoned)."""
    if count is None:
        yield from loader
        return
    left = count - start
    if left <= 0:
        return
    for index, batch in enumerate(loader):
        last = index == left - 1
        if last and end_of_data and hasattr(loader, "end_of_dataloader"):
            loader.end_of_dataloader = True
            loader.remainder = -1
        yield batch
        if last:
            break
    end = getattr(loader, "end", None)
    if callable(end):
        end()  # an Accelerate loader left before its end stays registered otherwise (see stop_iteration)


def overfit_loader(loader: Any) -> DataLoader:
    """A copy of the training ``loader`` that yields its batches in dataset order (a sequential sampler, no
    shuffling): ``overfit_batches`` trains on its first batches every epoch and validates on another copy.

    Raises:
        ConfigError: ``loader`` is not a `torch.utils.data.DataLoader`, or has no ``batch_size`` (a batch sampler
            decides its batches and their order).
    """
    if not isinstance(loader, DataLoader):
        raise ConfigError(
            f"engine: setting 'overfit_batches' needs a torch.utils.data.DataLoader as the training data, to train "
            f"on its batches in order; got {type(loader).__name__}"
        )
    iterable = isinstance(loader.dataset, IterableDataset)
    if loader.batch_size is None and not iterable:
        raise ConfigError(
            "engine: setting 'overfit_batches' needs a training DataLoader built with batch_size, which it rebuilds "
            f"without shuffling; this one has the batch sampler {type(loader.batch_sampler).__name__}, which "
            "decides the batches and their order itself"
        )
    kwargs: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "collate_fn": loader.collate_fn,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
    }
    if loader.num_workers > 0:
        kwargs.update(
            multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
        )
    return DataLoader(loader.dataset, shuffle=False, **kwargs)
