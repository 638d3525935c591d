"""The worked examples of docs/migrate-hf-trainer.md and docs/migrate-lightning.md run and print what the pages
show: every file a page names (a block whose first line is ``# name.py`` or ``# name.yaml``) is written to a
directory, every ``$ command`` of its console blocks runs there, and its output matches the page (``...`` skips
lines; numbers are compared to 4 significant digits). The HF Trainer script of the first guide runs too, and the
torchloom run converted from its arguments ends with the Trainer's validation loss. The Lightning side is not run
(Lightning is not a dependency); tests/test_docs.py compiles it. torchloom's commands run in this process, the
Trainer script in its own."""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

import torchloom
import torchloom_plugins
from torchloom import cli

DOCS = Path(__file__).resolve().parents[1] / "docs"
SOURCE_PATHS = [str(Path(torchloom.__file__).parents[1]), str(Path(torchloom_plugins.__file__).parents[1])]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.DOTALL | re.MULTILINE)
NUMBER = re.compile(r"-?\d+\.\d+(?:e-?\d+)?")
FILE_NAME = re.compile(r"# ([\w-]+\.(?:py|yaml))\b")


def blocks(page: str) -> list[tuple[str, str]]:
    """(language, text) of every fenced block of ``docs/<page>``, in order."""
    return FENCE.findall((DOCS / page).read_text(encoding="utf-8"))


def named_files(page: str) -> dict[str, str]:
    files = {}
    for language, text in blocks(page):
        match = FILE_NAME.match(text)
        if language in ("python", "yaml") and match:
            files[match.group(1)] = text
    return files


def console_commands(page: str) -> dict[str, list[str]]:
    """``$ command`` -> the lines the page shows it printing."""
    commands: dict[str, list[str]] = {}
    for language, text in blocks(page):
        if language != "console":
            continue
        current: list[str] = []
        for line in text.splitlines():
            if line.startswith("$ "):
                current = commands.setdefault(line[2:], [])
            else:
                current.append(line)
    return commands


def same_line(printed: str, shown: str) -> bool:
    if NUMBER.sub("#", printed).rstrip() != NUMBER.sub("#", shown).rstrip():
        return False
    pairs = zip(NUMBER.findall(printed), NUMBER.findall(shown), strict=True)
    return all(float(a) == pytest.approx(float(b), rel=1e-4, abs=1e-12) for a, b in pairs)


def matches(printed: list[str], shown: list[str]) -> bool:
    """Whether ``printed`` is ``shown``, where a ``...`` line of ``shown`` stands for any number of lines."""
    parts: list[list[str]] = [[]]
    for line in shown:
        if line.strip() == "...":
            parts.append([])
        else:
            parts[-1].append(line)
    if len(parts) == 1:
        return len(printed) == len(shown) and all(map(same_line, printed, shown))
    head, *middle, tail = parts
    if len(printed) < len(head) + len(tail) or not all(map(same_line, printed[: len(head)], head)):
        return False
    if tail and not all(map(same_line, printed[len(printed) - len(tail) :], tail)):
        return False
    rest = printed[len(head) : len(printed) - len(tail)]
    for part in middle:
        found = next((i for i in range(len(rest) - len(part) + 1) if all(map(same_line, rest[i:], part))), None)
        if found is None:
            return False
        rest = rest[found + len(part) :]
    return True


def run(command: str, directory: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Run a page's command (``python X.py`` or ``torchloom ...``) in ``directory``; return what it printed: its
    standard output, or its standard error when it printed nothing else (``convert-hf-args -o`` reports there).

    The HF Trainer script runs in a process of its own; torchloom's commands and scripts run in this one (the
    ``torchloom`` command's `main`, the script as ``__main__``), with the working directory on ``sys.path`` and
    the modules imported from there forgotten afterwards."""
    args = shlex.split(command)
    if args[:2] == ["python", "train_hf.py"]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*SOURCE_PATHS, os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(
            [sys.executable, *args[1:]], cwd=directory, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, f"{command}:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout.splitlines()
    modules, path, cwd = set(sys.modules), list(sys.path), os.getcwd()
    capsys.readouterr()
    os.chdir(directory)
    sys.path.insert(0, str(directory))
    try:
        if args[0] == "python":
            runpy.run_path(args[1], run_name="__main__")
        else:
            assert cli.main(args[1:]) == 0, capsys.readouterr()
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == directory:
                del sys.modules[name]
    out = capsys.readouterr()
    return (out.out or out.err).splitlines()


def run_page(page: str, order: list[str], directory: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, list[str]]:
    for name, text in named_files(page).items():
        (directory / name).write_text(text)
    commands = console_commands(page)
    assert set(commands) == set(order), f"docs/{page} shows other commands than this test runs"
    printed = {}
    for command in order:
        printed[command] = run(command, directory, capsys)
        assert matches(printed[command], commands[command]), (
            f"docs/{page}: `{command}` printed:\n" + "\n".join(printed[command]) + "\n\nthe page shows:\n"
            + "\n".join(commands[command])
        )  # fmt: skip
    return printed


HF_COMMANDS = [
    "python train_hf.py",
    "torchloom convert-hf-args training_args.json -o hf.yaml",
    "python train_torchloom.py",
    "torchloom fit --config token_task.yaml --config hf.yaml "
    "--plugins.eval_metrics.metrics='{accuracy: {task: multiclass, num_classes: 2}}'",
]


@pytest.mark.slow  # the HF Trainer and torchloom, each a fine-tune end to end
def test_the_hf_trainer_guide_runs_and_trains_what_the_trainer_trains(tmp_path, capsys):
    printed = run_page("migrate-hf-trainer.md", HF_COMMANDS, tmp_path, capsys)
    # The converted file is the YAML the page shows (the transformers that read the arguments aside).
    shown = next(text for language, text in blocks("migrate-hf-trainer.md") if text.startswith("# torchloom run"))
    version = re.search(r"transformers (\S+)\)", shown)
    assert version is not None
    written = (tmp_path / "hf.yaml").read_text()
    assert written == shown.replace(version.group(1), transformers.__version__)
    # The Trainer's run and the converted torchloom run end with the same validation loss and accuracy.
    trainer = dict(re.findall(r"(\S+) ([\d.]+)", printed["python train_hf.py"][-1]))
    ours = dict(re.findall(r"(\S+) ([\d.]+)", printed["python train_torchloom.py"][-1]))
    assert float(ours["val/loss"]) == pytest.approx(float(trainer["eval_loss"]), abs=2e-6)
    assert ours["val/accuracy"] == trainer["eval_accuracy"]


def test_the_lightning_guide_runs(tmp_path, capsys):
    run_page("migrate-lightning.md", ["python train.py", "torchloom fit --config regression.yaml"], tmp_path, capsys)
    assert {"lit_regression.py", "lit.yaml", "regression_task.py", "regression.yaml"} <= set(
        named_files("migrate-lightning.md")
    )


def test_the_output_matcher_can_fail():
    assert matches(["a", "b 1.0", "c"], ["a", "...", "c"])
    assert matches(["a", "b 1.00001"], ["a", "b 1.0"])
    assert not matches(["a", "b 1.1"], ["a", "b 1.0"])
    assert not matches(["a", "c"], ["a", "...", "b", "...", "c"])
    assert not matches(["a", "b"], ["a"])
