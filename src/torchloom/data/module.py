"""`DataModule`: prepare data once, set it up on every process, hand out dataloaders."""

from __future__ import annotations

from typing import Any

__all__ = ["DataModule"]


class DataModule:
    """Groups a run's data steps (Lightning's LightningDataModule).

    The engine calls `prepare_data` inside ``accelerator.main_process_first()`` (so the main process
    fills the cache first and the others then read it), then `setup` on every process, then asks for
    the dataloaders. Dataloaders are prepared (sharded across processes) by the engine.
    """

    def prepare_data(self) -> None:
        """Download, extract, preprocess and cache. Runs first on the main process, then on the others."""

    def setup(self, stage: str) -> None:
        """Load what `prepare_data` cached. ``stage`` is ``"fit"``, ``"validate"`` or ``"predict"``."""

    def check_model(self, model: Any) -> None:
        """Refuse a model this data cannot be used with (e.g. attention that would mix packed sequences).

        The engine calls it after ``configure_model``, before the model is prepared; the default accepts any.

        Raises:
            ConfigError: the model does not fit the data (says what to set instead).
        """

    def fit_log_values(self) -> dict[str, float]:
        """Values that describe the prepared training data, logged once per fit: ``name -> float``.

        The engine logs each with ``reduce="last"`` right after ``on_fit_start`` (after `setup`), so they are in
        the fit's first training record of ``metrics.jsonl`` and of every tracker, with the step of that record.
        Name them as logged values are named (``data/...``). The default logs nothing.

        Example: `torchloom.data.PromptCompletionData` with ``packing=True`` returns
        ``{"data/train_packing_efficiency": 0.834}`` (real tokens / computed tokens of the packed training rows).
        """
        return {}

    def train_dataloader(self) -> Any:
        """Return the training dataloader."""
        return None

    def val_dataloader(self) -> Any:
        """Return the validation dataloader, or ``None``."""
        return None

    def predict_dataloader(self) -> Any:
        """Return the prediction dataloader, or ``None``."""
        return None
