"""An exponential moving average (EMA) of the trained weights: validated with, swapped in before the final save.

Method card
-----------
- **What:** one shadow copy of the trainable parameters, updated every ``every`` optimizer steps as
  ``ema = decay_t * ema + (1 - decay_t) * weights`` from the weights at the start of the fit (Polyak & Juditsky
  1992; the exponential form of TensorFlow's ``ExponentialMovingAverage`` and timm's ``ModelEma``). With
  ``warmup_power`` > 0 the decay of the ``t``-th update (t = 0, 1, ...) is ``min(decay, 1 - (1 + t) ** -power)``
  (timm's ``ModelEmaV3`` and diffusers' ``EMAModel`` with ``inv_gamma`` 1): the first updates follow the weights
  closely, so the average does not stay anchored to the random initialisation.
- **Mechanism:** `torch.optim.swa_utils.get_ema_multi_avg_fn`, the update of `torch.optim.swa_utils.AveragedModel`
  (one ``torch._foreach_lerp_`` over the parameter list, on the device, no host-device sync), applied to a list of
  shadow tensors rather than a deep copy of the model: only the parameters with ``requires_grad`` are averaged,
  so under ``peft`` the shadow is the adapter's weights only and the frozen base is never copied.
- **Hooks:** ``on_fit_start`` (copy the weights, or place a state loaded before it: a resume loads every plugin's
  state after ``on_run_start`` and before ``on_fit_start``, the first hook that has the model; a warning when
  ``every`` exceeds the fit's optimizer steps, so that the average would stay the starting weights);
  ``after_optimizer_step`` (update; skips a
  step the fp16 loss scaler skipped); ``on_validation_start`` / ``on_validation_end`` (swap the average in, then the
  training weights back bit for bit; ``validate_with_ema``); ``on_train_end`` (copy the average into the model
  before the engine saves it, ``swap_at_end``); ``teardown`` (put the training weights back if a validation raised).
- **State:** ``state_dict`` / ``load_state_dict`` hold the counters (ints) and the shadow (tensors), so the
  ``checkpoint`` plugin saves them with no pickle and a resumed fit continues the average bit for bit.
- **Several processes:** under DDP every process holds the same average. Under ``local_sgd`` the processes'
  weights differ between synchronisations, and so do their averages: where the average is used (validation, the
  end of training, a checkpoint) the processes first replace theirs by the mean over processes, which is the
  average of the mean weights (the update is linear). The mean is computed as rank 0's value plus the mean of the
  differences from it, so equal averages (DDP) stay bitwise unchanged. Under FSDP2 the shadow tensors are
  DTensors laid out as the parameters: each process keeps and updates the average of its own shard (there is
  nothing to average over processes), writes it into the sharded parameters for a validation and puts the trained
  shards back. The model is resharded before each write (``torchloom.utils.reshard_module``): FSDP2 leaves the
  root module's parameters gathered after a forward without a backward, and the next training forward would run
  on them. A checkpoint holds the whole average (the plugin-state encoder gathers it); a resume gives each process
  its shard (tests/test_fsdp_plugins.py: within 1e-6 of DDP, a bitwise resume).
- **Sources:** Polyak & Juditsky, "Acceleration of stochastic approximation by averaging" (1992); PyTorch's
  ``torch.optim.swa_utils``; timm ``ModelEmaV3`` and diffusers ``EMAModel`` (the warm-up); Lightning's
  ``WeightAveraging`` callback (validation with the average, the swap before the save).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

import torchloom
from torchloom import ConfigError

__all__ = ["EMAConfig", "ExponentialMovingAverage", "ema_decay"]


@dataclass
class EMAConfig:
    """Settings of the ``ema`` plugin.

    Args:
        decay (`float`, defaults to 0.999): the weight of the old average in each update; strictly between 0 and 1.
        every (`int`, defaults to 1): update the average every this many optimizer steps.
        warmup_power (`float`, defaults to 0.0): ``0`` keeps the decay constant; ``> 0`` uses
            ``min(decay, 1 - (1 + t) ** -warmup_power)`` at the ``t``-th update (``2/3`` or ``3/4`` are usual).
        validate_with_ema (`bool`, defaults to True): run validation with the averaged weights swapped in.
        swap_at_end (`bool`, defaults to True): copy the average into the model when training ends, before the
            final model is saved, so that the saved model and the model ``fit`` returns with are the average.

    Raises:
        ConfigError: ``decay`` outside (0, 1), ``every`` < 1 or ``warmup_power`` negative.
    """

    decay: float = 0.999  # weight of the old average in each update, in (0, 1)
    every: int = 1  # update every this many optimizer steps
    warmup_power: float = 0.0  # 0: constant decay; > 0: min(decay, 1 - (1 + t) ** -power)
    validate_with_ema: bool = True  # validate with the average swapped in
    swap_at_end: bool = True  # the average replaces the weights before the final save

    def __post_init__(self) -> None:
        if not (math.isfinite(self.decay) and 0.0 < self.decay < 1.0):
            raise ConfigError(f"setting 'decay' = {self.decay!r}; expected a number strictly between 0 and 1")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"setting 'every' = {self.every!r}; expected an integer >= 1 (optimizer steps)")
        if not (math.isfinite(self.warmup_power) and self.warmup_power >= 0):
            raise ConfigError(f"setting 'warmup_power' = {self.warmup_power!r}; expected a number >= 0 (0: no warm-up)")


def ema_decay(decay: float, update: int, warmup_power: float = 0.0) -> float:
    """The decay of the ``update``-th update (0-based): ``decay``, or with a warm-up
    ``min(decay, 1 - (1 + update) ** -warmup_power)``."""
    if warmup_power <= 0:
        return decay
    return min(decay, 1.0 - (1.0 + update) ** -warmup_power)


class ExponentialMovingAverage(torchloom.Plugin):
    """Keep an exponential moving average of the trained weights, validate with it and save it at the end.

    Args:
        config (`EMAConfig`, *optional*): ready-made settings, or pass them as keywords (``decay=0.99``).

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"ema": {"decay": 0.999, "warmup_power": 0.75}})

    Attributes:
        steps (`int`): optimizer steps counted (those the fp16 loss scaler skipped are not).
        updates (`int`): updates of the average made.
    """

    name = "ema"
    Config = EMAConfig
    config: EMAConfig

    def __init__(self, config: EMAConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.steps = 0
        self.updates = 0
        self._shadow: list[torch.Tensor] | None = None  # one tensor per averaged parameter, on its device
        self._params: list[torch.Tensor] = []  # the averaged parameters of the fit's model, in order
        self._backup: list[torch.Tensor] | None = None  # the training weights while validating
        self._world = 1  # processes of the fit
        self._model: torch.nn.Module | None = None  # the fit's model (resharded before its parameters are written)
        self._fitting = False
        # A state loaded outside a fit (a resume's, before on_fit_start; a script's load_plugin_state before
        # Engine.fit): the next fit's on_fit_start, the first hook that has the model, places it on its parameters.
        self._next_start: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------------------------- hooks

    @torchloom.hookimpl
    def on_fit_start(self, model: torch.nn.Module, accelerator, task, progress) -> None:
        self._model = model
        self._params = _averaged(torchloom.utils.reshard_module(model))  # FSDP2: the sharded parameters
        self._world = accelerator.num_processes
        with torch.no_grad():
            self._shadow = [p.detach().clone() for p in self._params]
        self.steps = self.updates = 0
        self._fitting = True
        state, self._next_start = self._next_start, None
        if state is not None:  # loaded before this fit (a resume loads after on_run_start, before on_fit_start)
            self.load_state_dict(state)
        total = task.num_training_steps
        if total is not None and total > progress.global_step and accelerator.is_main_process:
            self._warn_if_never_updated(total - progress.global_step)

    def _warn_if_never_updated(self, steps: int) -> None:
        """Warn once when a fit of ``steps`` more optimizer steps never updates an average that was never updated."""
        every = self.config.every
        if self.updates or (self.steps + steps) // every:
            return
        uses = [
            text
            for on, text in (
                (self.config.validate_with_ema, "validate_with_ema validates them"),
                (self.config.swap_at_end, "swap_at_end puts them in place of the trained weights at the end"),
            )
            if on
        ]
        torchloom.utils.warn(
            f"ema: every = {every} optimizer steps, and this fit takes {steps}: the average is never updated and "
            f"stays the weights the fit started from{'; ' + ' and '.join(uses) if uses else ''}. Set every to at "
            f"most {self.steps + steps}, or train longer",
        )

    @torchloom.hookimpl
    def after_optimizer_step(self, optimizer) -> None:
        if getattr(optimizer, "step_was_skipped", False):  # an fp16 overflow: the weights did not move
            return
        self.steps += 1
        if self.steps % self.config.every or not self._shadow:
            return
        decay = ema_decay(self.config.decay, self.updates, self.config.warmup_power)
        # foreach lerp, on the device; under FSDP2 on each process's shards (elementwise: the same as on the whole)
        get_ema_multi_avg_fn(decay)(_local(self._shadow), _local(self._params), None)
        self.updates += 1

    @torchloom.hookimpl
    def on_validation_start(self, model: torch.nn.Module) -> None:
        if not self.config.validate_with_ema or self._shadow is None:
            return  # no average yet (validate before any fit)
        torchloom.utils.reshard_module(model)  # FSDP2: the parameters are the shards, which the forward gathers
        if not self._is_ours(model):
            return  # another model (Engine.validate on another task)
        self._synchronise()
        with torch.no_grad():
            self._backup = [p.detach().clone() for p in _local(self._params)]
            torch._foreach_copy_(_local(self._params), _local(self._shadow))

    @torchloom.hookimpl
    def on_validation_end(self) -> None:
        self._restore()

    @torchloom.hookimpl
    def on_train_end(self, model: torch.nn.Module) -> None:
        if (
            self.config.swap_at_end
            and self._shadow is not None
            and self._is_ours(torchloom.utils.reshard_module(model))
        ):
            self._synchronise()
            self.copy_to(model)

    @torchloom.hookimpl
    def teardown(self, stage: str) -> None:
        self._restore()
        if stage == "fit":
            self._fitting = False

    # ------------------------------------------------------------------------------------------ public API

    @property
    def averaged_parameters(self) -> list[torch.Tensor] | None:
        """The average, one tensor per trainable parameter in ``model.parameters()`` order (``None`` before the
        first fit). Under FSDP2 each is a DTensor laid out as its parameter: this process holds the average of its
        shard (`torchloom.utils.full_tensor` gathers the whole, a collective). Do not modify it in place."""
        return self._shadow

    def copy_to(self, model: torch.nn.Module) -> None:
        """Copy the average into ``model``'s trainable parameters.

        Under FSDP2 the model's FSDP modules are resharded first (``torchloom.utils.reshard_module``), so that the
        average is written into the sharded parameters that the next forward gathers; a sharded average copied into
        a model whose parameters are plain tensors is gathered first, a collective: call it on every process.

        Raises:
            RuntimeError: no average yet (no fit has started).
            ValueError: ``model``'s trainable parameters differ in number or shape from those averaged.
        """
        if self._shadow is None:
            raise RuntimeError("ema: no average to copy yet; it is created when a fit starts")
        params = _averaged(torchloom.utils.reshard_module(model))
        _check_shapes(params, self._shadow, "copy_to")
        with torch.no_grad():
            for param, average in zip(params, self._shadow, strict=True):
                _copy_into(param, average)

    def state_dict(self) -> dict[str, Any]:
        """``{"steps": int, "updates": int, "shadow": [tensor, ...]}``, as `torchloom.save_plugin_state` takes it
        (``ema.json`` + ``ema.safetensors``). With several processes it is a collective (the averages are made equal
        first): call it on every process, as the ``checkpoint`` plugin does. Under FSDP2 the shadow tensors are the
        DTensors of `averaged_parameters` (the plugin state file holds their whole values, gathered when saved)."""
        if self._next_start is not None:  # loaded, not placed yet: hand it back unchanged
            return dict(self._next_start)
        if self._fitting:
            self._synchronise()
        return {"steps": self.steps, "updates": self.updates, "shadow": list(self._shadow or [])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned: at once during a fit (copied onto each parameter's device; under
        FSDP2 each process keeps its shard of a whole saved tensor, or copies a DTensor's shard), else kept and
        applied when the next fit starts.

        Raises:
            PluginError: ``state`` lacks the integer counters or the list of tensors.
            ValueError: the tensors differ in number or shape from the model's trainable parameters.
        """
        steps, updates, shadow = (
            state.get(k) if isinstance(state, dict) else None for k in ("steps", "updates", "shadow")
        )
        if (
            not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (steps, updates))
            or not isinstance(shadow, list)
            or not all(isinstance(t, torch.Tensor) for t in shadow)
        ):
            raise torchloom.PluginError(
                "ema: cannot load the state; expected {'steps': int, 'updates': int, 'shadow': [tensor, ...]}"
            )
        if not self._fitting or self._shadow is None:
            self._next_start = dict(state)
            return
        _check_shapes(self._shadow, shadow, "load_state_dict")
        with torch.no_grad():
            for average, saved in zip(self._shadow, shadow, strict=True):
                _copy_into(average, saved)
        self.steps, self.updates = int(steps), int(updates)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------------- internals

    def _is_ours(self, model: torch.nn.Module) -> bool:
        params = _averaged(model)
        return len(params) == len(self._params) and all(p is q for p, q in zip(params, self._params))

    def _synchronise(self) -> None:
        """Make every process's average the mean over processes (a no-op on one process; bitwise when equal; a no-op
        under FSDP2, where each process holds the only average of its shard)."""
        if self._world < 2 or not self._shadow or not torch.distributed.is_initialized():
            return
        if any(_sharded(average) for average in self._shadow):
            return
        with torch.no_grad():
            for average in self._shadow:
                reference = average.clone()
                torch.distributed.broadcast(reference, src=0)
                difference = average - reference  # exactly zero where the processes agree (DDP)
                torch.distributed.all_reduce(difference)
                average.copy_(reference + difference / self._world)

    def _restore(self) -> None:
        """Put the training weights back bit for bit, into the sharded parameters under FSDP2: the model is
        resharded first, since FSDP2 leaves its root module's parameters gathered after a forward without a
        backward, and the next training forward would use those (the average) instead of the shards."""
        if self._backup is None:
            return
        if self._model is not None:
            torchloom.utils.reshard_module(self._model)
        with torch.no_grad():
            torch._foreach_copy_(_local(self._params), self._backup)
        self._backup = None


def _averaged(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters the average covers: floating point and trainable (under peft, the adapter's)."""
    return [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's part on this process: a DTensor's local shard (FSDP2), a plain tensor itself."""
    return [torchloom.utils.local_tensor(t) for t in tensors]


def _sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (its local shard is another object)."""
    return torchloom.utils.local_tensor(tensor) is not tensor


def _copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` for plain tensors and DTensors alike: a DTensor target receives its part of a plain
    (whole) source; a plain target receives the whole of a DTensor source (gathered: a collective)."""
    if _sharded(target):
        source = torchloom.utils.shard_like(source, target)  # a DTensor stays as it is
        torchloom.utils.local_tensor(target).copy_(torchloom.utils.local_tensor(source))
    else:
        target.copy_(torchloom.utils.full_tensor(source))


def _check_shapes(ours: list[torch.Tensor], theirs: list[torch.Tensor], where: str) -> None:
    if len(ours) != len(theirs) or any(a.shape != b.shape for a, b in zip(ours, theirs)):
        raise ValueError(
            f"ema.{where}: the average has {len(theirs)} tensors but the model has {len(ours)} trainable parameters "
            "(or their shapes differ); it comes from a different model"
        )
