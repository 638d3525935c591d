"""The list of library internals torchloom relies on (`INTERNALS`, kept in `torchloom._internals_table`), how an
entry is resolved on the installed versions (`resolve`), and the accessors through which the core reaches some of
them (`reset_accelerate_state`, the ``metric_*`` and ``loader_*`` functions), so that a change upstream is one edit
here. ``tests/test_internals.py`` resolves every entry and checks that the list names every private access.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from torchloom._internals_table import INTERNALS, LIBRARIES, Internal

__all__ = [
    "INTERNALS",
    "LIBRARIES",
    "Internal",
    "loader_at_end",
    "loader_remainder",
    "metric_is_synced",
    "metric_reductions",
    "metric_state_defaults",
    "metric_syncs_on_compute",
    "reset_accelerate_state",
    "resolve",
]


def resolve(entry: Internal) -> Any:
    """The object at ``entry.path`` on the installed versions.

    Raises:
        LookupError: it is not there (or not as the entry says); the message says what is missing.
    """
    parts = entry.path.split(".")
    if entry.kind == "instance":
        owner, name = ".".join(parts[:-1]), parts[-1]
        _lookup(owner)
        if entry.make is None:
            raise LookupError(f"{entry.path}: an 'instance' entry needs make")
        instance = entry.make()
        if not hasattr(instance, name):
            raise LookupError(f"a {type(instance).__name__} has no attribute {name!r}")
        return getattr(instance, name)
    found = _lookup(entry.path)
    if entry.kind == "source":
        try:
            source = inspect.getsource(found)
        except (OSError, TypeError) as exc:
            raise LookupError(f"the source of {entry.path} cannot be read: {exc}") from None
        missing = [text for text in entry.contains if text not in source]
        if missing:
            raise LookupError(f"the source of {entry.path} no longer contains {', '.join(map(repr, missing))}")
    elif entry.kind == "value" and found != entry.value:
        raise LookupError(f"{entry.path} is {found!r}, no longer {entry.value!r}")
    return found


def _lookup(path: str) -> Any:
    parts = path.split(".")
    module, index = None, len(parts)
    while index > 0:
        try:
            module = importlib.import_module(".".join(parts[:index]))
            break
        except ImportError:
            index -= 1
    if module is None:
        raise LookupError(f"module {parts[0]!r} cannot be imported")
    found: Any = module
    for i, part in enumerate(parts[index:], start=index):
        if not hasattr(found, part):
            raise LookupError(f"{'.'.join(parts[:i])} has no attribute {part!r}")
        found = getattr(found, part)
    return found


# ------------------------------------------------------------------------------------------------- accessors


def reset_accelerate_state() -> None:
    """Clear Accelerate's per-process singletons of the previous Accelerator (its settings, its accumulation and
    registered loaders); the process group (``PartialState``) is kept."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


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


def loader_at_end(loader: Any) -> bool:
    """Whether an Accelerate data loader just yielded its last batch (``False`` for any other loader)."""
    return bool(getattr(loader, "end_of_dataloader", False))


def loader_remainder(loader: Any) -> Any:
    """How many samples the last global batch of an Accelerate data loader holds (-1 when it does not know)."""
    return getattr(loader, "remainder", -1)
