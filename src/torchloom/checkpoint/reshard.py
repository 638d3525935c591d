"""A checkpoint written by one number of processes, resumed on another: what each process of the new run loads.

What a checkpoint holds once for the whole run (the model, the optimizer state, the scheduler, the plugins' states,
the counters, the data position) is the same whatever the number of processes under DDP or on one process, and the
data position is counted in samples of the epoch's global order (`torchloom.checkpoint.data_position`), which does not
depend on how many processes share each global batch. So a checkpoint of ``W`` processes resumes on ``W'`` processes
where these hold, and the rest of the epoch is exactly the rest of its global order, re-sharded over the new processes
(samples done must be a whole number of the new global batches, as for any change of batch size):

- each process's own part (``engine/process_<rank>/``) is mapped, not invented (`source_rank`): process ``r`` of the
  new run loads the random states and data generators of saved process ``r mod W``, so the processes that existed
  continue their own random streams and a new one starts from those of an existing one (the engine seeds every
  process alike, so they begin equal anyway). Random draws (dropout, augmentation) therefore go on, but not as the
  ``W``-process run would have drawn them: the sample order is exact, the draws are not;
- the partial sums of the values logged since the last logging step are merged (`merged_log_state`), so the next
  logged value is the one over the whole interval: a ``sum`` or a ``mean`` (sums and weights) over every saved
  process goes to the new process 0, the new maximum / minimum is over every saved process, ``last`` stays the main
  process's; the other new processes start the interval empty;
- the model and optimizer are loaded by ``torch.distributed.checkpoint`` into the new run's layout, whatever it is
  (one process, DDP, FSDP2 on any number of processes: `torchloom.checkpoint.layouts`);
- refused, with one message naming both counts, where each process saved state of its own that another number of
  processes cannot take (`reshard_problems`): the model and optimizer of DeepSpeed / FSDP1 (layouts torchloom does
  not re-shard), and the own parameters and optimizer states of a plugin whose processes' copies differ (LocalSGD,
  DiLoCo: ``replica``).

The HF Trainer and Lightning resume on any number of devices too, counting the batches to skip as batches of the new
run (which then points at other samples); torchtitan re-shards with ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchloom.checkpoint.replicas import REPLICA

__all__ = ["merged_log_state", "reshard_problems", "saved_layout_of", "source_rank"]

#: What a new process that holds none of the interval's values starts each reduction with.
_EMPTY = {"mean": 0.0, "sum": 0.0, "max": -math.inf, "min": math.inf}


def reshard_problems(manifest: Mapping[str, Any], world_size: int, layout: str | None) -> list[str]:
    """Why a checkpoint (its ``manifest``) cannot be resumed on ``world_size`` processes of the model layout
    ``layout`` (`torchloom.checkpoint.layouts.run_layout`: ``"whole"``, ``"fsdp_sharded"``, ``"fsdp_full"``, or
    ``None`` for DeepSpeed / FSDP1); empty when it can.

    The model and optimizer of the three layouts torchloom reads are loaded into any other of them on any number of
    processes (`torchloom.checkpoint.layouts.load_across_layouts`); a checkpoint of another layout (DeepSpeed,
    FSDP1, or an FSDP checkpoint written before the manifest recorded its layout) is left to Accelerate's
    ``load_state`` on the same number of processes, and refused on another.
    """
    saved = manifest.get("world_size")
    files = manifest.get("files") or {}
    stored = saved_layout_of(manifest)
    why = []
    layout_reason = saved != world_size and (stored is None or layout is None)
    if layout_reason:
        what = (
            "its model and optimizer are in a layout torchloom does not re-shard (DeepSpeed, FSDP1, or an FSDP "
            "checkpoint written before torchloom recorded its layout)"
            if stored is None
            else "this run's model and optimizer are in a layout torchloom does not re-shard (DeepSpeed or FSDP1)"
        )
        why.append(what)
    own = {name.split("/")[1] for name in files if name.startswith("engine/process_") and f"/{REPLICA}." in name}
    replicas = sorted(own)
    if replicas and saved != world_size:
        why.append(
            f"each process saved its own parameters and optimizer state ({', '.join(replicas)}: a plugin whose "
            "processes' copies of the model differ, LocalSGD or DiLoCo between two averages)"
        )
    if not why:
        return []
    shown = {"whole": "whole-model files", "fsdp_sharded": "FSDP2 shards", "fsdp_full": "FSDP2 whole-state files"}
    layouts = ["", ""]
    if layout_reason:  # the layouts are part of why
        layouts = [f" ({shown.get(str(stored), 'another layout')})", f" ({shown.get(str(layout), 'another layout')})"]
    return [
        f"it was written by {saved} process(es){layouts[0]} and this run has {world_size}{layouts[1]}, and "
        f"{' and '.join(why)}, which another number of processes cannot load; resume with {saved} process(es) "
        f"(torchrun --nproc_per_node {saved}, or accelerate launch --num_processes {saved})"
    ]


def saved_layout_of(manifest: Mapping[str, Any]) -> str | None:
    """The layout of a checkpoint's model and optimizer (`torchloom.checkpoint.layouts.saved_layout`): whole-model
    files are known by their names; FSDP2's only where the manifest records it (``layout``, since this torchloom),
    since FSDP1's sharded files have the same names."""
    from torchloom.checkpoint.layouts import saved_layout

    found = saved_layout(manifest.get("files") or {})
    if found == "whole":
        return found
    return found if found is not None and manifest.get("layout") == found else None


def source_rank(rank: int, saved_world_size: int) -> int:
    """The saved process whose own part (random states, data generators) process ``rank`` of the new run loads."""
    return rank % saved_world_size


def merged_log_state(states: Sequence[Mapping[str, Any]], rank: int) -> dict[str, Any]:
    """The log buffer state (`torchloom._logbuffer.LogBuffer.state_dict`) of process ``rank`` of the new run, from
    the saved processes' ``states`` (rank order): at ``rank`` 0 every saved process's partial reductions folded into
    one (``mean``: the sums and the weights added; ``sum`` added; ``max`` / ``min`` over the processes; ``last`` the
    main process's), at any other rank the empty start of each (``last``: the main process's, which only rank 0's
    counts), so that the reduction over the new processes at the next logging step is the one over the saved ones.
    Tensors are added in float64 (the buffer's own dtype on CPU and CUDA)."""
    reductions: dict[str, str] = {}
    for state in states:
        for name, reduce in state["reductions"].items():
            reductions.setdefault(name, reduce)
    values: dict[str, Any] = {}
    weights: dict[str, Any] = {}
    for name, reduce in reductions.items():
        held = [s["values"][name] for s in states if name in s["values"]]
        if reduce == "last":
            values[name] = held[0]
        elif rank != 0:
            values[name] = _EMPTY[reduce]
        elif reduce in ("mean", "sum"):
            values[name] = _total(held)
        else:
            extreme = torch.maximum if reduce == "max" else torch.minimum
            folded = torch.as_tensor(held[0], dtype=torch.float64)
            for value in held[1:]:
                folded = extreme(folded, torch.as_tensor(value, dtype=torch.float64))
            values[name] = folded
        if reduce == "mean":
            weights[name] = _total([s["weights"][name] for s in states if name in s["weights"]]) if rank == 0 else 0.0
    return {"values": values, "weights": weights, "reductions": reductions}


def _total(parts: Sequence[Any]) -> Any:
    """The sum of ``parts`` (floats or 0-dim tensors): a float64 tensor if any part is a tensor."""
    if not any(isinstance(p, torch.Tensor) for p in parts):
        return float(sum(parts))
    total = torch.zeros((), dtype=torch.float64)
    for part in parts:
        total = total + torch.as_tensor(part, dtype=torch.float64)
    return total
