"""`inspect_path`: what a checkpoint, a run directory or an exported model holds, read from JSON and headers only.

Nothing is loaded that could run code: the manifest, ``config.yaml`` (safe YAML), ``summary.json``,
``resumed_from.json``, ``metrics.jsonl``, the model card and ``config.json`` are data, and of the weights only the
safetensors headers (their JSON) are read. No pickle (``optimizer.bin``, the random states) is opened, and no file
is hashed: loading a checkpoint (``fit(ckpt_path=...)``, ``predict(ckpt_path=...)``) checks the hashes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

from torchloom import _strict_json
from torchloom.checkpoint.lineage import read_chain, read_records
from torchloom.checkpoint.scan import scan_checkpoints
from torchloom.checkpoint.store import MANIFEST, read_manifest
from torchloom.errors import ConfigError
from torchloom.rundir.adapter_format import is_adapter_dir, read_adapter_config
from torchloom.rundir.export import (
    CARD_FORMAT,
    CARD_VERSION,
    MODEL_CARD,
    is_exported_model,
    safetensors_summary,
    weight_files,
)
from torchloom.rundir.layout import CHECKPOINTS_DIR, MODEL_DIR, SUMMARY_FILE, is_run_dir, run_directories

__all__ = ["inspect_path"]

KINDS = ("checkpoint", "run", "model")


def inspect_path(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Describe a checkpoint directory, a run directory or an exported model (``torchloom inspect``).

    The result has the same keys for every kind, ``None`` where the path does not tell:

    - ``path``, ``kind`` (``"checkpoint"``, ``"run"`` or ``"model"``), ``model_class``;
    - ``parameters``: ``{"total", "trainable"}``, parameters counted once however many modules share them
      (from the manifest or the model card; ``None`` for weights saved without either);
    - ``weights``: from the safetensors headers: ``files``, ``tensors``, ``elements``, ``bytes`` and per
      dtype (``"float32": {"tensors", "elements", "bytes"}``); a shared tensor is stored, and counted, once;
      persistent buffers count too;
    - ``weights_from``: the directory the weights were read from (a run's ``model/`` or latest checkpoint);
    - ``plugins``: ``{name: settings}`` from the run's ``config.yaml`` or the model card; ``stateful_plugins``:
      the plugins whose state a checkpoint holds;
    - ``global_step``, ``epoch`` (0-based, as in ``metrics.jsonl``), ``metrics`` (the latest value of each
      logged name; non-finite values as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``);
    - ``checkpoints``: a run's checkpoints, oldest first (``path``, ``global_step``, ``epoch``, and ``unusable``:
      ``None``, or why it cannot be loaded (an unreadable manifest, another format version), with ``global_step``
      and ``epoch`` ``None``; `torchloom.checkpoint.scan`); the weights are of the latest usable one;
      ``model_dir``: a run's exported model; ``size_bytes``: a checkpoint's files, all together;
    - ``adapter``: a model with a LoRA (or other peft) adapter: ``method``, ``r``, ``lora_alpha``, ``targets`` (the
      adapted modules), ``modules_to_save``, ``quantization``, ``trainable_parameters``, ``total_parameters``,
      ``bytes`` and ``base`` (the base it needs: ``class``, ``name_or_path``, ``sha256`` of its frozen weights), from
      the model card or a checkpoint's manifest (an adapter folder without a card: what ``adapter_config.json``
      says); ``None`` without an adapter;
    - ``resumed_from``: the runs a resumed run continues (a checkpoint: that its run continued), oldest first,
      each ``run_dir``, ``checkpoint`` (the one the next run resumed from) and ``global_step``; ``None`` when it
      did not resume (or for an exported model).

    Args:
        path (`str` or `os.PathLike`): a checkpoint (a directory with ``manifest.json``); a run directory
            (``<output_dir>/version_N``: ``config.yaml``, ``metrics.jsonl``, ``checkpoints/``, ``model/``); or an
            exported model (a directory with ``model.safetensors`` or ``model.safetensors.index.json``, as
            `TaskModule.save_model` and ``save_pretrained`` write, or one ``.safetensors`` file).

    Returns:
        `dict`: the keys above.

    Raises:
        ConfigError: ``path`` does not exist or is none of these; a weights file or ``config.json`` that cannot be
            read; a model card of another format or version than this torchloom writes.
        CheckpointError: a checkpoint whose manifest is missing, unreadable or of another format.
    """
    root = Path(path)
    if not root.exists():
        raise ConfigError(f"inspect: {os.fspath(path)!r}: no such file or directory")
    if (root / MANIFEST).is_file():
        info = _checkpoint(root)
    elif is_exported_model(root):
        info = _model(root)
    elif is_run_dir(root):
        info = _run(root)
    else:
        runs = [run.name for run in run_directories(root)]
        hint = f"; it holds runs ({', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''}): inspect one" if runs else ""
        raise ConfigError(
            f"inspect: {os.fspath(path)!r} is not a checkpoint (manifest.json), a run directory (config.yaml, "
            f"metrics.jsonl) or an exported model (model.safetensors, model.safetensors.index.json or a .safetensors "
            f"file){hint}"
        )
    return _strict_json.encode(info)


def _empty(root: Path, kind: str) -> dict[str, Any]:
    return {
        "path": str(root),
        "kind": kind,
        "model_class": None,
        "parameters": {"total": None, "trainable": None},
        "weights": None,
        "weights_from": None,
        "plugins": None,
        "stateful_plugins": None,
        "global_step": None,
        "epoch": None,
        "metrics": {},
        "checkpoints": None,
        "model_dir": None,
        "size_bytes": None,
        "resumed_from": None,
        "adapter": None,
    }


def _checkpoint(root: Path) -> dict[str, Any]:
    manifest = read_manifest(root)
    model = manifest.get("model") or {}
    info = _empty(root, "checkpoint")
    shapes = (model.get("parameters") or {}).values()
    files = sorted((root / "accelerate").glob("*.safetensors"))
    info.update(
        model_class=model.get("class"),
        parameters={"total": sum(math.prod(s) for s in shapes), "trainable": model.get("trainable_parameters")},
        weights=safetensors_summary(files, root) if files else None,
        weights_from=str(root),
        stateful_plugins=list(manifest.get("plugins") or []),
        global_step=manifest.get("global_step"),
        epoch=manifest.get("epoch"),
        metrics=dict(manifest.get("metrics") or {}),
        adapter=manifest.get("adapter"),
        size_bytes=sum(int(f.get("bytes", 0)) for f in (manifest.get("files") or {}).values())
        + (root / MANIFEST).stat().st_size,
    )
    chain = (manifest.get("training") or {}).get("resumed_from")
    if isinstance(chain, list) and chain:
        info["resumed_from"] = chain
    if root.parent.name == CHECKPOINTS_DIR:  # inside a run directory: its config names every plugin
        info["plugins"] = (_read_yaml(root.parent.parent / "config.yaml") or {}).get("plugins")
    return info


def _model(root: Path) -> dict[str, Any]:
    info = _empty(root, "model")
    directory = root if root.is_dir() else root.parent
    files = weight_files(root) if root.is_dir() else [root]
    info["weights"] = safetensors_summary(files, directory)
    info["weights_from"] = str(root)
    card = _read_json(directory / MODEL_CARD) if root.is_dir() else None
    if card is not None:
        _check_card(directory / MODEL_CARD, card)
        model = card.get("model") or {}
        info.update(
            model_class=model.get("class"),
            parameters={"total": model.get("parameters"), "trainable": model.get("trainable_parameters")},
            plugins=card.get("plugins"),
            global_step=card.get("global_step"),
            epoch=card.get("epoch"),
            metrics=dict(card.get("metrics") or {}),
            adapter=card.get("adapter"),
        )
    elif root.is_dir() and (root / "config.json").is_file():  # saved by transformers, without a card
        architectures = (_read_json(root / "config.json") or {}).get("architectures") or [None]
        info["model_class"] = architectures[0]
    if info["adapter"] is None and root.is_dir() and is_adapter_dir(root):  # peft's folder, without a card
        config = read_adapter_config(root) or {}
        targets = config.get("target_modules")
        info["adapter"] = {
            "method": str(config.get("peft_type") or "").lower() or None,
            "r": config.get("r"),
            "lora_alpha": config.get("lora_alpha"),
            "targets": sorted(targets) if isinstance(targets, list) else targets,
            "modules_to_save": config.get("modules_to_save"),
            "bytes": info["weights"]["bytes"],
            "base": {"name_or_path": config.get("base_model_name_or_path")},
        }
    return info


def _run(root: Path) -> dict[str, Any]:
    info = _empty(root, "run")
    config = _read_yaml(root / "config.yaml") or {}
    checkpoints: list[dict[str, Any]] = []
    usable = None
    for path, manifest, reason in scan_checkpoints(root).ordered():  # an unusable one listed with why, not hidden
        step, epoch = (manifest.get("global_step"), manifest.get("epoch")) if manifest else (None, None)
        checkpoints.append({"path": path, "global_step": step, "epoch": epoch, "unusable": reason})
        usable = path if manifest is not None else usable
    model_dir = root / MODEL_DIR
    if is_exported_model(model_dir):  # the final weights of a completed fit
        source = _model(model_dir)
    elif usable is not None:
        source = _checkpoint(Path(usable))
    else:
        source = _empty(root, "run")
    info.update(
        model_class=source["model_class"],
        parameters=source["parameters"],
        adapter=source["adapter"],
        weights=source["weights"],
        weights_from=source["weights_from"],
        plugins=config.get("plugins"),
        checkpoints=checkpoints,
        model_dir=str(model_dir) if is_exported_model(model_dir) else None,
        resumed_from=read_chain(root),
    )
    records = read_records(root / "metrics.jsonl", ConfigError, "inspect: ")
    if records:
        info["global_step"], info["epoch"] = records[-1].get("step"), records[-1].get("epoch")
    summary = _read_json(root / SUMMARY_FILE)
    if summary is not None and isinstance(summary.get("metrics"), dict):
        info["metrics"] = {name: entry.get("last") for name, entry in summary["metrics"].items()}
    else:  # the latest value of every name, as Engine.logged_metrics holds them
        for record in records:
            info["metrics"].update({k: v for k, v in record.items() if k not in ("step", "epoch")})
    return info


def _check_card(path: Path, card: dict[str, Any]) -> None:
    """Refuse a model card of another format or version (a newer torchloom's): its fields may mean other things.
    A card without ``format`` / ``version`` is read as the current one.

    Raises:
        ConfigError: names the file, its format or version, and the one this torchloom reads.
    """
    form, version = card.get("format", CARD_FORMAT), card.get("version", CARD_VERSION)
    if form == CARD_FORMAT and type(version) is int and version == CARD_VERSION:
        return
    from torchloom._version import __version__

    what = f"format {form!r}" if form != CARD_FORMAT else f"version {version!r}"
    raise ConfigError(
        f"inspect: {str(path)!r} is a model card of {what}; this torchloom ({__version__}) reads format "
        f"{CARD_FORMAT!r} version {CARD_VERSION}"
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; ``None`` when there is no such file.

    Raises:
        ConfigError: it cannot be read, is empty, is not valid JSON or holds no JSON object (names the file).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"inspect: cannot read {str(path)!r}: {exc}") from None
    if not text.strip():
        raise ConfigError(f"inspect: {str(path)!r} is empty; expected a JSON object")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"inspect: {str(path)!r} is not valid JSON ({exc}); expected a JSON object") from None
    if not isinstance(value, dict):
        what = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
        raise ConfigError(f"inspect: {str(path)!r} holds {what}, not a JSON object; expected a JSON object")
    return value


def _read_yaml(path: Path) -> dict[str, Any] | None:
    try:
        value = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"inspect: cannot read {str(path)!r}: {' '.join(str(exc).split())}") from None
    return value if isinstance(value, dict) else None
