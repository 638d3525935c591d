"""`TaskModule`: the user's model, steps, optimizers and data, in one class (Lightning's LightningModule)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchloom._context import log_to_active_run, request_stop
from torchloom.errors import ConfigError
from torchloom.rundir.adapter_format import gather_trainable, has_adapter, save_adapter, sharded_adapter
from torchloom.rundir.layout import MODEL_CARD
from torchloom.rundir.weight_files import check_weight_files

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from torchmetrics import Metric

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
        pass

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
            ``grad_accum`` plugin's ``tokens`` normalisation uses it. A micro-batch with ``num_items`` 0 weighs
            nothing: its loss may be NaN (transformers' mean over no labelled token) if its gradient is zero; a
            loss that divides by its count (``sum / count``) has a NaN gradient there, so return
            ``sum / max(count, 1)`` (see docs/data.md).
        """
        raise NotImplementedError(f"{type(self).__name__} must define training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """Evaluate one validation batch (gradients disabled, model in eval mode); log with `log`.

        With several processes the last batch is whole, Accelerate's padding copies included (so
        ``accelerator.gather_for_metrics`` works here), but the torchmetrics objects the task holds are updated
        with the real rows only, and in a causal-LM batch (``labels`` and ``num_items``) the copies' labels are -100
        and ``num_items`` counts the real rows' loss tokens (see `log`).

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

    def save_model(self, directory: str | os.PathLike[str], *, max_shard_size: int | str = "10GB") -> None:
        """Save the trained weights to ``directory`` as safetensors, writing from the main process only.

        Call it on every process: gathering the weights may need all of them (FSDP, DeepSpeed), and it returns
        on each once the files are written, so any process may then load them. A transformers model is saved
        with ``save_pretrained`` (``config.json`` and the weights); reload it with its ``from_pretrained``. Any
        other module is saved with `huggingface_hub.save_torch_state_dict`; reload it with `load_model`. Either
        way a tensor shared by several parameters (tied weights, such as an ``lm_head.weight`` tied to the input
        embedding) is stored once, under one of its names, and both loaders restore the tie. A model larger than
        ``max_shard_size`` is split into ``model-0000k-of-0000n.safetensors`` shards listed in
        ``model.safetensors.index.json``; otherwise it is one ``model.safetensors``. Weight files of an earlier
        save in ``directory`` are replaced, and the model card of an earlier fit (``torchloom_model.json``, which
        the end of a fit writes after this) is removed: it described other weights. A model that carries
        an adapter injected in place (the ``peft`` plugin's LoRA / QLoRA) is saved as the adapter alone, in peft's own
        format (``adapter_config.json`` and ``adapter_model.safetensors``, as ``PeftModel.save_pretrained`` writes;
        the frozen base is not written): load it with ``peft.PeftModel.from_pretrained(base, directory)``; under FSDP
        only the adapter's values are gathered for it (`torchloom.rundir.adapter_format.gather_trainable`). Override
        to also save a tokenizer or processor.

        Args:
            directory (`str` or `os.PathLike`): where to save; created if missing.
            max_shard_size (`int` or `str`, defaults to ``"10GB"``): the largest shard, in bytes or as a string
                such as ``"500MB"``. A single tensor larger than that gets a shard of its own.
        """
        accelerator = self.accelerator
        model = accelerator.unwrap_model(self.model)
        if sharded_adapter(accelerator, self.model):  # FSDP: the adapter's whole values only, not the base's
            gathered = gather_trainable(self.model)  # on the main process; the others use their own shards' names
            if accelerator.is_main_process:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, MODEL_CARD))
            mine = gathered if accelerator.is_main_process else None
            save_adapter(model, directory, state_dict=mine, is_main_process=accelerator.is_main_process)
            accelerator.wait_for_everyone()
            return
        state_dict = accelerator.get_state_dict(self.model)  # on every rank: it gathers under FSDP / DeepSpeed
        if accelerator.is_main_process:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, MODEL_CARD))
        if has_adapter(model):  # an adapter injected in place (the peft plugin): peft's own format, no frozen base
            save_adapter(model, directory, state_dict=state_dict, is_main_process=accelerator.is_main_process)
        elif hasattr(model, "save_pretrained"):
            model.save_pretrained(
                directory,
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
                state_dict=state_dict,
                max_shard_size=max_shard_size,
            )
        elif accelerator.is_main_process:
            # Not `Accelerator.save_model`: it writes the shard index from every process.
            from huggingface_hub import save_torch_state_dict

            os.makedirs(directory, exist_ok=True)
            save_torch_state_dict(state_dict, os.fspath(directory), max_shard_size=max_shard_size)
        accelerator.wait_for_everyone()  # on return, every process can load what the main process wrote

    @staticmethod
    def load_model(model: torch.nn.Module, directory: str | os.PathLike[str]) -> torch.nn.Module:
        """Load weights that `save_model` wrote into ``model``, in place, and return ``model``.

        Reads ``directory/model.safetensors``, or the shards that ``directory/model.safetensors.index.json``
        lists (with `huggingface_hub.load_torch_model`; nothing is unpickled). ``directory`` may also be one
        ``.safetensors`` file. Use it in `configure_model` to start from, validate or predict with trained
        weights; ``model`` is the module `configure_model` builds (unprepared, on any device). Tied weights
        stay tied: a parameter that the file stores under another name it shares its tensor with (as
        `save_model` and ``save_pretrained`` store tied weights) is loaded through that name. It works for a
        transformers model too, though ``from_pretrained(directory)`` is the usual way to load one. Without
        torchloom, ``safetensors.torch.load_model(model, "<directory>/model.safetensors")`` loads a one-file save
        the same way (strict, ties restored); ``model.load_state_dict(safetensors.torch.load_file(...))`` does not
        for tied weights: the file stores their tensor once, so the other name is reported missing.

        Args:
            model (`torch.nn.Module`): the module to load into, with the architecture that was saved.
            directory (`str` or `os.PathLike`): the directory `save_model` wrote, or a ``.safetensors`` file.

        Returns:
            `torch.nn.Module`: ``model``, with the saved weights.

        Raises:
            ConfigError: ``directory`` holds no saved model (neither file), a weight file that is not safetensors,
                damaged or truncated (named, before anything is loaded), or the saved weights do not fit
                ``model``: a key that the model has and the file lacks (and that no loaded key shares its
                tensor with), a key that the model lacks, or a shape that differs. ``model`` may then be
                partly loaded.
        """
        from huggingface_hub import load_torch_model

        path = Path(directory)
        if path.is_dir() and not (path / "model.safetensors.index.json").is_file():
            path = path / "model.safetensors"  # a lone file: other *.safetensors beside it are not weights
        if not path.is_dir() and (path.suffix != ".safetensors" or not path.is_file()):
            raise ConfigError(
                f"{os.fspath(directory)!r} holds no saved model: expected a directory with model.safetensors or"
                " model.safetensors.index.json and its shards (what TaskModule.save_model writes), or a"
                " .safetensors file"
            )
        check_weight_files(path)  # a damaged file is named as such, not left to the loader's pickle advice
        where = f"the model saved in {os.fspath(directory)!r}"
        try:
            missing, unexpected = load_torch_model(model, path, strict=False)
        except (RuntimeError, OSError, ValueError) as exc:  # e.g. load_state_dict's "size mismatch for ..."
            raise ConfigError(f"{where} cannot be loaded into {type(model).__name__}: {exc}") from exc
        # A key the file lacks is loaded all the same when its tensor is that of a key the file has (a tie).
        state = model.state_dict()
        loaded = state.keys() - set(missing)
        missing = [key for key in missing if not any(state[key].is_set_to(state[other]) for other in loaded)]
        if missing or unexpected:
            problems = {"missing": missing, "unexpected": unexpected}
            found = "; ".join(f"{kind} keys {sorted(keys)}" for kind, keys in problems.items() if keys)
            raise ConfigError(
                f"{where} does not fit {type(model).__name__}: {found} (the same architecture, built with the"
                " same settings, loads it)"
            )
        return model

    # ---------------------------------------------------------------------------------------- utilities

    def log(
        self,
        name: str,
        value: torch.Tensor | float | Metric,
        weight: torch.Tensor | float = 1.0,
        reduce: str = "mean",
    ) -> None:
        """Buffer a value for logging, without a host-device sync.

        Values are folded on their device. Values logged during training are reduced once every
        ``log_every_n_steps`` optimizer steps and at the end of training; values logged during a validation
        pass (``validation_step``, the validation hooks) are reduced separately, right after the pass. What
        reaches ``on_log`` and ``metrics.jsonl`` is the same float64 value on every rank: with
        ``reduce="mean"`` the ``weight``-weighted mean over the micro-batches (or validation batches) and all
        ranks since the last reduction; ``"sum"`` the total; ``"max"`` / ``"min"`` the extreme; ``"last"`` the
        latest value on the main process (for "current value" quantities such as a learning rate). Every rank
        must log the same names with the same reductions (checked at each reduction: a `TaskError`
        otherwise).

        A `torchmetrics.Metric` (as in Lightning) is logged as the object: update it yourself (``metric(preds,
        target)`` or ``metric.update(...)``), log it once or on every batch, and at the reduction it is computed
        over all the data of all ranks (torchmetrics synchronises its state then, so AUROC, F1 or average
        precision are never a mean of per-rank values) and reset; one object logged under several names is computed
        once and each name gets its value. With several processes, the last validation batch holds copies
        Accelerate pads it with: while ``validation_step`` runs on it, the torchmetrics objects the task holds
        (attributes, also inside a dict, a list or an ``nn.Module``) see only this process's real rows (each
        tensor argument of ``update`` / ``forward`` whose first dimension is the batch size is cut; a process with
        none skips the update, and ``forward`` returns NaN there). An update with no such tensor (one row per
        token) is a `TaskError` on every process after the pass. A plain value is one number the engine cannot
        split, so the copies get no weight where the engine can see them: in a causal-LM batch (a mapping with
        ``labels`` and ``num_items``, as `torchloom.data.CausalLMCollator` makes) the copies' labels are -100 and
        ``num_items`` counts the real rows' loss tokens (on a process whose share is only copies the labels stay
        and ``num_items`` is 0), so ``self.log("val/loss", self.model(**inputs).loss, weight=batch["num_items"])``
        is the exact token mean on any number of processes. Count other values with
        ``accelerator.gather_for_metrics`` (it drops the copies). A value logged with ``reduce="mean"`` or
        ``"sum"`` from a padded batch that counts the copies (neither weighted by ``num_items`` nor logged after a
        ``gather_for_metrics``) is named in a warning, once per name, on the main process. During validation a
        value logged with weight 0 counts for nothing, even a NaN one (the loss of a batch with no loss token).

        Args:
            name (`str`): the metric name, e.g. ``"val/accuracy"``.
            value (`torch.Tensor`, `float` or `torchmetrics.Metric`): a number, a one-element tensor (any float
                dtype), or a metric whose ``compute()`` gives one number.
            weight (`torch.Tensor` or `float`, defaults to 1.0): e.g. the number of samples it averages
                (``reduce="mean"`` only).
            reduce (`str`, defaults to ``"mean"``): ``"mean"``, ``"sum"``, ``"max"``, ``"min"`` or ``"last"``.

        Raises:
            RuntimeError: called outside ``Engine.fit``, ``validate`` or ``predict``.
            TaskError: called during ``predict`` (a prediction run records no logged value: return it from
                ``predict_step`` instead); a bad name, value, weight or reduction (also a `TypeError` / `ValueError`);
                at the reduction, a metric whose compute fails or gives more than one number, or an update of a padded
                last validation batch that cannot be cut to the real rows.
        """
        log_to_active_run(name, value, weight, reduce)

    def request_stop(self, reason: str) -> None:
        """Ask the running ``fit`` to stop cleanly after the current optimizer step (`torchloom.request_stop`).

        Every rank stops at the same step: the request is combined over the ranks after the next logging of
        training values, validation pass or epoch end, whichever comes first. The fit ends as a success (final
        validation if needed, model save, ``on_fit_end``).

        Args:
            reason (`str`): why, kept in `Engine.stop_reason` and printed by the CLI.
        """
        request_stop(reason)

    def configure_metrics(self) -> Any:
        """Return the evaluation metrics of the ``eval_metrics`` plugin, or ``None`` (the default).

        Returns:
            A `torchmetrics.MetricCollection`, a `torchmetrics.Metric`, a ``{name: Metric}`` mapping, or
            ``None``. They are updated with ``update(preds, target)`` from ``validation_step``'s outputs and
            logged as ``val/<name>`` (see ``docs/plugins/eval_metrics.md``).
        """
        return None
