"""Plugin state on disk without pickle: tensors in safetensors, everything else in JSON.

The contract
------------
A plugin is *stateful* when it has both ``state_dict()`` and ``load_state_dict(state)``. ``state_dict()``
returns a ``dict`` whose values are, at any depth:

- ``torch.Tensor`` (dense; saved with its dtype and shape, loaded onto the device of the tensor at the same
  place in the plugin's current state, else onto the CPU). A ``DTensor`` (a shard of a sharded value, FSDP2) is
  saved as its whole value, gathered when the state is encoded (``full_tensor()``: a collective, which is fine
  since every process encodes its state at the same point), so the file does not depend on the number of
  processes; it loads as a DTensor laid out as the one at the same place in the plugin's current state (each
  process keeps its part of the saved value, no communication), else as a plain tensor of the whole value (the
  plugin places it, `torchloom.utils.shard_like`). The whole value costs one gather per tensor and one whole copy
  on each process while it is encoded; saving each process's shard instead would tie the file to the process
  count and to the process that wrote it, while the plugin state is written by the main process only.
- ``str``, ``int``, ``float``, ``bool``, ``None`` (exact types: a ``numpy.float64`` or an ``IntEnum`` is an
  error, not silently converted),
- ``dict`` with ``str`` keys, ``list`` and ``tuple`` of these (a tuple comes back as a list).

Floats round-trip exactly, NaN and infinities included; ints of any size stay ints. Anything else (a numpy
array, a custom object, a set) is a `PluginError` at save time that names the plugin and where the value is,
such as ``ema: state['shadow'][3] is a numpy.ndarray``.

On disk
-------
Each stateful plugin gets two files in ``directory``, named after the plugin:

- ``<name>.safetensors``: the tensors, under their path in the state (``shadow.3``);
- ``<name>.json``: ``{"format": "torchloom.plugin_state", "version": 2, "plugin": <name>, "state": ...}``,
  strict JSON, where the state has every tensor replaced by ``{"__tensor__": "<key in the safetensors file>"}``
  and every non-finite float by ``{"__float__": "NaN" | "Infinity" | "-Infinity"}``: the names every torchloom
  file uses for them (`torchloom._strict_json`), in a tag, so that a state's string ``"NaN"`` stays a string.
  Version 1 spelt them ``"nan" | "inf" | "-inf"``; it still loads.

Loading reads these two files with ``safetensors.torch.load_file`` and ``json`` and nothing else: no pickle,
no ``torch.load``, so a planted file (Accelerate's ``custom_checkpoint_0.pkl``, say) is never executed.
Each file is written in a temporary directory next to it and moved into place (``os.replace``,
`torchloom.utils.write_atomically`), so a crash never leaves a half-written file under the final name.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from torchloom import _strict_json
from torchloom.errors import PluginError
from torchloom.parallel.dtensors import full, is_dtensor, shard_like
from torchloom.plugins import blame, plugin_name
from torchloom.rundir.atomic import write_atomically

__all__ = ["encode_plugin_state", "load_plugin_state", "save_plugin_state", "stateful_plugins", "write_plugin_state"]

FORMAT = "torchloom.plugin_state"
VERSION = 2
_TENSOR, _FLOAT = "__tensor__", _strict_json.FLOAT_TAG  # the JSON tags: one-key dicts the state may not contain
#: The names of the non-finite floats by the version that wrote them (version 1 wrote Python's repr).
_NONFINITE = {1: {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}, 2: _strict_json.NONFINITE}
_PLAIN = (str, int, float, bool, type(None))
_CONTRACT = "plugin state holds only tensors, str, int, float, bool, None, and dicts (str keys) and lists of these"


def save_plugin_state(
    plugins: Iterable[Any], directory: str | os.PathLike[str], *, is_main_process: bool = True
) -> list[str]:
    """Save the state of every stateful plugin in ``plugins`` to ``directory``, one pair of files per plugin.

    Call it on every process: ``state_dict()`` is called and checked everywhere (so a bad state fails on every
    rank alike, and a plugin may gather in it), and only the process with ``is_main_process`` writes. The
    other processes return without waiting for the files; synchronise before reading them
    (``accelerator.wait_for_everyone()``). The state of the main process is the one saved: every process
    loads the same files.

    Args:
        plugins (`Iterable`): the run's plugin objects (those passed to ``Engine(plugins=...)``, or returned by
            `enable_plugins`). Those without both ``state_dict`` and ``load_state_dict`` are skipped.
        directory (`str` or `os.PathLike`): where to write; created if missing. Give the plugin state a
            directory of its own (``load_plugin_state`` treats every ``*.json`` / ``*.safetensors`` file in it
            as plugin state). Files of the same names are replaced; other files are left alone.
        is_main_process (`bool`, *optional*, defaults to `True`): whether this process writes; pass
            ``accelerator.is_main_process`` in a run with several processes.

    Returns:
        `list[str]`: the names of the plugins whose state was saved, in the order given.

    Raises:
        PluginError: ``state_dict()`` returned something outside the contract (the message names the plugin and
            the path of the bad value), two stateful plugins share a name, or a name cannot be a file name.
        OSError: the files cannot be written.
        Exception: whatever a plugin's ``state_dict`` raises, with a note naming the plugin (Python 3.11 and later).
    """
    encoded = encode_plugin_state(plugins, is_main_process=is_main_process)
    if is_main_process:
        write_plugin_state(encoded, directory)
    return [name for name, _, _ in encoded]


def encode_plugin_state(
    plugins: Iterable[Any], *, is_main_process: bool = True, own: bool = False
) -> list[tuple[str, Any, dict[str, torch.Tensor]]]:
    """The first half of `save_plugin_state`: every stateful plugin's ``state_dict()``, called and checked, as
    ``(name, JSON tree, tensors)``; the tensors are host copies on the main process (none elsewhere). ``own``:
    copies that share memory with nothing live, CPU tensors included (an asynchronous save writes them later,
    while training goes on: `torchloom.checkpoint.async_save`)."""
    return [
        (name, *_encode(name, _state_of(name, plugin, "to save its state"), copy=is_main_process, own=own))
        for name, plugin in _stateful(plugins)
    ]


def _state_of(name: str, plugin: Any, why: str) -> Any:
    """``plugin.state_dict()``; what it raises names the plugin (`torchloom.plugins.blame`), not the caller's."""
    try:
        return plugin.state_dict()
    except Exception as exc:
        blame(exc, name, "state_dict", f" (called {why})")
        raise


def write_plugin_state(
    encoded: list[tuple[str, Any, dict[str, torch.Tensor]]], directory: str | os.PathLike[str]
) -> None:
    """The second half of `save_plugin_state`: write what `encode_plugin_state` returned into ``directory``
    (created if missing). Runs no plugin code and no collective."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for name, tree, tensors in encoded:
        _write(root, name, tree, tensors)


def load_plugin_state(plugins: Iterable[Any], directory: str | os.PathLike[str]) -> list[str]:
    """Load what `save_plugin_state` wrote into the stateful plugins in ``plugins``.

    Every file is read and checked before any plugin's ``load_state_dict`` is called, so a missing or bad file
    leaves every plugin as it was. Only ``<name>.json`` (with ``json``) and ``<name>.safetensors`` (with
    ``safetensors.torch.load_file``) are read; no other file in ``directory`` is opened. Call it on every
    process.

    Args:
        plugins (`Iterable`): the run's plugin objects, as for `save_plugin_state`. Those without both
            ``state_dict`` and ``load_state_dict`` are skipped.
        directory (`str` or `os.PathLike`): the directory `save_plugin_state` wrote.

    Returns:
        `list[str]`: the names of the plugins whose state was loaded, in the order given.

    Raises:
        PluginError: an enabled stateful plugin has no saved state; ``directory`` has state for a plugin that
            is not among the stateful ``plugins``; a file is not torchloom plugin state, is for another plugin,
            or does not match its companion file.
        Exception: whatever a plugin's ``load_state_dict`` raises (with a note naming the plugin, on Python
            3.11 and later).
    """
    root = Path(directory)
    stateful = list(_stateful(plugins))
    names = [name for name, _ in stateful]
    if not root.is_dir():
        if not names and not root.exists():  # nothing to load: an empty folder that a copy dropped (git keeps none)
            return []
        raise PluginError(f"cannot load plugin state: {str(root)!r} is not a directory")
    saved = {p.stem for pattern in ("*.json", "*.safetensors") for p in root.glob(pattern) if p.stem[:1] != "."}
    missing = [n for n in names if n not in saved]
    if missing:
        raise PluginError(
            f"no saved state for the enabled plugin(s) {', '.join(map(repr, missing))} in {str(root)!r} (it has "
            f"state for: {', '.join(map(repr, sorted(saved))) or 'no plugin'}); load a checkpoint of a run with "
            "the same stateful plugins"
        )
    extra = sorted(saved - set(names))
    if extra:
        raise PluginError(
            f"{str(root)!r} has state for the plugin(s) {', '.join(map(repr, extra))}, which are not enabled "
            f"(stateful plugins enabled: {', '.join(map(repr, names)) or 'none'}); enable them, or load from a "
            "directory that holds only the state of the enabled plugins"
        )
    states = [(name, plugin, _read(name, root, plugin)) for name, plugin in stateful]
    for name, plugin, state in states:
        try:
            plugin.load_state_dict(state)
        except Exception as exc:
            blame(exc, name, "load_state_dict", f" (state from {str(root)!r})")
            raise
    return names


def stateful_plugins(plugins: Iterable[Any]) -> dict[str, Any]:
    """``{name: plugin}`` of the stateful plugins in ``plugins`` (both ``state_dict`` and ``load_state_dict``), in
    order: a checkpoint's plugin entries (`torchloom.checkpoint.entries`).

    Raises:
        PluginError: two stateful plugins share a name, or a name cannot be a file name.
    """
    return dict(_stateful(plugins))


# ------------------------------------------------------------------------------------------------ internals


def _stateful(plugins: Iterable[Any]) -> Iterator[tuple[str, Any]]:
    """(name, plugin) for each plugin with both methods; checks that the names are unique file names."""
    seen: set[str] = set()
    for plugin in plugins:
        if not (callable(getattr(plugin, "state_dict", None)) and callable(getattr(plugin, "load_state_dict", None))):
            continue
        name = plugin_name(plugin)
        if not name or name.startswith(".") or any(c in name for c in '/\\:*?"<>|\0'):
            raise PluginError(f"plugin {name!r}: its name cannot be a file name, so its state cannot be saved")
        if name in seen:
            raise PluginError(f"two stateful plugins are named {name!r}; their state would share one file")
        seen.add(name)
        yield name, plugin


def _encode(name: str, state: Any, copy: bool, own: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """The JSON tree of ``state`` and its tensors by key (host copies when ``copy``, else not collected; copies
    of CPU tensors too when ``own``)."""
    if not isinstance(state, dict):
        raise PluginError(f"{name}: state_dict() returned a {_type_name(state)}; expected a dict. {_CONTRACT}")
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    open_containers: set[int] = set()  # on the current path: a container inside itself is an error

    def walk(value: Any, where: str, key: str) -> Any:
        if isinstance(value, torch.Tensor):
            if is_dtensor(value):  # a shard of a sharded (FSDP2) value: the whole value, gathered (a collective)
                value = full(value)
            if value.layout != torch.strided:
                raise PluginError(f"{name}: state{where} is a {value.layout} tensor; save a dense one (.to_dense())")
            unique = key or "tensor"
            n = 1
            while unique in tensors:  # keys with dots in them can collide with nested paths
                n, unique = n + 1, f"{key}#{n + 1}"
            tensors[unique] = _host_copy(value, storages, own) if copy else value
            return {_TENSOR: unique}
        if type(value) is float:
            return value if math.isfinite(value) else _strict_json.tag(value)
        if type(value) in _PLAIN:
            return value
        if isinstance(value, dict | list | tuple):  # subclasses too (OrderedDict); they load as dict / list
            if id(value) in open_containers:
                raise PluginError(f"{name}: state{where} contains itself")
            open_containers.add(id(value))
            try:
                if isinstance(value, dict):
                    for k in value:
                        if type(k) is not str:
                            raise PluginError(
                                f"{name}: state{where} has the key {k!r} ({_type_name(k)}); keys must be str"
                            )
                    if len(value) == 1 and next(iter(value)) in (_TENSOR, _FLOAT):
                        raise PluginError(
                            f"{name}: state{where} is a dict with the single key {next(iter(value))!r}, "
                            "which the file format reserves"
                        )
                    return {k: walk(v, f"{where}[{k!r}]", f"{key}.{k}" if key else k) for k, v in value.items()}
                return [walk(v, f"{where}[{i}]", f"{key}.{i}" if key else str(i)) for i, v in enumerate(value)]
            finally:
                open_containers.discard(id(value))
        raise PluginError(f"{name}: state{where} is a {_type_name(value)}; {_CONTRACT}")

    return walk(state, "", ""), tensors


def _host_copy(tensor: torch.Tensor, storages: set[int], own: bool = False) -> torch.Tensor:
    """A dense, contiguous CPU tensor that shares memory with no other tensor being saved (safetensors refuses
    those): a device-to-host copy for device tensors, the tensor itself when that is already one (a copy when
    ``own``: then it shares memory with nothing live)."""
    t = tensor.detach().to("cpu").contiguous()
    if (own and t.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()) or (
        t.untyped_storage().data_ptr() in storages
    ):
        t = t.clone()
    storages.add(t.untyped_storage().data_ptr())
    return t


def _read(name: str, root: Path, plugin: Any) -> Any:
    """The state saved for ``plugin`` in ``root``, rebuilt: tensors on the devices of the current state."""
    json_path, tensor_path = root / f"{name}.json", root / f"{name}.safetensors"
    for path in (json_path, tensor_path):
        if not path.is_file():
            raise PluginError(
                f"{name}: {str(path)!r} is missing; the plugin's state needs both {name}.json and {name}.safetensors"
            )
    try:
        document = json.loads(json_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise PluginError(f"{name}: {str(json_path)!r} is not valid JSON ({exc})") from None
    if not (isinstance(document, dict) and document.get("format") == FORMAT and "state" in document):
        raise PluginError(f'{name}: {str(json_path)!r} is not torchloom plugin state (no "format": {FORMAT!r})')
    version = document.get("version")
    if not (type(version) is int and version in _NONFINITE) or document.get("plugin") != name:
        raise PluginError(
            f"{name}: {str(json_path)!r} holds version {version!r} state of plugin "
            f"{document.get('plugin')!r}; expected version {' or '.join(map(str, _NONFINITE))} of {name!r}"
        )
    try:
        tensors = load_file(tensor_path, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise PluginError(f"{name}: cannot read {str(tensor_path)!r}: {exc}") from None
    places = _tensor_places(_state_of(name, plugin, f"to load its state from {str(json_path.parent)!r}"))
    used: set[str] = set()

    def build(node: Any, key: str) -> Any:
        if isinstance(node, dict):
            if len(node) == 1 and _TENSOR in node:
                saved_key = node[_TENSOR]
                if not isinstance(saved_key, str) or saved_key not in tensors:
                    raise PluginError(
                        f"{name}: {str(tensor_path)!r} has no tensor {saved_key!r}, which "
                        f"{json_path.name} names; the two files are from different saves"
                    )
                used.add(saved_key)
                return _place(tensors[saved_key], places.get(key))
            if _strict_json.is_tag(node):
                try:
                    return _strict_json.untag(node, _NONFINITE[version])
                except ValueError as exc:
                    raise PluginError(f"{name}: {str(json_path)!r} has {exc}") from None
            return {k: build(v, f"{key}.{k}" if key else k) for k, v in node.items()}
        if isinstance(node, list):
            return [build(v, f"{key}.{i}" if key else str(i)) for i, v in enumerate(node)]
        return node

    state = build(document["state"], "")
    if used != tensors.keys():
        raise PluginError(
            f"{name}: {str(tensor_path)!r} has tensors {sorted(tensors.keys() - used)} that "
            f"{json_path.name} does not name; the two files are from different saves"
        )
    return state


def _tensor_places(state: Any) -> dict[str, torch.Tensor]:
    """Every tensor in a state, by its dotted path: where a load puts the tensor saved at the same path."""
    devices: dict[str, torch.Tensor] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, torch.Tensor):
            devices[key] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, f"{key}.{i}" if key else str(i))

    walk(state, "")
    return devices


def _place(saved: torch.Tensor, current: torch.Tensor | None) -> torch.Tensor:
    """A loaded tensor where the current state has its counterpart: on its device; laid out as it when it is a
    DTensor of the same global shape (this process's part of the whole value saved, no communication); else on the
    CPU."""
    if current is None:
        return saved
    if is_dtensor(current) and tuple(current.shape) == tuple(saved.shape):
        return shard_like(saved, current)
    return saved.to(current.device)


def _write(root: Path, name: str, tree: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Write one plugin's two files atomically (`torchloom.utils.write_atomically`), the tensors first: the JSON file
    is the one that names them."""
    write_atomically(root / f"{name}.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    document = {"format": FORMAT, "version": VERSION, "plugin": name, "state": tree}
    write_atomically(root / f"{name}.json", _strict_json.json_dumps(document, ensure_ascii=False) + "\n")


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
