"""The exported model's card, and loading trained weights (a checkpoint's or an exported model's) for ``predict``.

The card is ``<run_dir>/model/torchloom_model.json``, written by `finish_fit` next to what `TaskModule.save_model`
saved: the run's resolved config, its plugins and settings, the final logged values, the step and epoch, the model's
class and parameter counts, and the versions of the libraries that trained it. Its name is one no loader of the
directory reads (transformers' ``from_pretrained`` reads ``config.json`` and the weights, `TaskModule.load_model`
only the weights), so the directory loads as before.

Weights are read from safetensors files only (their header is JSON; their data is tensors), never through pickle.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from torchloom import _strict_json
from torchloom.checkpoint.store import MANIFEST, read_manifest, verify_files
from torchloom.errors import CheckpointError, ConfigError
from torchloom.rundir.adapter_format import describe, has_adapter, is_adapter_dir, load_adapter
from torchloom.rundir.layout import MODEL_CARD, MODEL_DIR, is_run_dir
from torchloom.rundir.weight_files import (
    WEIGHTS_INDEX,
    check_weight_files,
    header_entries,
    safetensors_summary,
    weight_files,
)
from torchloom.tools.sizes import count_parameters

__all__ = [
    "MODEL_CARD",
    "check_weight_files",
    "header_entries",
    "load_weights",
    "model_card",
    "resolve_weights",
    "safetensors_summary",
    "weight_files",
]

CARD_FORMAT, CARD_VERSION = "torchloom.model_card", 1
#: The libraries whose versions the card records (those installed).
LIBRARIES = ("torch", "accelerate", "transformers", "safetensors", "huggingface_hub", "datasets", "torchmetrics")


# ------------------------------------------------------------------------------------------------ the card


def adapter_card(model: torch.nn.Module) -> dict[str, Any] | None:
    """The card's ``adapter``: what `torchloom.rundir.adapter_format.describe` records (method, rank, alpha, adapted
    modules, ``modules_to_save``, quantisation, the base it needs: class, ``name_or_path``, SHA-256 of its frozen
    weights), with ``trainable_parameters``, ``total_parameters`` and ``bytes`` (the adapter's tensors as saved);
    ``None`` for a model without an adapter."""
    described = describe(model)
    if described is None:
        return None
    trainable = [p for p in model.parameters() if p.requires_grad]
    counts = count_parameters(model)
    return {
        **described,
        "trainable_parameters": counts["trainable"],
        "total_parameters": counts["total"],
        "bytes": sum(p.numel() * p.element_size() for p in trainable),
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
    from torchloom._version import __version__

    counts = count_parameters(model)
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
        "adapter": adapter_card(model),
        "global_step": global_step,
        "epoch": epoch,
        "metrics": dict(metrics),
        "plugins": (run_config or {}).get("plugins"),
        "config": run_config,
        "libraries": libraries,
    }
    return _strict_json.encode(card)


# ------------------------------------------------------------------------------------------- weight files


# ------------------------------------------------------------------------------------------ loading weights


def is_exported_model(path: Path) -> bool:
    """Whether ``path`` is what `TaskModule.save_model` (or ``save_pretrained``) writes, or one safetensors file."""
    if path.is_file():
        return path.suffix == ".safetensors"
    return (path / "model.safetensors").is_file() or (path / WEIGHTS_INDEX).is_file() or is_adapter_dir(path)


#: What ``validate``'s and ``predict``'s ``ckpt_path`` may name, for their messages.
PREDICT_WEIGHTS = (
    "a checkpoint (a directory with manifest.json), an exported model (a directory with model.safetensors or "
    "model.safetensors.index.json, or one .safetensors file, or an adapter folder with adapter_config.json and "
    "adapter_model.safetensors), a run directory (version_N, with model/ or checkpoints/), an output_dir whose "
    "runs have a checkpoint, or 'last' / 'best' (the latest / the best-scoring checkpoint of the engine's output_dir)"
)
#: The names ``ckpt_path`` may give instead of a path, as Lightning's ``trainer.validate(ckpt_path="best")``.
NAMED_CHECKPOINTS = ("last", "best")


def resolve_weights(
    path: str | os.PathLike[str],
    command: str = "predict",
    *,
    output_dir: str | os.PathLike[str] | None = None,
    monitor: str | None = None,
    mode: str = "min",
) -> tuple[str, str]:
    """Resolve ``validate``'s or ``predict``'s ``ckpt_path`` to ``("checkpoint" | "model", path)``.

    - ``"last"``: the latest complete checkpoint of ``output_dir``'s runs (`list_checkpoints`' order: by run, then
      by step); ``"best"``: the one whose manifest recorded the best value of ``monitor``, lowest or highest by
      ``mode``, an earlier one on a tie, NaN never (`torchloom.Monitor.is_better`); ``monitor`` and ``mode`` are the
      enabled plugins' ``checkpoint_ranking`` (`torchloom.Plugin`: the ``checkpoint`` plugin's) when given, else the
      ranking the newest checkpoint that records one recorded in its manifest (``"ranking"``); a directory of that
      name is ``./last``;
    - a checkpoint directory (with ``manifest.json``): itself, its files checked against the manifest;
    - an exported model (``model.safetensors`` or ``model.safetensors.index.json``; or an adapter in peft's format,
      ``adapter_config.json`` and ``adapter_model.safetensors``), or a ``.safetensors`` file:
      itself, the header of each weight file checked (`header_entries`);
    - a run directory: its ``model/`` when the fit saved one (the final weights), else its latest checkpoint;
    - otherwise (an ``output_dir``): the latest checkpoint of its latest run that has one.

    Raises:
        ConfigError: ``path`` does not exist; an exported model whose weight files are not safetensors, damaged
            or truncated; ``"best"`` without a ``monitor``, given or recorded by a checkpoint.
        CheckpointError: no weights there; an incomplete checkpoint or one whose files changed since it was saved;
            a checkpoint that a pick of the latest (``"last"``, a run directory, an ``output_dir``) would take, or
            any for ``"best"``, is unusable (`torchloom.checkpoint.scan`: named with why, never skipped).
        Each message begins with ``<command>: ckpt_path`` and the path, and says what it may name
        (`PREDICT_WEIGHTS`).
    """
    if isinstance(path, str) and path in NAMED_CHECKPOINTS:
        named = _named_checkpoint(path, command, output_dir, monitor, mode)
        return "checkpoint", _verified(named, command, path)
    root, shown = Path(path), os.fspath(path)
    where = f"{command}: ckpt_path {shown!r}"
    if not root.exists():
        raise ConfigError(f"{where}: no such file or directory; expected {PREDICT_WEIGHTS}")
    for model in (root, root / MODEL_DIR) if is_run_dir(root) else (root,):
        if is_exported_model(model) and not (root / MANIFEST).is_file():
            try:
                check_weight_files(model)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            return "model", str(model)
    if (root / MANIFEST).is_file():
        checkpoint = root
    elif is_run_dir(root):
        found = _usable_checkpoints(root, where)
        if not found:
            raise CheckpointError(
                f"{where}: the run directory holds neither a saved model (model/, written with "
                "save_model: true) nor a complete checkpoint (checkpoints/, written by the 'checkpoint' plugin)"
            )
        checkpoint = Path(found[-1])
    else:
        found = _usable_checkpoints(root, where) if root.is_dir() else []
        if not found:
            kind = "a directory" if root.is_dir() else "a file"
            raise CheckpointError(
                f"{where} is {kind} that holds no weights {command} reads; expected {PREDICT_WEIGHTS}"
            )
        checkpoint = Path(found[-1])
    return "checkpoint", _verified(checkpoint, command, shown)


def _usable_checkpoints(root: Path, where: str, *, newest_only: bool = True) -> list[str]:
    """The usable checkpoints under ``root`` (`torchloom.checkpoint.scan`), oldest first.

    Raises:
        CheckpointError: a checkpoint there is unusable and would have been picked (``newest_only``: newer than
            the newest usable one; else any): named with why, never skipped in silence.
    """
    from torchloom.checkpoint.scan import scan_checkpoints

    scan = scan_checkpoints(root)
    hint = "; or name a checkpoint (ckpt_path PATH)"
    refusal = scan.refusal(where, newest_only=newest_only, hint=hint)
    if refusal is not None:
        raise CheckpointError(refusal)
    return [str(candidate) for candidate, _ in scan.usable]


def _verified(checkpoint: str | os.PathLike[str], command: str, shown: str) -> str:
    """``checkpoint``, once its manifest reads and its files are the ones it lists, unchanged.

    Raises:
        CheckpointError: they are not; the message names ``ckpt_path`` (``shown``) and what a loadable checkpoint is.
    """
    try:
        verify_files(checkpoint, read_manifest(checkpoint))  # nothing planted or changed since it was written
    except CheckpointError as exc:
        named = "" if os.fspath(checkpoint) == shown else f" ({os.fspath(checkpoint)})"
        raise CheckpointError(
            f"{command}: ckpt_path {shown!r}{named}: {exc}; expected a complete checkpoint whose files are those its "
            "manifest.json lists, as the 'checkpoint' plugin wrote them"
        ) from None
    return str(checkpoint)


def _named_checkpoint(
    name: str, command: str, output_dir: str | os.PathLike[str] | None, monitor: str | None, mode: str
) -> str:
    """The checkpoint ``"last"`` or ``"best"`` names among the runs of ``output_dir``; ``"best"`` by ``monitor`` and
    ``mode`` when given, else by the ranking the newest checkpoint that records one recorded (`recorded_ranking`)."""
    from torchloom.checkpoint.scan import scan_checkpoints
    from torchloom.monitor import Monitor

    where = f"{command}: ckpt_path {name!r}"
    if output_dir is None:
        raise ConfigError(f"{where} names a checkpoint of the engine's output_dir, and none is known here")
    root = Path(output_dir)
    # A "best" pick reads every manifest's value: any unreadable one may have been the best; "last": a newer one
    scan = scan_checkpoints(root)
    whose = "the 'checkpoint' plugin's monitor"
    if name == "best" and monitor is None:
        recorded = recorded_ranking(manifest for _, manifest in scan.usable)
        if recorded is None:
            raise ConfigError(
                f"{where} is the checkpoint with the best value of the 'checkpoint' plugin's monitor, and it has none "
                "(plugins: {checkpoint: {monitor: val/loss}}), nor does any checkpoint of the output_dir "
                f"{os.fspath(output_dir)!r} record the monitor it was ranked by (manifest.json's ranking: written by a "
                "run without a monitor, or before checkpoints recorded it); name 'last' or a path: expected "
                + PREDICT_WEIGHTS
            )
        monitor, mode = recorded
        whose = "the monitor its newest ranked checkpoint recorded"
    hint = "; or name a checkpoint (ckpt_path PATH)"
    refusal = scan.refusal(where, newest_only=name == "last", hint=hint)
    if refusal is not None:
        raise CheckpointError(refusal)
    found = scan.usable
    if not found:
        raise CheckpointError(
            f"{where}: the output_dir {os.fspath(output_dir)!r} holds no complete checkpoint (the 'checkpoint' plugin "
            f"writes <run_dir>/checkpoints/); expected {PREDICT_WEIGHTS}"
        )
    if name == "last":
        return str(found[-1][0])
    best: tuple[float, Path] | None = None
    for candidate, manifest in found:
        value = (manifest.get("metrics") or {}).get(monitor)  # NaN is never better; a tie keeps the earlier one
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        if Monitor.is_better(float(value), None if best is None else best[0], mode):
            best = (float(value), candidate)
    if best is None:
        raise CheckpointError(
            f"{where}: no checkpoint of the output_dir {os.fspath(output_dir)!r} recorded a value of {monitor!r} "
            f"({whose}); name 'last' or a path: expected {PREDICT_WEIGHTS}"
        )
    return str(best[1])


def recorded_ranking(manifests: Iterable[Mapping[str, Any]]) -> tuple[str, str] | None:
    """``(monitor, mode)`` as the newest of ``manifests`` (oldest first) that records a ranking recorded it
    (``"ranking"``, `torchloom.checkpoint.manifest.ranking`); ``None`` when none does (checkpoints of a run without a
    monitor, or written before manifests recorded it)."""
    for manifest in reversed(list(manifests)):
        ranking = manifest.get("ranking")
        if isinstance(ranking, Mapping) and isinstance(ranking.get("monitor"), str):
            mode = ranking.get("mode")
            return ranking["monitor"], mode if isinstance(mode, str) else "min"
    return None


def load_weights(model: torch.nn.Module, kind: str, path: str) -> None:
    """Load what `resolve_weights` found into ``model`` (unwrapped), in place.

    A checkpoint's weights are ``accelerate/model.safetensors`` (the first model Accelerate saved), or an FSDP2
    checkpoint's model (its DCP shards read whole on this one process, or its gathered ``pytorch_model_fsdp.bin``:
    `torchloom.checkpoint.layouts.full_model_state`); a ``module.``
    prefix (DDP) or ``_orig_mod.`` prefix (``torch.compile``) on every key is removed first. Tied weights, stored
    once, are loaded through the name the file keeps; the checkpoint of a model with an adapter holds its trainable
    parameters only (the frozen base is the one the task built). An exported model is loaded with
    `TaskModule.load_model`; an adapter folder with `torchloom.rundir.adapter_format.load_adapter` (injected first into
    a model that has no adapter).

    Raises:
        CheckpointError: the checkpoint holds no model torchloom reads (DeepSpeed's or FSDP1's files), or its weights
            do not fit ``model`` (missing, unexpected or differently shaped keys).
        ConfigError: an exported model that does not fit ``model``.
    """
    if kind == "model" and is_adapter_dir(path):  # peft's format: injected first when the model has no adapter
        try:
            load_adapter(model, path)
        except ConfigError as exc:
            raise ConfigError(f"predict: {exc}") from None
        return
    if kind == "model":
        from torchloom.module import TaskModule

        TaskModule.load_model(model, path)
        return
    from torchloom.checkpoint.layouts import full_model_state

    state = full_model_state(Path(path) / "accelerate")  # whole files, or FSDP2's shards read whole
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
    if has_adapter(model):  # the checkpoint of an adapted model holds its trainable parameters only
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        missing = sorted(trainable - set(state))
    if missing or unexpected:
        found = "; ".join(
            f"{kind} keys {sorted(keys)}" for kind, keys in (("missing", missing), ("unexpected", unexpected)) if keys
        )
        raise CheckpointError(f"{where} do not fit {type(model).__name__}: {found}")
