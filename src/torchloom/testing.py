"""Helpers for testing plugins: a tiny task, a one-call tiny fit, and a plugin that records hook calls.

A third-party plugin's test can be a few lines:

.. code-block:: python

    from torchloom.testing import RecordingPlugin, tiny_fit

    def test_my_plugin_runs(tmp_path):
        recorder = RecordingPlugin()
        engine = tiny_fit([MyPlugin(), recorder], output_dir=str(tmp_path))
        assert recorder.calls.count("after_optimizer_step") == engine.progress.global_step
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from torchloom.engine import Engine
from torchloom.hookspecs import hookimpl
from torchloom.module import TaskModule
from torchloom.plugins import PluginSpec

__all__ = ["RecordingPlugin", "TinyTask", "tiny_dataset", "tiny_fit"]


def tiny_dataset(n: int = 32, in_features: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32) -> TensorDataset:
    """A linear-regression dataset: ``x`` of shape ``(n, in_features)`` drawn from ``seed``, and
    ``y = x @ w + 0.5`` of shape ``(n, 1)`` with one fixed ``w`` (no noise: training drives the loss to 0)."""
    w = torch.randn(in_features, 1, generator=torch.Generator().manual_seed(1234), dtype=dtype)
    x = torch.randn(n, in_features, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return TensorDataset(x, x @ w + 0.5)


class TinyTask(TaskModule):
    """Linear regression with MSE loss and SGD: a deterministic task to run plugins against.

    Args:
        n (`int`, defaults to 32): training samples; validation uses ``n // 2`` other samples.
        batch_size (`int`, defaults to 4): micro-batch size.
        lr (`float`, defaults to 0.1): SGD learning rate.
        in_features (`int`, defaults to 4): input width.
        dtype (`torch.dtype`, defaults to float32): dtype of the data and the model.
        validate (`bool`, defaults to True): provide a validation dataloader and log ``val/loss``.
    """

    def __init__(
        self,
        n: int = 32,
        batch_size: int = 4,
        lr: float = 0.1,
        in_features: int = 4,
        dtype: torch.dtype = torch.float32,
        validate: bool = True,
    ) -> None:
        super().__init__()
        self.n, self.batch_size, self.lr, self.in_features, self.dtype = n, batch_size, lr, in_features, dtype
        self.validate = validate

    def configure_model(self) -> torch.nn.Module:
        return torch.nn.Linear(self.in_features, 1).to(self.dtype)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        # Per-sample errors gathered with gather_for_metrics, which drops the samples a distributed sampler
        # repeats to even out the last batch: val/loss is then exact on any number of processes.
        errors = self.accelerator.gather_for_metrics(((self.model(x) - y) ** 2).mean(dim=1))
        loss = errors.mean()
        self.log("val/loss", loss, weight=len(errors))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(tiny_dataset(self.n, self.in_features, 0, self.dtype), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader | None:
        if not self.validate:
            return None
        return DataLoader(tiny_dataset(self.n // 2, self.in_features, 1, self.dtype), batch_size=self.batch_size)


def tiny_fit(plugins: PluginSpec = None, task: TaskModule | None = None, **settings: Any) -> Engine:
    """Fit ``task`` (default: `TinyTask`) with ``plugins`` and engine ``settings``; return the engine.

    ``log_every_n_steps`` defaults to 1 so that every optimizer step is in ``engine.history``. The fit enables
    exactly ``plugins``: none of the default plugins that `torchloom.Engine` adds (the ``progress`` display), so that
    a plugin's test sees only the plugins it names; pass ``default_plugins=True`` to add them.
    """
    settings.setdefault("log_every_n_steps", 1)
    settings.setdefault("default_plugins", False)
    engine = Engine(plugins=plugins, **settings)
    engine.fit(task if task is not None else TinyTask())
    return engine


class RecordingPlugin:
    """Records every hook call, in order, as ``(hook_name, progress)``; ``progress`` is ``None`` for hooks
    without one, and the stage string (``"fit"``, ...) for ``setup`` and ``teardown``.

    ``calls`` holds just the hook names. ``run_train_step`` is recorded by a wrapper, so the default step
    (or any other) still runs.
    """

    name = "torchloom.testing.recorder"

    def __init__(self) -> None:
        self.records: list[tuple[str, Any]] = []

    @property
    def calls(self) -> list[str]:
        return [name for name, _ in self.records]

    def _record(self, hook: str, progress: Any = None) -> None:
        self.records.append((hook, progress))

    @hookimpl
    def setup(self, stage) -> None:
        self._record("setup", stage)

    @hookimpl
    def configure_accelerator(self) -> None:
        self._record("configure_accelerator")

    @hookimpl
    def configure_model(self) -> None:
        self._record("configure_model")

    @hookimpl
    def configure_optimizers(self) -> None:
        self._record("configure_optimizers")

    @hookimpl
    def on_run_start(self, stage) -> None:
        self._record("on_run_start", stage)

    @hookimpl
    def on_fit_start(self, progress) -> None:
        self._record("on_fit_start", progress)

    @hookimpl
    def on_train_epoch_start(self, progress) -> None:
        self._record("on_train_epoch_start", progress)

    @hookimpl
    def on_train_batch_start(self, progress) -> None:
        self._record("on_train_batch_start", progress)

    @hookimpl(wrapper=True)
    def run_train_step(self, progress):
        self._record("run_train_step", progress)
        return (yield)

    @hookimpl
    def before_backward(self, progress) -> None:
        self._record("before_backward", progress)

    @hookimpl
    def after_window_discard(self, progress) -> None:
        self._record("after_window_discard", progress)

    @hookimpl
    def before_optimizer_step(self, progress) -> None:
        self._record("before_optimizer_step", progress)

    @hookimpl
    def after_optimizer_step(self, progress) -> None:
        self._record("after_optimizer_step", progress)

    @hookimpl
    def on_train_batch_end(self, progress) -> None:
        self._record("on_train_batch_end", progress)

    @hookimpl
    def on_train_step_end(self, progress) -> None:
        self._record("on_train_step_end", progress)

    @hookimpl
    def on_train_epoch_end(self, progress) -> None:
        self._record("on_train_epoch_end", progress)

    @hookimpl
    def on_validation_start(self, progress) -> None:
        self._record("on_validation_start", progress)

    @hookimpl
    def on_validation_batch_end(self, progress) -> None:
        self._record("on_validation_batch_end", progress)

    @hookimpl
    def on_validation_end(self, progress) -> None:
        self._record("on_validation_end", progress)

    @hookimpl
    def on_predict_start(self) -> None:
        self._record("on_predict_start")

    @hookimpl
    def run_predict_step(self) -> None:
        self._record("run_predict_step")  # returns None: the task's predict_step still runs

    @hookimpl
    def on_predict_batch_end(self) -> None:
        self._record("on_predict_batch_end")

    @hookimpl
    def on_predict_end(self) -> None:
        self._record("on_predict_end")

    @hookimpl
    def on_log(self, progress) -> None:
        self._record("on_log", progress)

    @hookimpl
    def on_train_end(self, progress) -> None:
        self._record("on_train_end", progress)

    @hookimpl
    def on_save_model(self) -> None:
        self._record("on_save_model")

    @hookimpl
    def on_exception(self, progress) -> None:
        self._record("on_exception", progress)

    @hookimpl
    def on_fit_end(self, progress) -> None:
        self._record("on_fit_end", progress)

    @hookimpl
    def teardown(self, stage) -> None:
        self._record("teardown", stage)
