"""Where torchloom's output goes: whether a stream is a terminal (`is_terminal`, the one rule the ``progress``
display and the quieting below follow), and the libraries' progress bars and colour codes kept out of output that
is not a terminal (`quiet_libraries`).

Off a terminal (a log file, ``| tee``, CI), a tqdm bar is not redrawn in place: every update is one more ``\\r``
segment of one growing line (``datasets``' ``map``, transformers' "Loading weights" and "Writing model shards"),
and transformers writes ANSI colour codes into its load report whatever the stream (the
report's title unconditionally; its table when *stdout* is a terminal, though it logs to stderr; it does not read
``NO_COLOR``). `quiet_libraries` switches those off through the libraries' own settings and leaves alone a
library whose output the user configured.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, MutableMapping
from typing import IO, Any

__all__ = ["is_terminal", "quiet_libraries"]

#: A library's variables: setting one of them (to any value) is the user's choice, which `quiet_libraries` keeps.
USER_SETTINGS = {
    "datasets": ("HF_DATASETS_DISABLE_PROGRESS_BARS", "DATASETS_VERBOSITY"),
    "transformers": ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY"),
}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # CSI sequences: colours, bold, cursor moves
_LOGGER_PREFIX = "transformers"
_active = 0  # nesting depth of quiet_libraries blocks that strip colour codes (an Engine call inside the command)


def is_terminal(file: IO[str] | None = None) -> bool:
    """Whether ``file`` (by default `sys.stdout`) is an interactive terminal, one that can redraw a line in place.

    rich decides, as it does for its own live displays: a terminal that is not ``TERM=dumb``; ``TTY_COMPATIBLE``,
    ``TTY_INTERACTIVE`` and ``FORCE_COLOR`` override the detection; a Jupyter notebook is not a terminal. The
    ``progress`` plugin draws its bar where this is true (unless its ``terminal`` setting says otherwise), and
    `quiet_libraries` asks it about `sys.stderr`, where the libraries write.

    Example: ``torchloom.utils.is_terminal()`` is false under ``torchloom fit ... > log.txt``.
    """
    from rich.console import Console

    console = Console(file=file if file is not None else sys.stdout)
    return bool(console.is_terminal and console.is_interactive)


def _in_notebook() -> bool:
    from rich.console import Console

    return bool(Console(file=sys.stderr).is_jupyter)  # tqdm draws widgets there, not \r lines


@contextlib.contextmanager
def quiet_libraries(environ: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """While the block runs, and when `sys.stderr` is not a terminal (`is_terminal`; a notebook counts as one):
    the progress bars of ``datasets``, transformers and ``huggingface_hub`` are off, and transformers' log messages
    carry no ANSI colour codes (also on a terminal when ``NO_COLOR`` is set). Afterwards every setting is what it was.

    A library the user configured is left alone: ``datasets`` when ``HF_DATASETS_DISABLE_PROGRESS_BARS`` or
    ``DATASETS_VERBOSITY`` is set (to any value), or when its verbosity is not the default ``WARNING``;
    transformers and ``huggingface_hub`` when ``HF_HUB_DISABLE_PROGRESS_BARS`` or ``TRANSFORMERS_VERBOSITY`` is set,
    or when transformers' verbosity is not ``WARNING``. Bars already off stay off. Colour codes have no library
    setting: they follow the terminal and ``NO_COLOR``. The switches are the libraries' own
    (``datasets.disable_progress_bars``, ``transformers.utils.logging.disable_progress_bar``,
    ``huggingface_hub.utils.disable_progress_bars``) and a `logging.setLogRecordFactory` step that strips the codes
    from the records of the ``transformers`` loggers.

    `torchloom.Engine`'s ``fit``, ``validate`` and ``predict`` run inside it (the data step, the model the task
    builds in ``configure_model``, the saved model), and so does the ``torchloom`` command's whole run (the task
    and data built from the config too).

    Args:
        environ (`MutableMapping[str, str]`, *optional*): the environment of a process the caller owns (the
            ``torchloom`` command passes `os.environ`). A library not imported yet is then quieted by its variable
            (``HF_DATASETS_DISABLE_PROGRESS_BARS=1``, ``HF_HUB_DISABLE_PROGRESS_BARS=1``), which it reads when it is
            imported; these stay set after the block. Without it, only libraries already imported are quieted.

    Example:

    .. code-block:: python

        with torchloom.utils.quiet_libraries():  # in a script whose output goes to a file
            data = datasets.load_dataset("csv", data_files="reviews.csv")
    """
    env = environ if environ is not None else os.environ
    undo: list[Callable[[], None]] = []
    try:
        if not is_terminal(sys.stderr) and not _in_notebook():
            _quiet_datasets(env, environ is not None, undo)
            _quiet_transformers(env, environ is not None, undo)
            _strip_colours(undo)
        elif env.get("NO_COLOR"):
            _strip_colours(undo)
        yield
    finally:
        for step in reversed(undo):
            step()


def _chosen(library: str, env: MutableMapping[str, str]) -> bool:
    return any(variable in env for variable in USER_SETTINGS[library])


def _quiet_datasets(env: MutableMapping[str, str], by_variable: bool, undo: list[Callable[[], None]]) -> None:
    if _chosen("datasets", env):
        return
    datasets = sys.modules.get("datasets")
    if datasets is None:
        if by_variable:
            env["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
        return
    if datasets.logging.get_verbosity() != logging.WARNING or datasets.are_progress_bars_disabled():
        return
    datasets.disable_progress_bars()
    undo.append(datasets.enable_progress_bars)


def _quiet_transformers(env: MutableMapping[str, str], by_variable: bool, undo: list[Callable[[], None]]) -> None:
    if _chosen("transformers", env):
        return
    if "huggingface_hub" not in sys.modules:  # nor transformers, which imports it
        if by_variable:
            env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' own bars start from the hub's setting
        return
    from huggingface_hub import utils as hub

    hf_logging: Any = None
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        if hf_logging.get_verbosity() != logging.WARNING:
            return
    hub_was_disabled = hub.are_progress_bars_disabled()
    if not hub_was_disabled:
        hub.disable_progress_bars()
        undo.append(hub.enable_progress_bars)
    if hf_logging is not None:  # transformers keeps a switch of its own
        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            undo.append(lambda: _enable_transformers_bars(hub_was_disabled))
    elif not hub_was_disabled:  # imported inside the block, transformers copies the hub's switch: off
        undo.append(lambda: _enable_transformers_bars(hub_was_disabled))


def _enable_transformers_bars(hub_was_disabled: bool) -> None:
    """Turn transformers' bars back on (when it is imported by now), and the hub's back off if they were off before
    (transformers' switch moves both)."""
    if "transformers" not in sys.modules:
        return
    from huggingface_hub import utils as hub
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    if hub_was_disabled:
        hub.disable_progress_bars()


def _strip_colours(undo: list[Callable[[], None]]) -> None:
    global _active
    _active += 1
    if _active == 1:
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            name = record.name
            if _active and (name == _LOGGER_PREFIX or name.startswith(f"{_LOGGER_PREFIX}.")):
                if isinstance(record.msg, str):
                    record.msg = _ANSI.sub("", record.msg)
                if isinstance(record.args, tuple):
                    record.args = tuple(_ANSI.sub("", a) if isinstance(a, str) else a for a in record.args)
            return record

        logging.setLogRecordFactory(factory)

        def remove() -> None:
            if logging.getLogRecordFactory() is factory:  # else another factory wraps ours: it stays, inactive
                logging.setLogRecordFactory(previous)

        undo.append(remove)

    def leave() -> None:
        global _active
        _active -= 1

    undo.append(leave)
