"""LocalSGD: each process steps on its own and the processes average their parameters every K optimizer steps.

Method card
-----------
- **What:** data-parallel training without a gradient all-reduce per step: every process runs ``sync_every``
  optimizer steps on its own shard, then all processes replace their parameters by the mean over processes
  (Stich 2019, "Local SGD Converges Fast and Communicates Little", arXiv:1805.09767; Zhang et al. 2016,
  arXiv:1606.07365). One parameter all-reduce per K steps instead of one gradient all-reduce per step.
- **Mechanism:** `accelerate.local_sgd.LocalSGD`, used through its public API only: its context enters the
  DDP model's ``no_sync()`` for the whole fit and averages the parameters once more when it exits; its
  ``step()`` counts calls and averages on every ``local_sgd_steps``-th.
- **Hooks:** ``setup`` (a fit's outer state starts afresh, or from a state loaded outside a fit; a resume loads
  after it); ``on_fit_start`` enters the context; ``after_optimizer_step`` calls ``step()`` (it fires once per
  optimizer step, never per micro-batch, whatever the accumulation or the number of parameter groups);
  ``on_train_end`` exits it (the final average, before the engine saves the model, so the saved model is the
  averaged one on every process); when the fit failed, ``on_train_end`` never fires and ``teardown`` leaves
  the context without that average, since another process may never reach that collective.
  ``state_dict`` / ``load_state_dict`` carry the step counter (one int) through
  ``torchloom.save_plugin_state`` / ``load_plugin_state``, so a resumed run averages on the same optimizer steps.
  ``divergent_replicas = True``: a checkpoint of several processes also holds each process's own parameters,
  optimizer state and loss scaler, which differ between two averages, so a resume at any step is exact.
- **Guarantees:** right after each averaging the parameters are bitwise equal on every process and are the
  mean of their values just before it; between averagings they differ; on one process the plugin warns once
  and is an exact no-op (no collective, bitwise the run without it).
- **Not supported (raised up front, at ``on_fit_start``):** FSDP (a `PluginError` that says why:
  tests/test_fsdp_plugins.py), and by Accelerate's own check DeepSpeed, Megatron-LM, XLA.
- **Optimizer state:** only parameters are averaged; momentum or Adam moments stay per process, as in
  Accelerate's implementation.
- **DiLoCo** (``outer_optimizer: nesterov`` or ``sgd``; Douillard et al. 2023, arXiv:2311.08105): the same
  communication, but after each averaging the change Δ = θ_global - mean(θ_local) is the outer gradient of an SGD
  step with (Nesterov) momentum on the fp32 global parameters θ_global, which every process then continues from.
  ``outer_lr: 1, outer_momentum: 0`` is plain averaging, bitwise. θ_global and the momentum buffer (2 x 4 bytes per
  parameter) are in ``state_dict``.

Run: ``torchrun --nproc_per_node 4 -m torchloom.cli fit --config config.yaml`` with
``plugins: {local_sgd: {sync_every: 8}}``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.local_sgd import LocalSGD

import torchloom
from torchloom import ConfigError, PluginError

__all__ = ["LocalSGDConfig", "LocalSGDPlugin"]


#: The outer optimizers of DiLoCo (``outer_optimizer``): SGD with momentum, plain or Nesterov.
OUTER_OPTIMIZERS = ("sgd", "nesterov")


@dataclass
class LocalSGDConfig:
    """Settings of the ``local_sgd`` plugin.

    Args:
        sync_every (`int`, defaults to 8): K, the optimizer steps between two synchronisations.
        outer_optimizer (`str`, *optional*): ``None`` (the default) averages the parameters (LocalSGD);
            ``"nesterov"`` or ``"sgd"`` applies DiLoCo's outer step instead: the averaged change is the outer
            gradient of an SGD step with (Nesterov) momentum on the global parameters.
        outer_lr (`float`, defaults to 0.7): the outer learning rate (DiLoCo's default), > 0.
        outer_momentum (`float`, defaults to 0.9): the outer momentum (DiLoCo's default), in [0, 1).

    Raises:
        ConfigError: ``sync_every`` < 1, an unknown ``outer_optimizer``, ``outer_lr`` <= 0 or ``outer_momentum``
            outside [0, 1).
    """

    sync_every: int = 8  # K: average the parameters over processes every K optimizer steps
    outer_optimizer: str | None = None  # None: average (LocalSGD); "nesterov" / "sgd": DiLoCo's outer step
    outer_lr: float = 0.7  # DiLoCo: the outer learning rate
    outer_momentum: float = 0.9  # DiLoCo: the outer momentum

    def __post_init__(self) -> None:
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ConfigError(f"setting 'sync_every' = {self.sync_every!r}: expected an integer >= 1 (optimizer steps)")
        if self.outer_optimizer is not None and self.outer_optimizer not in OUTER_OPTIMIZERS:
            close = torchloom.utils.closest_name(str(self.outer_optimizer), OUTER_OPTIMIZERS)
            raise ConfigError(
                f"setting 'outer_optimizer' = {self.outer_optimizer!r}"
                f"{f' (did you mean {close!r}?)' if close else ''}: expected null (plain averaging) or one of "
                f"{', '.join(OUTER_OPTIMIZERS)}"
            )
        if not math.isfinite(self.outer_lr) or self.outer_lr <= 0:
            raise ConfigError(f"setting 'outer_lr' = {self.outer_lr!r}: expected a number > 0")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"setting 'outer_momentum' = {self.outer_momentum!r}: expected a number in [0, 1)")


class LocalSGDPlugin(torchloom.Plugin):
    """Wraps `accelerate.local_sgd.LocalSGD` around the whole fit.

    Args:
        config (`LocalSGDConfig`, *optional*): ready-made settings, or pass ``sync_every`` as a keyword.

    Raises:
        PluginError: at ``on_fit_start``, a distributed type LocalSGD does not support (DeepSpeed, FSDP, ...).

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"local_sgd": {"sync_every": 8}})

    Attributes:
        num_steps (`int`): optimizer steps counted so far (restored by ``load_state_dict``).
        num_averages (`int`): parameter averagings done by ``step()`` in this process's current fit (the final
            average on exit is not counted).
    """

    name = "local_sgd"
    Config = LocalSGDConfig
    divergent_replicas = True  # between two averages: a checkpoint holds each process's parameters and optimizer

    def __init__(self, config: LocalSGDConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._local_sgd: LocalSGD | None = None
        self._stack: contextlib.ExitStack | None = None
        self._num_steps = 0  # kept here too, so load_state_dict works before or after on_fit_start
        self.num_averages = 0
        self._outer_steps = 0  # DiLoCo: outer steps taken (restored by load_state_dict)
        self._model: torch.nn.Module | None = None
        # DiLoCo: the global parameters and the outer momentum buffers, fp32, one per parameter (None before the
        # first fit, or until a checkpoint gives them).
        self.outer_params: list[torch.Tensor] | None = None
        self.outer_buffers: list[torch.Tensor] | None = None
        # DiLoCo's outer state loaded outside a fit (a resume's, after setup; a script's before Engine.fit): the next
        # fit starts from it
        self._next_start: tuple[list[torch.Tensor] | None, list[torch.Tensor] | None, int] | None = None

    @property
    def num_steps(self) -> int:
        return self._local_sgd.num_steps if self._local_sgd is not None else self._num_steps

    @torchloom.hookimpl
    def setup(self, stage: str) -> None:
        if stage == "fit":  # a fresh outer state (made at on_fit_start), or one loaded outside a fit
            self.outer_params, self.outer_buffers, self._outer_steps = self._next_start or (None, None, 0)

    @torchloom.hookimpl
    def on_fit_start(self, accelerator, model) -> None:
        if str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)) == "FSDP":
            # Accelerate's own message names only DeepSpeed and Megatron-LM
            raise PluginError(
                "local_sgd: Accelerate's LocalSGD does not support FSDP (this run: DistributedType.FSDP): it lets "
                "each process train its own copy of the whole model and averages the copies every sync_every "
                "steps, while under FSDP each process holds a shard of one model whose gradients are reduced at "
                "every step; use DDP (remove the fsdp plugin) or remove local_sgd"
            )
        try:
            local_sgd = LocalSGD(accelerator, model, local_sgd_steps=self.config.sync_every)
        except NotImplementedError as exc:
            raise PluginError(f"local_sgd: {exc} (this run: {accelerator.distributed_type})") from None
        if not local_sgd.enabled:
            torchloom.utils.warn(
                f"local_sgd: the run has {accelerator.num_processes} process and no data parallelism "
                f"({accelerator.distributed_type}); LocalSGD does nothing. Launch with several processes "
                "(torchrun --nproc_per_node N) to use it",
            )
        local_sgd.num_steps = self._num_steps
        self.num_averages = 0
        self._model = model
        if self.config.outer_optimizer is not None:
            params = [p.detach() for p in model.parameters()]
            if self.outer_params is None or self.outer_buffers is None:  # a fresh fit
                self._outer_steps = 0
                self.outer_params = [p.to(torch.float32, copy=True) for p in params]
                self.outer_buffers = [torch.zeros_like(g) for g in self.outer_params]
            else:  # a resume: the global parameters and momentum of the checkpoint, on the model's devices
                self.outer_params = [g.to(p.device, torch.float32) for g, p in zip(self.outer_params, params)]
                self.outer_buffers = [m.to(p.device, torch.float32) for m, p in zip(self.outer_buffers, params)]
        self._next_start = None  # used: the next fit starts afresh unless a state is loaded before it
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(local_sgd)  # enters model.no_sync(): no gradient all-reduce from here on
        self._local_sgd = local_sgd

    @torchloom.hookimpl
    def after_optimizer_step(self) -> None:
        local_sgd = self._local_sgd
        assert local_sgd is not None  # on_fit_start made it: step hooks fire only inside a fit
        local_sgd.step()  # averages when num_steps % sync_every == 0 (and only with several processes)
        if local_sgd.enabled and local_sgd.num_steps % self.config.sync_every == 0:
            self.num_averages += 1
            self._outer_step()

    @torchloom.hookimpl
    def on_train_end(self) -> None:
        # Training completed on every process: LocalSGD.__exit__ averages once more (before the engine saves the
        # model), then leaves no_sync(). With DiLoCo, that average ends the last interval: an outer step follows,
        # unless the fit ended right on a synchronisation (the average then changed nothing, and an outer step
        # would only move the parameters by the momentum).
        local_sgd = self._local_sgd
        pending = local_sgd is not None and local_sgd.enabled and local_sgd.num_steps % self.config.sync_every != 0
        self._release().close()
        if pending:
            self._outer_step()

    def _outer_step(self) -> None:
        """DiLoCo's outer step, right after the parameters were averaged over the processes (every process alike).

        With m the averaged parameters and θ the global ones: Δ = θ - m is the outer gradient; the momentum buffer
        is b = μ·b + Δ (b = Δ at the first step, as `torch.optim.SGD`), the update u = b (``sgd``) or Δ + μ·b
        (``nesterov``), and the new global parameters θ - lr·u are computed as m + (Δ - lr·u): with lr = 1 and
        μ = 0 that is m exactly, plain averaging. Every process then continues from them. In fp32.
        """
        if self.config.outer_optimizer is None or self.outer_params is None or self.outer_buffers is None:
            return
        assert self._model is not None and self.outer_buffers is not None
        lr, mu = self.config.outer_lr, self.config.outer_momentum
        nesterov, first = self.config.outer_optimizer == "nesterov", self._outer_steps == 0
        with torch.no_grad():
            for param, global_param, buffer in zip(self._model.parameters(), self.outer_params, self.outer_buffers):
                averaged = param.detach().to(torch.float32)
                delta = global_param - averaged
                buffer.copy_(delta) if first else buffer.mul_(mu).add_(delta)
                update = delta + mu * buffer if nesterov else buffer
                global_param.copy_(averaged + (delta - lr * update))
                param.copy_(global_param)
        self._outer_steps += 1

    @torchloom.hookimpl
    def teardown(self) -> None:
        # Still open only when the fit failed: another process may never reach the final average (a
        # collective), so the context is dropped without it.
        if self._stack is not None:
            self._release().pop_all()

    def _release(self) -> contextlib.ExitStack:
        stack, self._stack = self._stack, None
        assert stack is not None and self._local_sgd is not None
        self._num_steps, self._local_sgd = self._local_sgd.num_steps, None
        return stack

    # ---------------------------------------------------------------------------------------- checkpoints

    @classmethod
    def estimate_state_bytes(cls, model: torch.nn.Module, settings: dict[str, Any] | None = None) -> int:
        """Bytes of state the plugin holds per process for ``model`` beyond the optimizer's: with an outer optimizer
        (DiLoCo), the fp32 global parameters and the fp32 momentum buffer, 2 x 4 bytes per parameter; 0 for plain
        averaging. Add it to `torchloom.estimate_optimizer_memory` for the total.

        Raises:
            ConfigError: bad ``settings``.
        """
        config = torchloom.build_config(cls, settings)
        if config.outer_optimizer is None:
            return 0
        return 2 * 4 * sum(p.numel() for p in model.parameters())

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"num_steps": optimizer steps counted}``, and with an outer optimizer (DiLoCo) also
        ``"outer_steps"`` and the fp32 global parameters and momentum buffers (``"outer_params"``,
        ``"outer_buffers"``: lists of tensors, one per parameter), as `torchloom.save_plugin_state` takes them."""
        state: dict[str, Any] = {"num_steps": int(self.num_steps)}
        if self.config.outer_optimizer is not None:
            state["outer_steps"] = self._outer_steps
            state["outer_params"] = list(self.outer_params or [])
            state["outer_buffers"] = list(self.outer_buffers or [])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step counter (and DiLoCo's outer state), so that a resumed run synchronises on the same
        optimizer steps, from the same global parameters and momentum.

        Works before ``on_fit_start`` (the next fit starts from it) and during a fit.

        Raises:
            PluginError: ``state`` has no integer ``num_steps``, or its outer state does not match the
                ``outer_optimizer`` setting (saved with one and loaded without, or the reverse).
        """
        num_steps = state.get("num_steps") if isinstance(state, dict) else None
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
            raise PluginError(f"local_sgd: cannot load state {state!r}; expected {{'num_steps': int >= 0}}")
        has_outer = "outer_params" in state
        if has_outer != (self.config.outer_optimizer is not None):
            saved = "an outer optimizer (DiLoCo)" if has_outer else "plain averaging"
            raise PluginError(
                f"local_sgd: the state was saved with {saved}, but outer_optimizer is {self.config.outer_optimizer!r}"
            )
        if has_outer:
            params, buffers, steps = state["outer_params"], state.get("outer_buffers"), state.get("outer_steps")
            if (
                not isinstance(params, list)
                or not isinstance(buffers, list)
                or len(params) != len(buffers)
                or not all(isinstance(t, torch.Tensor) for t in [*params, *buffers])
                or isinstance(steps, bool)
                or not isinstance(steps, int)
            ):
                raise PluginError(
                    "local_sgd: cannot load the outer state; expected outer_params and outer_buffers (equal-length "
                    "lists of tensors) and an integer outer_steps"
                )
            self.outer_params = [t.to(torch.float32) for t in params]
            self.outer_buffers = [t.to(torch.float32) for t in buffers]
            self._outer_steps = steps
        self._num_steps = num_steps
        if self._local_sgd is None:  # outside a fit (or in a resume's set-up): what the next fit starts from
            self._next_start = (self.outer_params, self.outer_buffers, self._outer_steps)
        if self._local_sgd is not None:
            self._local_sgd.num_steps = num_steps
