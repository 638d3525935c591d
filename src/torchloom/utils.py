"""The second public shelf: helpers a plugin may use (atomic writes, strict JSON, warnings that point at the user's
code, byte formatting, did-you-mean, size counters, the shard and the whole value of a sharded (FSDP2) tensor, the
plugins that declare a capability, reserved names and file names).

The first shelf, ``torchloom``, holds the framework's model (`TaskModule`, `Engine`, the hooks, `Plugin`, the
settings, the errors, the checkpoint and memory entry points). A built-in plugin imports only these two; a third-party
plugin may do the same and is then as well placed as the built-ins. Names are imported when first used (PEP 562), as
on ``torchloom``: importing this module imports neither torch nor Accelerate.

Until release 0.3 each of these names but `plugins_with`, `full_tensor`, `local_tensor`, `reshard_module` and
`shard_like` (new here) also imports from ``torchloom`` (``torchloom.warn``), with a ``DeprecationWarning`` that
names its new place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchloom._lazy import lazy_exports

#: Public name -> the module that defines it.
_EXPORTS = {
    "INTERNAL_PREFIX": "torchloom._names",
    "MODEL_DIR": "torchloom.rundir.layout",
    "SUMMARY_FILE": "torchloom.rundir.layout",
    "closest_name": "torchloom._suggest",
    "count_parameters": "torchloom.tools.sizes",
    "format_bytes": "torchloom._bytes",
    "full_tensor": "torchloom.parallel.dtensors",
    "is_out_of_memory": "torchloom.step",
    "is_terminal": "torchloom._output",
    "json_dumps": "torchloom._strict_json",
    "local_tensor": "torchloom.parallel.dtensors",
    "optimizer_state_bytes": "torchloom.tools.sizes",
    "plugins_with": "torchloom.plugins",
    "quiet_libraries": "torchloom._output",
    "reshard_module": "torchloom.parallel.dtensors",
    "shard_like": "torchloom.parallel.dtensors",
    "warn": "torchloom._warn",
    "write_atomically": "torchloom.rundir.atomic",
}

__all__ = [
    "INTERNAL_PREFIX",
    "MODEL_DIR",
    "SUMMARY_FILE",
    "closest_name",
    "count_parameters",
    "format_bytes",
    "full_tensor",
    "is_out_of_memory",
    "is_terminal",
    "json_dumps",
    "local_tensor",
    "optimizer_state_bytes",
    "plugins_with",
    "quiet_libraries",
    "reshard_module",
    "shard_like",
    "warn",
    "write_atomically",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from torchloom._bytes import format_bytes
    from torchloom._names import INTERNAL_PREFIX
    from torchloom._output import is_terminal, quiet_libraries
    from torchloom._strict_json import json_dumps
    from torchloom._suggest import closest_name
    from torchloom._warn import warn
    from torchloom.parallel.dtensors import full_tensor, local_tensor, reshard_module, shard_like
    from torchloom.plugins import plugins_with
    from torchloom.rundir.atomic import write_atomically
    from torchloom.rundir.layout import MODEL_DIR, SUMMARY_FILE
    from torchloom.step import is_out_of_memory
    from torchloom.tools.sizes import count_parameters, optimizer_state_bytes
