"""How big a model and its optimizer state are, counted from the tensors themselves: `count_parameters` and
`optimizer_state_bytes`, the one count behind the run summary (``summary.json``), the model card, the ``optimizer``
plugin's ``optimizer/state_bytes`` and the benchmarks.

Both read tensor metadata only (shapes, dtypes, storage pointers): no data is copied and no host-device
synchronisation happens, so they can run at any point of a fit.
"""

from __future__ import annotations

from typing import Any

import torch

from torchloom.parallel.dtensors import local, local_nbytes

__all__ = ["count_parameters", "optimizer_state_bytes"]


def _elements(p: torch.Tensor) -> int:
    """The weights a parameter stands for: its ``numel``, except bitsandbytes' ``Params4bit``, which packs two
    4-bit values per byte of its storage dtype (peft's ``get_nb_trainable_parameters`` counts them the same way)."""
    if type(p).__name__ == "Params4bit":
        storage = getattr(p, "quant_storage", torch.uint8)
        itemsize = storage.itemsize if isinstance(storage, torch.dtype) else 1
        return p.numel() * 2 * itemsize
    return p.numel()


def count_parameters(model: torch.nn.Module) -> dict[str, Any]:
    """Count a model's parameters, each shared parameter once.

    Args:
        model (`torch.nn.Module`): any module (wrapped in DDP or not: the wrapper holds the same parameters).

    Returns:
        `dict`: ``total`` (`int`, weights, a 4-bit ``bitsandbytes.nn.Params4bit`` counted as the weights it packs),
        ``trainable`` (`int`, those with ``requires_grad``), ``bytes`` (`int`, the parameters' storage as held: 4-bit
        weights at half a byte each, their quantisation statistics, which are not parameters, excluded) and
        ``dtypes`` (`dict[str, int]`, weights per dtype name; a 4-bit weight under its storage dtype, ``uint8``) and
        ``process_bytes`` (`int`, the parameters' bytes this process holds: ``bytes`` unless the parameters are
        sharded DTensors, FSDP2, whose local shards are counted). Counts and ``bytes`` are the whole model's: a
        sharded parameter counts with its global shape.

    Example: ``torchloom.utils.count_parameters(torch.nn.Linear(3, 2))["total"] == 8``.
    """
    params = list(model.parameters())  # each shared Parameter once
    dtypes: dict[str, int] = {}
    for p in params:
        name = str(p.dtype).removeprefix("torch.")
        dtypes[name] = dtypes.get(name, 0) + _elements(p)
    return {
        "total": sum(_elements(p) for p in params),
        "trainable": sum(_elements(p) for p in params if p.requires_grad),
        "bytes": sum(p.numel() * p.element_size() for p in params),
        "process_bytes": sum(local_nbytes(p) for p in params),
        "dtypes": dtypes,
    }


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, *, per_process: bool = False) -> int:
    """Return the bytes held by an optimizer's state: the sum of ``nbytes`` of every distinct state tensor.

    A tensor shared between parameters (bitsandbytes' quantization maps) counts once; a parameter that never had
    a gradient has no state (torch's optimizers create it at the first step that sees a gradient), so a frozen
    base costs nothing here. Accelerate's ``AcceleratedOptimizer`` is read through to the optimizer it wraps. The
    state of sharded parameters (FSDP2) is DTensors: each counts with its global shape (the whole state, as a
    checkpoint holds it), or with ``per_process`` its local shard (what this process holds); two tensors are the
    same when their local shards share storage.

    Args:
        optimizer (`torch.optim.Optimizer`): any optimizer with torch's ``state`` mapping.
        per_process (`bool`): count what this process holds (differs only for DTensors).

    Returns:
        `int`: bytes, ``0`` before the first step.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    seen: set[tuple[str, int, int]] = set()
    total = 0
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                part = local(value)
                key = (str(part.device), part.data_ptr(), part.nbytes)
                if key not in seen:
                    seen.add(key)
                    total += local_nbytes(value) if per_process else value.numel() * value.element_size()
    return total
