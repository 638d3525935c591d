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
- refused, with one message naming both counts, where each process saved state of its own that another number of
  processes cannot take (`reshard_problems`): the model and optimizer shards of FSDP / DeepSpeed, and the own
  parameters and optimizer states of a plugin whose processes' copies differ (LocalSGD, DiLoCo: ``replica``).

The HF Trainer and Lightning resume on any number of devices too, counting the batches to skip as batches of the new
run (which then points at other samples); torchtitan re-shards with ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from accelerate.utils import DistributedType

from torchloom.checkpoint.replicas import REPLICA

__all__ = ["merged_log_state", "reshard_problems", "source_rank"]

#: What a new process that holds none of the interval's values starts each reduction with.
_EMPTY = {"mean": 0.0, "sum": 0.0, "max": -math.inf, "min": math.inf}


def reshard_problems(manifest: Mapping[str, Any], world_size: int, distributed_type: Any) -> list[str]:
    """Why a checkpoint (its ``manifest``) cannot be resumed on ``world_size`` processes of ``distributed_type``
    (Accelerate's `DistributedType`); empty when it can (also when the counts are the same)."""
    saved = manifest.get("world_size")
    if saved == world_size:
        return []
    files = manifest.get("files") or {}
    why = []
    sharded = distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    if sharded or "accelerate/model.safetensors" not in files:
        why.append("its model and optimizer state are sharded over the processes (FSDP / DeepSpeed)")
    own = {name.split("/")[1] for name in files if name.startswith("engine/process_") and f"/{REPLICA}." in name}
    replicas = sorted(own)
    if replicas:
        why.append(
            f"each process saved its own parameters and optimizer state ({', '.join(replicas)}: a plugin whose "
            "processes' copies of the model differ, LocalSGD or DiLoCo between two averages)"
        )
    if not why:
        return []
    return [
        f"it was written by {saved} process(es) and this run has {world_size}, and {' and '.join(why)}, which another "
        f"number of processes cannot load; resume with {saved} process(es) (torchrun --nproc_per_node {saved}, or "
        f"accelerate launch --num_processes {saved})"
    ]


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
