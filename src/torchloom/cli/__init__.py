"""The ``torchloom`` command: ``fit``, ``validate``, ``predict``, ``tune-lr``, ``plugins``, ``inspect``, ``export``,
``convert-hf-args`` and ``estimate-memory``.

Configs are parsed with jsonargparse (as LightningCLI does)::

    torchloom fit --config examples/fine_foods.yaml --engine.max_epochs=2 --data.init_args.batch_size=32
    torchloom fit --config examples/fine_foods.yaml --print_config       # the resolved config, then exit
    torchloom plugins [--json] [--config FILE]                           # installed plugins [and call order]
    torchloom validate --config run.yaml --ckpt_path PATH|last|best      # with a checkpoint's or export's weights
    torchloom predict --config run.yaml --ckpt_path PATH [--input FILE]  # the same --ckpt_path; raw rows of FILE
    torchloom tune-lr --config run.yaml [--min_lr 1e-8 --max_lr 1]       # a learning-rate sweep, a suggestion
    torchloom inspect PATH [--json]                                      # a checkpoint, run directory or export
    torchloom export CHECKPOINT OUT [--merge]                            # a checkpoint's model as a plain folder
    torchloom convert-hf-args args.json [-o run.yaml]                    # HF TrainingArguments -> engine + plugins
    torchloom estimate-memory MODEL [--budget 8GiB] [--optimizer adamw,adafactor] [--json]  # training memory

A config has four sections: ``engine`` (`EngineConfig` fields), ``task`` (``class_path`` of a `TaskModule`
subclass + ``init_args``), ``data`` (same for a `DataModule`, optional) and ``plugins``
(``name: {settings}``). Every command that reads a config (``fit``, ``validate``, ``predict``, ``--print_config``,
``plugins --config``) reads it with `torchloom.cli._config.load_run_config`, so all of them accept and reject the
same files. The ``plugins`` section is read by this package, not by jsonargparse: ``--plugins.NAME.SETTING=VALUE``
changes one setting and keeps the others. So is every option that sets one key of a free-form mapping argument of
the task or the data (``--data.init_args.feature_args.f_min=1e-3``, for an argument typed ``dict[str, Any]``): it
changes that key and keeps the others. Both kinds of values are read as the config file reads its values
(`torchloom.cli._yaml.ConfigLoader`: YAML, with ``1e-3`` a float), and both are applied after the config files and
the other options. The directory of the ``--config`` file (and the working directory) go on ``sys.path`` *after* the
installed packages, so tasks defined next to it import by module name but a file there cannot shadow a library; a
``class_path`` imports (runs) the module it names. They are on the path for the time of the command only: when
`main` returns, ``sys.path`` is as it was and the modules imported from them are forgotten, so a second `main` in
the same process runs its own project's modules::

    torchloom fit --config run.yaml --resume [PATH]                       # continue from the latest checkpoint
    torchloom fit --config run.yaml --resume auto                         # ... if there is one, else start fresh

Errors caused by bad input print one line and exit with status 2; no traceback. A fit stopped by SIGTERM or
Ctrl-C after the ``checkpoint`` plugin saved exits with 128 + the signal number (143, 130). ``fit``, ``validate`` and
``predict`` also enable the default plugins (the ``progress`` display and summary), as `torchloom.Engine` does,
unless the config names them; ``--print_config`` and ``plugins --config`` show the config as given, ``config.yaml``
what the run enabled.

The command is a client of torchloom's public API (the names in ``torchloom.__all__``), as a plugin is: it
builds and composes plugins through `torchloom.Engine` (``Engine.hook_order`` for the call order) and lists
them with `torchloom.installed_plugins`; ``tests/test_cli_public_api.py`` checks its imports.

One module per command (``fit``, ``validate``, ``predict``, ``tune_lr``, ``plugins``, ``inspect``, ``export``,
``convert_hf_args``, ``estimate_memory``: each its parser options and its ``run``), and the parts they share:
``_parser`` (the parser), ``_config`` (reading a run config), ``_options`` (the options read without
jsonargparse), ``_yaml`` (the YAML loader), ``_run`` (what the run commands share) and ``_environment``
(``sys.path``, quiet processes).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from torchloom import TorchloomError, TrainingInterrupted
from torchloom.utils import quiet_libraries

from ._config import load_run_config
from ._environment import project_imports, put_config_dir_on_path, quiet_other_processes
from ._options import take_cli_options
from ._parser import COMMANDS, RUN_COMMANDS, build_parser
from .fit import take_resume_options

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchloom`` console script. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    # A run owns its process: off a terminal, libraries imported later start without progress bars. Before
    # quiet_other_processes, whose variables are the command's, not a user's choice.
    with quiet_libraries(os.environ) if command in RUN_COMMANDS else contextlib.nullcontext():
        return _main(argv, command)


def _main(argv: list[str], command: str | None) -> int:
    quiet_other_processes(os.environ)
    with project_imports():  # a second main() in this process imports its own project's modules
        put_config_dir_on_path(argv)
        try:
            # The run commands' parsers import torch (they describe TaskModule / DataModule); the others start
            # without.
            full = (
                command in RUN_COMMANDS
                or command == "export"  # builds the model of a run config
                or (command == "plugins" and any(a.startswith("--config") for a in argv))
            )
            parser, run_parsers = build_parser(run_commands=full)
            if command in RUN_COMMANDS:
                argv, plugin_options, print_flags = take_cli_options(argv, argv.index(command) + 1)
                argv, resume = take_resume_options(argv, command)
                cfg, _ = load_run_config(parser, argv, command, plugin_options)
                if print_flags is not None:
                    sys.stdout.write(run_parsers[command].dump(cfg[command], **print_flags))
                    return 0
                return _run_command(parser, cfg, command, **resume)
            cfg = parser.parse_args(argv)
            return int(COMMANDS[cfg.subcommand].run(parser, cfg[cfg.subcommand]))
        except TrainingInterrupted as exc:  # a checkpoint was saved: the status tells a scheduler to requeue
            print(f"torchloom: {exc}", file=sys.stderr)
            return exc.exit_code
        except TorchloomError as exc:
            print(f"torchloom: error: {' '.join(str(exc).split())}", file=sys.stderr)  # always one line
            return 2
        except KeyboardInterrupt:
            print("torchloom: interrupted", file=sys.stderr)
            return 130


def _run_command(parser: Any, cfg: Any, command: str, **options: Any) -> int:
    """Run ``command`` (``fit``, ``validate`` or ``predict``) on a parsed config; ``options``: ``fit``'s resume."""
    return int(RUN_COMMANDS[command].run(parser, cfg, **options))
