"""The checkpoint: the whole state of a fit at an optimizer-step boundary, written atomically, loaded without
running code, and kept or pruned over the runs of a training.

Its modules, by role:

- `store`: the one write (`write`) and the one load (`load`) of a checkpoint directory; found, listed, deleted. Its
  docstring describes the format.
- `entries`: the mapping both take, ``{name: stateful}``, and the kinds of entry they dispatch on (a plugin, an
  engine `Part` with its main and per-process parts, `Files` that write a folder of their own: Accelerate's now,
  ``torch.distributed.checkpoint``'s for FSDP later).
- `compat`: whether a checkpoint can continue the run about to load it.
- `manifest`: ``manifest.json``, written last, with every file's size and checksum (XXH3-128).
- `plugin_state`: plugin state on disk without pickle (tensors in safetensors, the rest in JSON).
- `async_save`: the state copied once to host memory, written by a thread (`PendingCheckpoint`).
- `data_position`, `fetch_states`, `random_states`: where the data stands (`DataPosition`: an entry of the mapping),
  how a resumed epoch's loader starts again, and the random states that make a mid-epoch resume exact.
- `replicas`, `reshard`: each process's own part of the state, and a resume on another number of processes.
- `lineage`, `retention`, `scan`: a training in several runs, which checkpoints are kept, and which are usable.

The public entry points are exported here and on ``torchloom`` (`save_plugin_state`, `load_plugin_state`,
`delete_checkpoint`, `prune_checkpoints`, `prune_lineage`, `PendingCheckpoint`, `Resumed`). They are imported when
first used (PEP 562), so that importing one module of this package never imports the others.
"""

from __future__ import annotations

from torchloom._lazy import lazy_exports

#: Public name -> the module of this package that defines it.
_EXPORTS = {
    "PendingCheckpoint": "torchloom.checkpoint.async_save",
    "Resumed": "torchloom.checkpoint.lineage",
    "delete_checkpoint": "torchloom.checkpoint.store",
    "find_checkpoint": "torchloom.checkpoint.store",
    "list_checkpoints": "torchloom.checkpoint.store",
    "load": "torchloom.checkpoint.store",
    "load_plugin_state": "torchloom.checkpoint.plugin_state",
    "prune_checkpoints": "torchloom.checkpoint.retention",
    "prune_lineage": "torchloom.checkpoint.retention",
    "save_plugin_state": "torchloom.checkpoint.plugin_state",
    "scan_checkpoints": "torchloom.checkpoint.scan",
    "write": "torchloom.checkpoint.store",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
