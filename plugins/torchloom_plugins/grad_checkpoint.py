"""Activation (gradient) checkpointing: keep fewer activations for backward, recompute them instead.

Method card
-----------
- **What:** the forward pass of the chosen blocks keeps only their inputs; backward recomputes their
  internals (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174). Costs
  about one extra forward of the checkpointed blocks (~1.2x step time measured on a 2-core CPU) for a lower
  activation peak (see bench/activation_memory.py).
- **Mechanism:** transformers models: ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``
  before transformers 5) with ``{"use_reentrant": ...}``; any other module: its ``forward`` runs inside
  `torch.utils.checkpoint.checkpoint` (``preserve_rng_state=True``, so dropout masks are replayed exactly).
- **Hooks:** ``setup`` (the stage), ``configure_model``, before ``accelerator.prepare`` (so DDP wraps the
  checkpointed model); ``on_fit_start`` only warns when ``use_reentrant: true`` meets several processes;
  ``on_train_end`` and ``teardown`` give the model its ``use_cache`` back.
- **use_cache:** with ``modules: hf``, a fit sets ``config.use_cache = False`` on each checkpointed transformers
  model, as the HF Trainer does (``TrainingArguments.use_cache`` defaults to false): checkpointing recomputes the
  forward, so a key/value cache is never used in training, and transformers would otherwise log "`use_cache=True`
  is incompatible with gradient checkpointing" at the first step. The value comes back when training ends, before
  the model is saved, so its ``config.json`` keeps ``use_cache: true``.
- **Guarantees:** gradients equal those of the run without it (dropout included); ``use_reentrant`` defaults
  to False (works with frozen layers before the block and under DDP with a block used twice) and is never
  overridden; with ``use_reentrant: true`` inputs of a block whose trainable weights would otherwise get no
  gradient are made to require grad (the HF ``enable_input_require_grads`` fix); a ``modules`` entry that
  matches nothing is a `torchloom.ConfigError`.
- **Functional core:** `checkpoint_modules` and `checkpoint_use_reentrant` work without the loop.

Run: ``plugins: {grad_checkpoint: {modules: hf}}`` or ``{grad_checkpoint: {modules: [Block, "encoder.layers.*"]}}``.
"""

from __future__ import annotations

import fnmatch
import functools
import types
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

import torchloom
from torchloom import ConfigError, PluginError

__all__ = ["GradientCheckpointing", "GradientCheckpointingConfig", "checkpoint_modules", "checkpoint_use_reentrant"]

_SETTINGS_ATTR = "_torchloom_checkpoint"  # set on each module whose forward we checkpoint


@dataclass
class GradientCheckpointingConfig:
    """Settings of the ``grad_checkpoint`` plugin.

    Args:
        modules (`str` or `list[str]`, defaults to ``"hf"``): ``"hf"``: all checkpointable transformers layers.
            A list: each entry selects the submodules whose class name equals it (``Block``,
            ``LlamaDecoderLayer``) or whose qualified name matches it as an ``fnmatch`` pattern
            (``encoder.layers.*``, ``blocks.1?``).
        use_reentrant (`bool`, defaults to False): passed to ``torch.utils.checkpoint.checkpoint`` (or to
            transformers); never changed by the plugin.

    Raises:
        ConfigError: an empty ``modules`` list or an empty entry.
    """

    # "hf": every checkpointable layer of the transformers model(s) inside the model; or a list whose entries
    # are class names ("Block") or fnmatch patterns on qualified module names ("encoder.layers.*").
    modules: str | list[str] = "hf"
    use_reentrant: bool = False  # torch.utils.checkpoint's use_reentrant; kept exactly as given

    def __post_init__(self) -> None:
        entries = [self.modules] if isinstance(self.modules, str) else list(self.modules)
        if not entries or any(not isinstance(e, str) or not e.strip() for e in entries):
            raise ConfigError(
                f"setting 'modules' = {self.modules!r}: expected 'hf' or a non-empty list of class names or "
                "module-name patterns"
            )


# ------------------------------------------------------------------------------------------ functional core


def _checkpointed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The ``forward`` installed on a checkpointed module (bound with `types.MethodType`, so deepcopy rebinds)."""
    settings = self.__dict__[_SETTINGS_ATTR]
    # functools.partial, not types.MethodType: torch.compile traces through a partial, not a method constructor
    inner = settings["inner"] or functools.partial(type(self).forward, self)
    if not (self.training and torch.is_grad_enabled()):  # nothing to save for backward: run as is
        return inner(*args, **kwargs)
    use_reentrant = settings["use_reentrant"]
    if use_reentrant:
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in kwargs.values()):
            raise PluginError(
                f"grad_checkpoint: {type(self).__name__} got a tensor that requires grad as a keyword argument; "
                "reentrant checkpointing passes gradients only through positional arguments. Use "
                "use_reentrant: false"
            )
        if kwargs:
            inner = _bind_kwargs(inner, kwargs)
            kwargs = {}
        if any(p.requires_grad for p in self.parameters()) and not any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            # Reentrant checkpointing runs backward only through inputs that require grad: behind a frozen
            # layer the block's own weights would silently get grad=None (transformers #21381, #23170).
            args = tuple(
                a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args
            )
    return checkpoint(inner, *args, use_reentrant=use_reentrant, preserve_rng_state=True, **kwargs)


def _bind_kwargs(fn: Any, kwargs: dict[str, Any]) -> Any:
    def call(*args: Any) -> Any:
        return fn(*args, **kwargs)

    return call


def _matches(entry: str, qualified_name: str, module: torch.nn.Module) -> bool:
    return type(module).__name__ == entry or fnmatch.fnmatchcase(qualified_name, entry)


def checkpoint_modules(
    model: torch.nn.Module, modules: str | list[str] | tuple[str, ...] = "hf", use_reentrant: bool = False
) -> list[str]:
    """Enable activation checkpointing on ``model`` in place; return the qualified names of what was enabled.

    Args:
        model (`torch.nn.Module`): the model (unprepared).
        modules (`str` or `list[str]`, defaults to ``"hf"``): ``"hf"`` calls transformers'
            ``activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": ...})`` (or
            ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`` on transformers < 5) on every
            outermost `transformers.PreTrainedModel` in ``model`` (``model`` itself included). Otherwise each entry
            selects the submodules whose class name equals it or whose qualified name (as in
            ``model.named_modules()``) matches it as an `fnmatch` pattern; each selected module, except those
            inside another selected one, has its ``forward`` run under `torch.utils.checkpoint.checkpoint`
            in training mode with gradients enabled. Parameter names and ``state_dict`` keys do not change.
        use_reentrant (`bool`, defaults to False): passed to `torch.utils.checkpoint.checkpoint`.

    Returns:
        `list[str]`: qualified names of the checkpointed modules (``""`` is ``model`` itself).

    Raises:
        ConfigError: ``"hf"`` on a model without a checkpointable transformers model, or an entry that matches
            no module (the message names it and lists some module names and classes).
    """
    if modules == "hf":
        return _enable_hf(model, use_reentrant)
    entries = [modules] if isinstance(modules, str) else list(modules)
    named = list(model.named_modules())
    for entry in entries:
        if not any(_matches(entry, n, m) for n, m in named):
            classes = sorted({type(m).__name__ for _, m in named})
            names = [n for n, _ in named if n][:12]
            raise ConfigError(
                f"grad_checkpoint: setting 'modules' entry {entry!r} matches no submodule of "
                f"{type(model).__name__}; classes: {', '.join(classes)}; names: {', '.join(names) or '(none)'}"
            )
    chosen: list[str] = []
    for name, module in named:
        if not any(_matches(e, name, module) for e in entries):
            continue
        if any(name.startswith(f"{outer}.") or outer == "" for outer in chosen):
            continue  # already inside a checkpointed module
        if _SETTINGS_ATTR not in module.__dict__:
            module.__dict__[_SETTINGS_ATTR] = {"use_reentrant": use_reentrant, "inner": module.__dict__.get("forward")}
            module.forward = types.MethodType(_checkpointed_forward, module)
        else:
            module.__dict__[_SETTINGS_ATTR]["use_reentrant"] = use_reentrant
        chosen.append(name)
    return chosen


def _enable_hf(model: torch.nn.Module, use_reentrant: bool) -> list[str]:
    kwargs = {"use_reentrant": use_reentrant}
    enabled: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") or outer == "" for outer in enabled):
            continue
        if not getattr(module, "supports_gradient_checkpointing", False):
            continue
        if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5
            module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        elif hasattr(module, "gradient_checkpointing_enable"):
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            continue
        enabled.append(name)
    if not enabled:
        raise ConfigError(
            f"grad_checkpoint: setting 'modules' = 'hf' but {type(model).__name__} contains no transformers model "
            "that supports gradient checkpointing; list the blocks to checkpoint by class name or name pattern"
        )
    return enabled


def checkpoint_use_reentrant(module: torch.nn.Module) -> bool | None:
    """Return the ``use_reentrant`` that checkpointing of ``module`` really uses, or ``None`` if not checkpointed.

    Reads what `checkpoint_modules` installed, or for a transformers layer the keyword bound into its
    ``_gradient_checkpointing_func``.
    """
    settings = module.__dict__.get(_SETTINGS_ATTR)
    if settings is not None:
        return bool(settings["use_reentrant"])
    if getattr(module, "gradient_checkpointing", False):
        func = getattr(module, "_gradient_checkpointing_func", None)
        keywords = getattr(func, "keywords", None) or {}
        return keywords.get("use_reentrant")
    return None


# ------------------------------------------------------------------------------------------------- plugin


class GradientCheckpointing(torchloom.Plugin):
    """Enables activation checkpointing on the model before it is prepared.

    Args:
        config (`GradientCheckpointingConfig`, *optional*): ready-made settings, or pass them as keywords.

    Raises:
        ConfigError: at ``configure_model``, a ``modules`` entry that matches nothing.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"grad_checkpoint": {"modules": ["Block"]}})

    Attributes:
        checkpointed (`list[str]`): qualified names of the modules checkpointed in the last run.
    """

    name = "grad_checkpoint"
    Config = GradientCheckpointingConfig
    capabilities = frozenset({"activation_checkpointing"})  # configure_model, from the settings alone

    def __init__(self, config: GradientCheckpointingConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.checkpointed: list[str] = []
        self._stage = "fit"
        self._cache_configs: list[Any] = []  # the transformers configs whose use_cache this fit turned off

    @torchloom.hookimpl
    def setup(self, stage: str) -> None:
        self._stage = stage

    @torchloom.hookimpl
    def configure_model(self, model: torch.nn.Module) -> None:
        self.checkpointed = checkpoint_modules(model, self.config.modules, self.config.use_reentrant)
        if self.config.modules == "hf" and self._stage == "fit":
            self._turn_off_cache(model)

    def _turn_off_cache(self, model: torch.nn.Module) -> None:
        # A checkpointed transformers model ignores use_cache=True in training and logs "`use_cache=True` is
        # incompatible with gradient checkpointing. Setting `use_cache=False`." at its first step; turned off in
        # its config as the HF Trainer does (use_cache: false), and turned back on when training ends, so the
        # saved config.json keeps the model's own value.
        for name in self.checkpointed:
            config: Any = getattr(model.get_submodule(name), "config", None)
            if getattr(config, "use_cache", None) is True and not any(c is config for c in self._cache_configs):
                config.use_cache = False
                self._cache_configs.append(config)

    def _restore_cache(self) -> None:
        for config in self._cache_configs:
            config.use_cache = True
        self._cache_configs = []

    @torchloom.hookimpl
    def on_train_end(self) -> None:
        self._restore_cache()

    @torchloom.hookimpl
    def teardown(self) -> None:
        self._restore_cache()  # a fit that failed before the end of training

    @torchloom.hookimpl
    def on_fit_start(self, accelerator) -> None:
        if self.config.use_reentrant and accelerator.num_processes > 1:
            torchloom.utils.warn(
                "grad_checkpoint: use_reentrant=True under DDP fails with 'Expected to mark a variable ready "
                "only once' when a checkpointed module runs twice in one forward or find_unused_parameters is "
                "on (huggingface/peft #313); use_reentrant=False (the default) has no such limit",
            )


def __getattr__(name: str) -> Any:
    # The settings class was named CheckpointConfig, like the checkpoint plugin's; the old name still imports.
    if name == "CheckpointConfig":
        warnings.warn(
            "torchloom_plugins.grad_checkpoint.CheckpointConfig is now GradientCheckpointingConfig (the checkpoint "
            "plugin's settings class is torchloom_plugins.checkpoint.CheckpointConfig); import the new name",
            DeprecationWarning,
            stacklevel=2,
        )
        return GradientCheckpointingConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
