"""Where `torchloom.estimate_memory`'s model comes from: a model directory, a transformers config, a run config's task,
a module or a callable, built on ``meta`` or fake tensors (nothing allocated) into a `Source`: a fake prototype of the
model and how to run one micro-batch of it (the inputs and labels a transformers model's head takes)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchloom._suggest import closest_name
from torchloom.errors import ConfigError, TorchloomError
from torchloom.parallel.copies import copy_module
from torchloom.parallel.dtensors import is_dtensor

__all__ = [
    "ADAPTER",
    "CHECKPOINTING",
    "ForwardFn",
    "Source",
    "capable_plugin",
    "construct",
    "fake_copy",
    "load_source",
    "quantization_state_bytes",
]

#: The capability (`torchloom.Plugin`'s ``capabilities``) of the plugin whose ``configure_model`` enables activation
#: checkpointing in the checkpointed rows (the ``grad_checkpoint`` plugin declares it).
CHECKPOINTING = "activation_checkpointing"
#: The capability of the plugin whose ``configure_model`` injects an adapter (LoRA, QLoRA: on a 4-bit / 8-bit base)
#: into the model (the ``peft`` plugin declares it).
ADAPTER = "adapter"

ForwardFn = Callable[[torch.nn.Module, int, "int | None"], torch.Tensor]


@dataclass
class Source:
    """A fake prototype of the model and how to run one micro-batch of it."""

    label: str
    prototype: torch.nn.Module
    loss: Callable[[torch.nn.Module, Any, int, int | None], torch.Tensor]
    make_batch: Callable[[torch.nn.Module, int, int | None], Any] | None = None
    max_len: int | None = None
    needs_seq_len: bool = False
    checkpoint_settings: dict[str, Any] | None = None
    #: The plugin that checkpoints activations (`CHECKPOINTING`): a run config's, else found when first needed.
    checkpoint_plugin: str | None = None


def capable_plugin(capability: str, names: Any = None, caller: str = "estimate_memory") -> str | None:
    """The name of the plugin that declares ``capability`` (`torchloom.plugins.plugins_with`): among ``names`` (a
    run config's plugins) when given, ``None`` when none of them does; else among the installed ones.

    Raises:
        PluginError: no installed plugin declares it (``names`` not given), or a plugin of ``names`` fails to import.
        ConfigError: several do.
    """
    from torchloom.errors import PluginError
    from torchloom.plugins import plugins_with

    found = [name for name, _ in plugins_with(capability, names)]
    if len(found) > 1:
        raise ConfigError(
            f"{caller}: plugins {', '.join(map(repr, found))} all declare the capability {capability!r}; "
            "expected one (enable one of them in the run config, or limit the installed ones with TORCHLOOM_PLUGINS)"
        )
    if not found and names is None:
        raise PluginError(
            f"{caller}: no installed plugin declares the capability {capability!r} (torchloom.Plugin.capabilities: "
            "the torchloom_plugins distribution's plugins do), or TORCHLOOM_PLUGINS leaves it out"
        )
    return found[0] if found else None


def load_source(
    model: Any,
    architecture: str | None,
    forward: ForwardFn | None,
    mode: Any,
    caller: str = "estimate_memory",
    peft: Mapping[str, Any] | bool | None = None,
) -> Source:
    """The model and how to run one micro-batch of it; ``caller`` names the public function in error messages.

    ``peft``: the ``peft`` plugin's settings (its ``configure_model`` is applied to a ``meta`` copy of the model,
    see `with_adapter`); ``None`` or ``True``: a run config's ``peft`` settings if it enables the plugin, else no
    adapter; ``False``: no adapter.

    Raises:
        ConfigError: a path that does not exist, a model that cannot be built, a bad ``peft`` setting (the plugin's
            message), or (without ``forward``) a model whose inputs are unknown.
    """
    if not (peft is None or isinstance(peft, bool | Mapping)):
        raise ConfigError(
            f"peft = {peft!r}; expected the peft plugin's settings (e.g. {{'r': 8, 'load_in_4bit': "
            "True}), True (a run config's) or False (no adapter)"
        )
    checkpoint_settings = checkpoint_plugin = None
    adapter_settings: dict[str, Any] | None = None
    adapter_plugin: str | None = None
    if isinstance(model, str | os.PathLike):
        path = os.fspath(model)
        if not os.path.exists(path):
            raise ConfigError(
                f"model {path!r} does not exist; expected a local Hugging Face model directory (with config.json), "
                "a transformers config (.json) or a torchloom run config (.yaml)"
            )
        if path.endswith((".yaml", ".yml")) and os.path.isfile(path):
            built, (checkpoint_plugin, checkpoint_settings), (adapter_plugin, adapter_settings) = _from_run_config(
                path, mode
            )
        else:
            built = _build_hf(_read_hf_config(path), architecture, mode, caller)
    elif _is_hf_config(model):
        built = _build_hf(model, architecture, mode, caller)
    elif isinstance(model, torch.nn.Module):
        built = model
    elif callable(model):
        built = construct(model, mode)
        if not isinstance(built, torch.nn.Module):
            raise ConfigError(f"model: {model!r} returned {type(built).__name__}; expected a torch.nn.Module")
    else:
        raise ConfigError(
            f"model = {model!r}; expected a path (model directory, config .json, run config .yaml), a transformers "
            "config, a torch.nn.Module or a callable that returns one"
        )
    if isinstance(peft, Mapping):
        adapter_settings = dict(peft)
    elif peft is False:
        adapter_settings = None
    if adapter_settings is not None:
        built = with_adapter(built, adapter_settings, adapter_plugin)
    prototype = fake_copy(built, mode)
    label = type(prototype).__name__  # of an FSDP2 model: its own class, not FSDP<Class>
    if forward is not None:
        if not callable(forward):
            raise ConfigError(f"forward = {forward!r}; expected a callable (model, batch_size, seq_len) -> loss")
        source = Source(
            label, prototype, lambda m, _batch, b, s: forward(m, b, s), checkpoint_settings=checkpoint_settings
        )
    else:
        config = getattr(prototype, "config", None)
        if not _is_hf_model(prototype) or not _is_hf_config(config):
            raise ConfigError(
                f"{caller}: {label} is not a transformers model, so its inputs are unknown; pass "
                f"forward=lambda model, batch_size, seq_len: <loss> (Python API: torchloom.{caller})"
            )
        source = _hf_source(label, prototype, config, checkpoint_settings, caller)
    source.checkpoint_plugin = checkpoint_plugin
    return source


def _is_hf_config(obj: Any) -> bool:
    if "transformers" not in sys.modules:
        return False
    return isinstance(obj, sys.modules["transformers"].PretrainedConfig)


def _is_hf_model(obj: Any) -> bool:
    if "transformers" not in sys.modules:
        return False
    return isinstance(obj, sys.modules["transformers"].PreTrainedModel)


def _read_hf_config(path: str) -> Any:
    import transformers

    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model {path!r} is a directory without config.json; expected a Hugging Face model directory")
    if os.path.isfile(path) and not path.endswith(".json"):
        raise ConfigError(
            f"model {path!r} is neither a transformers config (.json) nor a torchloom run config (.yaml / .yml)"
        )
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model {path!r}: not a transformers config: {exc}") from None


def _head_classes() -> dict[str, set[str]]:
    """transformers class names by the labels their head takes (from the auto-class mappings)."""
    from transformers.models.auto import modeling_auto as auto

    def names(*mappings: Mapping[str, Any]) -> set[str]:
        found: set[str] = set()
        for mapping in mappings:
            for value in mapping.values():
                found.update([value] if isinstance(value, str) else value)
        return found

    return {
        "token": names(
            auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
            auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
            auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
        ),
        "token_classes": names(auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES),
        "sequence": names(auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
    }


def _auto_class_names(model_type: Any) -> dict[str, str]:
    """The transformers class names registered for ``model_type``, by auto-class kind (from the auto mappings)."""
    from transformers.models.auto import modeling_auto as auto

    mappings: dict[str, Mapping[str, Any]] = {
        "masked": auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "causal": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "seq2seq": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        "base": auto.MODEL_MAPPING_NAMES,
        "sequence": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        "token": auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    }
    found = {kind: mapping.get(str(model_type)) for kind, mapping in mappings.items()}
    return {kind: name for kind, name in found.items() if isinstance(name, str)}


def _build_hf(config: Any, architecture: str | None, mode: Any, caller: str) -> torch.nn.Module:
    import transformers

    model_type = getattr(config, "model_type", None)
    registered = _auto_class_names(model_type)
    valid = f"Valid for model_type {model_type!r}: {', '.join(sorted(set(registered.values()))) or '(none known)'}"
    name: str | None = architecture or next(iter(getattr(config, "architectures", None) or []), None)
    if name is None:  # an encoder's masked LM, else the causal LM, else the seq2seq LM, else the base model
        kinds = (
            ["causal", "seq2seq", "base"]
            if getattr(config, "is_decoder", False)
            else ["masked", "causal", "seq2seq", "base"]
        )
        name = next((registered[k] for k in kinds if k in registered), None)
    cls = getattr(transformers, name, None) if name else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        close = closest_name(str(name), sorted(set(registered.values())))
        hint = f"; did you mean {close!r}?" if close else "."
        raise ConfigError(f"architecture {name!r} is not a transformers model class{hint} {valid}")
    config_class: Any = cls.config_class
    if isinstance(config_class, type) and not isinstance(config, config_class):
        raise ConfigError(
            f"architecture {name!r} takes a {config_class.__name__}, not the {type(config).__name__} given. {valid}"
        )
    try:
        return construct(lambda: cls(config), mode)
    except Exception as exc:
        raise ConfigError(f"{caller}: building {name} from its config failed: {type(exc).__name__}: {exc}") from exc


def _hf_source(
    label: str, prototype: torch.nn.Module, config: Any, checkpoint: dict[str, Any] | None, caller: str
) -> Source:
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(
            f"{caller}: {label} takes no input_ids (its config has no vocab_size); pass "
            "forward=lambda model, batch_size, seq_len: <loss>"
        )
    heads = _head_classes()
    kind = "token" if label in heads["token"] else "sequence" if label in heads["sequence"] else None
    num_labels = getattr(config, "num_labels", 2)

    def make_batch(model: torch.nn.Module, batch_size: int, seq_len: int | None) -> dict[str, torch.Tensor]:
        assert seq_len is not None
        batch = {"input_ids": torch.randint(0, vocab, (batch_size, seq_len))}
        if kind == "token":
            high = num_labels if label in heads["token_classes"] else vocab
            batch["labels"] = torch.randint(0, high, (batch_size, seq_len))
        elif kind == "sequence":
            batch["labels"] = (
                torch.randn(batch_size) if num_labels == 1 else torch.randint(0, num_labels, (batch_size,))
            )
        return batch

    def loss(model: torch.nn.Module, batch: Any, batch_size: int, seq_len: int | None) -> torch.Tensor:
        outputs = model(**batch)
        if kind is not None:
            return outputs.loss
        first = outputs[0] if isinstance(outputs, tuple | list) or hasattr(outputs, "to_tuple") else outputs
        return first.float().sum()

    max_len = getattr(config, "max_position_embeddings", None)
    return Source(
        label,
        prototype,
        loss,
        make_batch,
        max_len=max_len if isinstance(max_len, int) and max_len > 0 else None,
        needs_seq_len=True,
        checkpoint_settings=checkpoint,
    )


_Named = tuple[str | None, dict[str, Any] | None]


def _from_run_config(path: str, mode: Any) -> tuple[torch.nn.Module, _Named, _Named]:
    """Build the model of a run config's task (its ``configure_model``, on fake tensors) and read the name and
    settings of the plugins it enables that checkpoint activations (`CHECKPOINTING`) and inject an adapter
    (`ADAPTER`): ``(None, None)`` for one it does not enable."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"run config {path!r}: cannot read it: {exc}") from None
    task_section = config.get("task") if isinstance(config, Mapping) else None
    if not isinstance(task_section, Mapping) or "class_path" not in task_section:
        raise ConfigError(
            f"run config {path!r} has no task (task: {{class_path: module.Class, init_args: {{...}}}}); "
            "estimate-memory builds the task's model"
        )
    from jsonargparse import ArgumentParser

    from torchloom.module import TaskModule

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(TaskModule, "task", required=True)
    try:
        task = parser.instantiate(parser.parse_object({"task": dict(task_section)})).task
    except Exception as exc:
        cause = _torchloom_error_in(exc)
        if cause is not None:
            raise cause from None
        raise ConfigError(f"run config {path!r}: task: {' '.join(str(exc).split())}") from None
    built = construct(task.configure_model, mode)
    if not isinstance(built, torch.nn.Module):
        raise ConfigError(
            f"run config {path!r}: {type(task).__name__}.configure_model returned {type(built).__name__}; "
            "expected a torch.nn.Module"
        )
    plugins = _plugin_entries(config.get("plugins"))
    named = []
    for capability in (CHECKPOINTING, ADAPTER):
        name = capable_plugin(capability, [key for key, _ in plugins if isinstance(key, str)])
        named.append((name, next(dict(value or {}) for key, value in plugins if key == name) if name else None))
    return built, named[0], named[1]


def _plugin_entries(section: Any) -> list[tuple[Any, Any]]:
    """A run config's ``plugins`` section as ``(name, settings)`` pairs (settings ``None`` if enabled without any)."""
    entries: list[Any] = list(section.items()) if isinstance(section, Mapping) else []
    if isinstance(section, list):
        for entry in section:
            if isinstance(entry, str):
                entries.append((entry, None))
            elif isinstance(entry, Mapping):
                entries.extend(entry.items())
    return entries


def _torchloom_error_in(exc: BaseException) -> TorchloomError | None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, TorchloomError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def construct(build: Callable[[], Any], mode: Any) -> Any:
    """Call ``build`` with ``meta`` as the default device (nothing allocated); if that fails (transformers'
    ``from_pretrained`` refuses it), on fake tensors, where loaded weights are read into host memory once."""
    try:
        with torch.device("meta"):
            return build()
    except TorchloomError:
        raise
    except Exception:
        with mode:
            return build()


def with_adapter(model: torch.nn.Module, settings: Mapping[str, Any], plugin: str | None = None) -> torch.nn.Module:
    """A ``meta`` copy of ``model`` after the adapter plugin's ``configure_model`` ran on it with ``settings``, as at
    run set-up: the base quantised as the plugin quantises it, the adapter injected, only the adapter (and
    ``modules_to_save``) trainable. ``model`` is not changed. On ``meta`` bitsandbytes leaves a quantised layer's
    weight unquantised (it quantises when the weight moves to a device); `fake_copy` quantises it on fake tensors.
    The plugin is ``plugin`` (a run config's), else the installed one that declares `ADAPTER` (the ``peft`` plugin).

    Raises:
        ConfigError: a bad setting, or a model the plugin cannot adapt (the plugin's one-line message).
        PluginError: no installed plugin declares `ADAPTER`.
    """
    from torchloom.plugins import HookRelay, enable_plugins

    name = plugin or capable_plugin(ADAPTER)
    assert name is not None  # among the installed ones: found, or raised
    plugins = enable_plugins({name: dict(settings)})  # validates the settings: the plugin's ConfigError
    adapted = meta_copy(model)
    HookRelay(plugins).call("configure_model", model=adapted, task=None, accelerator=None)
    return adapted


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are on ``meta``, tied parameters still tied (no data)."""
    memo: dict[int, Any] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for _, t in [*named, *_tensor_attributes(model)]:
        if id(t) not in memo:
            data = torch.empty(t.shape, dtype=t.dtype, device="meta")
            memo[id(t)] = torch.nn.Parameter(data, t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
    return copy_module(model, memo)


def _tensor_attributes(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Tensors that modules hold as plain attributes, neither parameters nor buffers (e.g. a rotary embedding's
    ``original_inv_freq``, which stops being its buffer once the buffer is moved or reloaded, as FSDP2's
    preparation does): copied as fake / ``meta`` tensors too, never as real data into a fake copy."""
    found = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                found.append((f"{prefix}.{name}" if prefix else name, value))
    return found


def fake_copy(model: torch.nn.Module, mode: Any) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors (on the CPU for a ``meta`` model), tied
    parameters still tied; ``model`` itself is not changed and no data is copied. A bitsandbytes weight
    (``Params4bit``, ``Int8Params``) becomes a fake parameter of its quantised storage carrying its quantisation
    state (quantised here, on fake tensors, if it is not yet: a ``meta`` one)."""
    memo: dict[int, Any] = {}
    if any(type(p).__name__ == "Params4bit" and getattr(p, "compress_statistics", False) for p in model.parameters()):
        import bitsandbytes as bnb

        # Double quantisation uses one code bitsandbytes builds from Python numbers at its first use and caches: a
        # fake tensor has no numbers, so it is built here, from a real block of 64 zeros.
        bnb.functional.quantize_4bit(torch.zeros(64), compress_statistics=True)
    with mode:
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        named += _tensor_attributes(model)
        for _, t in named:
            if id(t) in memo:
                continue
            quantized = _fake_quantized(t)
            if quantized is not None:
                memo[id(t)] = quantized
                continue
            device = "cpu" if t.device.type == "meta" else t.device
            if is_dtensor(t):  # an FSDP2 shard: the whole parameter, its global shape
                data = torch.empty(t.shape, dtype=t.dtype, device=device)
            else:
                data = torch.empty_like(t, device=device)
            memo[id(t)] = torch.nn.Parameter(data, t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
        for module in model.modules():  # a 4-bit layer's copy of its weight's state: the same object
            state = getattr(module, "quant_state", None)
            if state is not None:
                memo[id(state)] = state
        return copy_module(model, memo)


#: The attributes of a bitsandbytes weight that its layer reads in forward, kept on its fake copy.
_QUANT_ATTRS = ("quant_state", "SCB", "has_fp16_weights", "bnb_quantized", "blocksize", "quant_type", "quant_storage")


def _fake_quantized(t: Any) -> torch.nn.Parameter | None:
    """The fake copy of a bitsandbytes weight (inside the fake mode), or ``None`` for any other tensor.

    A 4-bit weight not yet quantised is quantised with ``bitsandbytes.functional.quantize_4bit`` on a fake tensor
    of its shape (bitsandbytes' fake kernels give the packed data and the quantisation state, ``absmax`` and the
    nested state of double quantisation, their real shapes); an 8-bit one with ``int8_vectorwise_quant`` (the
    ``int8`` rows and their float32 scales ``SCB``), as ``Params4bit._quantize`` / ``Int8Params._quantize`` do."""
    kind = type(t).__name__
    state = getattr(t, "quant_state", None)
    if kind != "Params4bit" and state is None and not (kind == "Int8Params" or hasattr(t, "SCB")):
        return None
    import bitsandbytes as bnb

    attrs = {name: getattr(t, name) for name in _QUANT_ATTRS if hasattr(t, name)}
    if kind == "Params4bit" and not t.bnb_quantized:
        data, attrs["quant_state"] = bnb.functional.quantize_4bit(
            torch.empty(t.shape, dtype=t.dtype),
            blocksize=t.blocksize,
            compress_statistics=t.compress_statistics,
            quant_type=t.quant_type,
            quant_storage=t.quant_storage,
        )
        attrs["bnb_quantized"] = True
    elif "SCB" in attrs and t.dtype != torch.int8:
        data, attrs["SCB"], _ = bnb.functional.int8_vectorwise_quant(torch.empty(t.shape, dtype=torch.float16))
    else:
        data = torch.empty_like(t, device="cpu" if t.device.type == "meta" else t.device)
    param = torch.nn.Parameter(data, False)
    for name, value in attrs.items():
        setattr(param, name, value)
    if "SCB" in attrs:
        param.CB = data  # type: ignore[attr-defined]  # Linear8bitLt reads the int8 rows from weight.CB
    return param


def quantization_state_bytes(model: torch.nn.Module) -> int:
    """Bytes of the quantisation state of ``model``'s bitsandbytes weights, which are neither parameters nor
    buffers: a 4-bit weight's ``absmax`` and code (with double quantisation its ``uint8`` absmax, the nested absmax,
    code and offset), an 8-bit weight's row scales ``SCB``; each storage once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        tensors: list[Any] = [getattr(p, "SCB", None)]
        while state is not None:
            tensors += [state.absmax, state.code, getattr(state, "offset", None)]
            state = getattr(state, "state2", None) if getattr(state, "nested", False) else None
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen:
                seen.add(t.untyped_storage()._cdata)
                total += t.untyped_storage().nbytes()
    return total
