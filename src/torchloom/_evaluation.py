"""The validation pass and the prediction pass: the model in eval mode, every sample once.

With several processes Accelerate pads the last batch with copies of the first samples; both passes cut them off
the outputs (`torchloom._padding`), and the validation pass also shows the task's own torchmetrics objects only the
real rows and gives the copies of a causal-LM batch no weight (their labels -100, ``num_items`` recounted), so that
each sample counts once; a value logged by hand that still counts them is named in a warning.
"""

from __future__ import annotations

from typing import Any

import torch

from torchloom._batch_limits import limited
from torchloom._context import current
from torchloom._guards import check_same_length, eval_mode
from torchloom._padding import (
    batch_size,
    real_rows,
    real_rows_in_metrics,
    take_rows,
    watch_hand_logged,
    without_copies_weight,
)

__all__ = ["prediction_pass", "validation_pass"]


def validation_pass(task: Any, run: Any, logs: Any, progress: Any) -> None:
    """Run ``validation_step`` over the run's validation data with the validation hooks; what is logged goes to
    ``logs.val`` (the caller reduces it). Every module gets its own train / eval mode back afterwards. Under a
    validation limit (``limit_val_batches``, ``fast_dev_run``, ``overfit_batches``) only the first
    ``run.val_batches`` batches run, on every process.

    Raises:
        TaskError: the processes have different numbers of validation batches.
    """
    relay, acc, model, loader = run.relay, run.accelerator, run.model, run.val_dataloader
    check_same_length(run.agreement, loader, "validation")
    batch_end = relay.implemented("on_validation_batch_end")
    with eval_mode(model), logs.validating():
        relay.call("on_validation_start", task=task, model=model, accelerator=acc, progress=progress)
        with torch.no_grad():
            for batch_idx, batch in enumerate(limited(loader, run.val_batches)):
                rows = real_rows(loader, acc)  # Accelerate's padding copies are cut off: each sample counts once
                size = batch_size(batch) if rows is not None else None
                if rows is None or size is None or rows == size:
                    outputs = task.validation_step(batch, batch_idx)
                else:  # the whole batch (gather_for_metrics works), but the copies count nowhere: no weight in a
                    # causal-LM loss, no update of the task's metrics, a warning for a value logged that counts them
                    batch, items = without_copies_weight(batch, rows, size)
                    with (
                        real_rows_in_metrics(task, rows, size, logs.val.fail),
                        watch_hand_logged(logs.val, acc, rows, size, items),
                    ):
                        outputs = task.validation_step(batch, batch_idx)
                if batch_end and rows != 0:
                    if rows is not None and size is not None:
                        outputs, batch = take_rows(outputs, rows, size), take_rows(batch, rows, size)
                    relay.call(
                        "on_validation_batch_end", outputs=outputs, batch=batch, accelerator=acc, progress=progress
                    )
        relay.call("on_validation_end", task=task, model=model, accelerator=acc, progress=progress, log=logs.log)


def prediction_pass(task: Any, run: Any) -> list[Any]:
    """Run ``run_predict_step`` (the first plugin's outputs), else ``predict_step``, over the run's prediction data
    with the prediction hooks (eval mode, no gradients); return this process's outputs, one per batch, without
    Accelerate's padding copies (a process whose share of a batch is only copies drops its output)."""
    relay, acc, loader = run.relay, run.accelerator, run.predict_dataloader
    predictions: list[Any] = []
    with eval_mode(run.model), torch.no_grad(), current("predict").log.predicting():
        relay.call("on_predict_start", task=task, model=run.model, accelerator=acc)
        replaced = relay.implemented("run_predict_step")
        for batch_idx, batch in enumerate(loader):
            outputs = None
            if replaced:
                outputs = relay.call(
                    "run_predict_step", task=task, model=run.model, batch=batch, batch_idx=batch_idx, accelerator=acc
                )
            if outputs is None:
                outputs = task.predict_step(batch, batch_idx)
            rows = real_rows(loader, acc)  # the outputs lose Accelerate's padding copies
            if rows == 0:  # only copies on this process
                continue
            if rows is not None and (size := batch_size(batch)) is not None:
                real = without_copies_weight(batch, rows, size)[0]  # num_items: the real rows' loss tokens
                outputs, batch = take_rows(outputs, rows, size), take_rows(real, rows, size)
            if relay.implemented("on_predict_batch_end"):
                relay.call("on_predict_batch_end", outputs=outputs, batch=batch, accelerator=acc)
            predictions.append(outputs)
        relay.call("on_predict_end", predictions=predictions, accelerator=acc)
    return predictions
