"""Whether a checkpoint can continue the run about to load it (`check_compatible`), and holds every file the run
loads (`check_complete`): checked before anything of the run changes, with one `CheckpointError` naming what differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from torchloom.checkpoint.layouts import run_layout
from torchloom.checkpoint.reshard import reshard_problems
from torchloom.errors import CheckpointError
from torchloom.rundir.adapter_format import describe, resume_problems

__all__ = ["check_compatible", "check_complete"]


def check_compatible(
    manifest: Mapping[str, Any],
    *,
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    reset_optimizer: bool,
    plugins: Iterable[str] | None = None,
    scheduler: bool | None = None,
    more: Iterable[str] = (),
) -> bool:
    """Compare a checkpoint with the run about to load it; return whether to load the optimizer's state.

    ``plugins`` (the names of the run's stateful plugins) and ``scheduler`` (whether the run has a learning-rate
    scheduler) are compared when given; ``more``: the problems the other entries found (the data position's:
    `torchloom.checkpoint.data_position.DataPosition.problems`), listed last.

    Raises:
        CheckpointError: another number of processes where the state cannot be re-sharded
            (`torchloom.checkpoint.reshard.reshard_problems`), DeepSpeed on one side only, other parameter names or
            shapes, another optimizer
            class without ``reset_optimizer``, another set of stateful plugins, a learning-rate scheduler on
            one side only, or training data in which the checkpoint's epoch cannot be continued exactly: one
            message listing what differs.
    """
    problems = reshard_problems(manifest, accelerator.num_processes, run_layout(accelerator))
    problems += _deepspeed_problems(manifest, accelerator)
    saved = {k: tuple(v) for k, v in (manifest.get("model") or {}).get("parameters", {}).items()}
    current = {name: tuple(p.shape) for name, p in accelerator.unwrap_model(model).named_parameters()}
    adapter = resume_problems(manifest.get("adapter"), describe(accelerator.unwrap_model(model)))
    if adapter:  # named as what differs (base, rank, targets), not as the parameter shapes that follow from it
        problems += adapter
    elif saved != current:
        diffs = [f"{n}: saved {list(saved[n])}, now {list(current[n])}" for n in saved.keys() & current.keys()]
        diffs = sorted(d for d in diffs if (n := d.split(":")[0]) and saved[n] != current[n])
        diffs += [f"{n}: only in the checkpoint" for n in sorted(saved.keys() - current.keys())]
        diffs += [f"{n}: only in this model" for n in sorted(current.keys() - saved.keys())]
        shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        problems.append(f"the model's parameters differ ({shown})")
    saved_optimizer = (manifest.get("optimizer") or {}).get("class")
    inner = getattr(optimizer, "optimizer", optimizer)
    load_optimizer = True
    if saved_optimizer != type(inner).__name__:
        if reset_optimizer:
            load_optimizer = False
        else:
            problems.append(
                f"its optimizer is {saved_optimizer}, this run's is {type(inner).__name__} (pass reset_optimizer=True, "
                "or --reset_optimizer, to start the new optimizer with fresh state)"
            )
    if plugins is not None:
        saved_plugins, enabled = sorted(manifest.get("plugins") or []), sorted(plugins)
        if saved_plugins != enabled:
            problems.append(
                f"its stateful plugins are {', '.join(map(repr, saved_plugins)) or 'none'}, this run's are "
                f"{', '.join(map(repr, enabled)) or 'none'} (enable the same stateful plugins)"
            )
    if scheduler is not None:
        saved_scheduler = "engine/lr_scheduler.json" in (manifest.get("files") or {})
        if saved_scheduler != scheduler:
            problems.append(
                "it holds a learning-rate scheduler's state and this run has no scheduler"
                if saved_scheduler
                else "this run has a learning-rate scheduler and the checkpoint holds none"
            )
    problems += list(more)
    if problems:
        raise CheckpointError("cannot resume from checkpoint: " + "; ".join(problems))
    return load_optimizer and not reset_optimizer


def _deepspeed_problems(manifest: Mapping[str, Any], accelerator: Any) -> list[str]:
    """A DeepSpeed checkpoint (DeepSpeed's own files, read by its ``load_checkpoint``) into a run without DeepSpeed,
    or another checkpoint into a DeepSpeed run: neither side's loader reads the other's files."""
    saved = str(manifest.get("distributed_type", "")).rsplit(".", 1)[-1]
    now = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if (saved == "DEEPSPEED") == (now == "DEEPSPEED"):
        return []
    return [
        f"it was written under {saved or 'an unrecorded distributed type'} and this run is {now}: DeepSpeed's "
        "checkpoint files load into a DeepSpeed run only, and a DeepSpeed run loads DeepSpeed's only (torchloom "
        "export writes a ZeRO-1/2 checkpoint's model as a folder that any run can start from)"
    ]


def check_complete(root: Path, manifest: Mapping[str, Any], names: Iterable[str]) -> None:
    """Raise if the manifest lacks a file this run loads (a manifest edited to drop one, with the file); ``names``:
    those files, relative to the checkpoint.

    Raises:
        CheckpointError: naming the files it lacks.
    """
    missing = [name for name in names if name not in (manifest.get("files") or {})]
    if missing:
        raise CheckpointError(
            f"checkpoint {str(root)!r} is incomplete: it lacks {', '.join(missing)}, which this run loads (its "
            "manifest lists no such file)"
        )
