"""The ``torchloom`` command's process set-up: what it puts on ``sys.path`` and how quiet it keeps processes other
than the main one."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, MutableMapping

from ._config import config_paths

__all__ = [
    "forget_modules_found_in",
    "is_other_process",
    "project_imports",
    "put_config_dir_on_path",
    "quiet_other_processes",
]


@contextlib.contextmanager
def project_imports() -> Iterator[None]:
    """The directories one command puts on ``sys.path`` (`put_config_dir_on_path`) are the command's: afterwards
    ``sys.path`` no longer has them and the modules imported from them are forgotten. So a second `main` in the
    same process (a notebook, a test, a script that runs two configs) imports the ``task.py`` next to its own
    config, not the first project's one from ``sys.modules``. A directory that was on the path already, and what
    was imported before, stay."""
    path, modules = list(sys.path), set(sys.modules)
    try:
        yield
    finally:
        added = {os.path.abspath(p) for p in sys.path if p not in path}
        sys.path[:] = [p for p in sys.path if p in path]
        forget_modules_found_in(added, modules)


def forget_modules_found_in(directories: set[str], keep: set[str]) -> None:
    """Remove from ``sys.modules`` the modules not in ``keep`` that were found in one of ``directories`` (absolute
    paths): the module, or the top-level package it belongs to, lies directly in it. A module found through another
    path entry stays, even in a directory below one of them (``src/pkg`` when the working directory was added)."""
    for name in set(sys.modules) - keep:
        top = sys.modules.get(name.partition(".")[0])
        if top is not None and _found_in(top) in directories:
            del sys.modules[name]


def _found_in(module: object) -> str | None:
    """The ``sys.path`` directory a top-level module was found in (None: a built-in or frozen module)."""
    where = getattr(module, "__file__", None)
    if where is None:  # a namespace package: the parent of its first portion
        portions = list(getattr(module, "__path__", []))
        return os.path.dirname(os.path.abspath(portions[0])) if portions else None
    where = os.path.dirname(os.path.abspath(where))
    return os.path.dirname(where) if getattr(module, "__path__", None) is not None else where


def put_config_dir_on_path(argv: list[str]) -> None:
    """Make modules next to the ``--config`` file (and in the working directory) importable, after the installed
    packages: a file there named like a library (``yaml.py``) never replaces it. A config is data; only a
    ``class_path`` (or a plugin the config enables) imports code."""
    paths = [os.getcwd()] + [os.path.dirname(os.path.abspath(p)) for p in config_paths(argv)]
    for path in paths:
        if path not in sys.path:
            sys.path.append(path)


def quiet_other_processes(environ: MutableMapping[str, str]) -> bool:
    """On a process other than the main one of a multi-process run (``WORLD_SIZE`` > 1, ``RANK`` != 0), keep
    library chatter to the main process: transformers' and datasets' logging at errors only (their load reports
    print once, from rank 0) and Python warnings off. ``TRANSFORMERS_VERBOSITY``, ``DATASETS_VERBOSITY`` and
    ``-W`` / ``PYTHONWARNINGS`` set by the user win. Returns whether this is such a process."""
    if not is_other_process(environ):
        return False
    for variable, module in (("TRANSFORMERS_VERBOSITY", "transformers"), ("DATASETS_VERBOSITY", "datasets")):
        if variable in environ:
            continue
        environ[variable] = "error"  # read when the library is first imported
        if module in sys.modules:  # already imported: set it directly
            sys.modules[module].logging.set_verbosity_error()
    if not sys.warnoptions:
        warnings.simplefilter("ignore")
    return True


def is_other_process(environ: Mapping[str, str]) -> bool:
    """Whether the environment says this is a process other than rank 0 of a run of several processes (set by
    ``torchrun`` and ``accelerate launch``)."""
    try:
        return int(environ.get("WORLD_SIZE", "1")) > 1 and int(environ.get("RANK", "0")) != 0
    except ValueError:
        return False
