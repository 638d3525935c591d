"""From a checkpoint to a model (`export_checkpoint`): what ``torchloom export CHECKPOINT OUT`` and `Engine.export`
write, the folder a fit with ``save_model: true`` would have written had it ended at the checkpoint.

The model is built as a fit builds it (the seed, ``configure_model``, the plugins' ``configure_model``: an adapter
injected by the ``peft`` plugin), the checkpoint's weights are loaded into it (`torchloom.rundir.export.load_weights`:
safetensors only), and `TaskModule.save_model` writes the folder (a transformers model: ``save_pretrained``, an
ordinary transformers folder; any other module: ``model.safetensors``; a model with an adapter: the adapter in
peft's format), the plugins' ``on_save_model`` adds to it (the ``peft`` plugin's ``merge``: ``merged/``), and the
model card ``torchloom_model.json`` records the run's config, the checkpoint's values, step and epoch, and the
checkpoint it came from. The folder appears complete or not at all (built under a temporary name, renamed).

Nothing is loaded from a checkpoint whose manifest does not verify (`torchloom.checkpoint.store.verify_files`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import yaml
from accelerate.utils import set_seed

from torchloom._guards import check_model
from torchloom._strict_json import json_dumps
from torchloom.checkpoint.store import MANIFEST, read_manifest, verify_files
from torchloom.errors import CheckpointError, ConfigError, RunFileError
from torchloom.rundir.adapter_format import describe, resume_problems
from torchloom.rundir.atomic import atomic_directory, remove_orphans, write_failure
from torchloom.rundir.export import MODEL_CARD, load_weights, model_card

__all__ = ["export_checkpoint"]

_EXPECTED = "expected a checkpoint directory (with manifest.json, as <run_dir>/checkpoints/step-00000040)"
#: The empty file an export's temporary folder (``.<OUT>.tmp-<pid>``) holds while it is written: what tells a folder
#: that a killed export left next to OUT from anything else there (`torchloom.rundir.atomic.remove_orphans`).
IN_PROGRESS = ".torchloom-export-in-progress"


def export_checkpoint(
    start: Callable[[], AbstractContextManager[tuple[Any, Any, Any]]],
    task: Any,
    checkpoint: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    run_config: Any = None,
) -> str:
    """Write the model of ``checkpoint`` into the new directory ``directory`` (see the module docstring), with
    ``task``'s model; return ``directory``. ``start()``: the engine's call without a run (`RunStarter.bare`: its
    ``setup``, settings, plugins and accelerator, then ``teardown``); ``run_config``: the engine's, the model card's
    config when the checkpoint's run directory has no ``config.yaml``.

    Raises:
        ConfigError: ``checkpoint`` does not exist; ``directory`` exists and is not an empty directory; more than
            one process.
        RunFileError: the folder cannot be written (a full disk, no permission): nothing is left of it. Before it is
            written, the temporary folders that exports killed half-way left next to it are removed (those of the
            same ``directory``, and those marked as an export's), never anything else.
        CheckpointError: ``checkpoint`` is not a complete checkpoint, or its files do not match its manifest (a file
            added, missing or changed: refused before anything loads); its weights or its adapter do not fit the
            task's model.
    """
    root, shown = Path(checkpoint), os.fspath(checkpoint)
    if not root.exists():
        raise ConfigError(f"export: checkpoint {shown!r}: no such file or directory; {_EXPECTED}")
    if not (root / MANIFEST).is_file():
        raise CheckpointError(f"export: {shown!r} is not a checkpoint: it has no {MANIFEST}; {_EXPECTED}")
    try:
        manifest = read_manifest(root)
        verify_files(root, manifest)  # nothing planted or changed since it was written
    except CheckpointError as exc:
        raise CheckpointError(
            f"export: {exc}; a checkpoint is exported only as written (its files those its manifest.json lists)"
        ) from None
    out = Path(directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"export: OUT {os.fspath(directory)!r} exists; expected a new (or empty) directory")
    with start() as (config, relay, accelerator):
        if accelerator.num_processes > 1:
            raise ConfigError(f"export: runs on one process, not {accelerator.num_processes}; run it without torchrun")
        if config.seed is not None:
            set_seed(config.seed)  # a base built from a config (not from_pretrained) is the fit's base
        model = check_model(task.configure_model(), task)
        task.model, task.accelerator = model, accelerator
        relay.call("configure_model", model=model, task=task, accelerator=accelerator)
        problems = resume_problems(manifest.get("adapter"), describe(model))
        if problems:
            raise CheckpointError(f"export: checkpoint {shown!r} does not fit the task's model: {'; '.join(problems)}")
        load_weights(model, "checkpoint", str(root))
        card = model_card(
            model,
            _run_config(root, run_config),
            manifest.get("metrics") or {},
            manifest.get("global_step"),
            manifest.get("epoch"),
        )
        card["exported_from"] = str(root)
        if out.is_dir():
            out.rmdir()  # empty: the rename puts the folder there
        # What exports killed half-way left next to OUT: this OUT's temporary folders, and marked ones of other OUTs.
        remove_orphans(out.parent, name=out.name, marker=IN_PROGRESS)
        try:
            with atomic_directory(out, marker=IN_PROGRESS) as tmp:
                task.save_model(str(tmp))
                relay.call("on_save_model", directory=str(tmp), model=model, accelerator=accelerator)
                (tmp / MODEL_CARD).write_text(json_dumps(card, indent=1) + "\n", encoding="utf-8")
        except Exception as exc:
            reason = write_failure(exc, out)
            if reason is None:
                raise
            raise RunFileError(
                f"export: cannot write the model of checkpoint {shown!r} to {os.fspath(directory)!r}: {reason}; "
                "nothing was left there"
            ) from exc
    return str(out)


def _run_config(checkpoint: Path, run_config: Any) -> Any:
    """The resolved config of the checkpoint's run (its ``config.yaml``), else the engine's ``run_config``."""
    try:
        return yaml.safe_load((checkpoint.parent.parent / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return run_config
