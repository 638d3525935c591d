"""Automatic micro-batch size: the largest micro-batch that fits, found from the memory planner and by backing off
on out-of-memory errors, with the effective batch, the data order and the schedule unchanged.

Method card
-----------
- **What:** the user sets the effective batch (the dataloader's batch size times the processes); the plugin
  chooses the micro-batch size ``m`` and the accumulation ``k = batch / m`` so that ``m * k * processes`` equals it.
  It starts from ``micro_batch_size``, else the memory planner's suggestion (`torchloom.estimate_memory` with the
  device's memory or ``budget``), else the whole batch. On an out-of-memory error in the forward, the backward or
  the optimizer step, on any process, every process learns of it at the same point, the window's gradients are
  dropped, ``m`` shrinks to the largest divisor of the batch at most ``m / 2`` (``k`` grows to match) and the same
  batch is redone from the same samples.
- **Mechanism:** the plugin is the training step (``run_train_step``, a replacement of the default one that makes
  the same `torchloom.StepHooks` calls). Each dataloader batch is one optimizer step: it is cut along its first
  dimension into ``k`` pieces of ``m`` rows, each piece runs forward, ``hooks.before_backward`` and backward under
  DDP's ``no_sync`` (no collective inside the model's backward), and after each piece every process says whether it
  ran out of memory (`StepHooks.agree_out_of_memory`: one host all-reduce of one integer per piece; none on one
  process). The gradients are then averaged over the processes in one bucketed all-reduce (what DDP's backward would
  have done), and ``hooks.optimizer_step(..., agree_out_of_memory=True)`` steps with the step's own errors agreed
  before the scheduler moves. A `torchloom.WindowOutOfMemory` is followed by `StepHooks.discard_window`
  (``zero_grad``, the ``after_window_discard`` hook: ``grad_accum`` restarts its item count) and a redo.
- **Normalisation:** a piece's loss is divided by ``k`` (the batch's loss is the mean of its pieces' means, as in a
  ``grad_accum`` window of ``k`` micro-batches), unless ``before_backward`` made it a sum over its items
  (``hooks.loss_reduction == "sum"``, `torchloom.StepHooks`: ``grad_accum`` with ``normalization: tokens``),
  which the window's item count divides once per step. Either way a back-off changes nothing but the summation order.
- **Hooks:** ``setup`` (a fit starts from scratch, or from a state loaded outside a fit), ``on_fit_start``
  (checks the combination), ``run_train_step`` (the step), ``state_dict`` /
  ``load_state_dict`` (the chosen size travels in checkpoints).
- **Limits:** ``grad_accum`` must keep ``steps: 1`` (the plugin accumulates); DDP or one process only (not FSDP,
  DeepSpeed); an out-of-memory error inside ``optimizer.step()`` is redone only when every process failed there
  before updating anything, and never with the fp16 loss scaler; tensors are cut along their first dimension when
  it has the batch's rows, anything else is given whole to every piece.
- **Sources:** huggingface/transformers ``auto_find_batch_size`` (``accelerate.utils.find_executable_batch_size``:
  halves the batch, not the accumulation); Lightning's ``BatchSizeFinder`` (one process); mosaicml/composer's
  ``device_train_microbatch_size="auto"`` and its fixes (an out-of-memory error on one rank agreed with an
  all-reduce before the next collective, gradients zeroed before the redo).

Functional use, without the engine::

    smaller_micro_batch(batch=12, current=12)  # 6, then 3, then 1
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

import torchloom

__all__ = ["AutoBatch", "AutoBatchConfig", "smaller_micro_batch", "split_batch"]

#: Bytes per all-reduce bucket of the gradient average (DDP's default bucket is 25 MiB).
BUCKET_BYTES = 25 * 2**20


@dataclass
class AutoBatchConfig:
    """Settings of the ``auto_batch`` plugin.

    Args:
        micro_batch_size (`int`, *optional*): the micro-batch (rows per forward, per process) to start from; a
            divisor of the dataloader's batch size. ``None``: the memory planner's suggestion for the device's
            memory (CUDA) or for ``budget``, else the whole batch.
        budget (`int` or `str`, *optional*): memory per process the planner's suggestion must fit, as ``"20GiB"``
            or a number of bytes; ``None``: the device's total memory on CUDA, and no planner on other devices.
        max_retries (`int`, defaults to 8): back-offs allowed in one fit (each halves the micro-batch at least); one
            more out-of-memory error is an error.
        effective_batch_size (`int`, *optional*): samples per optimizer step over all processes, checked against
            the dataloader's batch size times the processes (the batch is the effective batch per process).

    Raises:
        ConfigError: ``micro_batch_size`` or ``effective_batch_size`` below 1, ``max_retries`` below 0, a ``budget``
            that is not a size, or a ``budget`` with ``micro_batch_size`` (which leaves the planner out).
    """

    micro_batch_size: int | None = None  # rows per forward per process to start from; None: planner, else batch
    budget: int | str | None = None  # memory per process for the planner ("20GiB"); None: the CUDA device's memory
    max_retries: int = 8  # back-offs allowed in one fit, >= 0
    effective_batch_size: int | None = None  # samples per optimizer step over all processes (checked)

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "effective_batch_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise torchloom.ConfigError(f"setting {name!r} = {value!r}; expected an integer >= 1 or null")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise torchloom.ConfigError(f"setting 'max_retries' = {self.max_retries!r}; expected an integer >= 0")
        if self.budget is not None:
            if _size(self.budget) is None:  # else read only at the start of the fit, where a planner error is a note
                raise torchloom.ConfigError(
                    f"setting 'budget' = {self.budget!r}; expected bytes (an integer > 0) or a number with a unit: "
                    "KiB, MiB, GiB (powers of 2) or kB, MB, GB, e.g. '20GiB'"
                )
            if self.micro_batch_size is not None:
                raise torchloom.ConfigError(
                    f"settings 'budget' = {self.budget!r} and 'micro_batch_size' = {self.micro_batch_size!r}: the "
                    "budget is what the planner fits a micro-batch to, and micro_batch_size replaces the planner; "
                    "set one of them"
                )


def _size(value: int | str) -> int | None:
    """``value`` in bytes (an int, or a size with a unit as Accelerate reads it: ``"20GiB"``), ``None`` when it is
    not a size > 0."""
    from accelerate.utils import convert_file_size_to_int

    if isinstance(value, bool):
        return None
    try:
        size = (
            int(value.strip())
            if isinstance(value, str) and value.strip().isdigit()
            else convert_file_size_to_int(value)
        )
    except (ValueError, AttributeError, TypeError):
        return None
    return int(size) if size > 0 else None


# ------------------------------------------------------------------------------------------ functional core


def smaller_micro_batch(batch: int, current: int) -> int | None:
    """The micro-batch after a back-off: the largest divisor of ``batch`` that is at most ``current // 2``, so that
    every piece of a full batch has the same size; ``None`` when ``current`` is already 1.

    Args:
        batch (`int`): rows of a full batch per process.
        current (`int`): the micro-batch that ran out of memory.
    """
    if current <= 1:
        return None
    return max(d for d in range(1, current // 2 + 1) if batch % d == 0)


def batch_rows(batch: Any) -> int | None:
    """The rows of ``batch``: the first dimension of its first tensor (a shape read), or ``None``."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else None
    if isinstance(batch, Mapping):
        values: Any = batch.values()
    elif isinstance(batch, list | tuple):
        values = batch
    else:
        return None
    for value in values:
        rows = batch_rows(value)
        if rows is not None:
            return rows
    return None


def split_batch(batch: Any, rows: int, size: int) -> list[Any]:
    """``batch`` cut into pieces of ``size`` rows (the last one shorter when ``size`` does not divide ``rows``).

    Every tensor whose first dimension is ``rows`` is sliced (a view: no copy); mappings (a dict, a transformers
    ``BatchEncoding``), lists and tuples keep their type with their items cut; anything else goes whole into every
    piece.
    """

    def cut(value: Any, start: int, stop: int) -> Any:
        if isinstance(value, torch.Tensor):
            return value[start:stop] if value.ndim and value.shape[0] == rows else value
        if isinstance(value, Mapping):
            items = {key: cut(item, start, stop) for key, item in value.items()}
            kind: Any = type(value)
            try:
                return kind(items)
            except TypeError:
                return items
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
            return type(value)(*(cut(item, start, stop) for item in value))
        if isinstance(value, list | tuple):
            return type(value)(cut(item, start, stop) for item in value)
        return value

    return [cut(batch, start, min(start + size, rows)) for start in range(0, rows, size)]


def average_gradients(parameters: list[torch.nn.Parameter], world_size: int) -> None:
    """Average the gradients of ``parameters`` over the default process group, as DDP's backward does, in buckets
    of at most `BUCKET_BYTES`. A parameter without a gradient takes part with zeros (and keeps the average)."""
    import torch.distributed as dist

    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        if not bucket:
            return
        flat = torch.cat([grad.reshape(-1) for grad in bucket])
        dist.all_reduce(flat)
        flat.div_(world_size)
        for grad, reduced in zip(bucket, torch.split(flat, [grad.numel() for grad in bucket]), strict=True):
            grad.copy_(reduced.view_as(grad))
        bucket.clear()

    for p in parameters:
        grad = p.grad
        assert grad is not None
        if bucket and (grad.dtype != bucket[0].dtype or grad.device != bucket[0].device or size >= BUCKET_BYTES):
            flush()
            size = 0
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
    flush()


def release_memory(device: torch.device) -> None:
    """What the allocator can give back after an out-of-memory error: collected garbage, the CUDA cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------- plugin


class AutoBatch(torchloom.Plugin):
    """Choose the micro-batch size, and back off on out-of-memory errors, keeping the effective batch.

    Implements ``on_fit_start`` and ``run_train_step`` (replacing the default step), and ``state_dict`` /
    ``load_state_dict``. See the module docstring for the method and ``docs/plugins/auto_batch.md`` for the
    settings and limits.

    Attributes:
        micro_batch_size (`int`, *optional*): the micro-batch in use (``None`` before the first batch).
        changes (`list[dict]`): every change of this fit: ``step``, ``from``, ``to``, ``phases`` (rank -> where).

    Raises:
        ConfigError: (during the fit) a combination that cannot be made exact (``grad_accum`` with ``steps`` > 1,
            FSDP / DeepSpeed), a ``micro_batch_size`` that does not divide the batch, an ``effective_batch_size``
            that is not the batch times the processes, ``max_retries`` back-offs used up, a micro-batch of 1 that
            does not fit (with the planner's estimate), an out-of-memory error in the optimizer step that cannot
            be redone exactly.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(
            plugins={"auto_batch": {"budget": "20GiB"}, "grad_accum": {"normalization": "tokens"}}
        )
    """

    name = "auto_batch"
    Config = AutoBatchConfig

    def __init__(self, config: AutoBatchConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.micro_batch_size: int | None = None
        self.changes: list[dict[str, Any]] = []
        self._rows: int | None = None  # rows of a full batch per process (the first batch's)
        self._backoffs = 0
        # a state loaded outside a fit (a script's load_plugin_state before Engine.fit): the next fit starts from it
        self._next_start: dict[str, Any] | None = None
        self._seq_len: int | None = None  # tokens per row of the first batch (input_ids), for the planner
        self._phase = "forward"  # where the current piece is
        self._count_checked = False  # a batch's num_items was checked to be its labels' loss-token count

    # ------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "batch_rows": self._rows, "backoffs": self._backoffs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_batch_size, self._rows, self._backoffs = (
            state["micro_batch_size"],
            state["batch_rows"],
            int(state["backoffs"]),
        )
        self._next_start = self.state_dict()  # (a resume's, loaded after setup, is forgotten at on_fit_start)

    # ------------------------------------------------------------------------------------ hooks

    @torchloom.hookimpl
    def setup(self, stage: str) -> None:
        if stage == "fit":  # from scratch, or from a state loaded outside a fit; a resume's load comes after
            start = self._next_start or {"micro_batch_size": None, "batch_rows": None, "backoffs": 0}
            self.micro_batch_size, self._rows, self._backoffs = (
                start["micro_batch_size"],
                start["batch_rows"],
                start["backoffs"],
            )

    @torchloom.hookimpl
    def on_fit_start(self, accelerator) -> None:
        from accelerate.utils import DistributedType

        self._next_start = None  # used: the next fit starts from scratch unless a state is loaded before it
        self.changes = []
        if accelerator.gradient_accumulation_steps != 1:
            raise torchloom.ConfigError(
                f"plugin 'auto_batch': gradient_accumulation_steps = {accelerator.gradient_accumulation_steps} (the "
                "grad_accum plugin's 'steps'); auto_batch chooses the accumulation itself, inside each dataloader "
                "batch: set grad_accum's steps to 1 (keep its normalization) and the dataloader's batch size to the "
                "effective batch per process"
            )
        supported = {DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU}
        if accelerator.distributed_type not in supported:
            raise torchloom.ConfigError(
                f"plugin 'auto_batch': distributed type {accelerator.distributed_type.value} is not supported; "
                "auto_batch averages the gradients as DDP does and runs on one process or under DDP (MULTI_GPU, "
                "MULTI_CPU)"
            )

    @torchloom.hookimpl
    def run_train_step(self, task, model, optimizer, scheduler, accelerator, batch, progress, hooks) -> dict[str, Any]:
        rows = batch_rows(batch)
        if rows is None:
            raise torchloom.ConfigError(
                f"plugin 'auto_batch': the training batch ({type(batch).__name__}) holds no tensor with a batch "
                "dimension to cut into micro-batches"
            )
        if self.micro_batch_size is None:
            self._start(batch, rows, model, accelerator)
        while True:
            try:
                return self._window(task, model, optimizer, scheduler, accelerator, batch, rows, progress, hooks)
            except torchloom.WindowOutOfMemory as oom:
                phases, redoable = oom.phases, oom.redoable
            hooks.discard_window(optimizer, accelerator, progress)  # every process, at the same point
            release_memory(accelerator.device)
            self._back_off(phases, redoable, model, accelerator, progress)

    # ------------------------------------------------------------------------------------ the step

    def _window(self, task, model, optimizer, scheduler, accelerator, batch, rows, progress, hooks) -> dict[str, Any]:
        """One batch as pieces of `micro_batch_size` rows, then the optimizer step (`WindowOutOfMemory` on every
        process when any ran out of memory)."""
        assert self.micro_batch_size is not None
        pieces = self._pieces(batch, rows)
        several = accelerator.num_processes > 1
        outputs: list[dict[str, Any]] = []
        for piece in pieces:
            self._phase = "forward"
            with accelerator.no_sync(model) if several else contextlib.nullcontext():
                try:
                    outputs.append(self._piece(task, model, accelerator, piece, len(pieces), progress, hooks))
                    failed = None
                    if len(outputs) > 1:  # of the pieces before the last, only what _combined reads is kept
                        outputs[-2] = {k: outputs[-2][k] for k in ("loss", "num_items") if k in outputs[-2]}
                except Exception as exc:  # not kept: the frames of an out-of-memory error hold the activations
                    if not torchloom.utils.is_out_of_memory(exc):
                        raise
                    failed = self._phase
            hooks.agree_out_of_memory(failed)  # every process, after every piece: before any later collective
        if several:
            average_gradients([p for p in model.parameters() if p.requires_grad], accelerator.num_processes)
        if accelerator.sync_gradients:
            hooks.optimizer_step(model, optimizer, scheduler, accelerator, progress, agree_out_of_memory=True)
        hooks.log("train/micro_batch_size", float(self.micro_batch_size), reduce="last")
        return _combined(outputs)

    def _pieces(self, batch: Any, rows: int) -> list[Any]:
        """`split_batch`, with a batch's own 0-dim ``num_items`` (torchloom's causal-LM batches) counted again for
        each piece as the collator counts it, ``(labels[..., 1:] != -100).sum()``: the whole batch's count would
        weigh every piece as the whole batch. Checked once, on the first batch (one sync), that the batch's count is
        that one."""
        assert self.micro_batch_size is not None
        pieces = split_batch(batch, rows, self.micro_batch_size)
        count = batch.get("num_items") if isinstance(batch, Mapping) else None
        if not (isinstance(count, torch.Tensor) and count.ndim == 0):
            return pieces
        labels = batch.get("labels")
        if not self._count_checked:
            recount = None if not isinstance(labels, torch.Tensor) else _loss_tokens(labels)
            if recount is None or not bool((recount == count).item()):
                raise torchloom.ConfigError(
                    "plugin 'auto_batch': the batch's 'num_items' is not (labels[..., 1:] != -100).sum() of its "
                    "'labels' (torchloom's causal-LM batches), so it cannot be counted again for each micro-batch; "
                    "count the items in training_step from the micro-batch it gets, or leave them out of the batch"
                )
            self._count_checked = True
        if len(pieces) > 1:
            for piece in pieces:
                piece["num_items"] = _loss_tokens(piece["labels"])
        return pieces

    def _piece(self, task, model, accelerator, piece, count, progress, hooks) -> dict[str, Any]:
        """Forward and backward of one piece of ``count``; its outputs, with the raw loss detached."""
        result = task.training_step(piece, progress.batch_idx)
        out = dict(result) if isinstance(result, dict) else {"loss": result}
        raw = out["loss"]
        hooks.before_backward(out, accelerator, progress, model)
        loss = out["loss"] if hooks.loss_reduction == "sum" else out["loss"] / count
        self._phase = "backward"
        accelerator.backward(loss)
        out["loss"] = raw.detach()
        return out

    # ------------------------------------------------------------------------------------ sizes

    def _start(self, batch: Any, rows: int, model: Any, accelerator: Any) -> None:
        """The first micro-batch of this fit: the setting, else the planner's suggestion, else the whole batch."""
        cfg, world = self.config, accelerator.num_processes
        self._seq_len = _seq_len(batch)
        if cfg.effective_batch_size is not None and cfg.effective_batch_size != rows * world:
            raise torchloom.ConfigError(
                f"plugin 'auto_batch': effective_batch_size = {cfg.effective_batch_size}, but the dataloader's batch "
                f"of {rows} rows on {world} process(es) makes {rows * world}; set the dataloader's batch size to "
                f"the effective batch per process ({cfg.effective_batch_size} / {world})"
            )
        self._rows = rows
        source = "configured"
        if cfg.micro_batch_size is not None:
            if rows % cfg.micro_batch_size:
                divisors = [d for d in range(1, rows + 1) if rows % d == 0]
                raise torchloom.ConfigError(
                    f"plugin 'auto_batch': micro_batch_size = {cfg.micro_batch_size} does not divide the batch of "
                    f"{rows} rows per process; valid: {divisors}"
                )
            size = cfg.micro_batch_size
        else:
            size, source = self._planned(rows, model, accelerator)
        self.micro_batch_size = size
        if accelerator.is_main_process:
            torchloom.utils.warn(
                f"auto_batch: micro-batch {size} x accumulation {rows // size} x {world} process(es) = effective "
                f"batch {rows * world} ({source})"
            )

    def _planned(self, rows: int, model: Any, accelerator: Any) -> tuple[int, str]:
        budget: int | str | None = self.config.budget
        if budget is None and accelerator.device.type == "cuda":
            budget = torch.cuda.get_device_properties(accelerator.device).total_memory
        if budget is None:
            return rows, "the whole batch: no memory budget on this device"
        try:
            estimate = self._estimate(model, accelerator, rows, budget)
        except (torchloom.TorchloomError, RuntimeError, TypeError, ValueError) as exc:
            return rows, f"the whole batch: the planner could not estimate this model: {exc}"
        suggestion = estimate.rows[0].suggestion
        if suggestion is None:
            return 1, f"the planner: not even a micro-batch of 1 fits {torchloom.utils.format_bytes(estimate.budget)}"
        return suggestion.micro_batch_size, (
            f"the planner's suggestion for {torchloom.utils.format_bytes(estimate.budget)}: "
            f"{torchloom.utils.format_bytes(suggestion.total)}"
        )

    def _estimate(self, model: Any, accelerator: Any, batch: int, budget: int | str | None) -> Any:
        precision = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}.get(str(accelerator.mixed_precision), "fp32")
        return torchloom.estimate_memory(
            accelerator.unwrap_model(model),
            batch_size=1,
            seq_len=self._seq_len,
            precision=precision,
            grad_checkpoint=False,
            budget=budget,
            effective_batch_size=batch if budget is not None else None,
        )

    def _back_off(self, phases: dict[int, str], redoable: bool, model: Any, accelerator: Any, progress: Any) -> None:
        """After an agreed out-of-memory error: the next micro-batch, or the error that ends the fit."""
        assert self.micro_batch_size is not None and self._rows is not None
        current, where = self.micro_batch_size, ", ".join(f"rank {r} ({p})" for r, p in sorted(phases.items()))
        step = progress.global_step + 1
        if not redoable:
            updated = sorted(set(range(accelerator.num_processes)) - set(phases)) + sorted(
                r for r, p in phases.items() if p != "step"
            )
            raise torchloom.ConfigError(
                f"plugin 'auto_batch': out of memory in the optimizer step of step {step} on {where}, after "
                f"rank(s) {', '.join(map(str, sorted(updated)))} had updated their parameters: the window cannot be "
                "redone exactly. Start with a smaller micro_batch_size, free memory for the optimizer state "
                "(e.g. the optimizer plugin's adamw8bit), or use the planner (torchloom estimate-memory --budget)"
            )
        if accelerator.scaler is not None and any(p.startswith("step") for p in phases.values()):
            raise torchloom.ConfigError(
                f"plugin 'auto_batch': out of memory in the optimizer step of step {step} on {where} under the fp16 "
                "loss scaler, whose state cannot be rewound: start with a smaller micro_batch_size"
            )
        smaller = smaller_micro_batch(self._rows, current)
        if smaller is None:
            raise torchloom.ConfigError(
                f"plugin 'auto_batch': a micro-batch of 1 does not fit: out of memory at step {step} on {where}. "
                f"{self._planner_note(model, accelerator)} Free memory (grad_checkpoint, mixed_precision bf16, a "
                "smaller optimizer state, peft) or use a device with more memory"
            )
        if self._backoffs >= self.config.max_retries:
            raise torchloom.ConfigError(
                f"plugin 'auto_batch': out of memory at step {step} on {where} with micro-batch {current}, after "
                f"max_retries = {self.config.max_retries} back-off(s) in this fit; raise max_retries or start with "
                "a smaller micro_batch_size"
            )
        self._backoffs += 1
        self.micro_batch_size = smaller
        self.changes.append({"step": step, "from": current, "to": smaller, "phases": dict(phases)})
        if accelerator.is_main_process:
            torchloom.utils.warn(
                f"auto_batch: out of memory at step {step} on {where}: micro-batch {current} -> {smaller}, "
                f"accumulation {self._rows // current} -> {self._rows // smaller} (effective batch "
                f"{self._rows * accelerator.num_processes} unchanged); redoing the step"
            )

    def _planner_note(self, model: Any, accelerator: Any) -> str:
        try:
            row = self._estimate(model, accelerator, 1, None).rows[0]
        except (torchloom.TorchloomError, RuntimeError, TypeError, ValueError) as exc:
            return f"The planner could not estimate this model ({exc})."
        fmt = torchloom.utils.format_bytes
        return (
            f"The planner estimates {fmt(row.total)} per process at micro-batch 1 (weights {fmt(row.weights)}, "
            f"gradients {fmt(row.gradients)}, optimizer state {fmt(row.optimizer_state)}, activations "
            f"{fmt(row.activations)})."
        )


def _loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Transformers' causal-LM loss tokens (its loss shifts the labels by one), as torchloom's collator counts."""
    return (labels[..., 1:] != -100).sum()


def _seq_len(batch: Any) -> int | None:
    """The second dimension of the batch's ``input_ids`` (a language model's tokens per row), else ``None``."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.ndim == 2 else None


def _combined(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch's outputs from its pieces': the last piece's other keys; ``loss`` the mean over the batch (weighted
    by ``num_items`` when every piece returned it, which then is their sum)."""
    combined = dict(outputs[-1])
    losses = torch.stack([out["loss"] for out in outputs])
    if all("num_items" in out for out in outputs):
        counts = [out["num_items"] for out in outputs]
        total: Any = sum(counts[1:], counts[0])
        weights = torch.stack([torch.as_tensor(c, dtype=losses.dtype, device=losses.device) for c in counts])
        # A piece with no item (no loss token: its mean is 0 / 0 = NaN, with a zero gradient) weighs nothing.
        weighted = torch.where(weights != 0, losses * weights, torch.zeros_like(losses))
        combined["loss"] = weighted.sum() / weights.sum().clamp_min(torch.finfo(losses.dtype).tiny)
        combined["num_items"] = total
    else:
        combined["loss"] = losses.mean()
    return combined
