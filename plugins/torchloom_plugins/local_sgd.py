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
- **Hooks:** ``on_fit_start`` enters the context; ``after_optimizer_step`` calls ``step()`` (it fires once per
  optimizer step, never per micro-batch, whatever the accumulation or the number of parameter groups);
  ``on_train_end`` exits it (the final average, before the engine saves the model, so the saved model is the
  averaged one on every process); when the fit failed, ``on_train_end`` never fires and ``teardown`` leaves
  the context without that average, since another process may never reach that collective.
  ``state_dict`` / ``load_state_dict`` carry the step counter (one int) through
  ``torchloom.save_plugin_state`` / ``load_plugin_state``, so a resumed run averages on the same optimizer steps.
- **Guarantees:** right after each averaging the parameters are bitwise equal on every process and are the
  mean of their values just before it; between averagings they differ; on one process the plugin warns once
  and is an exact no-op (no collective, bitwise the run without it).
- **Not supported (Accelerate's own check, raised up front):** DeepSpeed, Megatron-LM, FSDP, XLA.
- **Optimizer state:** only parameters are averaged; momentum or Adam moments stay per process, as in
  Accelerate's implementation.

Run: ``torchrun --nproc_per_node 4 -m torchloom.cli fit --config config.yaml`` with
``plugins: {local_sgd: {sync_every: 8}}``.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

from accelerate.local_sgd import LocalSGD

import torchloom
from torchloom import ConfigError, PluginError

__all__ = ["LocalSGDConfig", "LocalSGDPlugin"]


@dataclass
class LocalSGDConfig:
    """Settings of the ``local_sgd`` plugin.

    Raises:
        ConfigError: ``sync_every`` < 1.
    """

    sync_every: int = 8  # K: average the parameters over processes every K optimizer steps

    def __post_init__(self) -> None:
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ConfigError(f"setting 'sync_every' = {self.sync_every!r}: expected an integer >= 1 (optimizer steps)")


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

    def __init__(self, config: LocalSGDConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._local_sgd: LocalSGD | None = None
        self._stack: contextlib.ExitStack | None = None
        self._num_steps = 0  # kept here too, so load_state_dict works before or after on_fit_start
        self.num_averages = 0

    @property
    def num_steps(self) -> int:
        return self._local_sgd.num_steps if self._local_sgd is not None else self._num_steps

    @torchloom.hookimpl
    def on_fit_start(self, accelerator, model) -> None:
        try:
            local_sgd = LocalSGD(accelerator, model, local_sgd_steps=self.config.sync_every)
        except NotImplementedError as exc:
            raise PluginError(f"local_sgd: {exc} (this run: {accelerator.distributed_type})") from None
        if not local_sgd.enabled:
            warnings.warn(
                f"local_sgd: the run has {accelerator.num_processes} process and no data parallelism "
                f"({accelerator.distributed_type}); LocalSGD does nothing. Launch with several processes "
                "(torchrun --nproc_per_node N) to use it",
                UserWarning,
                stacklevel=2,
            )
        local_sgd.num_steps = self._num_steps
        self.num_averages = 0
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

    @torchloom.hookimpl
    def on_train_end(self) -> None:
        # Training completed on every process: LocalSGD.__exit__ averages once more (before the engine saves the
        # model), then leaves no_sync().
        self._release().close()

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

    def state_dict(self) -> dict[str, int]:
        """Return ``{"num_steps": optimizer steps counted}``: one int, as `torchloom.save_plugin_state` takes."""
        return {"num_steps": int(self.num_steps)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the step counter, so averaging stays on the same optimizer steps after a resume.

        Works before ``on_fit_start`` (the next fit starts counting from it) and during a fit.

        Raises:
            PluginError: ``state`` has no integer ``num_steps``.
        """
        num_steps = state.get("num_steps") if isinstance(state, dict) else None
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
            raise PluginError(f"local_sgd: cannot load state {state!r}; expected {{'num_steps': int >= 0}}")
        self._num_steps = num_steps
        if self._local_sgd is not None:
            self._local_sgd.num_steps = num_steps
