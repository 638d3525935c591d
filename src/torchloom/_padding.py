"""The samples Accelerate pads an evaluation's last batch with, cut off so every sample counts once.

With several processes Accelerate (``even_batches=True``, its default) gives every process a batch of the
same size in the last round: the real samples come first in rank order, then copies of the first samples of
the dataset. ``accelerator.gather_for_metrics`` drops the copies after a gather, using
``dataloader.remainder`` (``len(dataset) % total_batch_size``); the engine uses the same numbers to cut the
copies off the *outputs* of ``validation_step`` / ``predict_step`` (the batch itself is left whole, so a
``gather_for_metrics`` inside the step still works), so ``on_validation_batch_end`` consumers (metric plugins)
and predictions see every sample exactly once. (pytorch/pytorch#25162, Lightning-AI/pytorch-lightning#4732,
huggingface/accelerate#226.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from accelerate.utils import find_batch_size

__all__ = ["batch_size", "real_rows", "take_rows"]


def real_rows(loader: Any, accelerator: Any) -> int | None:
    """How many leading rows of the batch ``loader`` just yielded are real samples on this process.

    Returns:
        ``None`` when every row is real (one process, not the last batch, no padding, or a dataset without a
        length, where Accelerate cannot know either); else a count in ``[0, per-process batch size]``.
    """
    if accelerator.num_processes == 1 or not getattr(loader, "end_of_dataloader", False):
        return None
    remainder = getattr(loader, "remainder", -1)
    if remainder <= 0 or not accelerator.even_batches:  # even_batches=False: uneven batches, nothing padded
        return None
    per_process = loader.total_batch_size // accelerator.num_processes
    return max(0, min(per_process, remainder - accelerator.process_index * per_process))


def take_rows(data: Any, rows: int, size: int) -> Any:
    """The first ``rows`` of every per-sample part of ``data`` (a batch, or a step's outputs): tensors whose first
    dimension is the batch size ``size`` are sliced; mappings, tuples and lists are followed; a list or tuple of
    ``size`` plain items (strings, ids) is sliced too. Anything else (a scalar loss, ``None``) is kept as is."""

    def take(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x[:rows] if x.ndim and x.shape[0] == size else x
        if isinstance(x, Mapping):
            taken = {k: take(v) for k, v in x.items()}
            return taken if type(x) is dict else type(x)(taken)  # type: ignore[call-arg]
        if isinstance(x, list | tuple):
            if len(x) == size and not any(isinstance(v, torch.Tensor | Mapping | list | tuple) for v in x):
                return x[:rows]
            items = [take(v) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        return x

    return take(data)


def batch_size(batch: Any) -> int | None:
    """The number of samples in a batch (Accelerate's ``find_batch_size``), or ``None`` when it has none."""
    try:
        return find_batch_size(batch)
    except (TypeError, IndexError, ValueError):
        return None
