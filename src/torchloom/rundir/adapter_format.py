"""Adapters (LoRA and the other ``peft`` tuners) injected in place into a model: peft's own folder format.

A model into which ``peft.inject_adapter_in_model`` injected an adapter (the ``peft`` plugin does, in
``configure_model``) carries ``peft_config`` (``{adapter name: PeftConfig}``). `TaskModule.save_model` then writes
what ``PeftModel.save_pretrained`` writes, and nothing of the frozen base:

- ``adapter_config.json``: the adapter's `peft.PeftConfig` (``PeftConfig.save_pretrained``);
- ``adapter_model.safetensors``: the adapter's weights (``peft.get_peft_model_state_dict``: the adapter name
  removed from the keys), each key prefixed with ``base_model.model.`` as a `peft.PeftModel` names them.

``PeftModel.from_pretrained(base, folder)`` loads it onto the base with plain ``peft``; `load_adapter` loads it back
into a model here (``predict`` from an adapter folder). ``peft`` is imported only when an adapter is saved or loaded.

Checkpoints of an adapted model hold its trainable parameters and persistent buffers only (`saved_names`):
`TrainableOnly` filters Accelerate's ``save_state`` / ``load_state``; a model sharded by FSDP is written and loaded
by `save_sharded_trainable` / `load_sharded_trainable` (the adapter gathered into one file, the optimizer's shards),
and its base's hash is taken before it is sharded (`remember_base`).
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
    "base_class",
    "gather_trainable",
    "has_adapter",
    "is_adapter_dir",
    "load_adapter",
    "load_sharded_trainable",
    "remember_base",
    "save_adapter",
    "save_sharded_trainable",
    "sharded_adapter",
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
    4-bit base's packed bytes and quantisation state included). Computed once per model object: the base is frozen.

    Raises:
        RuntimeError: ``model`` is sharded (FSDP2: its values are DTensors) and `remember_base` did not take the
            hash before it was sharded (reading the whole values now would be a collective that only the main
            process reaches).
    """
    cached = model.__dict__.get("_torchloom_base_sha256")
    if cached is not None:
        return str(cached)
    import hashlib

    from torchloom.parallel.dtensors import is_dtensor

    trainable = saved_names(model)
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        if name in trainable or not isinstance(value, torch.Tensor):
            continue
        if is_dtensor(value):
            raise RuntimeError(
                f"the SHA-256 of the frozen base of {type(model).__name__} is taken before the model is sharded "
                f"(torchloom.rundir.adapter_format.remember_base); {name!r} is a shard (DTensor) already"
            )
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    model.__dict__["_torchloom_base_sha256"] = value = digest.hexdigest()
    return value


def remember_base(model: torch.nn.Module) -> None:
    """Take the frozen base's SHA-256 (`describe`'s ``base.sha256``) now, on the whole unsharded model: before
    ``accelerator.prepare`` shards it (FSDP2), after which each process holds only its shards. Called on every
    process alike (no collective); a model without an adapter is left alone. The hash is the one a DDP or one-process
    run of the same base records, so their checkpoints name the same base."""
    if has_adapter(model):
        _base_sha256(model)


def base_class(model: torch.nn.Module) -> type:
    """The class the task built ``model`` as: FSDP2's ``fully_shard`` gives a sharded module a class of its own
    (``FSDP<Name>``, a subclass of ``FSDPModule`` and of the original); this is the original, for anything else
    ``type(model)``."""
    import sys

    fsdp = sys.modules.get("torch.distributed.fsdp")
    sharded = getattr(fsdp, "FSDPModule", None)
    if sharded is None or not isinstance(model, sharded):
        return type(model)
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, sharded))


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
            "class": f"{base_class(model).__module__}.{base_class(model).__qualname__}",
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

        for i, model in enumerate(list(models)):
            unwrapped = self.accelerator.unwrap_model(model)
            if not has_adapter(unwrapped):
                continue
            path = Path(input_dir) / ("model.safetensors" if i == 0 else f"model_{i}.safetensors")
            device = next((p.device for p in unwrapped.parameters() if p.requires_grad), torch.device("cpu"))
            state = {_plain_name(k): v for k, v in load_file(path, device=str(device)).items()}
            _check_saved_names(state, unwrapped, path.name)
            unwrapped.load_state_dict(state, strict=False)
            models.remove(model)  # Accelerate loads the others in full


def _check_saved_names(state: dict[str, Any], model: torch.nn.Module, file: str) -> None:
    """Raises: CheckpointError: ``state``'s keys are not `saved_names` of ``model`` (unwrapped)."""
    from torchloom.errors import CheckpointError

    expected = saved_names(model)
    if set(state) != expected:
        only_saved, only_model = sorted(set(state) - expected), sorted(expected - set(state))
        raise CheckpointError(
            f"cannot resume from checkpoint: its adapter weights ({file}) do not match this run's "
            f"trainable parameters and buffers: only in the checkpoint {only_saved[:4]}, only in this run "
            f"{only_model[:4]}"
        )


# ------------------------------------------------------------------------------- sharded (FSDP) checkpoints

#: The adapter's file in a checkpoint's ``accelerate/`` folder, sharded run or not (Accelerate's name for a model).
MODEL_FILE = "model.safetensors"


def sharded_adapter(accelerator: Any, model: torch.nn.Module) -> bool:
    """Whether ``model`` (as prepared) carries an adapter and the run shards it (Accelerate's distributed type
    ``FSDP``): its checkpoint is then written by `save_sharded_trainable`, not by Accelerate's ``save_state``, which
    would write every shard of the frozen base too."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP and has_adapter(accelerator.unwrap_model(model))


def gather_trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole values of a sharded (FSDP) adapted model's trainable parameters and persistent buffers
    (`saved_names`), on the CPU of the main process; the other processes get ``{}``. A collective: every process
    calls it at the same point. Keys: the unwrapped model's ``state_dict`` names (``...lora_A.default.weight``).

    Uses ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with ``full_state_dict``,
    ``cpu_offload`` and ``ignore_frozen_params``: only the trainable values are gathered, never the frozen base.

    Args:
        model (`torch.nn.Module`): the prepared (sharded) model.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def save_sharded_trainable(accelerator: Any, model: torch.nn.Module, optimizer: Any, directory: Path) -> None:
    """Write the checkpoint files of a sharded adapted model into ``directory`` (``accelerate/``), on every process:
    ``model.safetensors``, the whole adapter and ``modules_to_save`` (`gather_trainable`, written by the main
    process: the file a DDP or one-process run writes, so `torchloom.rundir.export.load_weights` and ``export``
    read it alike), and the optimizer's state as Accelerate's FSDP save writes it (``optimizer_0/``, each
    process's shards through ``torch.distributed.checkpoint``; the optimizer holds state for the trainable
    parameters only). Nothing of the frozen base is written.

    Raises:
        CheckpointError: the run has an fp16 loss scaler (not saved here: refused rather than resumed without it).
    """
    from accelerate.utils import save_fsdp_optimizer
    from safetensors.torch import save_file

    from torchloom.errors import CheckpointError

    if accelerator.scaler is not None:
        raise CheckpointError(
            "cannot save the checkpoint: an adapter under FSDP with fp16 loss scaling (mixed_precision: fp16) is "
            "not supported by torchloom's checkpoints; use bf16"
        )
    directory.mkdir(parents=True, exist_ok=True)
    state = gather_trainable(model)
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items()}, directory / MODEL_FILE, metadata={"format": "pt"})
    save_fsdp_optimizer(accelerator.state.fsdp_plugin, accelerator, optimizer, model, str(directory), 0)


def load_sharded_trainable(
    accelerator: Any, model: torch.nn.Module, optimizer: Any, directory: Path, *, load_optimizer: bool
) -> None:
    """Load what `save_sharded_trainable` wrote, on every process: the adapter's whole values into this process's
    shards (``set_model_state_dict`` with ``full_state_dict``; the frozen base stays as the run built it) and, with
    ``load_optimizer``, the optimizer's shards (Accelerate's ``load_fsdp_optimizer``).

    Raises:
        CheckpointError: ``model.safetensors`` is missing, or its keys are not this run's trainable parameters and
            persistent buffers (another adapter).
    """
    from accelerate.utils import load_fsdp_optimizer
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from torchloom.errors import CheckpointError

    path = directory / MODEL_FILE
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {str(directory.parent)!r} is incomplete: it holds no accelerate/{MODEL_FILE} (the adapter)"
        )
    state: dict[str, Any] = {_plain_name(k): v for k, v in load_file(path).items()}
    _check_saved_names(state, accelerator.unwrap_model(model), path.name)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    if load_optimizer:
        load_fsdp_optimizer(accelerator.state.fsdp_plugin, accelerator, optimizer, model, str(directory), 0)
