"""The layouts a checkpoint's model and optimizer take under ``accelerate/``, and loading one into a run of another
layout through ``torch.distributed.checkpoint`` (DCP): an FSDP2 checkpoint on another number of processes or
without FSDP, a DDP / one-process checkpoint into an FSDP2 run.

Accelerate's ``save_state`` writes, by the run's layout (`run_layout`; `saved_layout` reads a checkpoint's):

- ``"whole"`` (one process, DDP): ``model.safetensors`` (the unwrapped model's ``state_dict()``) and
  ``optimizer.bin`` (``optimizer.state_dict()``: parameters numbered in the order of the optimizer's groups);
- ``"fsdp_sharded"`` (FSDP2, ``SHARDED_STATE_DICT``): DCP folders ``pytorch_model_fsdp_0/`` (``{"model":
  get_model_state_dict(model)}``) and ``optimizer_0/`` (``{"optimizer": get_optimizer_state_dict(model,
  optimizer)}``), every tensor stored by its fully-qualified name (FQN) and its global shape, each process writing
  its shards;
- ``"fsdp_full"`` (FSDP2, ``FULL_STATE_DICT``): the same two states gathered, whole, by the main process, in
  ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` (``torch.save``; read with ``weights_only=True``).

Where the checkpoint's layout is the run's, Accelerate's ``load_state`` reads it (on the same processes a
resume is bitwise; FSDP2 shards on another number of FSDP2 processes are re-sharded by the same ``dcp.load`` in
Accelerate's ``load_fsdp_model`` / ``load_fsdp_optimizer``). Otherwise
`load_across_layouts` loads it without Accelerate, with DCP's own re-sharding and never a layer of torchloom's: the
run's state dicts as DCP returns them (``get_model_state_dict`` / ``get_optimizer_state_dict``: DTensor shards under
FSDP2, whole tensors otherwise, keyed by FQN whatever the processes) are filled by ``dcp.load`` from DCP folders,
or set from whole files with ``set_model_state_dict`` / ``set_optimizer_state_dict`` and
``StateDictOptions(full_state_dict=True)`` (each process reads the whole file; DCP keeps each process's shard).
`full_model_state` reads a checkpoint's whole model on one process, for ``torchloom export`` (also a DeepSpeed
ZeRO-1/2 checkpoint's, ``pytorch_model/mp_rank_00_model_states.pt``).

The values loaded are the saved ones, exactly; what differs afterwards from an uninterrupted run is the order in
which the new processes reduce gradients (see ``docs/plugins/checkpoint.md``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchloom.errors import CheckpointError

__all__ = ["full_model_state", "load_across_layouts", "run_layout", "saved_layout"]

#: The files and folders of each layout under ``accelerate/`` (model, optimizer).
LAYOUT_FILES = {
    "whole": ("model.safetensors", "optimizer.bin"),
    "fsdp_sharded": ("pytorch_model_fsdp_0", "optimizer_0"),
    "fsdp_full": ("pytorch_model_fsdp.bin", "optimizer.bin"),
}
#: The model file of a DeepSpeed checkpoint under ``accelerate/`` (`full_model_state` reads it; DeepSpeed's own
#: ``load_checkpoint`` resumes it, on the same number of processes only).
DEEPSPEED_MODEL_FILE = "pytorch_model/mp_rank_00_model_states.pt"
#: What each layout is, for messages.
LAYOUT_NAMES = {
    "whole": "whole-model files (one process or DDP)",
    "fsdp_sharded": "FSDP2 shards (SHARDED_STATE_DICT)",
    "fsdp_full": "FSDP2 whole-state files (FULL_STATE_DICT)",
}


def saved_layout(files: Mapping[str, Any] | Path) -> str | None:
    """The layout of a checkpoint's model: from its manifest's ``files`` (names relative to the checkpoint) or from
    its ``accelerate/`` folder (a `Path`); ``None`` for any other (DeepSpeed's, FSDP1's per-rank files)."""
    if isinstance(files, Path):
        names = {f"accelerate/{p.relative_to(files).as_posix()}" for p in files.rglob("*")} if files.is_dir() else set()
    else:
        names = set(files)
    if "accelerate/model.safetensors" in names:
        return "whole"
    if "accelerate/pytorch_model_fsdp_0/.metadata" in names:
        return "fsdp_sharded"
    if "accelerate/pytorch_model_fsdp.bin" in names:
        return "fsdp_full"
    return None


def run_layout(accelerator: Any) -> str | None:
    """The layout Accelerate's ``save_state`` writes for this run (``accelerator``), ``None`` for one torchloom does
    not re-shard (DeepSpeed, FSDP1)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return None
    if accelerator.distributed_type != DistributedType.FSDP:
        return "whole"
    plugin = accelerator.state.fsdp_plugin
    if getattr(plugin, "fsdp_version", 1) != 2:
        return None
    return "fsdp_full" if "FULL" in str(plugin.state_dict_type) else "fsdp_sharded"


def load_across_layouts(
    directory: Path, layout: str, *, accelerator: Any, model: torch.nn.Module, optimizer: Any, load_optimizer: bool
) -> None:
    """Load the model (and with ``load_optimizer`` the optimizer) of the ``accelerate/`` folder ``directory``, saved
    in ``layout`` (`saved_layout`), into this prepared run (every process, at the same point: DCP's collectives).

    Args:
        directory (`Path`): the checkpoint's ``accelerate/`` folder.
        layout (`str`): ``"whole"``, ``"fsdp_sharded"`` or ``"fsdp_full"``.
        accelerator (`accelerate.Accelerator`), model (`torch.nn.Module`: the prepared model, DDP / FSDP2 / plain),
            optimizer (the prepared optimizer, or the torch optimizer it wraps): the run's.
        load_optimizer (`bool`): also the optimizer's state (``False``: it keeps its fresh state).

    Raises:
        CheckpointError: a saved tensor is missing or of another shape than the run's (naming it), or the saved
            optimizer's parameter groups do not match the run's.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    inner = getattr(optimizer, "optimizer", optimizer)
    model_file, optimizer_file = (directory / name for name in LAYOUT_FILES[layout])
    root = str(directory.parent)
    try:
        if layout == "fsdp_sharded":
            model_state = get_model_state_dict(model)  # the run's layout: DTensor shards or whole tensors, by FQN
            with warnings.catch_warnings():  # on one process DCP warns that it reads without a process group
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                dcp.load({"model": model_state}, storage_reader=dcp.FileSystemReader(str(model_file)))
                set_model_state_dict(model, model_state)
                if load_optimizer:
                    optimizer_state = get_optimizer_state_dict(model, inner)
                    reader = dcp.FileSystemReader(str(optimizer_file))
                    dcp.load({"optimizer": optimizer_state}, storage_reader=reader)
                    set_optimizer_state_dict(model, inner, optimizer_state)
        else:
            whole = StateDictOptions(full_state_dict=True)
            unwrapped = accelerator.unwrap_model(model)
            whole_model: dict[str, Any] = _with_tied(_read_whole(model_file), unwrapped)
            set_model_state_dict(model, whole_model, options=whole)
            if load_optimizer:
                saved = torch.load(optimizer_file, map_location="cpu", weights_only=True)
                if layout == "whole":  # numbered parameters: named by the run's groups
                    saved = _named_optimizer_state(saved, inner, unwrapped, root)
                set_optimizer_state_dict(model, inner, saved, options=whole)
    except CheckpointError:
        raise
    except (RuntimeError, KeyError, ValueError) as exc:
        detail = " ".join(str(exc).split())[:600]
        raise CheckpointError(
            f"checkpoint {root!r}: its model and optimizer ({LAYOUT_NAMES[layout]}) cannot be loaded into this run "
            f"({LAYOUT_NAMES.get(str(run_layout(accelerator)), 'another layout')}): {type(exc).__name__}: {detail}"
        ) from None


def full_model_state(directory: Path) -> dict[str, torch.Tensor]:
    """The whole model state of a checkpoint's ``accelerate/`` folder ``directory``, on one process: ``{FQN: tensor}``
    (CPU tensors, the saved dtypes and global shapes); DCP shards are read whole with ``dcp.load`` into tensors of
    the shapes the folder's metadata records (no process group).

    Raises:
        CheckpointError: the folder holds no model of a layout torchloom reads.
    """
    layout = saved_layout(directory)
    if layout is None and (directory / DEEPSPEED_MODEL_FILE).is_file():
        return _deepspeed_model_state(directory / DEEPSPEED_MODEL_FILE)
    if layout is None:
        raise CheckpointError(
            f"checkpoint {str(directory.parent)!r} holds no model files torchloom reads under accelerate/ (expected "
            "model.safetensors, an FSDP2 checkpoint's pytorch_model_fsdp_0/ or pytorch_model_fsdp.bin, or a DeepSpeed "
            f"ZeRO-1/2 checkpoint's {DEEPSPEED_MODEL_FILE})"
        )
    model_file = directory / LAYOUT_FILES[layout][0]
    if layout != "fsdp_sharded":
        return _read_whole(model_file)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(model_file)).read_metadata()
    prefix = "model."  # Accelerate saves {"model": state}: DCP stores its tensors as "model.<FQN>"
    model = {
        key.removeprefix(prefix): torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    if not model:
        raise CheckpointError(f"checkpoint {str(directory.parent)!r}: {model_file.name}/ holds no 'model' state")
    with warnings.catch_warnings():  # DCP warns that it reads in one process, which it does here by design
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({"model": model}, storage_reader=dcp.FileSystemReader(str(model_file)))
    return model


def _deepspeed_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The model of a DeepSpeed checkpoint (Accelerate's ``save_state`` under DeepSpeed: ``engine.save_checkpoint``
    into ``pytorch_model/``): under ZeRO-1 and ZeRO-2 every process holds all the parameters, and the main process's
    ``mp_rank_00_model_states.pt`` has them whole in its ``module`` (the training dtype: float32 when the run had no
    mixed precision). Read with ``weights_only=True`` (its other entries are DeepSpeed's plain bookkeeping).

    Raises:
        CheckpointError: a ZeRO-3 checkpoint (its ``module`` holds placeholders: its parameters are partitioned in
            the optimizer files; DeepSpeed's ``zero_to_fp32.py`` in the folder gathers them).
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    stage = int(((state.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0))
    if stage >= 3:
        raise CheckpointError(
            f"checkpoint {str(path.parents[2])!r}: a DeepSpeed ZeRO-3 checkpoint, whose parameters are partitioned "
            "over its processes' files; torchloom reads ZeRO-1 and ZeRO-2 checkpoints only (DeepSpeed's "
            "zero_to_fp32.py in its accelerate/ folder gathers a ZeRO-3 one)"
        )
    return dict(state["module"])


def _read_whole(path: Path) -> dict[str, torch.Tensor]:
    """A whole model file: safetensors, or a ``torch.save`` of tensors (``weights_only=True``)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    return dict(state)


def _with_tied(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state`` with the names a file stores once (tied weights) under each of their names in ``model``."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    state = dict(state)
    for aliases in names.values():
        present = [n for n in aliases if n in state]
        for name in aliases if present else ():
            state.setdefault(name, state[present[0]])
    return state


def _named_optimizer_state(
    saved: Mapping[str, Any], optimizer: Any, model: torch.nn.Module, root: str
) -> dict[str, Any]:
    """A torch ``optimizer.state_dict()`` (parameters numbered in the order of its groups) keyed by the run's FQNs:
    saved parameter ``k`` of group ``g`` is the run's ``k``-th parameter of group ``g`` (the same model and optimizer
    built by the same code; the manifest's names and group sizes are checked before this)."""
    fqn = {id(p): name for name, p in model.named_parameters()}
    groups = saved["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(
            f"checkpoint {root!r}: its optimizer's parameter groups hold {[len(g['params']) for g in groups]} "
            f"parameters, this run's {[len(g['params']) for g in optimizer.param_groups]}"
        )
    names: dict[Any, str] = {}
    for saved_group, group in zip(groups, optimizer.param_groups, strict=True):
        for index, param in zip(saved_group["params"], group["params"], strict=True):
            names[index] = fqn[id(param)]
    return {
        "state": {names[index]: value for index, value in saved["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups],
    }
