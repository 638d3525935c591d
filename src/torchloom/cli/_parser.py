"""The ``torchloom`` parser: one subcommand per command module, in the order ``--help`` lists them."""

from __future__ import annotations

import types
from typing import Any

import torchloom

from . import convert_hf_args, estimate_memory, export, fit, inspect, plugins, predict, tune_lr, validate
from ._run import add_run_arguments

__all__ = ["COMMANDS", "RUN_COMMANDS", "build_parser"]

#: The commands that run a task, each with its module (``add_arguments``, ``run``).
RUN_COMMANDS: dict[str, types.ModuleType] = {"fit": fit, "validate": validate, "predict": predict, "tune-lr": tune_lr}
#: The other commands, each with its module (``HELP``, ``parser``, ``run``).
COMMANDS: dict[str, types.ModuleType] = {
    "plugins": plugins,
    "inspect": inspect,
    "export": export,
    "convert-hf-args": convert_hf_args,
    "estimate-memory": estimate_memory,
}


def build_parser(run_commands: bool = True) -> tuple[Any, dict[str, Any]]:
    """The ``torchloom`` parser, and the parser of each run command (for ``--print_config``).

    With ``run_commands`` false the run commands get a parser that only names them (enough for ``--help``,
    ``--version``, ``plugins`` and ``inspect``), which imports neither torch nor the task and data classes.
    """
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(
        prog="torchloom", description="Train, validate and inspect torchloom runs.", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"torchloom {torchloom.__version__}")
    subcommands = parser.add_subcommands(dest="subcommand")
    run_parsers = {}
    for command, module in RUN_COMMANDS.items():
        sub = ArgumentParser(description=f"{command} a task (see 'torchloom {command} --help')", allow_abbrev=False)
        if run_commands:
            add_run_arguments(sub)
            module.add_arguments(sub)
            run_parsers[command] = sub
        subcommands.add_subcommand(command, sub, help=module.HELP)
    for command, module in COMMANDS.items():
        subcommands.add_subcommand(command, module.parser(), help=module.HELP)
    return parser, run_parsers
