"""`EngineConfig`: the loop's own settings. Techniques keep their settings in their plugin's ``*Config``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from torchloom._settings import build_settings, check_fields, invalid
from torchloom.errors import ConfigError

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
        fast_dev_run (`bool` or `int`, defaults to False): a quick-debug fit (Lightning's setting of the same
            name): ``True`` (= 1) or ``N`` runs N training batches and N validation batches per process in one
            epoch, then a final validation only if none ran; no sanity pass, no checkpoints, no trackers, no saved
            model and no ``latest`` link (`is_fast_dev_run` tells plugins), and a one-line summary. ``max_epochs``,
            ``val_check_interval``, ``num_sanity_val_steps`` and ``save_model`` are overridden; it cannot be
            combined with ``max_steps``, ``limit_train_batches``, ``limit_val_batches`` or ``overfit_batches``,
            nor with a resume (``fit``'s ``ckpt_path``, ``--resume``; ``"auto"`` only over an ``output_dir`` without
            checkpoints): a `ConfigError`. Its summary never says it passed after no optimizer step.
            ``validate`` runs N validation batches too.
        limit_train_batches (`int` or `float`, *optional*): train on only this many batches of every epoch, per
            process (an integer >= 1), or this fraction of them (a float in (0, 1], rounded down; one that leaves
            no batch is a `ConfigError`): the same count on every process. The schedule length
            (``num_training_steps``), the progress total and the data position a checkpoint records count the
            limited epochs, so a resume is exact. ``None``: every batch.
        limit_val_batches (`int` or `float`, *optional*): validate on only this many batches per process (an
            integer >= 1), or this fraction of them (a float in (0, 1]), in every validation pass of ``fit`` and
            ``validate``. ``None``: every batch.
        overfit_batches (`int` or `float`, *optional*): train on the same first batches every epoch (a count, or
            a fraction of the epoch, as ``limit_train_batches``), in order: the training dataloader is rebuilt
            without shuffling (a sequential sampler; it must have a ``batch_size``), and every validation runs on
            those same training batches (when the task has a ``validation_step``; the validation data is not
            used). Cannot be combined with ``limit_train_batches`` or ``limit_val_batches``.

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
    fast_dev_run: bool | int = False
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    overfit_batches: int | float | None = None

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
        self._check_debug_settings()

    def _check_debug_settings(self) -> None:
        """The quick-debug settings: their values, then the combinations that contradict each other."""
        if not isinstance(self.fast_dev_run, bool) and self.fast_dev_run < 1:
            raise invalid(
                "fast_dev_run", self.fast_dev_run, "false, true (1 batch) or a number of batches >= 1", owner=OWNER
            )
        for field in ("limit_train_batches", "limit_val_batches", "overfit_batches"):
            check_batch_limit(field, getattr(self, field))
        if self.is_fast_dev_run:
            for field in ("max_steps", "limit_train_batches", "limit_val_batches", "overfit_batches"):
                if getattr(self, field) is not None:
                    raise ConfigError(
                        f"{OWNER}: setting {field!r} = {getattr(self, field)!r} cannot be combined with "
                        f"fast_dev_run = {self.fast_dev_run!r}, which sets the batches itself; expected {field} "
                        "null with fast_dev_run, or fast_dev_run false"
                    )
        if self.overfit_batches is not None:
            for field in ("limit_train_batches", "limit_val_batches"):
                if getattr(self, field) is not None:
                    raise ConfigError(
                        f"{OWNER}: setting {field!r} = {getattr(self, field)!r} cannot be combined with "
                        f"overfit_batches = {self.overfit_batches!r}, which trains and validates on the same "
                        f"batches; expected {field} null with overfit_batches"
                    )

    @property
    def is_fast_dev_run(self) -> bool:
        """Whether this is a quick-debug fit (``fast_dev_run`` set): the one way plugins learn it, from the
        ``config`` their ``setup`` receives. A plugin that writes what outlives the run (checkpoints, tracker
        logs, exported files) writes nothing then, as the ``checkpoint`` and ``trackers`` plugins do."""
        return self.fast_dev_run is True or (not isinstance(self.fast_dev_run, bool) and self.fast_dev_run >= 1)

    @property
    def fast_dev_run_batches(self) -> int | None:
        """The batches of a ``fast_dev_run`` (``True`` is 1); ``None`` when it is off."""
        if not self.is_fast_dev_run:
            return None
        return 1 if self.fast_dev_run is True else int(self.fast_dev_run)

    def for_run(self) -> EngineConfig:
        """The settings a call runs by: these, or under ``fast_dev_run`` a copy with one epoch, validation at its
        end, no sanity pass and no saved model (what the engine, and the plugins' ``setup``, receive)."""
        if not self.is_fast_dev_run:
            return self
        return replace(self, max_epochs=1, val_check_interval=None, num_sanity_val_steps=0, save_model=False)


def check_batch_limit(name: str, value: int | float | None) -> None:
    """A batch limit (``limit_train_batches``, ``limit_val_batches``, ``overfit_batches``): ``None``, an integer
    >= 1 (batches) or a float in (0, 1] (a fraction of the batches).

    Raises:
        ConfigError: ``engine: setting 'limit_train_batches' = 1.5; expected ...``.
    """
    if value is None:
        return
    if not (0.0 < value <= 1.0 if isinstance(value, float) else value >= 1):
        raise invalid(
            name, value, "null (every batch), an integer >= 1 (batches) or a float in (0, 1] (a fraction)", owner=OWNER
        )


def _one_of(values: tuple[str, ...]) -> str:
    return f"one of {', '.join(map(repr, values))}"
