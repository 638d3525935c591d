"""A process's random states (Python, numpy, torch's CPU generator, every CUDA device) in the plugin-state format of
`torchloom.checkpoint.plugin_state` (plain values and tensors), so that a checkpoint stores them without pickle."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torchloom.errors import CheckpointError

__all__ = ["random_states", "set_random_states"]


def random_states() -> dict[str, Any]:
    """This process's random states: Python's, numpy's, torch's CPU generator and every CUDA device's, in the
    plugin-state format of `torchloom.checkpoint.plugin_state` (plain values and tensors), so a checkpoint stores them
    without pickle."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    states: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_random_states(states: Mapping[str, Any]) -> None:
    """Restore what `random_states` returned.

    Raises:
        CheckpointError: ``states`` is not what `random_states` returns (a part is missing or of another type).
    """
    try:
        py, npy = states["python"], states["numpy"]
        python_state = (py["version"], tuple(py["internal"]), py["gauss_next"])
        numpy_state = (
            npy["kind"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(states["torch"])
        if "cuda" in states:
            torch.cuda.set_rng_state_all(states["cuda"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(
            f"the saved random states cannot be restored ({type(exc).__name__}: {exc}); expected what "
            "torchloom.checkpoint.store.random_states() returns"
        ) from None
