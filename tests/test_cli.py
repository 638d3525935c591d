"""The ``torchloom`` command: fit with config + dotted overrides, resolved config, plugins listing, errors."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from cli_util import run_cli  # in this process; the entry points' own tests: tests/test_cli_inputs.py

TASK_MODULE = '''
import torch
from torchloom.testing import TinyTask


class Regression(TinyTask):
    """TinyTask whose settings are plain types, so a YAML config can set them."""

    def __init__(self, lr: float = 0.1, batch_size: int = 4, n: int = 32):
        super().__init__(n=n, batch_size=batch_size, lr=lr)
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A directory with a task module next to a config, as a user project would have it."""
    (tmp_path / "regression.py").write_text(TASK_MODULE)
    config = {
        "engine": {"max_epochs": 2, "log_every_n_steps": 2, "output_dir": str(tmp_path / "run")},
        "task": {"class_path": "regression.Regression", "init_args": {"lr": 0.05}},
        "plugins": {},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def test_fit_writes_resolved_config_and_metrics(project: Path) -> None:
    proc = run_cli(
        "fit", "--config", "config.yaml", "--engine.max_epochs=3", "--task.init_args.batch_size=8", cwd=project
    )
    assert proc.returncode == 0, proc.stderr
    run_dir = project / "run" / "version_0"
    lines = proc.stdout.splitlines()  # the run directory when the run starts, and again with the results
    assert lines.index(f"torchloom fit: run directory {run_dir}") < lines.index(f"torchloom fit: output in {run_dir}")
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    # The override on the command line wins over the file; unspecified fields are filled with defaults.
    assert resolved["engine"]["max_epochs"] == 3
    assert resolved["engine"]["seed"] == 0
    assert resolved["task"]["init_args"] == {"lr": 0.05, "batch_size": 8, "n": 32}
    records = [json.loads(line) for line in (project / "run" / "version_0" / "metrics.jsonl").read_text().splitlines()]
    # 32 samples / batch 8 = 4 optimizer steps per epoch, 3 epochs, a train/loss record every 2 steps.
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == [2, 4, 6, 8, 10, 12]
    val = [r for r in records if "val/loss" in r]
    assert [(r["step"], r["epoch"]) for r in val] == [(4, 0), (8, 1), (12, 2)]
    assert val[-1]["val/loss"] < val[0]["val/loss"]
    assert "val/loss" in proc.stdout


def test_fit_stopped_early_says_when_and_why(project: Path) -> None:
    config = yaml.safe_load((project / "config.yaml").read_text())
    config["plugins"] = {"early_stopping": {"monitor": "val/loss", "divergence_threshold": 0.0}}  # any loss > 0
    (project / "config.yaml").write_text(yaml.safe_dump(config))
    proc = run_cli("fit", "--config", "config.yaml", cwd=project)
    assert proc.returncode == 0, proc.stderr
    # The first validation (end of epoch 0, step 8 of 16) crosses the threshold: the fit ends there, successfully.
    assert "  stopped early at step 8: early_stopping: 'val/loss' " in proc.stdout
    assert json.loads((project / "run" / "version_0" / "summary.json").read_text())["optimizer_steps"] == 8


def test_print_config_shows_the_resolved_config_and_exits(project: Path) -> None:
    proc = run_cli("fit", "--config", "config.yaml", "--engine.seed=7", "--print_config", cwd=project)
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["engine"]["seed"] == 7
    assert printed["task"]["class_path"] == "regression.Regression"
    assert not (project / "run").exists()  # nothing ran


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ('--plugins={"grad_acum": {}}', "unknown plugin 'grad_acum'. Did you mean 'grad_accum'?"),
        ("--engine.max_epochs=0", "engine: setting 'max_epochs' = 0; expected a positive integer"),
        ("--resume", "/run': no such file or directory"),  # no run has written output_dir yet
        ("--resume=nowhere", "cannot resume from 'nowhere': no such file or directory"),
        ("--reset_optimizer", "--reset_optimizer applies to a resumed fit; add --resume [PATH]"),
    ],
)
def test_user_errors_are_one_line_without_traceback(project: Path, override: str, expected: str) -> None:
    proc = run_cli("fit", "--config", "config.yaml", override, cwd=project)
    assert proc.returncode == 2
    assert proc.stderr.startswith("torchloom: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((project / "run").rglob("config.yaml"))  # nothing half-written


def test_resume_is_an_option_of_fit_only(project: Path) -> None:
    proc = run_cli("validate", "--config", "config.yaml", "--resume", cwd=project)
    assert proc.returncode == 2
    assert "--resume and --reset_optimizer apply to 'torchloom fit', not to 'validate'" in proc.stderr


def test_plugins_lists_installed_builtins(tmp_path: Path) -> None:
    proc = run_cli("plugins", "--json", "--check", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {row["name"]: row for row in json.loads(proc.stdout) if row["distribution"] == "torchloom"}
    assert set(rows) >= {"grad_accum", "grad_checkpoint", "grad_clip", "local_sgd", "mixed_precision", "optimizer"}
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row["status"])
        assert row["version"] and row["summary"] and row["hooks"], row
    table = run_cli("plugins", cwd=tmp_path).stdout
    assert "grad_accum  (torchloom" in table and "hooks:" in table


def test_plugins_reads_every_summary_and_hook_list_from_source_as_the_import_gives_them(tmp_path: Path) -> None:
    """Without --check nothing is imported; what the source gives equals pluggy's reading of the imported class, for
    every installed plugin that imports (built-ins, the example distribution, the test fixtures)."""
    imported = {(r["name"], r["distribution"]): r for r in json.loads(run_cli("plugins", "--json", "--check",
                                                                              cwd=tmp_path).stdout)}  # fmt: skip
    read = {(r["name"], r["distribution"]): r for r in json.loads(run_cli("plugins", "--json", cwd=tmp_path).stdout)}
    assert read.keys() == imported.keys() and len(read) >= 15
    compared = 0
    for key, row in imported.items():
        if row["status"].startswith("failed to import"):
            assert read[key]["status"] == "not imported"  # the source is read all the same
            continue
        assert (read[key]["summary"], read[key]["hooks"]) == (row["summary"], row["hooks"]), key
        compared += 1
    assert compared >= 14


def test_plugins_shows_call_order_for_a_config(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        textwrap.dedent("""
        plugins:
          grad_accum: {steps: 2}
          grad_clip: {max_norm: 1.0}
    """)
    )
    proc = run_cli("plugins", "--config", str(config), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    order = json.loads(proc.stdout)
    assert order["enabled"] == ["grad_accum", "grad_clip"]
    # The default step runs last (trylast); grad_accum's gradient rescale runs before clipping.
    assert order["hooks"]["run_train_step"][-1] == "torchloom.default_step"
    assert order["hooks"]["before_optimizer_step"].index("grad_accum") < order["hooks"]["before_optimizer_step"].index(
        "grad_clip"
    )


def test_validate_and_predict_commands(project: Path) -> None:
    proc = run_cli("validate", "--config", "config.yaml", cwd=project)
    assert proc.returncode == 0, proc.stderr
    assert "val/loss = " in proc.stdout
    assert (project / "run" / "version_0" / "config.yaml").is_file()  # validate has a run directory of its own
    records = [json.loads(line) for line in (project / "run" / "version_0" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["step"] == 0 and records[0]["val/loss"] > 0
    proc = run_cli("predict", "--config", "config.yaml", "--task.init_args.n=32", cwd=project)
    assert proc.returncode == 2 and "predict: no data" in proc.stderr  # the task defines no predict data


def test_main_called_twice_in_one_process_runs_each_projects_own_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two projects with a ``mytask.py`` each: the second `main` runs its own, not the first one's from
    ``sys.modules``; afterwards ``sys.path`` is as it was and neither module is imported."""
    from torchloom import cli

    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mytask.py").write_text(
            f"{TASK_MODULE}\n\nclass MyTask(Regression):\n    def __init__(self, n: int = 8):\n"
            f"        super().__init__(n=n)\n        print('the task of project {name}')\n"
        )
        config = {"engine": {"max_epochs": 1, "output_dir": f"{name}/run"}, "task": {"class_path": "mytask.MyTask"}}
        (tmp_path / name / "c.yaml").write_text(yaml.safe_dump(config))
    path = list(sys.path)
    for name in ("a", "b"):
        assert cli.main(["fit", "--config", f"{name}/c.yaml"]) == 0
        assert f"the task of project {name}\n" in capsys.readouterr().out
        assert sys.path == path
        assert "mytask" not in sys.modules


def test_main_forgets_only_the_modules_found_in_the_directories_it_added(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A package under the working directory that was importable through its own path entry (``src/``, as an
    editable install has it) stays imported: only what was found in a directory `main` added is forgotten."""
    from torchloom import cli

    (tmp_path / "src" / "mypkg").mkdir(parents=True)
    (tmp_path / "src" / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "src" / "mypkg" / "tasks.py").write_text(TASK_MODULE)
    (tmp_path / "local_task.py").write_text(TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.chdir(tmp_path)  # added by main: below it, src/mypkg
    for name in ("mypkg", "mypkg.tasks", "local_task"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    for class_path in ("mypkg.tasks.Regression", "local_task.Regression"):
        assert cli.main(["fit", f"--task={class_path}", "--engine.max_epochs=1", "--engine.output_dir=run"]) == 0
    capsys.readouterr()
    assert {"mypkg", "mypkg.tasks"} <= set(sys.modules)
    assert "local_task" not in sys.modules
