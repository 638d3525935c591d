"""Buffers logged values on their device and reduces them in one sync at logging intervals."""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import gather_object

from torchloom.errors import TaskError

__all__ = ["LogBuffer"]


class LogBuffer:
    """Weighted running sums of logged values, kept on device until `reduce`."""

    def __init__(self) -> None:
        self._sums: dict[str, Any] = {}  # 0-dim tensors on the values' device, or floats
        self._weights: dict[str, Any] = {}

    def log(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        """Add ``value * weight`` to the running sum of ``name`` (see `TaskModule.log`)."""
        # A bad name or value is the task's input error: a `TaskError` (a TypeError and a ValueError too), one line.
        if not isinstance(name, str) or not name:
            raise TaskError(f"log({name!r}, ...): the name is a {type(name).__name__}; expected a non-empty string")
        for what, x in (("value", value), ("weight", weight)):
            if isinstance(x, bool) or not isinstance(x, torch.Tensor | int | float):
                kind = type(x).__name__
                raise TaskError(
                    f"log({name!r}): {what} {x!r:.60} is a {kind}; expected a number or a one-element tensor"
                )
            if isinstance(x, torch.Tensor) and (x.numel() != 1 or x.is_complex() or x.dtype == torch.bool):
                raise TaskError(
                    f"log({name!r}): {what} is a {x.dtype} tensor of shape {tuple(x.shape)}; expected a single real "
                    "number (a one-element tensor, or a float): reduce it, e.g. with .mean()"
                )
        if isinstance(value, torch.Tensor):
            value = value.detach().reshape(())
            value = value.to(torch.float64 if value.device.type != "mps" else torch.float32)
        if isinstance(weight, torch.Tensor):
            weight = weight.detach().reshape(()).to(value.dtype if isinstance(value, torch.Tensor) else torch.float64)
        self._sums[name] = self._sums.get(name, 0.0) + value * weight
        self._weights[name] = self._weights.get(name, 0.0) + weight

    def clear(self) -> None:
        """Drop everything buffered."""
        self._sums.clear()
        self._weights.clear()

    def __bool__(self) -> bool:
        return bool(self._sums)

    def reduce(self, accelerator: Any) -> dict[str, float]:
        """Return name -> weighted mean over everything buffered, on every rank, and clear the buffer.

        One collective (a sum over ranks) and one device-to-host copy, whatever the number of names.
        """
        names = sorted(self._sums)
        if accelerator.num_processes > 1:
            # One small object gather per logging interval turns a rank logging other names (which would make
            # the reduction below mismatch or hang) into a clear error.
            per_rank = gather_object([names])
            if any(other != names for other in per_rank):
                listing = "; ".join(f"rank {r}: {n}" for r, n in enumerate(per_rank))
                raise TaskError(f"every process must log the same names between two logging steps; got {listing}")
        if not names:
            return {}
        dtype = torch.float64 if accelerator.device.type != "mps" else torch.float32

        def column(d: dict[str, Any]) -> torch.Tensor:
            return torch.stack([torch.as_tensor(d[n], dtype=dtype).to(accelerator.device) for n in names])

        totals = torch.stack([column(self._sums), column(self._weights)])
        if accelerator.num_processes > 1:
            totals = accelerator.reduce(totals, reduction="sum")
        means = (totals[0] / totals[1]).tolist()
        self._sums.clear()
        self._weights.clear()
        return dict(zip(names, means))
