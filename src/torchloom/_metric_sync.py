"""The gather that synchronises a torchmetrics object's list states, also when a process holds no sample.

torchmetrics (1.9) gathers each state with ``gather_all_tensors``: first every process's shape, then the data
padded to the largest shape. A list state (the predictions an AUROC, an average precision or a Spearman
correlation keeps) of a process that was never updated is replaced by ``torch.tensor([], dtype=metric.dtype)``
before the gather: one dimension and the metric's float dtype, where the other processes hold, say, ``(n,)``
int64 targets or ``(n, classes)`` scores. The shape gather then mismatches (a different number of dimensions)
or the data gather does (another dtype: gloo's "size mismatch ... 256 vs 128"), and both processes abort.

A list state that torchmetrics does not concatenate before the sync (``dist_reduce_fx=None``: the retrieval
metrics' predictions, targets and query indexes, detection boxes) is gathered element by element, so processes
holding different numbers of elements (one that was updated less often, or never) enter different numbers of
collectives. `even_list_states` first pads such lists with empty elements to the longest one over the processes
(one small collective), and takes the padding off again after the compute.

`gather_states` first gathers every process's number of dimensions, dtype and shape in one fixed-size
collective; a process whose tensor is empty takes the number of dimensions, trailing shape and dtype of the
first process that holds data, so the padded gather that follows matches on every process. The engine sets it
as the ``dist_sync_fn`` of every metric with a list state while it computes the metric (`compute_metric`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["even_list_states", "gather_states", "has_list_state", "uneven"]

#: The dtypes a state may have, by code; another dtype gets code -1 (every process must then agree on it).
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
#: The most dimensions a state may have (the metadata gather has a fixed size).
_MAX_DIMS = 8


def has_list_state(metric: Any) -> bool:
    """Whether a torchmetrics ``Metric`` keeps a state that is a list of tensors (concatenated at sync)."""
    return any(isinstance(getattr(metric, name, None), list) for name in metric_state_defaults(metric))


def even_list_states(metric: Any) -> dict[str, int]:
    """Pad each list state of ``metric`` that torchmetrics gathers element by element (``dist_reduce_fx=None``) with
    empty tensors to the longest such list over the processes; return name -> its own length, for `uneven`.

    Call it on every process before a compute that synchronises (one ``all_reduce`` when there is such a state;
    nothing on one process or when the metric does not synchronise on compute).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return {}
    if not metric_syncs_on_compute(metric) or getattr(metric, "dist_sync_fn", None) not in (None, gather_states):
        return {}
    reductions = metric_reductions(metric)
    names = [n for n, fx in reductions.items() if fx is None and isinstance(getattr(metric, n, None), list)]
    if not names:
        return {}
    lengths = {name: len(getattr(metric, name)) for name in names}
    longest = torch.tensor(list(lengths.values()), dtype=torch.long, device=metric.device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=getattr(metric, "process_group", None))
    for name, most in zip(names, longest.tolist(), strict=True):
        states = getattr(metric, name)
        states.extend(torch.empty(0, device=metric.device) for _ in range(most - len(states)))
    return lengths


def uneven(metric: Any, lengths: dict[str, int]) -> None:
    """Take the padding `even_list_states` added off ``metric``'s (local) list states."""
    for name, length in lengths.items():
        del getattr(metric, name)[length:]


def gather_states(result: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every process's ``result``, in rank order, as torchmetrics' ``gather_all_tensors`` gives them (padded to the
    largest shape for the transfer, then trimmed), where an empty ``result`` first takes the number of dimensions,
    trailing shape and dtype of the processes that hold data.

    Raises:
        RuntimeError: processes that hold data disagree on the number of dimensions or the dtype of the state,
            or it has more than 8 dimensions (raised on every process alike).
    """
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    result = result.contiguous()
    if result.ndim > _MAX_DIMS:
        raise RuntimeError(f"a metric state of {result.ndim} dimensions; at most {_MAX_DIMS} can be gathered")
    code = _DTYPES.index(result.dtype) if result.dtype in _DTYPES else -1
    meta = [result.ndim, code, int(result.numel() > 0), *result.shape, *[0] * (_MAX_DIMS - result.ndim)]
    local = torch.tensor(meta, dtype=torch.long, device=result.device)
    metas = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(metas, local, group=group)
    table = torch.stack(metas).tolist()  # one host copy per state, at compute time
    holders = [row for row in table if row[2]]
    # A 0-dim state travels as one element, so that it meets 1-dim ones (a list state of a single scalar).
    ndim = max(1, *(row[0] for row in holders or table))
    reference = next((row for row in holders if row[0] == ndim), None) or max(table, key=lambda row: row[0])
    for other, row in enumerate(table):
        if row[2] and (row[0] not in (ndim, 0) or (row[0] == 0 and ndim != 1) or row[1] != reference[1]):
            raise RuntimeError(
                f"a metric state is a {_describe(row)} tensor on process {other} and a {_describe(reference)} "
                "tensor on another: update() got differently shaped tensors on the processes"
            )

    def transfer_shape(row: list[int]) -> list[int]:
        if row[2]:
            return row[3 : 3 + row[0]] if row[0] else [1]
        if row[0] == ndim and row[1] == reference[1]:
            return row[3 : 3 + ndim]
        return [0, *reference[4 : 3 + ndim]]  # no sample: the others' trailing shape

    shapes = [transfer_shape(row) for row in table]
    dtype = _DTYPES[reference[1]] if reference[1] >= 0 else result.dtype
    sent = result.reshape(shapes[rank]).to(dtype)
    largest = [max(shape[d] for shape in shapes) for d in range(ndim)]
    pad: list[int] = []
    for have, want in zip(reversed(sent.shape), reversed(largest), strict=True):
        pad += [0, want - have]
    padded = torch.nn.functional.pad(sent, pad) if any(pad) else sent
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    trimmed = [g[tuple(slice(n) for n in shape)] for g, shape in zip(gathered, shapes, strict=True)]
    trimmed = [t.reshape(()) if row[2] and row[0] == 0 else t for t, row in zip(trimmed, table, strict=True)]
    trimmed[rank] = result if result.numel() else trimmed[rank]  # the local tensor itself, as torchmetrics keeps it
    return trimmed


def _describe(row: list[int]) -> str:
    shape = "x".join(str(n) for n in row[3 : 3 + row[0]]) or "0-dim"
    return f"{shape} {_dtype_name(row[1])}"


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).removeprefix("torch.") if code >= 0 else "another dtype"


# ---------------------------------------------------------- library internals (tests/upstream_internals.py)


def metric_state_defaults(metric: Any) -> Mapping[str, Any]:
    """A torchmetrics ``Metric``'s states by name, with their default values (empty for another object)."""
    return getattr(metric, "_defaults", {})


def metric_reductions(metric: Any) -> Mapping[str, Any]:
    """A torchmetrics ``Metric``'s ``dist_reduce_fx`` by state name (empty for another object)."""
    return getattr(metric, "_reductions", {})


def metric_syncs_on_compute(metric: Any) -> bool:
    """Whether a torchmetrics ``Metric`` synchronises its states when it computes (its ``sync_on_compute``)."""
    return bool(getattr(metric, "_to_sync", True))


def metric_is_synced(metric: Any) -> bool:
    """Whether a torchmetrics ``Metric`` holds the synchronised states (between its sync and unsync)."""
    return bool(getattr(metric, "_is_synced", False))
