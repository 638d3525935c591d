"""Adapters (LoRA and the other ``peft`` tuners) injected in place into a model: peft's own folder format.

A model into which ``peft.inject_adapter_in_model`` injected an adapter (the ``peft`` plugin does, in
``configure_model``) carries ``peft_config`` (``{adapter name: PeftConfig}``). `TaskModule.save_model` then writes
what ``PeftModel.save_pretrained`` writes, and nothing of the frozen base:

- ``adapter_config.json``: the adapter's `peft.PeftConfig` (``PeftConfig.save_pretrained``);
- ``adapter_model.safetensors``: the adapter's weights (``peft.get_peft_model_state_dict``: the adapter name
  removed from the keys), each key prefixed with ``base_model.model.`` as a `peft.PeftModel` names them.

``PeftModel.from_pretrained(base, folder)`` loads it onto the base with plain ``peft``; `load_adapter` loads it back
into a model here (``predict`` from an adapter folder). ``peft`` is imported only when an adapter is saved or loaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from torchloom.errors import ConfigError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "PEFT_PREFIX",
    "adapter_config",
    "has_adapter",
    "is_adapter_dir",
    "load_adapter",
    "save_adapter",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: The prefix of every key in ``adapter_model.safetensors``: the path from a `peft.PeftModel` to the base model.
PEFT_PREFIX = "base_model.model."
#: The one adapter name torchloom trains (peft's default).
ADAPTER_NAME = "default"


def has_adapter(model: torch.nn.Module) -> bool:
    """Whether ``model`` (unwrapped) carries an adapter injected in place (a non-empty ``peft_config`` dict)."""
    config = getattr(model, "peft_config", None)
    return isinstance(config, dict) and bool(config)


def adapter_config(model: torch.nn.Module) -> Any:
    """The `peft.PeftConfig` of the model's adapter (`has_adapter` must hold)."""
    configs: Any = model.peft_config
    return configs[ADAPTER_NAME] if ADAPTER_NAME in configs else next(iter(configs.values()))


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder in peft's format (``adapter_config.json`` and ``adapter_model.safetensors``)."""
    root = Path(path)
    return (root / ADAPTER_CONFIG).is_file() and (root / ADAPTER_WEIGHTS).is_file()


def adapter_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The adapter's tensors as ``adapter_model.safetensors`` names them (``base_model.model.<name>``, without the
    adapter name), from ``state_dict`` (the model's, e.g. gathered by Accelerate) or ``model.state_dict()``."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=ADAPTER_NAME)
    return {PEFT_PREFIX + key: value.detach().contiguous() for key, value in state.items()}


def save_adapter(
    model: torch.nn.Module,
    directory: str | os.PathLike[str],
    state_dict: dict[str, torch.Tensor] | None = None,
    is_main_process: bool = True,
) -> None:
    """Write ``model``'s adapter into ``directory`` in peft's format (see the module docstring), main process only.

    ``base_model_name_or_path`` in ``adapter_config.json`` is the base's ``name_or_path`` (what ``from_pretrained``
    loaded it from), or ``None`` for a model built from a config.
    """
    tensors = adapter_state_dict(model, state_dict)  # on every process (no collective, but the same work)
    if not is_main_process:
        return
    import copy

    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    config = copy.copy(adapter_config(model))
    config.base_model_name_or_path = getattr(model, "name_or_path", None) or None
    if isinstance(config.target_modules, set):  # "all-linear" resolved to module names: a stable order
        config.target_modules = sorted(config.target_modules)
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config.save_pretrained(os.fspath(directory))


def load_adapter(model: torch.nn.Module, directory: str | os.PathLike[str]) -> torch.nn.Module:
    """Load the adapter folder ``directory`` into ``model`` in place; inject it first when ``model`` has none.

    Raises:
        ConfigError: not an adapter folder, or its weights do not fit the model's adapter (keys the adapter lacks or
            has too many, shapes that differ: another rank or other target modules).
    """
    from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    root = Path(directory)
    if not is_adapter_dir(root):
        raise ConfigError(f"{os.fspath(directory)!r} is not an adapter folder ({ADAPTER_CONFIG}, {ADAPTER_WEIGHTS})")
    if not has_adapter(model):
        inject_adapter_in_model(PeftConfig.from_pretrained(os.fspath(root)), model, adapter_name=ADAPTER_NAME)
    state = {key.removeprefix(PEFT_PREFIX): value for key, value in load_file(root / ADAPTER_WEIGHTS).items()}
    expected = set(adapter_state_dict(model))
    saved = {PEFT_PREFIX + key for key in state}
    where = f"the adapter in {os.fspath(directory)!r}"
    if saved != expected:
        only_saved, only_model = sorted(saved - expected), sorted(expected - saved)
        raise ConfigError(
            f"{where} does not fit {type(model).__name__}'s adapter: "
            + "; ".join(
                f"{what} {names[:4]}{' ...' if len(names) > 4 else ''}"
                for what, names in (("only in the folder:", only_saved), ("only in the model:", only_model))
                if names
            )
        )
    try:
        set_peft_model_state_dict(model, state, adapter_name=ADAPTER_NAME)
    except RuntimeError as exc:  # size mismatch: another rank
        raise ConfigError(f"{where} does not fit {type(model).__name__}: {' '.join(str(exc).split())}") from None
    return model


def read_adapter_config(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``adapter_config.json`` of ``directory`` as a dict (JSON only; ``None`` if there is none or it is not JSON)."""
    try:
        value = json.loads((Path(directory) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


# ------------------------------------------------------------------------------------------- checkpoints


def _base_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the frozen base: every state_dict entry that is neither a trainable parameter nor a buffer (buffers,
    such as running statistics, may change in training: a checkpoint saves them), name, dtype, shape and bytes (a
    4-bit base's packed bytes and quantisation state included). Computed once per model object: the base is frozen."""
    cached = model.__dict__.get("_torchloom_base_sha256")
    if cached is not None:
        return str(cached)
    import hashlib

    trainable = saved_names(model)
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        if name in trainable or not isinstance(value, torch.Tensor):
            continue
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    model.__dict__["_torchloom_base_sha256"] = value = digest.hexdigest()
    return value


def adapted_modules(model: torch.nn.Module) -> list[str]:
    """Qualified names of the modules that carry the adapter (peft's tuner layers: a ``base_layer`` and adapter
    weights), in ``named_modules`` order."""
    return [
        name
        for name, module in model.named_modules()
        if hasattr(module, "base_layer") and hasattr(module, "active_adapters")
    ]


def describe(model: torch.nn.Module) -> dict[str, Any] | None:
    """What a checkpoint records of ``model``'s adapter and a resume must find again (JSON), or ``None`` without one:
    ``method``, ``r``, ``lora_alpha``, ``targets`` (the adapted modules), ``modules_to_save``, ``quantization``
    (``"4bit"``, ``"8bit"`` or ``None``) and ``base`` (``class``, ``name_or_path``, ``sha256`` of the frozen base)."""
    if not has_adapter(model):
        return None
    config = adapter_config(model)
    peft_type = getattr(config, "peft_type", None)
    quantization = "4bit" if getattr(model, "is_loaded_in_4bit", False) else None
    quantization = "8bit" if getattr(model, "is_loaded_in_8bit", False) else quantization
    modules_to_save = getattr(config, "modules_to_save", None)
    return {
        "method": str(getattr(peft_type, "value", peft_type)).lower(),
        "r": getattr(config, "r", None),
        "lora_alpha": getattr(config, "lora_alpha", None),
        "targets": adapted_modules(model),
        "modules_to_save": sorted(modules_to_save) if modules_to_save else None,
        "quantization": quantization,
        "base": {
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "name_or_path": getattr(model, "name_or_path", None) or None,
            "sha256": _base_sha256(model),
        },
    }


def resume_problems(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> list[str]:
    """What differs between the adapter a checkpoint recorded (`describe`) and the run's, one phrase each."""
    if saved is None and current is None:
        return []
    if saved is None:
        return ["this run's model carries an adapter and the checkpoint's did not (it holds a full model's weights)"]
    if current is None:
        return ["the checkpoint holds an adapter and this run's model carries none (enable the same peft plugin)"]
    problems = []
    saved_base, base = saved.get("base") or {}, current.get("base") or {}
    if saved_base.get("class") != base.get("class"):
        problems.append(f"another base model class: saved {saved_base.get('class')}, now {base.get('class')}")
    elif saved_base.get("sha256") != base.get("sha256"):
        problems.append(
            f"another base model ({base.get('class')}): its frozen weights differ (SHA-256 saved "
            f"{str(saved_base.get('sha256'))[:12]}..., now {str(base.get('sha256'))[:12]}...; name_or_path saved "
            f"{saved_base.get('name_or_path')!r}, now {base.get('name_or_path')!r})"
        )
    for key, what in (("method", "method"), ("r", "rank r"), ("lora_alpha", "lora_alpha")):
        if saved.get(key) != current.get(key):
            problems.append(f"another adapter {what}: saved {saved.get(key)!r}, now {current.get(key)!r}")
    if saved.get("targets") != current.get("targets"):
        only_saved = [t for t in saved.get("targets") or [] if t not in (current.get("targets") or [])]
        only_now = [t for t in current.get("targets") or [] if t not in (saved.get("targets") or [])]
        problems.append(
            "another set of target modules: "
            + "; ".join(
                f"{what} {names[:4]}{' ...' if len(names) > 4 else ''}"
                for what, names in (("only in the checkpoint:", only_saved), ("only in this run:", only_now))
                if names
            )
        )
    if saved.get("modules_to_save") != current.get("modules_to_save"):
        problems.append(
            f"other modules_to_save: saved {saved.get('modules_to_save')}, now {current.get('modules_to_save')}"
        )
    if saved.get("quantization") != current.get("quantization"):
        problems.append(
            f"another base quantization: saved {saved.get('quantization')}, now {current.get('quantization')}"
        )
    return problems


_MODULE_PREFIXES = ("module.", "_orig_mod.")


def _plain_name(key: str) -> str:
    for prefix in _MODULE_PREFIXES:
        key = key.removeprefix(prefix)
    return key


def saved_names(model: torch.nn.Module) -> set[str]:
    """What the checkpoint of an adapted model holds: its trainable parameters and its persistent buffers (running
    statistics change in training even in a frozen base), as ``state_dict`` names them."""
    buffers = {name for name, _ in model.named_buffers()}
    return {name for name, p in model.named_parameters() if p.requires_grad} | (buffers & set(model.state_dict()))


class TrainableOnly:
    """While active (``with``), Accelerate's ``save_state`` writes of an adapted model only its trainable parameters
    (the adapter, and ``modules_to_save``) and persistent buffers (`saved_names`), and ``load_state`` loads them
    back, leaving the frozen base as the run built it; models without an adapter are saved and loaded in full. Uses
    Accelerate's state pre-hooks."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self._handles: list[Any] = []

    def __enter__(self) -> TrainableOnly:
        self._handles = [
            self.accelerator.register_save_state_pre_hook(self._save),
            self.accelerator.register_load_state_pre_hook(self._load),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _save(self, models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        for i, model in enumerate(models):
            unwrapped = self.accelerator.unwrap_model(model)
            if i < len(weights) and has_adapter(unwrapped):
                keep = saved_names(unwrapped)
                weights[i] = {k: v for k, v in weights[i].items() if _plain_name(k) in keep}

    def _load(self, models: list[Any], input_dir: str) -> None:
        from safetensors.torch import load_file

        from torchloom.errors import CheckpointError

        for i, model in enumerate(list(models)):
            unwrapped = self.accelerator.unwrap_model(model)
            if not has_adapter(unwrapped):
                continue
            path = Path(input_dir) / ("model.safetensors" if i == 0 else f"model_{i}.safetensors")
            device = next((p.device for p in unwrapped.parameters() if p.requires_grad), torch.device("cpu"))
            state = {_plain_name(k): v for k, v in load_file(path, device=str(device)).items()}
            expected = saved_names(unwrapped)
            if set(state) != expected:
                only_saved, only_model = sorted(set(state) - expected), sorted(expected - set(state))
                raise CheckpointError(
                    f"cannot resume from checkpoint: its adapter weights ({path.name}) do not match this run's "
                    f"trainable parameters and buffers: only in the checkpoint {only_saved[:4]}, only in this run "
                    f"{only_model[:4]}"
                )
            unwrapped.load_state_dict(state, strict=False)
            models.remove(model)  # Accelerate loads the others in full
