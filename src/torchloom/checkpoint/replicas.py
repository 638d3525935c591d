"""Each process's own parameters, optimizer state and loss scaler in a checkpoint, for runs whose processes' copies
of them differ (LocalSGD and DiLoCo between two averages).

Accelerate's ``save_state`` writes the main process's model and optimizer, and every process loads those: exact for
DDP, whose copies are equal after every step, but not for a plugin that lets the processes train apart for a while.
A plugin says so with the class attribute ``divergent_replicas = True`` (`torchloom.Plugin`); the checkpoint then
also writes, from every process, ``engine/process_<rank>/replica.json`` / ``.safetensors`` (`replica_state`: the
trainable parameters by name, the optimizer's per-parameter state, the loss scaler's state), which the manifest
lists and checks like every file, and each process loads its own after Accelerate's files (`load_replica`). A
checkpoint of one process needs none: its one copy is Accelerate's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from torchloom.errors import CheckpointError

__all__ = ["REPLICA", "divergent", "load_replica", "replica_state"]

#: The state's name in ``engine/process_<rank>/`` (`torchloom.checkpoint.plugin_state`'s two files: ``replica.json``,
# ``.safetensors``).
REPLICA = "replica"
#: The plugin class attribute that asks for it.
DIVERGENT_ATTR = "divergent_replicas"


def divergent(plugins: Iterable[Any]) -> bool:
    """Whether a plugin of the run lets the processes' parameters and optimizer states differ at a checkpoint."""
    return any(getattr(plugin, DIVERGENT_ATTR, False) is True for plugin in plugins)


def replica_state(accelerator: Any, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """This process's copy, in `torchloom.checkpoint.plugin_state`'s format: ``parameters`` (the trainable ones by name:
    what an adapter run's checkpoint holds too), ``optimizer`` (the optimizer's ``state``, by the parameter's index as a
    string; its ``param_groups`` are the same on every process and come from Accelerate's file) and ``scaler`` (the
    fp16 loss scaler's state, or ``None``)."""
    unwrapped = accelerator.unwrap_model(model)
    parameters = {name: p.detach() for name, p in unwrapped.named_parameters() if p.requires_grad}
    inner = getattr(optimizer, "optimizer", optimizer)
    state = {str(index): dict(values) for index, values in inner.state_dict()["state"].items()}
    scaler = accelerator.scaler.state_dict() if accelerator.scaler is not None else None
    return {"parameters": parameters, "optimizer": state, "scaler": scaler}


def load_replica(
    saved: Mapping[str, Any], accelerator: Any, model: torch.nn.Module, optimizer: Any, *, load_optimizer: bool
) -> None:
    """Put what `replica_state` saved into this process's model, optimizer (unless ``load_optimizer`` is false:
    ``reset_optimizer``) and scaler, after Accelerate's ``load_state`` put the main process's there.

    Raises:
        CheckpointError: the saved parameters are not this model's (names or shapes).
    """
    unwrapped = accelerator.unwrap_model(model)
    current = {name: p for name, p in unwrapped.named_parameters() if p.requires_grad}
    parameters = saved.get("parameters") or {}
    if parameters.keys() != current.keys() or any(parameters[n].shape != p.shape for n, p in current.items()):
        raise CheckpointError(
            f"checkpoint: engine/process_{accelerator.process_index}/{REPLICA}.safetensors holds other parameters "
            "than this model's trainable ones; refused"
        )
    with torch.no_grad():
        for name, param in current.items():
            param.copy_(parameters[name])
    if load_optimizer:
        state_dict = optimizer.state_dict()
        state_dict["state"] = {int(index): values for index, values in (saved.get("optimizer") or {}).items()}
        optimizer.load_state_dict(state_dict)  # Accelerate's optimizer moves the state to the parameters' devices
    if accelerator.scaler is not None and saved.get("scaler"):
        accelerator.scaler.load_state_dict(saved["scaler"])
