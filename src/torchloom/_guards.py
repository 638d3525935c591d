"""Checks that turn a run that would go silently wrong into one clear error (or keep user state intact).

Each function guards one thing: module train/eval modes, what ``configure_model`` / ``configure_optimizers``
return, whether the ranks iterate the same number of batches, and whether the trained weights are finite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from torchloom._schedule import schedule_from
from torchloom._warn import warn
from torchloom.errors import PluginError, TaskError
from torchloom.parallel.dtensors import local

__all__ = [
    "NEGATIVE_ITEMS",
    "EmptyMicroBatches",
    "check_finite_parameters",
    "check_model",
    "check_optimizer_parameters",
    "check_same_length",
    "check_step_outputs",
    "check_training",
    "eval_mode",
    "listing",
    "nonfinite_loss_error",
    "nonfinite_parts",
    "optimizer_steps",
    "split_optimizers",
    "state_tensors",
    "stop_iteration",
    "train_mode_unless_chosen",
]


# ------------------------------------------------------------------------------------------ module modes


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode, then give every submodule back exactly the mode it had.

    ``model.train()`` after an evaluation would also switch on a submodule the user froze with ``.eval()``
    (a frozen BatchNorm would update its running statistics again): the mode of each module is recorded
    before and restored after, one by one, as Lightning's ``_ModuleMode`` does.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def train_mode_unless_chosen(model: torch.nn.Module) -> None:
    """Put a model that is wholly in eval mode in train mode; leave per-module modes the user chose alone.

    ``from_pretrained`` (transformers) returns a model in eval mode, with dropout off, and fine-tuning it as
    it is would silently train without dropout: such a model is switched to train mode once, when the fit
    starts. A model with any module in train mode has modes someone chose (a frozen BatchNorm put in
    ``eval()`` under a training head): those are kept exactly, at the start and after every validation.
    """
    if not any(module.training for module in model.modules()):
        model.train()


def stop_iteration(dataloader: Any) -> None:
    """Tell an Accelerate dataloader that an iteration left early (``max_steps``, a sanity pass) is over.

    `accelerate.data_loader.DataLoaderShard` registers itself with the `accelerate.state.GradientState` when
    an iteration starts and unregisters only when it runs to the end; a registered, abandoned loader would
    decide ``accelerator.sync_gradients`` for the next one. ``end()`` unregisters it (a no-op otherwise).
    """
    end = getattr(dataloader, "end", None)
    if callable(end):
        end()


# -------------------------------------------------------------------------------- what the task returns


def check_model(model: Any, task: Any) -> torch.nn.Module:
    """Return ``model`` if it is an ``nn.Module``.

    Raises:
        TaskError: ``configure_model`` returned something else (``None``, a dict, a class instead of an instance).
    """
    if not isinstance(model, torch.nn.Module):
        hint = " (a class: return an instance)" if isinstance(model, type) else ""
        raise TaskError(
            f"{type(task).__name__}.configure_model() returned {_describe(model)}{hint}; expected a torch.nn.Module"
        )
    return model


def split_optimizers(spec: Any, source: str) -> tuple[torch.optim.Optimizer, Any]:
    """Normalise a ``configure_optimizers`` result to ``(optimizer, scheduler or None)``.

    Accepted: an optimizer; ``(optimizer, scheduler)``; ``{"optimizer": ..., "lr_scheduler": ...}`` where the
    scheduler may be Lightning's ``{"scheduler": ..., "interval": "step"}``. A scheduler is any object with a
    ``step()`` method that is not an optimizer (``torch.optim.lr_scheduler.LRScheduler``, transformers'
    schedules).

    Args:
        spec: what ``configure_optimizers`` returned.
        source (`str`): who returned it, for the message (``"MyTask.configure_optimizers()"``).

    Raises:
        TaskError: anything else: ``None``, a string, a parameter generator, two optimizers (torchloom steps
            one), a second element that is not a scheduler.
        ConfigError: a Lightning scheduler dict with an unknown key, interval, frequency or monitor.
    """
    expected = "an optimizer, (optimizer, scheduler) or {'optimizer': ..., 'lr_scheduler': ...}"
    optimizer, scheduler, when = spec, None, None
    if isinstance(spec, Mapping):
        optimizer, scheduler = spec.get("optimizer"), spec.get("lr_scheduler")
        if isinstance(scheduler, Mapping):  # Lightning's {"scheduler": ..., "interval": "epoch", "monitor": ...}
            when, scheduler = scheduler, scheduler.get("scheduler")
    elif isinstance(spec, tuple | list):
        optimizers = [o for o in spec if isinstance(o, torch.optim.Optimizer)]
        if len(optimizers) > 1:
            raise TaskError(
                f"{source} returned {len(optimizers)} optimizers; torchloom steps exactly one. Put the parameter "
                "sets in one optimizer as parameter groups, or return (optimizer, scheduler)"
            )
        if len(spec) != 2:
            raise TaskError(f"{source} returned a {type(spec).__name__} of {len(spec)} items; expected {expected}")
        optimizer, scheduler = spec
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TaskError(f"{source} returned {_describe(spec)}; expected {expected}")
    if scheduler is not None:
        if isinstance(scheduler, torch.optim.Optimizer) or not callable(getattr(scheduler, "step", None)):
            raise TaskError(
                f"{source}: the scheduler is {_describe(scheduler)}; expected a learning-rate scheduler (an object "
                "with step(), such as torch.optim.lr_scheduler.LambdaLR or transformers.get_scheduler(...))"
            )
        scheduler = schedule_from(scheduler, when, source)  # per epoch, every N, or on a monitored value
    return optimizer, scheduler


def check_optimizer_parameters(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, source: str, task: Any
) -> None:
    """Refuse an optimizer that holds none of the model's parameters; warn when it holds some that are not the model's.

    An optimizer built over another module (a second instance, a copy, a module the task keeps beside the model)
    steps tensors the model's forward never uses: the model never changes and the loss stays flat, silently. That
    can only be a mistake, so it is an error. Parameters beside the model's (a learnable temperature kept on the
    task) do train, but they are not saved with the model, and on several processes DDP does not average their
    gradients: a warning. Both name the parameters (``self.<attribute>.<name>`` where the task holds them, else
    their shapes).

    Args:
        optimizer: the optimizer ``configure_optimizers`` returned (not yet prepared).
        model: the model ``configure_model`` returned (after the ``configure_model`` hook).
        source (`str`): who built the optimizer, for the message (``"MyTask.configure_optimizers()"``).
        task: the task, searched for the modules and tensors that hold the parameters.

    Raises:
        TaskError: none of the optimizer's parameters is a parameter of the model.
    """
    own = {id(p) for p in model.parameters()}
    params = list({id(p): p for group in optimizer.param_groups for p in group["params"]}.values())
    foreign = [p for p in params if id(p) not in own]
    if not foreign:
        return
    listing = _parameter_listing(foreign, task)
    if len(foreign) == len(params):
        kept = sum(1 for _ in model.parameters())
        raise TaskError(
            f"{source}: the optimizer holds none of the model's parameters: its {len(params)} parameter"
            f"{'s' if len(params) != 1 else ''} ({listing}) are not parameters of the "
            f"{type(model).__name__} that configure_model returned ({kept} parameter{'s' if kept != 1 else ''}), "
            "so the model would never change. Build the optimizer from self.model.parameters() in "
            "configure_optimizers"
        )
    warn(
        f"{source}: {len(foreign)} of the optimizer's {len(params)} parameters "
        f"{'is not a parameter' if len(foreign) == 1 else 'are not parameters'} of the model: {listing}. They are "
        "stepped, but not saved with the model, and on several processes their gradients are not averaged. Put them "
        "in the module configure_model returns (as submodules or nn.Parameter attributes)",
    )


def _parameter_listing(tensors: list[torch.Tensor], task: Any, limit: int = 6) -> str:
    """``self.other.weight [1, 4], self.other.bias [1]``: the name each tensor has as an attribute of ``task`` (or of
    a module the task holds), else ``a tensor of shape [1, 4]``; at most ``limit``, then how many more."""
    names: dict[int, str] = {}
    for attribute, value in vars(task).items() if hasattr(task, "__dict__") else ():
        if attribute == "model" or attribute.startswith("__"):
            continue
        if isinstance(value, torch.nn.Module):
            for name, parameter in value.named_parameters(prefix=f"self.{attribute}"):
                names.setdefault(id(parameter), name)
        elif isinstance(value, torch.Tensor):
            names.setdefault(id(value), f"self.{attribute}")
    shown = [
        f"{names[id(t)]} {list(t.shape)}" if id(t) in names else f"a tensor of shape {list(t.shape)}"
        for t in tensors[:limit]
    ]
    more = f" and {len(tensors) - limit} more" if len(tensors) > limit else ""
    return ", ".join(shown) + more


# --------------------------------------------------------------------------------------- several ranks


def check_same_length(agreement: Any, dataloader: Any, what: str) -> None:
    """Raise on every rank if the ranks' ``dataloader`` lengths differ (one small gather of the run's
    `torchloom.RankAgreement`).

    A rank with more batches would enter a gradient all-reduce that no other rank joins and wait forever.
    Skipped on one process; dataloaders without a length count as -1 (every rank must agree on that too).

    Raises:
        TaskError: the lengths differ (the message lists them per rank).
    """
    if agreement.num_processes < 2:
        return
    try:
        length = len(dataloader)
    except TypeError:
        length = -1
    lengths = agreement.gather(length)
    if len(set(lengths)) > 1:
        listing = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(lengths))
        raise TaskError(
            f"the processes have different numbers of {what} batches ({listing}); every process must run the "
            "same number of batches or they wait for each other forever. Give every process the same "
            "DataLoader over the whole dataset and let Accelerate shard it"
        )


# ------------------------------------------------------------------------------------------ non-finite


#: Internal log name: the share of micro-batches whose tensor ``num_items`` was negative (`check_training`).
NEGATIVE_ITEMS = "torchloom/negative_num_items"


def check_training(
    loss: float | None,
    negative_items: float,
    items: float | None,
    steps: tuple[int, int],
    epoch: int,
    overflowed: bool,
    nonfinite_loss: str,
    culprit: Any = None,
) -> None:
    """Check one reduction of the training values logged over the optimizer steps ``steps`` (first, last; 1-based)
    since the previous logging step. The values are reduced over the ranks, so every rank decides alike (no rank
    raises alone).

    Args:
        loss (`float`, *optional*): the reduced ``train/loss`` (``None`` if nothing was trained).
        negative_items (`float`): the share of micro-batches with a negative tensor ``num_items``.
        items (`float`, *optional*): the sum of ``num_items`` over the micro-batches and ranks (the summed weight of
            ``train/loss``; ``None`` when nothing was logged).
        steps (`tuple[int, int]`): the optimizer steps checked.
        epoch (`int`): the current epoch.
        overflowed (`bool`): the fp16 loss scaler skipped a step in this interval: under fp16 a non-finite loss
            gives non-finite gradients, which the scaler skips (and lowers its scale), an overflow it handles.
        nonfinite_loss (`str`): `EngineConfig.nonfinite_loss`; only ``"error"`` raises for a non-finite loss.
        culprit (`Callable[[], str | None]`, *optional*): called on every process before a non-finite-loss error
            (`EmptyMicroBatches.culprit`): the micro-batch with no loss token whose non-finite loss came before the
            divergence, which the error names instead of giving divergence advice.

    Raises:
        TaskError: a negative ``num_items``; a non-finite loss in a step the loss scaler did not skip, which is a
            loss over no items when every micro-batch returned ``num_items`` 0 (`zero_items_error`).
    """
    first, last = steps
    if negative_items > 0:
        raise TaskError(
            f"training_step returned a negative num_items in {optimizer_steps(first, last)}; num_items counts "
            "the items (samples, labelled tokens) its loss is a mean over: it must be >= 0"
        )
    if loss is not None and nonfinite_loss == "error" and not math.isfinite(loss) and not overflowed:
        if items == 0:  # the weighted mean over no items is 0 / 0: not a divergence
            raise zero_items_error(loss, first, last, epoch)
        where = culprit() if culprit is not None else None
        if where is not None:
            raise TaskError(
                f"the training loss became {loss} in {optimizer_steps(first, last)} (epoch {epoch}) after {where} "
                "had no loss tokens (num_items 0): its loss was not finite (a mean over no tokens is 0 / 0), and "
                "the loss it returned gives NaN gradients too (it divides by its count, e.g. sum / mask.sum()), "
                "which made the weights NaN; this is not a divergence, and the model is not saved. Return a loss "
                "that is finite with no items, e.g. sum / max(count, 1), or transformers' self.model(**batch).loss"
            )
        raise nonfinite_loss_error(loss, first, last, epoch)


class EmptyMicroBatches:
    """Where a micro-batch with no loss token (``num_items`` 0) had a non-finite loss, kept on the device (no
    sync): the first such micro-batch of the fit on this process, and the last optimizer step in which a
    micro-batch with items had a finite loss. Transformers' mean over no token is NaN with a zero gradient, which
    the engine leaves out of ``train/loss``; a loss that divides by its count (``sum / mask.sum()``) has a NaN
    gradient too, which makes the weights NaN: `culprit` tells that case from a divergence when the loss turns
    non-finite."""

    def __init__(self) -> None:
        self._code: torch.Tensor | None = None  # step * 2**27 + batch_idx of the first one, or -1
        self._epoch: torch.Tensor | None = None
        self._finite: torch.Tensor | None = None  # the last step with a finite loss over items, or -1

    def note(self, loss: torch.Tensor, items: Any, kept: Any, where: tuple[int, int, int]) -> None:
        """Note one micro-batch: its loss, ``num_items``, ``kept`` (``num_items != 0``: a device tensor, a host bool,
        or ``None`` without ``num_items``) and ``where`` it is (epoch, batch index in the epoch, optimizer step)."""
        if kept is None or (kept is True and self._code is None):  # no micro-batch without items yet: nothing to do
            return
        epoch, batch_idx, step = where
        bad = ~torch.isfinite(loss.detach())
        if self._code is None:
            self._code = torch.full((), -1.0, dtype=torch.float64, device=loss.device)
            self._epoch = torch.full((), -1.0, dtype=torch.float64, device=loss.device)
            self._finite = torch.full((), -1.0, dtype=torch.float64, device=loss.device)
        assert self._epoch is not None and self._finite is not None
        empty = ~kept if isinstance(kept, torch.Tensor) else not kept
        first = bad & empty & (self._code < 0)
        self._code = torch.where(first, float(step * 2**27 + batch_idx), self._code)
        self._epoch = torch.where(first, float(epoch), self._epoch)
        self._finite = torch.where(~bad & kept, float(step), self._finite)

    def culprit(self, agreement: Any) -> str | None:
        """On every process (one gather; only before an error): ``"micro-batch N (epoch E, optimizer step S, on
        process R)"`` for the first micro-batch with no loss token and a non-finite loss, on any process, after
        which no optimizer step had a finite loss over items; else ``None``."""
        mine = None
        if self._code is not None and self._epoch is not None and self._finite is not None:
            mine = (float(self._code), float(self._epoch), float(self._finite))
        found = agreement.gather(mine)
        finite = max((f for _, _, f in filter(None, found)), default=-1.0)
        firsts = [(m[0], rank, m[1]) for rank, m in enumerate(found) if m is not None and m[0] >= 0]
        if not firsts:
            return None
        code, rank, epoch = min(firsts)
        step, batch_idx = divmod(int(code), 2**27)
        if finite > step:  # a later step trained on a finite loss: that micro-batch's gradient was not NaN
            return None
        on = f", on process {rank}" if agreement.num_processes > 1 else ""
        return f"micro-batch {batch_idx} (epoch {int(epoch)}, optimizer step {step}{on})"


def check_step_outputs(outputs: Any, wrappers: list[str]) -> dict[str, Any]:
    """Return the outputs of ``run_train_step`` if they are a dict with ``"loss"``.

    Raises:
        PluginError: anything else: a ``run_train_step`` wrapper (one of ``wrappers``) dropped the result.
    """
    if not isinstance(outputs, dict) or "loss" not in outputs:
        who = f"plugin {wrappers[0]!r}" if len(wrappers) == 1 else f"one of the plugins {wrappers}"
        raise PluginError(
            f"run_train_step returned {type(outputs).__name__} instead of the step's outputs (a dict with 'loss'): "
            f"{who} wraps run_train_step and must return the inner result, `return (yield)`"
        )
    return outputs


def optimizer_steps(first: int, last: int) -> str:
    """``"optimizer step 3"`` or ``"optimizer steps 1-8"`` (1-based, inclusive)."""
    return f"optimizer step {last}" if first >= last else f"optimizer steps {first}-{last}"


def nonfinite_loss_error(value: float, first_step: int, last_step: int, epoch: int) -> TaskError:
    """The error for a non-finite training loss seen in the optimizer steps ``first_step..last_step`` (1-based)."""
    return TaskError(
        f"the training loss became {value} in {optimizer_steps(first_step, last_step)} (epoch {epoch}); "
        "stopping, and the model is not saved. "
        "Lower the learning rate, clip gradients (grad_clip), check the data and the loss for division by zero "
        "or log(0), or set the engine setting nonfinite_loss to 'skip' (skip such steps) or 'ignore'. "
        "log_every_n_steps=1 narrows down the step"
    )


def zero_items_error(value: float, first_step: int, last_step: int, epoch: int) -> TaskError:
    """The error for a training loss that is a mean over no items: every micro-batch of the optimizer steps
    ``first_step..last_step`` (1-based), on every process, returned ``num_items`` 0."""
    return TaskError(
        f"every micro-batch of {optimizer_steps(first_step, last_step)} (epoch {epoch}) returned num_items=0, on "
        f"every process, so the training loss is {value}: a mean over no items (no labelled tokens), not a "
        "divergence; stopping, and the model is not saved. Check the labels and the loss mask (every label -100, "
        "or truncation that cut off every completion?), and return num_items = the number of items the loss is a "
        "mean over"
    )


def nonfinite_parts(parts: Sequence[tuple[str, Iterable[torch.Tensor]]], accelerator: Any) -> list[str]:
    """The names of the ``parts`` (``(name, tensors)``) whose floating tensors hold NaN or inf on any process: one
    flag per part, computed on the device and fused into one vector, one all-reduce over the processes and one
    host read, so every process gets the same answer (call it on every process, with the same part names).

    Returns:
        `list[str]`: the names of the non-finite parts, in the order given (empty when all are finite).
    """
    device = accelerator.device
    flags = []
    for _, tensors in parts:
        bad = [_nonfinite(t).to(device) for t in tensors if (t.is_floating_point() or t.is_complex()) and t.numel()]
        flags.append(torch.stack(bad).any() if bad else torch.zeros((), dtype=torch.bool, device=device))
    if not flags:
        return []
    found = torch.stack(flags).to(torch.float32)
    if accelerator.num_processes > 1:
        found = accelerator.reduce(found, reduction="sum")
    return [name for (name, _), count in zip(parts, found.tolist(), strict=True) if count > 0]


#: The dtypes whose NaN and inf `_nonfinite` finds from the minimum and maximum (``torch.aminmax``).
_MINMAX_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor, on ``tensor``'s device: whether the floating or complex ``tensor`` (numel > 0) holds a
    NaN or an infinity. From its minimum and maximum (``torch.aminmax``: one pass that allocates nothing; a NaN
    propagates into both, an infinity is one of them), about ten times as fast on CPU as ``isfinite(t).all()``,
    which writes a bool tensor of ``tensor``'s size; other dtypes (float8) take that way."""
    values = local(tensor).detach()  # a DTensor's shard: every process checks its own, the flags are summed
    if values.is_complex():
        values = torch.view_as_real(values)
    if values.dtype not in _MINMAX_DTYPES:
        return ~torch.isfinite(values).all()
    return ~torch.isfinite(torch.stack(torch.aminmax(values))).all()


def check_finite_parameters(parameters: Iterable[torch.Tensor], accelerator: Any, where: str) -> None:
    """Raise on every rank if any rank's floating parameters hold NaN or inf (one sync, one small all-reduce:
    `nonfinite_parts`).

    Raises:
        TaskError: a parameter is not finite (``where`` says what was about to happen).
    """
    if nonfinite_parts([("model weights", parameters)], accelerator):
        raise TaskError(
            f"the trained model holds NaN or infinite weights; {where}. A non-finite gradient in the last optimizer "
            "steps is the usual cause: clip gradients (grad_clip) or lower the learning rate"
        )


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, Iterator):
        return (
            f"an iterator ({type(value).__name__}); materialise it, e.g. list(model.parameters()), inside an optimizer"
        )
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def state_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a state (dicts, lists and tuples of tensors and plain values)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from state_tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from state_tensors(item)


def listing(names: list[str]) -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
