"""The samples Accelerate pads an evaluation's last batch with, cut off so every sample counts once.

With several processes Accelerate (``even_batches=True``, its default) gives every process a batch of the
same size in the last round: the real samples come first in rank order, then copies of the first samples of
the dataset. ``accelerator.gather_for_metrics`` drops the copies after a gather, using
``dataloader.remainder`` (``len(dataset) % total_batch_size``); the engine uses the same numbers to cut the
copies off the *outputs* of ``validation_step`` / ``predict_step`` (the batch itself is left whole, so a
``gather_for_metrics`` inside the step still works), so ``on_validation_batch_end`` consumers (metric plugins)
and predictions see every sample exactly once; and while ``validation_step`` runs on such a batch, the
torchmetrics objects the task holds are updated with the real rows only (`real_rows_in_metrics`: Lightning's
idiom of a metric updated in the step and logged as the object).

A plain value the task logs by hand from such a batch is one number the engine cannot split, so the copies get no
weight before the step runs: in a causal-LM batch (``labels`` and ``num_items``, what
`torchloom.data.CausalLMCollator` makes) their labels become -100 and ``num_items`` counts the real rows' loss
tokens (`without_copies_weight`), so the documented ``self.log("val/loss", loss, weight=num_items)`` is the exact
token mean. Any other value logged with ``reduce="mean"`` / ``"sum"`` from a padded batch is named in one warning
(`watch_hand_logged`), unless it came after an ``accelerator.gather_for_metrics`` (which drops the copies itself).
(pytorch/pytorch#25162, Lightning-AI/pytorch-lightning#4732, huggingface/accelerate#226.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from accelerate.utils import find_batch_size

from torchloom.data.packing import IGNORE_INDEX, count_loss_tokens

__all__ = [
    "batch_size",
    "real_rows",
    "real_rows_in_metrics",
    "take_rows",
    "watch_hand_logged",
    "without_copies_weight",
]


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


def without_copies_weight(batch: Any, rows: int, size: int) -> tuple[Any, Any]:
    """``batch`` (of ``size`` rows, the first ``rows`` real on this process) with its copies given no weight, and
    the recounted ``num_items`` (``None`` when ``batch`` is not a causal-LM batch, returned as it is).

    A causal-LM batch is a mapping with ``labels`` (one row per sample) and ``num_items`` (the loss tokens the
    model's loss is a mean over, as `torchloom.data.CausalLMCollator` counts them, `count_loss_tokens`). The result
    is a new mapping, the input's tensors untouched: ``num_items`` counts the real rows' loss tokens only (a 0-dim
    tensor of the input's dtype and device, or an ``int`` where the input held one); the copies' ``labels`` are -100,
    so the model's loss is the mean over the real rows' tokens. Where no row is real (``rows == 0``) the labels are
    kept (a loss over no token would be NaN) and ``num_items`` is 0: the loss counts for nothing with that weight.
    """
    if not isinstance(batch, Mapping) or "num_items" not in batch:
        return batch, None
    labels, counted = batch.get("labels"), batch["num_items"]
    if not isinstance(labels, torch.Tensor) or labels.ndim < 2 or labels.shape[0] != size:
        return batch, None
    items: Any = count_loss_tokens(labels[:rows])
    if isinstance(counted, torch.Tensor):
        items = items.to(counted.device, counted.dtype)
    elif isinstance(counted, int | float):
        items = type(counted)(items)  # the step gets the type it is given (one host read, once per pass)
    if rows:
        labels = labels.clone()
        labels[rows:] = IGNORE_INDEX
    result = {**batch, "labels": labels, "num_items": items}
    return (result if type(batch) is dict else type(batch)(result)), items  # type: ignore[call-arg]


@contextmanager
def watch_hand_logged(buffer: Any, accelerator: Any, rows: int, size: int, items: Any) -> Iterator[None]:
    """While ``validation_step`` runs on a batch of ``size`` rows of which only the first ``rows`` are real on this
    process, note in ``buffer`` (`LogBuffer.note`: one warning on the main process at the reduction) every plain
    value logged with ``reduce="mean"`` or ``"sum"`` that counts the copies, as far as the engine can tell.

    Not noted: a value logged after the step called ``accelerator.gather_for_metrics`` (which drops the copies; the
    method is wrapped for the step's duration to see the call); a mean weighted by the recounted ``num_items``
    ``items`` (`without_copies_weight`) or by 0, and a sum of ``items``: the same object, or an equal number (read
    from the device: once per pass, on the padded batch only). ``max``, ``min`` and ``last`` are left alone: a copy
    repeats a real sample, so an extreme is unchanged.
    """
    gathered = [False]
    original = accelerator.gather_for_metrics

    def gather_for_metrics(*args: Any, **kwargs: Any) -> Any:
        gathered[0] = True
        return original(*args, **kwargs)

    def equal(x: Any, y: Any) -> bool:
        if x is y:
            return True
        if isinstance(x, bool) or not isinstance(x, torch.Tensor | int | float) or y is None:
            return False
        if isinstance(x, torch.Tensor) and x.numel() != 1:
            return False
        return float(x) == float(y)

    def watch(name: str, value: Any, weight: Any, reduce: str) -> None:
        if gathered[0] or reduce not in ("mean", "sum"):
            return
        counted = weight if reduce == "mean" else value
        if equal(counted, items) or (reduce == "mean" and equal(weight, 0)):
            return
        buffer.note(
            name,
            f"validation_step logged {name!r} from a padded batch: with several processes Accelerate pads the last "
            f"validation batch with copies of the first samples ({size - rows} of the {size} rows on process "
            f"{accelerator.process_index}), and a value computed over the whole batch counts them, so {name!r} is "
            "not exact. Log it over the real rows: gather per-sample values with accelerator.gather_for_metrics (it "
            "drops the copies) and log their mean weighted by their count; for a causal-LM loss, log the model's "
            "loss weighted by the batch's num_items, which the engine recounts over the real rows (the copies' "
            "labels are -100 there)",
        )

    accelerator.gather_for_metrics = gather_for_metrics
    buffer.watch = watch
    try:
        yield
    finally:
        buffer.watch = None
        accelerator.__dict__.pop("gather_for_metrics", None)


# ---------------------------------------------------------- library internals (tests/upstream_internals.py)


def loader_at_end(loader: Any) -> bool:
    """Whether an Accelerate data loader just yielded its last batch (``False`` for any other loader)."""
    return bool(getattr(loader, "end_of_dataloader", False))


def loader_remainder(loader: Any) -> Any:
    """How many samples the last global batch of an Accelerate data loader holds (-1 when it does not know)."""
    return getattr(loader, "remainder", -1)
