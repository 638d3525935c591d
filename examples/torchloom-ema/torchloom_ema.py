"""An exponential moving average (EMA) of the model's weights, as a torchloom plugin.

Every ``every`` optimizer steps the plugin updates one shadow copy of the parameters::

    ema = decay * ema + (1 - decay) * weights

starting from the weights at the start of the fit. Validation runs with the averaged weights swapped in,
and the training weights are restored, bit for bit, when it ends. The average and the step counter are the
plugin's state (``state_dict`` / ``load_state_dict``: tensors and ints only), which
``torchloom.save_plugin_state`` writes as ``example_ema.safetensors`` + ``example_ema.json`` and
``torchloom.load_plugin_state`` reads back, with no pickle::

    torchloom.save_plugin_state([ema], "checkpoint/plugins", is_main_process=accelerator.is_main_process)
    torchloom.load_plugin_state([ema], "checkpoint/plugins")  # before the next fit, or during it

Enable it by name once this distribution is installed (torchloom's built-in ``ema`` plugin does the same with
more settings; this one is the template of a third-party plugin, so it has a name of its own)::

    plugins:
      example_ema: {decay: 0.999, every: 1}

It uses only names exported by ``torchloom`` (``Plugin``, ``hookimpl``, ``ConfigError``), which is what
makes it safe to release separately. Averaging weights goes back to Polyak & Juditsky (1992), "Acceleration
of stochastic approximation by averaging"; the exponential form is the one used by TensorFlow's
``ExponentialMovingAverage`` and timm's ``ModelEma``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import torchloom

__all__ = ["EMA"]


class EMA(torchloom.Plugin):
    """Keeps an exponential moving average of the weights and validates with it.

    Hooks: ``on_fit_start`` (copy the weights), ``after_optimizer_step`` (update, on the device, no
    host-device sync), ``on_validation_start`` / ``on_validation_end`` (swap the average in, then back),
    ``teardown`` (restore the training weights if a validation pass raised half-way).

    State: ``state_dict`` / ``load_state_dict``, the stateful-plugin contract of `torchloom.save_plugin_state`.

    Attributes:
        steps (`int`): optimizer steps counted so far (steps the fp16 loss scaler skipped are not counted).
        updates (`int`): updates of the average made so far.
    """

    name = "example_ema"

    @dataclass
    class Config:
        decay: float = 0.999  # weight of the old average in each update; strictly between 0 and 1
        every: int = 1  # update the average every this many optimizer steps
        validate_with_ema: bool = True  # run validation with the averaged weights swapped in

        def __post_init__(self) -> None:
            if isinstance(self.decay, bool) or not isinstance(self.decay, int | float):
                raise torchloom.ConfigError(f"setting 'decay' = {self.decay!r}; expected a float in (0, 1)")
            if not 0.0 < self.decay < 1.0:
                raise torchloom.ConfigError(
                    f"setting 'decay' = {self.decay!r}; expected a float strictly between 0 and 1"
                )
            if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
                raise torchloom.ConfigError(f"setting 'every' = {self.every!r}; expected a positive integer")

    config: Config

    def __init__(self, config: Any = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.steps = 0
        self.updates = 0
        self._shadow: list[torch.Tensor] | None = None  # one tensor per parameter, on its device
        self._backup: list[torch.Tensor] | None = None  # the training weights while validating
        self._params: list[torch.Tensor] = []  # the averaged model's parameters, in order
        self._swapped: list[torch.Tensor] = []  # the parameters holding the average while validating
        self._fitting = False  # between on_fit_start and the fit's teardown
        self._loaded: dict[str, Any] | None = None  # a state loaded outside a fit, applied at the next start

    # ----------------------------------------------------------------------------------------- hooks

    @torchloom.hookimpl
    def on_fit_start(self, model: torch.nn.Module) -> None:
        self._params = _parameters(model)
        with torch.no_grad():
            self._shadow = [p.detach().clone() for p in self._params]
        self.steps = self.updates = 0
        self._fitting = True
        if self._loaded is not None:  # a checkpoint loaded before the fit started
            state, self._loaded = self._loaded, None
            self.load_state_dict(state)

    @torchloom.hookimpl
    def after_optimizer_step(self, optimizer: Any) -> None:
        if getattr(optimizer, "step_was_skipped", False):  # an fp16 overflow: the weights did not move
            return
        self.steps += 1
        if self.steps % self.config.every:
            return
        weight = 1.0 - self.config.decay
        with torch.no_grad():
            for average, param in zip(self._shadow, self._params, strict=True):
                average.lerp_(param, weight)  # average += (1 - decay) * (param - average), on the device
        self.updates += 1

    @torchloom.hookimpl
    def on_validation_start(self, model: torch.nn.Module) -> None:
        if not self.config.validate_with_ema or self._shadow is None:  # no average yet: a validate before any fit
            return
        params = _parameters(model)
        if len(params) != len(self._params) or any(p is not q for p, q in zip(params, self._params)):
            return  # not the model that was averaged (e.g. Engine.validate on another task)
        with torch.no_grad():
            self._backup = [p.detach().clone() for p in params]
            for param, average in zip(params, self._shadow, strict=True):
                param.copy_(average)
        self._swapped = params

    @torchloom.hookimpl
    def on_validation_end(self) -> None:
        self._restore()

    @torchloom.hookimpl
    def teardown(self, stage: str) -> None:
        self._restore()
        if stage == "fit":
            self._fitting = False

    # ------------------------------------------------------------------------------------ public API

    @property
    def averaged_parameters(self) -> list[torch.Tensor] | None:
        """The averaged weights, one tensor per parameter in ``model.parameters()`` order (``None`` before
        the first fit). Do not modify them in place."""
        return self._shadow

    def copy_to(self, model: torch.nn.Module) -> None:
        """Copy the averaged weights into ``model`` (e.g. before ``task.save_model(...)``).

        Raises:
            RuntimeError: no average yet (no fit has started).
            ValueError: ``model`` has different parameters than the model that was averaged.
        """
        if self._shadow is None:
            raise RuntimeError("example_ema: no average to copy yet; it is created when a fit starts")
        params = _parameters(model)
        _check_shapes(params, self._shadow, "copy_to")
        with torch.no_grad():
            for param, average in zip(params, self._shadow, strict=True):
                param.copy_(average)

    def state_dict(self) -> dict[str, Any]:
        """The counters and the averaged weights: ``{"steps": int, "updates": int, "shadow": [tensor, ...]}``,
        one tensor per averaged parameter, on its device. Only ints and tensors, as the stateful-plugin contract
        asks: `torchloom.save_plugin_state` writes the tensors to ``example_ema.safetensors`` (``shadow.0``, ...) and
        the rest to ``example_ema.json``."""
        if self._loaded is not None:  # loaded, not applied yet: hand it back unchanged
            return dict(self._loaded)
        return {
            "steps": self.steps,
            "updates": self.updates,
            "shadow": list(self._shadow) if self._shadow is not None else [],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned.

        During a fit the average is replaced at once (copied into place, onto each parameter's device). Outside
        a fit (a checkpoint loaded before ``Engine.fit``) the state is kept and replaces the fresh copy of the
        weights when the next fit starts.

        Raises:
            ValueError: the state holds a different number or shape of tensors than the model.
        """
        if not self._fitting or self._shadow is None:
            self._loaded = dict(state)
            return
        shadow = list(state["shadow"])
        _check_shapes(self._shadow, shadow, "load_state_dict")
        with torch.no_grad():
            for average, saved in zip(self._shadow, shadow, strict=True):
                average.copy_(saved)
        self.steps, self.updates = int(state["steps"]), int(state["updates"])

    # ------------------------------------------------------------------------------------- internals

    def _restore(self) -> None:
        if self._backup is None:
            return
        with torch.no_grad():
            for param, saved in zip(self._swapped, self._backup, strict=True):
                param.copy_(saved)
        self._backup, self._swapped = None, []


def _parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """The floating-point parameters the average covers (DDP and other wrappers share them)."""
    return [p for p in model.parameters() if p.is_floating_point()]


def _check_shapes(ours: list[torch.Tensor], theirs: list[torch.Tensor], where: str) -> None:
    if len(ours) != len(theirs) or any(a.shape != b.shape for a, b in zip(ours, theirs, strict=False)):
        raise ValueError(
            f"example_ema.{where}: the average has {len(theirs)} tensors but the model has {len(ours)} parameters "
            "(or their shapes differ); it comes from a different model"
        )
