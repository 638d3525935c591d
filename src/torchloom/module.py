"""`TaskModule`: the user's model, steps, optimizers and data, in one class (Lightning's LightningModule)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

__all__ = ["TaskModule"]


class TaskModule:
    """What to train and how to compute its loss. Subclass it; the engine runs the loop.

    The engine calls `configure_model` once, lets plugins transform the model (``configure_model``
    hook), prepares it with the Accelerator and stores the prepared model (possibly DDP-wrapped) in
    ``self.model``. Call ``self.model(...)`` in the steps so that distributed wrappers see the forward.

    Attributes set by the engine:
        model (`torch.nn.Module`): the prepared model.
        accelerator (`accelerate.Accelerator`): the run's Accelerator (device, rank, gather, ...).
        num_training_steps (`int` or ``None``): set before `configure_optimizers` in ``fit``: the optimizer
            steps the fit will take (what a learning-rate schedule spans; see the ``configure_optimizers``
            hook); ``None`` when the training dataloader has no length and ``max_steps`` is not set.

    Example:

    .. code-block:: python

        class Regression(torchloom.TaskModule):
            def configure_model(self):
                return torch.nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                x, y = batch
                return torch.nn.functional.mse_loss(self.model(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.model.parameters(), lr=0.1)
    """

    model: torch.nn.Module
    accelerator: Accelerator
    num_training_steps: int | None = None

    def __init__(self) -> None:
        self._log_fn: Any = None

    # -------------------------------------------------------------------------------------- to override

    def configure_model(self) -> torch.nn.Module:
        """Build and return the model (on the CPU; the engine moves it). Called once per run.

        Raises:
            NotImplementedError: the subclass did not define it.
        """
        raise NotImplementedError(f"{type(self).__name__} must define configure_model() returning an nn.Module")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict[str, Any]:
        """Compute the loss of one micro-batch.

        Args:
            batch: one micro-batch from the training dataloader, on the device.
            batch_idx (`int`): index of the micro-batch within the epoch.

        Returns:
            The loss as a 0-dim floating tensor, or a dict with ``"loss"`` and optional extra entries. An
            optional ``"num_items"`` (int or 0-dim tensor) is the number of items (samples, or labelled
            tokens) the loss is a mean over; the engine weights the logged loss by it, and the
            ``grad_accum`` plugin's ``tokens`` normalisation uses it.
        """
        raise NotImplementedError(f"{type(self).__name__} must define training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """Evaluate one validation batch (gradients disabled, model in eval mode); log with `log`.

        Returns:
            Anything; it is passed to the ``on_validation_batch_end`` hook (metric plugins use it).
        """
        raise NotImplementedError(
            f"{type(self).__name__} got validation data but defines no validation_step(batch, batch_idx)"
        )

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """Return the prediction for one batch. The default calls the model on the batch (a mapping is
        passed as keyword arguments)."""
        if isinstance(batch, dict):
            return self.model(**batch)
        return self.model(batch)

    def configure_optimizers(self) -> Any:
        """Return the optimizer, ``(optimizer, scheduler)`` or ``{"optimizer": ..., "lr_scheduler": ...}``.

        ``self.model`` is the unprepared model when this is called. Not called when a plugin (such as
        ``optimizer``) answers the ``configure_optimizers`` hook. The scheduler is stepped once per
        optimizer step.
        """
        raise NotImplementedError(
            f"{type(self).__name__} defines no configure_optimizers(); define it or enable the 'optimizer' plugin"
        )

    def train_dataloader(self) -> DataLoader | None:
        """Return the training dataloader, unless one is given to ``Engine.fit`` or by a DataModule."""
        return None

    def val_dataloader(self) -> DataLoader | None:
        """Return the validation dataloader (optional)."""
        return None

    def predict_dataloader(self) -> DataLoader | None:
        """Return the prediction dataloader (optional)."""
        return None

    def save_model(self, directory: str | os.PathLike[str]) -> None:
        """Save the trained weights to ``directory``, from the main process only.

        The default saves a transformers model with ``save_pretrained`` (config + ``model.safetensors``)
        and any other module with `accelerate.Accelerator.save_model` (safetensors). Override to also save a
        tokenizer or processor.
        """
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(
                directory,
                is_main_process=self.accelerator.is_main_process,
                save_function=self.accelerator.save,
                state_dict=self.accelerator.get_state_dict(self.model),
            )
        else:
            self.accelerator.save_model(self.model, directory)

    # ---------------------------------------------------------------------------------------- utilities

    def log(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        """Buffer a value for logging, without a host-device sync.

        Values are summed on their device and reduced once every ``log_every_n_steps`` optimizer steps
        (and after each validation pass): what reaches ``on_log`` and ``metrics.jsonl`` is the
        ``weight``-weighted mean over the micro-batches (or validation batches) and all ranks since the
        last reduction. Every rank must log the same names (checked at each reduction: a `TaskError` otherwise).

        Args:
            name (`str`): the metric name, e.g. ``"val/accuracy"``.
            value (`torch.Tensor` or `float`): a number or a one-element tensor (any float dtype).
            weight (`torch.Tensor` or `float`, defaults to 1.0): e.g. the number of samples it averages.

        Raises:
            RuntimeError: called before an engine set the task up (``fit``, ``validate`` or ``predict``).
            ValueError: ``value`` has more than one element.
        """
        if self._log_fn is None:
            raise RuntimeError(f"{type(self).__name__}.log({name!r}) called before Engine.fit/validate/predict")
        self._log_fn(name, value, weight)
