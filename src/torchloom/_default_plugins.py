"""The plugins every run enables unless told not to: one list, which `torchloom.Engine` applies, and with it the
``torchloom`` command (which runs through `Engine`), so that a config run from the command line and the same
settings run from Python enable the same plugins.

A default is added after the plugins the run names, with its default settings, when the run does not name it, it
is installed and ``TORCHLOOM_PLUGINS`` (when set) allows it. It is enabled by name through the plugin loader, as
any plugin is: the core names it and imports nothing of it. To switch one off, name it with its setting that
turns it off (``{"progress": {"enabled": False}}``; in YAML ``progress: {enabled: false}``; on the command line
``--plugins.progress.enabled=false``); ``Engine(default_plugins=False)`` enables none of them. Every default has
such a setting, and off it registers no per-step hook (``tests/test_dispatch.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from torchloom.plugins import PluginSpec, installed_plugins, plugin_name

__all__ = ["DEFAULT_PLUGINS", "with_default_plugins"]

#: The default plugins, in the order they are added: ``progress``, the display and end-of-run summary.
DEFAULT_PLUGINS = ("progress",)


def with_default_plugins(spec: PluginSpec) -> PluginSpec:
    """``spec`` (any form `torchloom.enable_plugins` takes), then each of `DEFAULT_PLUGINS` that ``spec`` does not
    name and that is installed and allowed, with its default settings. A ``spec`` of no valid form is returned as
    it is, for `enable_plugins` to reject."""
    if spec is None:
        spec = {}
    if isinstance(spec, Mapping):
        named = {str(name) for name in spec}
    elif isinstance(spec, list | tuple):
        named = set()
        for entry in spec:
            if isinstance(entry, str):
                named.add(entry)
            elif isinstance(entry, Mapping):
                named.update(str(name) for name in entry)
            elif not isinstance(entry, type):
                named.add(plugin_name(entry))
    else:
        return spec
    missing = [name for name in DEFAULT_PLUGINS if name not in named]
    if not missing:
        return spec
    installed = installed_plugins()
    added = [name for name in missing if name in installed]
    if not added:
        return spec
    if isinstance(spec, Mapping):
        return {**spec, **dict.fromkeys(added)}
    return [*spec, *added]
