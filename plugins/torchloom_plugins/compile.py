"""``torch.compile`` of the model, with recompilations, graph breaks and compile time made visible.

Method card
-----------
- **What:** compile the model's forward (and, through AOTAutograd, its backward) with TorchDynamo and a
  backend (``inductor`` by default). The first step pays the compile time; later steps run the compiled
  graphs, as long as their guards (input shapes, dtypes, grad mode, ...) still hold. A new input shape
  triggers a *recompilation*; Python that Dynamo cannot trace causes a *graph break* (the rest runs eagerly).
- **Mechanism:** ``configure_model`` compiles the model's ``__call__`` in place, as `torch.nn.Module.compile`
  does (through a frame of this file, see `compile_in_place`), before
  ``accelerator.prepare``. Not Accelerate's ``TorchDynamoPlugin`` (``Accelerator(dynamo_plugin=...)``): that
  replaces the prepared model with a ``torch._dynamo.OptimizedModule`` whose ``state_dict`` keys all start
  with ``_orig_mod.``, and Accelerate's ``get_state_dict`` / ``save_state`` (which `TaskModule.save_model`
  and the checkpoints use) do not strip it, so saved files could not be loaded into an uncompiled model.
  ``Module.compile`` keeps the module object and its parameter names: saved models and checkpoints are
  exactly those of an eager run, and the ``configure_model`` contract (mutate, never replace) holds.
- **Composition:** ``grad_checkpoint`` (its ``configure_model`` patches submodules' ``forward``; Dynamo
  traces what is there at the first call, so the plugin order does not matter; non-reentrant checkpointing
  is traced as one higher-order op), ``mixed_precision`` (Accelerate wraps ``forward`` in autocast at
  prepare, after this hook; Dynamo traces the autocast region), ``grad_accum`` (the compiled graphs do not
  depend on the accumulation window) and ``local_sgd`` (it averages parameters between steps, outside the
  graphs). Under DDP the compiled module runs inside DDP, whose gradient hooks fire after the compiled
  backward: correct, but without DDP's communication / computation overlap.
- **Visibility:** logs ``compile/recompiles`` (graphs compiled after the first optimizer step: new shapes,
  failed guards, the first validation in eval mode), ``compile/graph_breaks`` (since the start of the fit)
  and ``compile/first_step_seconds`` (host wall time from the first micro-batch to the end of the first
  optimizer step, compilation included, without a device sync: on a GPU its last kernels may still run, which
  the compilation dwarfs; compare with the steady-state step time). The counters are host-side Python integers of
  ``torch._dynamo.utils.counters``: reading them costs no device sync. Past ``recompile_warn_threshold``
  recompilations it warns once, with the fix: ``dynamic=True`` or padding to a few length buckets.
- **Sources:** PyTorch docs "torch.compile" and "Dynamo recompilation / dynamic shapes"; Accelerate's
  ``TorchDynamoPlugin`` and ``extract_model_from_parallel(keep_torch_compile=...)``.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass
from typing import Any

import torch

import torchloom

__all__ = ["Compile", "CompileConfig", "compile_counters", "compile_in_place", "last_recompile_reason"]

_MODES = ("default", "reduce-overhead", "max-autotune")


def _backends() -> list[str]:
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


@dataclass
class CompileConfig:
    """Settings of the ``compile`` plugin.

    Args:
        backend (`str`, defaults to ``"inductor"``): a Dynamo backend (``torch._dynamo.list_backends()``):
            ``"inductor"`` generates kernels; ``"aot_eager"`` and ``"eager"`` only trace (for debugging).
        mode (`str`, defaults to ``"default"``): ``"default"``, ``"reduce-overhead"`` (CUDA graphs) or
            ``"max-autotune"``; the last two need ``backend="inductor"``.
        fullgraph (`bool`, defaults to False): raise on a graph break instead of running that part eagerly.
        dynamic (`bool`, *optional*): ``True`` compiles shape-generic graphs from the start, ``False`` one
            graph per shape, ``None`` (PyTorch's default) recompiles once shape-generic after a shape changes.
        recompile_warn_threshold (`int`, defaults to 4): warn once when more graphs than this were compiled
            after the first optimizer step.

    Raises:
        ConfigError: an unknown backend or mode, a mode other than ``"default"`` without inductor, a
            negative threshold.
    """

    backend: str = "inductor"  # the Dynamo backend
    mode: str = "default"  # inductor's mode: default, reduce-overhead, max-autotune
    fullgraph: bool = False  # a graph break is an error
    dynamic: bool | None = None  # shape-generic graphs: True, False, None (automatic)
    recompile_warn_threshold: int = 4  # recompilations before a warning

    def __post_init__(self) -> None:
        backends = _backends()
        if self.backend not in backends:
            raise torchloom.ConfigError(
                f"setting 'backend' = {self.backend!r}{_did_you_mean(self.backend, backends)}; valid values: "
                f"{', '.join(map(repr, backends))}"
            )
        if self.mode not in _MODES:
            raise torchloom.ConfigError(
                f"setting 'mode' = {self.mode!r}{_did_you_mean(self.mode, _MODES)}; valid values: "
                f"{', '.join(map(repr, _MODES))}"
            )
        if self.mode != "default" and self.backend != "inductor":
            raise torchloom.ConfigError(
                f"setting 'mode' = {self.mode!r} needs backend 'inductor', but 'backend' = {self.backend!r}; "
                "set mode: default or backend: inductor"
            )
        for field in ("fullgraph",):
            if not isinstance(getattr(self, field), bool):
                raise torchloom.ConfigError(f"setting {field!r} = {getattr(self, field)!r}; expected true or false")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise torchloom.ConfigError(f"setting 'dynamic' = {self.dynamic!r}; expected true, false or null")
        threshold = self.recompile_warn_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise torchloom.ConfigError(f"setting 'recompile_warn_threshold' = {threshold!r}; expected an integer >= 0")

    def compile_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `torch.compile`."""
        kwargs: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode != "default":
            kwargs["mode"] = self.mode
        return kwargs


def _did_you_mean(value: Any, valid: Any) -> str:
    close = torchloom.utils.closest_name(str(value), valid)
    return f" (did you mean {close!r}?)" if close else ""


def compile_counters() -> tuple[int, int]:
    """Return ``(graphs compiled, graph breaks)`` in this process so far, from ``torch._dynamo.utils.counters``.

    Host-side Python integers: no device sync.
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def compile_in_place(model: torch.nn.Module, **kwargs: Any) -> None:
    """Compile ``model``'s ``__call__`` in place, as `torch.nn.Module.compile` does, for any module.

    ``Module.compile`` compiles ``model._call_impl`` directly; for a module made only of ``torch.nn`` classes
    (an ``nn.Sequential`` of ``nn.Linear``) every frame is then in PyTorch's own files, which Dynamo skips, and
    nothing is compiled (torch 2.13). Calling it through a frame of this file lets Dynamo start tracing here and
    inline the rest. The module object, its parameters and their names do not change.

    Args:
        model (`torch.nn.Module`): the model, before ``accelerator.prepare``.
        **kwargs: keyword arguments of `torch.compile`.
    """
    call = model._call_impl

    def call_compiled(*args: Any, **call_kwargs: Any) -> Any:
        return call(*args, **call_kwargs)

    # A code object of its own per model: Dynamo keeps its cache, and counts torch._dynamo.config.recompile_limit,
    # per code object, so models compiled earlier in the process (other fits, other plugin combinations) neither
    # use up this model's recompilations nor stay cached through it.
    fresh = types.FunctionType(
        call_compiled.__code__.replace(), call_compiled.__globals__, "call_compiled", None, call_compiled.__closure__
    )
    model._compiled_call_impl = torch.compile(fresh, **kwargs)


def last_recompile_reason() -> str | None:
    """The reason Dynamo gave for its latest recompilation in this process (a failed guard, such as
    ``tensor 'args[0]' size mismatch at index 1. expected 13, actual 15``), or ``None`` if it kept none."""
    try:
        from torch._dynamo.utils import get_compilation_metrics

        reasons = [m.recompile_reason for m in get_compilation_metrics() if getattr(m, "recompile_reason", None)]
    except (ImportError, AttributeError):  # a private API: absent in another torch version
        return None
    return str(reasons[-1]) if reasons else None


class Compile(torchloom.Plugin):
    """Compile the model with ``torch.compile`` (in place, before it is prepared) and log what it costs.

    Implements ``configure_model``, ``on_fit_start``, ``on_train_batch_start`` and ``after_optimizer_step``.
    See the module docstring and ``docs/plugins/compile.md``.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"compile": {"dynamic": True}})

    Attributes:
        recompiles (`int`): graphs compiled after the first optimizer step of the last fit.
        graph_breaks (`int`): graph breaks since the start of the last fit.
        first_step_seconds (`float` or `None`): wall time of the last fit's first optimizer step.
    """

    name = "compile"
    Config = CompileConfig

    def __init__(self, config: CompileConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.recompiles = 0
        self.graph_breaks = 0
        self.first_step_seconds: float | None = None
        self._start: float | None = None
        self._base = (0, 0)
        self._graphs_after_first: int | None = None
        self._warned = False

    @torchloom.hookimpl
    def configure_model(self, model: torch.nn.Module) -> None:
        compile_in_place(model, **self.config.compile_kwargs())

    @torchloom.hookimpl
    def on_fit_start(self) -> None:
        self.recompiles, self.graph_breaks, self.first_step_seconds = 0, 0, None
        self._start, self._graphs_after_first, self._warned = None, None, False
        self._base = compile_counters()

    @torchloom.hookimpl
    def on_train_batch_start(self) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    @torchloom.hookimpl
    def after_optimizer_step(self, log) -> None:
        graphs, breaks = compile_counters()
        if self._graphs_after_first is None:
            self.first_step_seconds = time.perf_counter() - (self._start or time.perf_counter())
            self._graphs_after_first = graphs
            log("compile/first_step_seconds", self.first_step_seconds, reduce="last")
        self.recompiles = graphs - self._graphs_after_first
        self.graph_breaks = breaks - self._base[1]
        log("compile/recompiles", float(self.recompiles), reduce="last")
        log("compile/graph_breaks", float(self.graph_breaks), reduce="last")
        if self.recompiles > self.config.recompile_warn_threshold and not self._warned:
            self._warned = True
            reason = last_recompile_reason()
            torchloom.utils.warn(
                f"compile: {self.recompiles} graphs were recompiled after the first step (threshold "
                f"{self.config.recompile_warn_threshold}; last reason: {reason or 'not recorded'}): the inputs keep "
                "changing shape (or dtype), typically a "
                "new sequence length per batch under dynamic padding; each new shape costs a compilation, and "
                "past torch._dynamo.config.recompile_limit the model silently runs eagerly. Set dynamic: true, "
                "or pad batches to a few length buckets",
            )
