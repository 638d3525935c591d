"""`EngineConfig`: the loop's own settings. Techniques keep their settings in their plugin's ``*Config``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from torchloom.errors import ConfigError

__all__ = ["EngineConfig"]

#: The values of `EngineConfig.nonfinite_loss`.
NONFINITE_POLICIES = ("error", "skip", "ignore")


@dataclass
class EngineConfig:
    """Settings of the training loop, and nothing technique-specific.

    Args:
        max_epochs (`int`, defaults to 1): passes over the training data; the fit stops at whichever of
            ``max_epochs`` and ``max_steps`` comes first.
        max_steps (`int`, *optional*): optimizer steps (not micro-batches) after which the fit stops.
        val_check_interval (`int`, *optional*): run validation every this many optimizer steps; ``None``
            validates at the end of every epoch only.
        log_every_n_steps (`int`, defaults to 50): reduce buffered logged values (one host-device sync) and
            call ``on_log`` every this many optimizer steps.
        seed (`int`, *optional*, defaults to 0): passed to `accelerate.utils.set_seed` before the model is
            built; ``None`` leaves the random state alone.
        output_dir (`str`, defaults to ``"runs/default"``): the root of the run directories: every fit, validate
            and predict call writes its ``config.yaml``, ``metrics.jsonl`` and what plugins save into a new
            ``<output_dir>/version_N``, by the main process only; ``<output_dir>/latest`` links to the last
            completed fit.
        save_model (`bool`, defaults to False): at the end of a fit that completed, save the trained model
            to ``<run directory>/model`` with `TaskModule.save_model` (``<output_dir>/version_N/model``).
        num_sanity_val_steps (`int`, defaults to 2): before training, run ``validation_step`` on this many
            validation batches (nothing logged, random state restored), so that a broken validation fails in
            seconds rather than after the first epoch (Lightning's setting of the same name); 0 skips it.
        nonfinite_loss (`str`, defaults to ``"error"``): what a NaN or infinite training loss does.
            ``"error"``: stop with a `TaskError` naming the optimizer steps where it happened (checked on the
            device, read at each logging interval and before the model is saved: no per-step sync), and do not
            save the model. ``"skip"``: skip the optimizer step of any accumulation window with a non-finite
            loss on any rank (gradients dropped, scheduler not stepped; costs one host-device sync and, on
            several processes, one small all-reduce per optimizer step); skipped steps are logged as
            ``train/skipped_steps``. ``"ignore"``: train on (the model may become NaN). fp16 loss-scale
            overflows are not affected: the loss scaler skips those steps itself.

    Raises:
        ConfigError: if a count is not positive.
    """

    max_epochs: int = 1
    max_steps: int | None = None
    val_check_interval: int | None = None
    log_every_n_steps: int = 50
    seed: int | None = 0
    output_dir: str = "runs/default"
    save_model: bool = False
    num_sanity_val_steps: int = 2
    nonfinite_loss: str = "error"

    @classmethod
    def from_settings(cls, settings: dict[str, object]) -> EngineConfig:
        """Build from ``{field: value}``.

        Raises:
            ConfigError: an unknown field (naming the valid ones), or a bad value.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(f"unknown engine setting {unknown[0]!r}; valid settings: {', '.join(sorted(known))}")
        return cls(**settings)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"engine setting 'seed': got {self.seed!r}; expected an integer or null")
        if isinstance(self.output_dir, os.PathLike):
            self.output_dir = os.fspath(self.output_dir)
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise ConfigError(f"engine setting 'output_dir': got {self.output_dir!r}; expected a directory path")
        if not isinstance(self.save_model, bool):
            raise ConfigError(f"engine setting 'save_model': got {self.save_model!r}; expected true or false")
        for field in ("max_epochs", "log_every_n_steps"):
            _check_positive(field, getattr(self, field))
        if self.nonfinite_loss not in NONFINITE_POLICIES:
            raise ConfigError(
                f"engine setting 'nonfinite_loss': got {self.nonfinite_loss!r}; expected one of "
                f"{', '.join(map(repr, NONFINITE_POLICIES))}"
            )
        n = self.num_sanity_val_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"engine setting 'num_sanity_val_steps': got {n!r}; expected an integer >= 0")
        for field in ("max_steps", "val_check_interval"):
            if getattr(self, field) is not None:
                _check_positive(field, getattr(self, field))


def _check_positive(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"engine setting {field!r}: got {value!r}; expected a positive integer")
