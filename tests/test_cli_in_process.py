"""The in-process way of running the ``torchloom`` command (tests/cli_util.py) gives what a process gives: the same
exit status, stdout and stderr for output, errors of every kind, warnings and logging; and it leaves this process as
it found it. The command-line tests rely on both (they run in this process; the entry points, start-up, signals and
multi-process runs start real processes)."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from cli_util import run_cli, run_cli_process

TASKS = '''
import logging
import warnings

from torchloom.testing import TinyTask


class Chatty(TinyTask):
    """Warns and logs while it is built, as libraries do."""

    def __init__(self, n: int = 16):
        super().__init__(n=n)
        warnings.warn("a user warning from the task")
        warnings.warn("a deprecation a fresh process does not show", DeprecationWarning)
        logging.getLogger("chatty").warning("a warning logged by the task")
        logging.getLogger("chatty").info("an info record nobody shows")


class Broken(TinyTask):
    def __init__(self, n: int = 16):
        super().__init__(n=n)
        raise RuntimeError("not a torchloom error")
'''

CONFIG = {"engine": {"max_epochs": 1, "output_dir": "run"}, "task": {"class_path": "tasks.Chatty"}}

#: ``NAME: ARGS``: commands whose three outputs must be the same, byte for byte, in and out of process: each way
#: the command ends (a parser exit, --help and --version, a one-line error, a run that warns and logs).
COMMANDS = {
    "version": ["--version"],
    "help": ["inspect", "--help"],
    "no command": ["nonsense"],
    "one-line error": ["fit", "--config", "c.yaml", "--engine.max_epochs=0"],
    "a warning and a log record": ["validate", "--config", "c.yaml", "--plugins.progress.enabled=false"],
}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "tasks.py").write_text(TASKS)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CONFIG))
    return tmp_path


def _masked(text: str, project: Path) -> str:
    """Without what differs between two runs of a command: timings and the run directory's number."""
    return re.sub(r"version_\d+", "version_N", re.sub(r"\d+(\.\d+)?", "#", text.replace(str(project), "PROJECT")))


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_command_in_this_process_gives_what_a_process_gives(project: Path, name: str) -> None:
    inside, outside = run_cli(*COMMANDS[name], cwd=project), run_cli_process(*COMMANDS[name], cwd=project)
    outside.stdout = outside.stdout.replace("version_1", "version_0")  # the second run of the project
    assert (inside.returncode, inside.stdout, inside.stderr) == (outside.returncode, outside.stdout, outside.stderr)


def test_a_run_with_the_progress_display_gives_what_a_process_gives(project: Path) -> None:
    inside = run_cli("fit", "--config", "c.yaml", "--task.init_args.n=8", cwd=project)
    outside = run_cli_process("fit", "--config", "c.yaml", "--task.init_args.n=8", cwd=project)
    assert inside.returncode == outside.returncode == 0, (inside.stderr, outside.stderr)
    assert _masked(inside.stdout, project) == _masked(outside.stdout, project)
    assert _masked(inside.stderr, project) == _masked(outside.stderr, project)
    assert "a user warning from the task" in inside.stderr and "a warning logged by the task" in inside.stderr
    assert "deprecation" not in inside.stderr and "info record" not in inside.stderr


def test_an_uncaught_exception_is_a_traceback_and_status_1(project: Path) -> None:
    args = ["fit", "--config", "c.yaml", "--task=tasks.Broken"]
    inside, outside = run_cli(*args, cwd=project), run_cli_process(*args, cwd=project)
    assert inside.returncode == outside.returncode == 1
    assert inside.stderr.startswith("Traceback (most recent call last):\n") and outside.stderr.startswith("Traceback")
    assert inside.stderr.splitlines()[-1] == outside.stderr.splitlines()[-1]
    assert "RuntimeError: not a torchloom error" in inside.stderr and "RuntimeError: not a" in outside.stderr


def test_the_environment_and_pythonpath_of_a_command(project: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``env`` reaches the command (TORCHLOOM_PLUGINS) and PYTHONPATH puts a directory on the path, as for a
    process; neither stays."""
    site = tmp_path_factory.mktemp("site")
    (site / "elsewhere_task.py").write_text("from torchloom.testing import TinyTask as Elsewhere\n")
    args = ["fit", "--config", "c.yaml", "--task=elsewhere_task.Elsewhere", "--print_config"]
    env = {"PYTHONPATH": str(site), "TORCHLOOM_PLUGINS": ""}
    inside, outside = run_cli(*args, cwd=project, env=env), run_cli_process(*args, cwd=project, env=env)
    assert (inside.returncode, inside.stdout, inside.stderr) == (outside.returncode, outside.stdout, outside.stderr)
    assert inside.returncode == 0, inside.stderr
    assert run_cli(*args, cwd=project).returncode == 2  # not on the path any more
    assert "TORCHLOOM_PLUGINS" not in os.environ and "elsewhere_task" not in sys.modules


def _process_state() -> dict[str, object]:
    import torch

    return {
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "path": list(sys.path),
        "argv": list(sys.argv),
        "filters": list(warnings.filters),
        "showwarning": warnings.showwarning,
        "root handlers": list(logging.getLogger().handlers),
        "transformers level": logging.getLogger("transformers").level,
        "signals": {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)},
        "threads": torch.get_num_threads(),
        "stdout": (sys.stdout, sys.stderr),
    }


def test_a_command_leaves_this_process_as_it_found_it(project: Path) -> None:
    before = _process_state()
    # The checkpoint plugin's signal handlers, for the time of the fit.
    fit = run_cli("fit", "--config", "c.yaml", "--plugins.checkpoint.save_on_interrupt=true", cwd=project)
    assert fit.returncode == 0, fit.stderr
    # A process other than the main one: the command quiets transformers and Python's warnings.
    assert run_cli("--version", cwd=project, env={"RANK": "1", "WORLD_SIZE": "2"}).returncode == 0
    assert _process_state() == before
    assert "tasks" not in sys.modules  # the project's module: the next test's tasks.py is its own
