"""Run the ``torchloom`` command in this process, as a fresh ``python -m torchloom.cli`` process would run it.

`run_cli` calls `torchloom.cli.main` with the arguments, in the given working directory and environment, and
returns what a subprocess would have given: a `subprocess.CompletedProcess` with the exit status (``main``'s return
value, or the code of a ``SystemExit``, or 1 and the traceback on stderr for an exception, as the interpreter does)
and everything the command wrote to stdout and stderr: ``print``, Python warnings (under the interpreter's default
warning filters, not pytest's), and logging (the lastResort handler and the libraries' own stream handlers, such as
transformers'), each on the stream a process would have written it to.

It starts no interpreter, so it saves the import of torch, transformers and the engine (1 to 3 s a command on the
2-core machine). What a subprocess proves and this does not (the entry point scripts, start-up and what a command
imports, signals, exit statuses set by the interpreter, several processes) is tested with `run_cli_process`.

Afterwards the process is as it was: the working directory, ``os.environ``, ``sys.path``, ``sys.argv``, the modules
imported from the directories the command put on the path (a ``regression.py`` next to one test's config is never
found by the next test), the warning filters, the logging handlers and levels, the signal handlers and torch's
thread count. The engine itself clears Accelerate's per-run state when it builds an Accelerator
(`torchloom._internals.reset_accelerate_state`); the process group (one process here) is kept, as in a process
that runs several commands.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torchloom
import torchloom_plugins
from torchloom.cli._environment import forget_modules_found_in

#: The torchloom under test (the source tree, or whatever this process imports), ahead of an installed copy.
SOURCE_PATHS = [str(Path(torchloom.__file__).parents[1]), str(Path(torchloom_plugins.__file__).parents[1])]

#: The warning filters of a fresh CPython 3.10+ interpreter started without -W or PYTHONWARNINGS.
DEFAULT_WARNING_FILTERS = [
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, None),
    ("ignore", PendingDeprecationWarning, None),
    ("ignore", ImportWarning, None),
    ("ignore", ResourceWarning, None),
]
SIGNALS = [
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, name)
]


def run_cli(
    *args: str, cwd: Path | str, env: Mapping[str, str | None] | None = None, argv0: str = "torchloom"
) -> subprocess.CompletedProcess[str]:
    """``torchloom ARGS`` in ``cwd`` with the variables of ``env`` added to this process's environment (a value
    None: removed from it), run in this process; what ``subprocess.run([sys.executable, "-m", "torchloom.cli",
    *args], cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True)`` would return. A ``PYTHONPATH`` in
    ``env`` goes on ``sys.path`` as the interpreter would put it there (after the working directory, before the
    installed packages)."""
    from torchloom import cli

    out, err = io.StringIO(), io.StringIO()
    with _process_like(Path(cwd), dict(env or {}), out, err, [argv0, *args]):
        try:
            status = cli.main(list(args))
        except SystemExit as exc:  # the argument parser's errors, --help and --version
            status = _exit_status(exc, err)
        except BaseException:  # what the interpreter does with an uncaught exception
            traceback.print_exc(file=err)
            status = 1
        else:
            status = _exit_status(SystemExit(status), err)
    return subprocess.CompletedProcess(
        [sys.executable, "-m", "torchloom.cli", *args], status, out.getvalue(), err.getvalue()
    )


def run_cli_process(
    *args: str,
    cwd: Path | str,
    env: Mapping[str, str | None] | None = None,
    module: str = "torchloom.cli",
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` in a process of its own, importing the torchloom under test: for what only a real
    process shows (the entry points, start-up, signals, exit statuses the interpreter sets). ``env`` as for
    `run_cli`."""
    environ = _environment(dict(os.environ), env or {})
    environ["PYTHONPATH"] = os.pathsep.join([*SOURCE_PATHS, *filter(None, [environ.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout
    )


def _environment(environ: dict[str, str], changes: Mapping[str, str | None]) -> dict[str, str]:
    """``environ`` with ``changes`` made (None: the variable removed)."""
    for name, value in changes.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return environ


def _exit_status(exc: SystemExit, err: io.StringIO) -> int:
    """The status of a process ended by ``exc`` (``SystemExit(None)`` is 0; a message is printed, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=err)
    return 1


@contextlib.contextmanager
def _process_like(
    cwd: Path, env: dict[str, str | None], out: io.StringIO, err: io.StringIO, argv: list[str]
) -> Iterator[None]:
    """This process, for the time of the block, as a fresh ``python -m`` process in ``cwd`` with ``env`` writing to
    ``out`` and ``err``; afterwards as it was."""
    saved_cwd, saved_environ = os.getcwd(), dict(os.environ)
    saved_path, saved_argv, saved_warnoptions = list(sys.path), list(sys.argv), list(sys.warnoptions)
    saved_modules = set(sys.modules)
    saved_signals = {number: signal.getsignal(number) for number in SIGNALS}
    torch = sys.modules.get("torch")
    saved_threads = torch.get_num_threads() if torch is not None else None
    restore_logging = _capture_logging(out, err)
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(DEFAULT_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module or "")
            environ = _environment(dict(os.environ), env)
            python_warnings = [option for option in environ.get("PYTHONWARNINGS", "").split(",") if option]
            sys.warnoptions[:] = python_warnings
            for option in python_warnings:
                warnings._setoption(option)  # type: ignore[attr-defined]  # as the interpreter reads it
            warnings.showwarning = _show_warning_on(err)
            os.environ.clear()
            os.environ.update(environ)
            os.chdir(cwd)
            python_path = [os.path.abspath(p) for p in (env.get("PYTHONPATH") or "").split(os.pathsep) if p]
            sys.path[:] = [str(cwd.resolve()), *python_path, *saved_path]  # python -m: the working directory first
            sys.argv[:] = argv
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_environ)
        added = {os.path.abspath(p) for p in sys.path if p not in saved_path}
        sys.path[:] = saved_path
        sys.argv[:] = saved_argv
        sys.warnoptions[:] = saved_warnoptions
        # The project's task and data modules (found in the working directory or on PYTHONPATH), as main() does
        forget_modules_found_in(added, saved_modules)
        for number, handler in saved_signals.items():
            if handler is not None:
                signal.signal(number, handler)
        if saved_threads is not None and torch.get_num_threads() != saved_threads:
            torch.set_num_threads(saved_threads)
        restore_logging()


def _show_warning_on(err: io.StringIO) -> Any:
    def show(
        message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: str | None = None
    ) -> None:
        (file or err).write(warnings.formatwarning(message, category, filename, lineno, line))

    return show


def _capture_logging(out: io.StringIO, err: io.StringIO) -> Any:
    """Send logging where a process would: the libraries' stream handlers (bound to the stream that was stderr
    when the library first logged) to ``err`` (or ``out``), and the root logger's records to the lastResort handler
    (stderr) rather than to pytest's capture. Returns the function that undoes it, levels included."""
    loggers = [
        logging.getLogger(),
        *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)),
    ]
    levels = {lg: (lg.level, lg.disabled, lg.propagate, list(lg.handlers)) for lg in loggers}
    streams: dict[logging.StreamHandler[Any], Any] = {}
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
    for lg in loggers:
        for handler in lg.handlers:
            if type(handler) is logging.StreamHandler and handler not in streams:
                streams[handler] = handler.stream
                to_stdout = handler.stream in (sys.stdout, sys.__stdout__)
                _set_stream(handler, out if to_stdout else err)
    disable = logging.root.manager.disable

    def restore() -> None:
        for handler, stream in streams.items():
            # A stream closed meanwhile (a library that first logged under an earlier test's capture): stderr.
            _set_stream(handler, sys.stderr if getattr(stream, "closed", False) else stream)
        # A library first imported by the command bound its handler to ``err``: give it this process's stderr.
        for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            for handler in getattr(lg, "handlers", ()):
                if isinstance(handler, logging.StreamHandler) and handler.stream in (out, err):
                    _set_stream(handler, sys.stdout if handler.stream is out else sys.stderr)
        for lg, (level, disabled, propagate, handlers) in levels.items():
            lg.setLevel(level)
            lg.disabled, lg.propagate = disabled, propagate
            lg.handlers[:] = handlers
        logging.disable(disable)

    return restore


def _set_stream(handler: logging.StreamHandler[Any], stream: Any) -> None:
    """``handler.setStream(stream)``, which flushes the old stream first, unless that stream is closed: a handler a
    library made while an earlier test captured stderr keeps pytest's capture file, closed since (flushing it
    raised ``ValueError: I/O operation on closed file`` in the next in-process CLI test)."""
    if getattr(handler.stream, "closed", False):
        handler.stream = stream
    else:
        handler.setStream(stream)
