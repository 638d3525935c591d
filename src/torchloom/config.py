"""`EngineConfig`: the loop's own settings. Techniques keep their settings in their plugin's ``*Config``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from torchloom._settings import build_settings, check_fields, invalid

__all__ = ["EngineConfig"]

#: The owner named by every error of an engine setting (`torchloom._settings`: one shape for every setting).
OWNER = "engine"

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
        num_threads (`int`, *optional*): torch's intra-op CPU thread count in this process for each ``fit`` /
            ``validate`` / ``predict`` call (`torch.set_num_threads`; the previous count is restored when the call
            ends). ``None``: when ``OMP_NUM_THREADS`` is set (by you, by ``torchrun`` with several processes, or
            by ``accelerate launch``) torch's count from it is kept; otherwise the CPUs this process may use are
            divided among the processes of this machine (``LOCAL_WORLD_SIZE``), at least one each, as
            ``accelerate launch`` does. On a small model and a shared machine, 1 is often much faster than
            torch's default (one thread per core): see the performance page.

    Raises:
        ConfigError: a setting of the wrong type (by its annotation) or out of range, one message of the shape
            every setting's error has: ``engine: setting 'max_epochs' = 0; expected a positive integer``.
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
    num_threads: int | None = None

    @classmethod
    def from_settings(cls, settings: Mapping[str, object] | None) -> EngineConfig:
        """Build from ``{field: value}``, as `torchloom.build_config` builds a plugin's settings (one path,
        `torchloom._settings.build_settings`): unknown names, then types, then the ranges below.

        Raises:
            ConfigError: an unknown setting (``engine: unknown setting 'max_epoch'; did you mean 'max_epochs'?
                Valid settings: ...``), or a bad value.
        """
        output_dir = settings.get("output_dir") if isinstance(settings, Mapping) else None
        if isinstance(output_dir, os.PathLike):  # a path object, as __post_init__ takes it
            settings = {**settings, "output_dir": os.fspath(output_dir)}  # type: ignore[dict-item]
        config: EngineConfig = build_settings(cls, settings, owner=OWNER)
        return config

    def __post_init__(self) -> None:
        if isinstance(self.output_dir, os.PathLike):
            self.output_dir = os.fspath(self.output_dir)
        check_fields(self, OWNER)  # the types, by the annotations above
        for field in ("max_epochs", "log_every_n_steps", "max_steps", "val_check_interval", "num_threads"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise invalid(field, value, "a positive integer", owner=OWNER)
        if not self.output_dir:
            raise invalid("output_dir", self.output_dir, "a directory path", owner=OWNER)
        if self.nonfinite_loss not in NONFINITE_POLICIES:
            raise invalid("nonfinite_loss", self.nonfinite_loss, _one_of(NONFINITE_POLICIES), owner=OWNER)
        if self.num_sanity_val_steps < 0:
            raise invalid("num_sanity_val_steps", self.num_sanity_val_steps, "an integer >= 0", owner=OWNER)


def _one_of(values: tuple[str, ...]) -> str:
    return f"one of {', '.join(map(repr, values))}"
