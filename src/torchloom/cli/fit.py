"""``torchloom fit``: train the config's task; ``--resume [PATH]`` continues from a checkpoint (``--resume auto``:
when the ``output_dir`` has one, else starts fresh), ``--reset_optimizer`` with it keeps the weights and starts a new
optimizer."""

from __future__ import annotations

from typing import Any

from torchloom import ConfigError

from ._run import prepare, report

__all__ = ["add_arguments", "run", "take_resume_options"]

HELP = "fit a task"


def add_arguments(sub: Any) -> None:
    """``fit`` takes only the run commands' options (``--resume`` and ``--reset_optimizer``: `take_resume_options`)."""


def run(parser: Any, cfg: Any, resume: str | bool | None = None, reset_optimizer: bool = False) -> int:
    """Fit the task of a parsed config; print the run's output directory, why it stopped early, its metrics."""
    engine, task, data = prepare(parser, cfg, "fit")
    # --resume alone: the output_dir, whose latest checkpoint fit takes
    ckpt_path = engine.config.output_dir if resume is True else resume if isinstance(resume, str) else None
    metrics = engine.fit(task, datamodule=data, ckpt_path=ckpt_path, reset_optimizer=reset_optimizer)
    stopped = (
        []
        if engine.stop_reason is None
        else [f"  stopped early at step {engine.progress.global_step}: {engine.stop_reason}"]
    )
    return report(engine, "fit", metrics, after=stopped)


def take_resume_options(argv: list[str], command: str) -> tuple[list[str], dict[str, Any]]:
    """Take ``--resume [PATH]`` and ``--reset_optimizer`` (``fit`` only) out of ``argv``.

    ``--resume`` alone resumes from the latest checkpoint under the run's ``output_dir``; ``--resume PATH`` (or
    ``--resume=PATH``) from a checkpoint, a run directory or an ``output_dir``; ``--resume auto`` from the latest
    checkpoint of the ``output_dir`` when there is one, else it starts fresh (the same command line for the first
    start and every restart of a preempted job; a directory named ``auto`` is ``./auto``). Checkpoints that are all
    unusable are not "none", and a latest one that is unusable is not skipped: ``fit`` refuses them
    (`torchloom.Engine.fit`). Not with ``--engine.fast_dev_run`` when there is a checkpoint to resume from.

    Raises:
        ConfigError: either option with a command other than ``fit``, or ``--reset_optimizer`` without ``--resume``.
    """
    rest: list[str] = []
    resume: str | bool | None = None
    reset, i = False, 0
    while i < len(argv):
        option, has_value, text = argv[i].partition("=")
        if option == "--resume":
            if has_value:
                resume = text
            elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                resume, i = argv[i + 1], i + 1
            else:
                resume = True
        elif argv[i] == "--reset_optimizer":
            reset = True
        else:
            rest.append(argv[i])
        i += 1
    if (resume is not None or reset) and command != "fit":
        raise ConfigError(f"--resume and --reset_optimizer apply to 'torchloom fit', not to '{command}'")
    if reset and resume is None:
        raise ConfigError("--reset_optimizer applies to a resumed fit; add --resume [PATH]")
    return rest, ({"resume": resume, "reset_optimizer": reset} if command == "fit" else {})
