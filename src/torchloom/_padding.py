"""The samples Accelerate pads an evaluation's last batch with, cut off so every sample counts once.

With several processes Accelerate (``even_batches=True``, its default) gives every process a batch of the
same size in the last round: the real samples come first in rank order, then copies of the first samples of
the dataset. ``accelerator.gather_for_metrics`` drops the copies after a gather, using
``dataloader.remainder`` (``len(dataset) % total_batch_size``); the engine uses the same numbers to cut the
copies off the *outputs* of ``validation_step`` / ``predict_step`` (the batch itself is left whole, so a
``gather_for_metrics`` inside the step still works), so ``on_validation_batch_end`` consumers (metric plugins)
and predictions see every sample exactly once; and while ``validation_step`` runs on such a batch, the
torchmetrics objects the task holds are updated with the real rows only (`real_rows_in_metrics`: Lightning's
idiom of a metric updated in the step and logged as the object). (pytorch/pytorch#25162,
Lightning-AI/pytorch-lightning#4732, huggingface/accelerate#226.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from accelerate.utils import find_batch_size

from torchloom._internals import loader_at_end, loader_remainder

__all__ = ["batch_size", "real_rows", "real_rows_in_metrics", "take_rows"]


def real_rows(loader: Any, accelerator: Any) -> int | None:
    """How many leading rows of the batch ``loader`` just yielded are real samples on this process.

    Returns:
        ``None`` when every row is real (one process, not the last batch, no padding, or a dataset without a
        length, where Accelerate cannot know either); else a count in ``[0, per-process batch size]``.
    """
    if accelerator.num_processes == 1 or not loader_at_end(loader):
        return None
    remainder = loader_remainder(loader)
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


def held_metrics(task: Any) -> dict[str, Any]:
    """The torchmetrics objects ``task`` holds, by where: ``self.<attribute>``, also inside a mapping, list or tuple
    (two levels) and inside any `torch.nn.Module` (a ``MetricCollection``, a ``ModuleDict``, the model)."""
    torchmetrics = sys.modules.get("torchmetrics")
    if torchmetrics is None:  # never imported: the task holds no metric
        return {}
    found: dict[int, tuple[str, Any]] = {}
    seen: set[int] = set()

    def visit(value: Any, where: str, depth: int) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.nn.Module):
            for name, module in value.named_modules(prefix=where):
                if isinstance(module, torchmetrics.Metric):
                    found.setdefault(id(module), (name, module))
        elif depth < 2 and isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, f"{where}[{key!r}]", depth + 1)
        elif depth < 2 and isinstance(value, list | tuple):
            for i, item in enumerate(value):
                visit(item, f"{where}[{i}]", depth + 1)

    for attribute, value in vars(task).items():
        visit(value, f"self.{attribute}", 0)
    return dict(found.values())


@contextmanager
def real_rows_in_metrics(task: Any, rows: int, size: int, fail: Callable[[str], None]) -> Iterator[None]:
    """While ``validation_step`` runs on a batch of ``size`` rows of which only the first ``rows`` are real on this
    process, every torchmetrics object ``task`` holds (`held_metrics`) is updated with those rows only.

    Each tensor argument of ``update`` (also through ``metric(...)`` / ``forward`` and a ``MetricCollection``)
    whose first dimension is ``size`` is cut to its first ``rows`` rows (`take_rows`); with ``rows == 0`` the
    update is skipped and ``forward`` returns NaN (no real sample here, and an empty update breaks some metrics:
    Pearson's, a multiclass accuracy's). An update with no such tensor (e.g. flattened tokens) cannot be cut:
    ``fail`` gets a message (raised after the pass, on every process alike), the update is skipped and
    ``forward`` returns NaN.
    """
    metrics = held_metrics(task)
    updates = {name: metric.update for name, metric in metrics.items()}
    forwards = {name: metric.forward for name, metric in metrics.items()}
    depth = [0]  # > 0 inside a cut call: a metric that another one calls gets the rows already cut

    def cuttable(name: str, metric: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if any(t.ndim and t.shape[0] == size for t in tensors):
            return True
        got = ", ".join(str(tuple(t.shape)) for t in tensors) or "no tensor"
        fail(
            f"validation_step updated {name} ({type(metric).__name__}) with tensors of shapes {got} on a batch of "
            f"{size} samples whose last {size - rows} on this process are copies that Accelerate pads the last "
            "batch with; the engine cuts the copies off tensors whose first dimension is the batch size, and none "
            "is: update the metric with one row per sample (before flattening), or from the outputs in "
            "on_validation_batch_end (as the eval_metrics plugin does)"
        )
        return False

    def cut(name: str, metric: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
        update, forward = updates[name], forwards[name]

        def update_real_rows(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return update(*args, **kwargs)
            if not cuttable(name, metric, args, kwargs) or rows == 0:
                return None
            depth[0] += 1
            try:
                return update(*take_rows(args, rows, size), **take_rows(kwargs, rows, size))
            finally:
                depth[0] -= 1

        def forward_real_rows(*args: Any, **kwargs: Any) -> Any:
            # forward updates through ``self.update`` (cut above), then computes the value of this batch alone:
            # NaN where nothing real is left (its compute could fail on an empty state, on this process only).
            if depth[0] or (cuttable(name, metric, args, kwargs) and rows):
                return forward(*args, **kwargs)
            return torch.tensor(float("nan"), device=metric.device)

        return update_real_rows, forward_real_rows

    for name, metric in metrics.items():
        metric.update, metric.forward = cut(name, metric)
    try:
        yield
    finally:
        for name, metric in metrics.items():
            metric.update = updates[name]
            metric.__dict__.pop("forward", None)
