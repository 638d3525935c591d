"""The exported model's card, and loading trained weights (a checkpoint's or an exported model's) for ``predict``.

The card is ``<run_dir>/model/torchloom_model.json``, written by `finish_fit` next to what `TaskModule.save_model`
saved: the run's resolved config, its plugins and settings, the final logged values, the step and epoch, the model's
class and parameter counts, and the versions of the libraries that trained it. Its name is one no loader of the
directory reads (transformers' ``from_pretrained`` reads ``config.json`` and the weights, `TaskModule.load_model`
only the weights), so the directory loads as before.

Weights are read from safetensors files only (their header is JSON; their data is tensors), never through pickle.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from torchloom import _strict_json
from torchloom._layout import MODEL_DIR, is_run_dir
from torchloom.checkpoint import MANIFEST, list_checkpoints, read_manifest, verify_files
from torchloom.errors import CheckpointError, ConfigError

__all__ = [
    "MODEL_CARD",
    "check_weight_files",
    "header_entries",
    "load_weights",
    "model_card",
    "parameter_counts",
    "resolve_weights",
    "safetensors_summary",
    "weight_files",
]

#: The model card's file name, in the exported model's directory.
MODEL_CARD = "torchloom_model.json"
CARD_FORMAT, CARD_VERSION = "torchloom.model_card", 1
#: The libraries whose versions the card records (those installed).
LIBRARIES = ("torch", "accelerate", "transformers", "safetensors", "huggingface_hub", "datasets", "torchmetrics")
WEIGHTS_INDEX = "model.safetensors.index.json"
#: Bytes per element of each safetensors dtype, and its torch name.
_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "C64": ("complex64", 8),
}


# ------------------------------------------------------------------------------------------------ the card


def parameter_counts(model: torch.nn.Module) -> dict[str, Any]:
    """``total`` and ``trainable`` parameters (a parameter shared by several modules counted once), and the
    parameters per dtype."""
    params = list(model.parameters())  # each shared Parameter once
    dtypes: dict[str, int] = {}
    for p in params:
        name = str(p.dtype).removeprefix("torch.")
        dtypes[name] = dtypes.get(name, 0) + p.numel()
    return {
        "total": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "dtypes": dtypes,
    }


def model_card(
    model: torch.nn.Module,
    run_config: Mapping[str, Any] | None,
    metrics: Mapping[str, float],
    global_step: int | None,
    epoch: int | None,
) -> dict[str, Any]:
    """The model card of a fit's exported model (see the module docstring); strict JSON (a non-finite value is
    the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, as in ``metrics.jsonl``)."""
    from torchloom import __version__

    counts = parameter_counts(model)
    libraries = {"torchloom": __version__}
    for name in LIBRARIES:
        try:
            libraries[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    card = {
        "format": CARD_FORMAT,
        "version": CARD_VERSION,
        "model": {
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "parameters": counts["total"],
            "trainable_parameters": counts["trainable"],
            "parameter_dtypes": counts["dtypes"],
        },
        "global_step": global_step,
        "epoch": epoch,
        "metrics": dict(metrics),
        "plugins": (run_config or {}).get("plugins"),
        "config": run_config,
        "libraries": libraries,
    }
    return _strict_json.encode(card)


# ------------------------------------------------------------------------------------------- weight files


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a saved model: the shards its ``model.safetensors.index.json`` lists, else every
    ``*.safetensors`` file in it (sorted).

    Raises:
        ConfigError: an index that cannot be read.
    """
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"cannot read {str(index)!r}: {exc}") from None
        return [directory / shard for shard in shards]
    return sorted(directory.glob("*.safetensors"))


def safetensors_summary(files: Iterable[Path], root: Path) -> dict[str, Any]:
    """What the headers of safetensors files say: tensors, elements and bytes, in all and per dtype.

    Only each file's header (8 bytes of length, then JSON) is read: no tensor data, nothing that can run code.
    A tensor that several names share is stored, and so counted, once.

    Raises:
        ConfigError: a file that is missing, truncated, or not safetensors.
    """
    summary: dict[str, Any] = {"files": [], "tensors": 0, "elements": 0, "bytes": 0, "dtypes": {}}
    for file in files:
        for code, shape, nbytes in header_entries(file):
            name = _DTYPES.get(code, (code.lower(), 0))[0]
            elements = math.prod(shape)
            row = summary["dtypes"].setdefault(name, {"tensors": 0, "elements": 0, "bytes": 0})
            for entry in (summary, row):
                entry["tensors"] += 1
                entry["elements"] += elements
                entry["bytes"] += nbytes
        summary["files"].append(file.relative_to(root).as_posix() if file.is_relative_to(root) else str(file))
    return summary


#: What a safetensors file is, for the messages about a file that is not one.
SAFETENSORS_LAYOUT = "a safetensors file is an 8-byte header length, a JSON header ({...}), then the tensor data"


def header_entries(file: Path) -> list[tuple[str, list[int], int]]:
    """``(dtype code, shape, bytes)`` of every tensor in a safetensors file, from its header only.

    The file's form is checked in the order it is laid out: the 8-byte header length, a JSON header after it (a
    file that is no safetensors at all, such as a text or a pickle, fails here, whatever its first 8 bytes say
    as a length), the header's length against the file's, the header's entries, and where the tensors end.

    Raises:
        ConfigError: a file that is missing, unreadable, not safetensors, with a damaged header, or truncated;
            one line naming the file and what is wrong.
    """
    shown = str(file)
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(9)
            if len(head) < 9:
                raise ConfigError(
                    f"{shown!r} is not a safetensors file: it holds {size} bytes, too few for a header "
                    f"({SAFETENSORS_LAYOUT})"
                )
            if head[8:9] != b"{":
                start = head + f.read(7)
                raise ConfigError(
                    f"{shown!r} is not a safetensors file: it starts with {start!r}, not with a header length and a "
                    f"JSON header ({SAFETENSORS_LAYOUT})"
                )
            (length,) = struct.unpack("<Q", head[:8])
            if length > size - 8:
                raise ConfigError(
                    f"{shown!r} is truncated or its header is damaged: the header length says {length} bytes, but "
                    f"the file holds {size - 8} after it"
                )
            text = head[8:] + f.read(length - 1) if length else b""
    except FileNotFoundError:
        raise ConfigError(f"weights file {shown!r} is missing") from None
    except OSError as exc:
        raise ConfigError(f"weights file {shown!r} cannot be read: {exc.strerror or exc}") from None
    try:
        header = json.loads(text)
    except ValueError as exc:
        problem = f"{exc.msg} at byte {8 + exc.pos}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise ConfigError(
            f"{shown!r} has a damaged safetensors header: its {length}-byte JSON header does not parse ({problem})"
        ) from None
    if not isinstance(header, dict):
        raise ConfigError(f"{shown!r} has a damaged safetensors header: it holds {header!r:.60}, not a JSON object")
    entries, end = [], 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, stop = (int(n) for n in entry["data_offsets"])
            entries.append((str(entry["dtype"]), [int(n) for n in entry["shape"]], stop - begin))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"{shown!r} has a damaged safetensors header: tensor {key!r} is {entry!r:.80}; expected "
                '{"dtype": ..., "shape": [...], "data_offsets": [start, end]}'
            ) from None
        end = max(end, stop)
    if 8 + length + end > size:
        raise ConfigError(f"{shown!r} is truncated: its tensors end at byte {8 + length + end}, the file at {size}")
    return entries


def check_weight_files(path: Path) -> None:
    """Read the header of every weight file of an exported model (a directory, or one ``.safetensors`` file),
    so that a damaged file is reported as such before a loader reads it (`header_entries`).

    Raises:
        ConfigError: see `header_entries`; an index that cannot be read.
    """
    for file in weight_files(path) if path.is_dir() else [path]:
        header_entries(file)


# ------------------------------------------------------------------------------------------ loading weights


def is_exported_model(path: Path) -> bool:
    """Whether ``path`` is what `TaskModule.save_model` (or ``save_pretrained``) writes, or one safetensors file."""
    if path.is_file():
        return path.suffix == ".safetensors"
    return (path / "model.safetensors").is_file() or (path / WEIGHTS_INDEX).is_file()


#: What ``predict``'s ``ckpt_path`` may name, for its messages.
PREDICT_WEIGHTS = (
    "a checkpoint (a directory with manifest.json), an exported model (a directory with model.safetensors or "
    "model.safetensors.index.json, or one .safetensors file), a run directory (version_N, with model/ or "
    "checkpoints/) or an output_dir whose runs have a checkpoint"
)


def resolve_weights(path: str | os.PathLike[str]) -> tuple[str, str]:
    """Resolve ``predict``'s ``ckpt_path`` to ``("checkpoint" | "model", path)``.

    - a checkpoint directory (with ``manifest.json``): itself, its files checked against the manifest;
    - an exported model (``model.safetensors`` or ``model.safetensors.index.json``), or a ``.safetensors`` file:
      itself, the header of each weight file checked (`header_entries`);
    - a run directory: its ``model/`` when the fit saved one (the final weights), else its latest checkpoint;
    - otherwise (an ``output_dir``): the latest checkpoint of its latest run that has one.

    Raises:
        ConfigError: ``path`` does not exist; an exported model whose weight files are not safetensors, damaged
            or truncated.
        CheckpointError: no weights there; an incomplete checkpoint or one whose files changed since it was saved.
        Each message begins with ``predict: ckpt_path`` and says what the path may name (`PREDICT_WEIGHTS`).
    """
    root, shown = Path(path), os.fspath(path)
    if not root.exists():
        raise ConfigError(f"predict: ckpt_path {shown!r}: no such file or directory; expected {PREDICT_WEIGHTS}")
    for model in (root, root / MODEL_DIR) if is_run_dir(root) else (root,):
        if is_exported_model(model) and not (root / MANIFEST).is_file():
            try:
                check_weight_files(model)
            except ConfigError as exc:
                raise ConfigError(f"predict: ckpt_path {shown!r}: {exc}") from None
            return "model", str(model)
    if (root / MANIFEST).is_file():
        checkpoint = root
    elif is_run_dir(root):
        found = list_checkpoints(root)
        if not found:
            raise CheckpointError(
                f"predict: ckpt_path {shown!r}: the run directory holds neither a saved model (model/, written with "
                "save_model: true) nor a complete checkpoint (checkpoints/, written by the 'checkpoint' plugin)"
            )
        checkpoint = Path(found[-1])
    else:
        found = list_checkpoints(root) if root.is_dir() else []
        if not found:
            kind = "a directory" if root.is_dir() else "a file"
            raise CheckpointError(
                f"predict: ckpt_path {shown!r} is {kind} that holds no weights predict reads; expected "
                f"{PREDICT_WEIGHTS}"
            )
        checkpoint = Path(found[-1])
    manifest = read_manifest(checkpoint)
    verify_files(checkpoint, manifest)  # nothing planted or changed since the checkpoint was written
    return "checkpoint", str(checkpoint)


def load_weights(model: torch.nn.Module, kind: str, path: str) -> None:
    """Load what `resolve_weights` found into ``model`` (unwrapped), in place.

    A checkpoint's weights are ``accelerate/model.safetensors`` (the first model Accelerate saved); a ``module.``
    prefix (DDP) or ``_orig_mod.`` prefix (``torch.compile``) on every key is removed first. Tied weights, stored
    once, are loaded through the name the file keeps. An exported model is loaded with `TaskModule.load_model`.

    Raises:
        CheckpointError: the checkpoint holds no single-file weights (FSDP / DeepSpeed shards), or they do not fit
            ``model`` (missing, unexpected or differently shaped keys).
        ConfigError: an exported model that does not fit ``model``.
    """
    if kind == "model":
        from torchloom.module import TaskModule

        TaskModule.load_model(model, path)
        return
    file = Path(path) / "accelerate" / "model.safetensors"
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {path!r} holds no accelerate/model.safetensors (the weights of a sharded FSDP or DeepSpeed "
            "fit are not one file); predict loads single-file weights only"
        )
    from safetensors.torch import load_file

    state = load_file(str(file))
    expected = model.state_dict()
    for prefix in ("module.", "_orig_mod."):
        if state and all(k.startswith(prefix) for k in state) and not any(k.startswith(prefix) for k in expected):
            state = {k.removeprefix(prefix): v for k, v in state.items()}
    where = f"the weights of checkpoint {path!r}"
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # size mismatch
        raise CheckpointError(f"{where} do not fit {type(model).__name__}: {' '.join(str(exc).split())}") from None
    loaded = expected.keys() - set(missing)
    missing = [k for k in missing if not any(expected[k].is_set_to(expected[other]) for other in loaded)]
    if missing or unexpected:
        found = "; ".join(
            f"{kind} keys {sorted(keys)}" for kind, keys in (("missing", missing), ("unexpected", unexpected)) if keys
        )
        raise CheckpointError(f"{where} do not fit {type(model).__name__}: {found}")
