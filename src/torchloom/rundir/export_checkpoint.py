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
from pathlib import Path
from typing import Any

import yaml
from accelerate.utils import set_seed

from torchloom._accelerator import build_accelerator
from torchloom._default_step import DefaultTrainStep
from torchloom._guards import check_model
from torchloom._setup import engine_relay
from torchloom._strict_json import json_dumps
from torchloom.checkpoint.store import MANIFEST, read_manifest, verify_files
from torchloom.errors import CheckpointError, ConfigError, RunFileError
from torchloom.rundir.adapter_format import describe, resume_problems
from torchloom.rundir.atomic import atomic_directory, remove_orphans, write_failure
from torchloom.rundir.export import MODEL_CARD, load_weights, model_card
from torchloom.rundir.runfiles import MetricsFile

__all__ = ["export_checkpoint"]

_EXPECTED = "expected a checkpoint directory (with manifest.json, as <run_dir>/checkpoints/step-00000040)"
#: The empty file an export's temporary folder (``.<OUT>.tmp-<pid>``) holds while it is written: what tells a folder
#: that a killed export left next to OUT from anything else there (`torchloom.rundir.atomic.remove_orphans`).
IN_PROGRESS = ".torchloom-export-in-progress"


def export_checkpoint(
    engine: Any, task: Any, checkpoint: str | os.PathLike[str], directory: str | os.PathLike[str]
) -> str:
    """Write the model of ``checkpoint`` into the new directory ``directory`` (see the module docstring), with
    ``engine``'s settings and plugins and ``task``'s model; return ``directory``.

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
    config = engine.config.for_run()
    relay = engine_relay(engine.plugins, DefaultTrainStep(), MetricsFile())
    relay.call("setup", config=config, stage="predict")
    accelerator, error = None, None
    try:
        accelerator = build_accelerator(relay, config)
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
            _run_config(root, engine),
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
    except BaseException as exc:
        error = exc
        raise
    finally:
        failure = relay.call_cleanup("teardown", error, accelerator=accelerator, stage="predict")
        if failure is not None and failure is not error:
            raise failure
    return str(out)


def _run_config(checkpoint: Path, engine: Any) -> Any:
    """The resolved config of the checkpoint's run (its ``config.yaml``), else the engine's ``run_config``."""
    try:
        return yaml.safe_load((checkpoint.parent.parent / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return engine.run_config
