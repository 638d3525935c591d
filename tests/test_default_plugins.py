"""The default plugins: one list, which `torchloom.Engine` applies and so the ``torchloom`` command too (it runs
through `Engine`): the command line and the Python API enable the same plugins for the same settings, and a user
can switch each default off, from Python and from a config, with no per-step cost once it is off."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

import torchloom
from torchloom import cli
from torchloom._default_plugins import DEFAULT_PLUGINS
from torchloom.testing import TinyTask

#: The hooks that fire once per micro-batch (or per prediction / validation batch): a default that is off
#: registers none of them.
PER_BATCH_HOOKS = (
    "on_train_batch_start",
    "run_train_step",
    "before_backward",
    "before_optimizer_step",
    "after_optimizer_step",
    "on_train_batch_end",
    "on_train_step_end",
    "on_validation_batch_end",
    "on_predict_batch_end",
)


def names(engine: torchloom.Engine) -> list[str]:
    return list(engine.resolved_plugin_settings())


def test_the_defaults_are_the_progress_display():
    assert DEFAULT_PLUGINS == ("progress",)


@pytest.mark.parametrize(
    ("plugins", "expected"),
    [
        (None, ["progress"]),
        ({}, ["progress"]),
        ([], ["progress"]),
        (["grad_clip"], ["grad_clip", "progress"]),
        ({"grad_clip": {"max_norm": 1.0}}, ["grad_clip", "progress"]),
        ([{"grad_accum": {"steps": 2}}, "grad_clip"], ["grad_accum", "grad_clip", "progress"]),
        # named by the run: its place and its settings
        ({"progress": {"refresh_per_second": 2.0}, "grad_clip": {}}, ["progress", "grad_clip"]),
        (["progress", "grad_clip"], ["progress", "grad_clip"]),
    ],
)
def test_the_engine_adds_each_default_the_run_does_not_name_after_the_runs_own(plugins, expected):
    assert names(torchloom.Engine(plugins=plugins)) == expected


def test_a_default_given_as_an_object_is_not_added_twice():
    progress_cls = torchloom.installed_plugins()["progress"][0].load()
    mine = progress_cls(progress_cls.Config(refresh_per_second=1.0))
    engine = torchloom.Engine(plugins=[mine])
    assert engine.plugins == [mine]


def test_default_plugins_false_enables_exactly_the_plugins_given():
    assert names(torchloom.Engine(default_plugins=False)) == []
    assert names(torchloom.Engine(plugins=["grad_clip"], default_plugins=False)) == ["grad_clip"]


def test_a_default_that_torchloom_plugins_does_not_allow_is_left_out(monkeypatch):
    monkeypatch.setenv("TORCHLOOM_PLUGINS", "grad_clip")
    assert names(torchloom.Engine(plugins=["grad_clip"])) == ["grad_clip"]
    monkeypatch.setenv("TORCHLOOM_PLUGINS", "")
    assert names(torchloom.Engine()) == []


def test_a_bad_plugins_value_is_still_the_loaders_error():
    with pytest.raises(torchloom.ConfigError, match="got the string 'grad_clip'"):
        torchloom.Engine(plugins="grad_clip")


@pytest.mark.parametrize("name", DEFAULT_PLUGINS)
def test_every_default_switches_off_with_its_enabled_setting_and_then_costs_nothing_per_step(name):
    settings = torchloom.Engine(plugins={name: {}}).resolved_plugin_settings()[name]
    assert settings["enabled"] is True
    order = torchloom.Engine(plugins={name: {"enabled": False}}).hook_order()
    assert [hook for hook in PER_BATCH_HOOKS if name in order.get(hook, [])] == []


def test_from_python_a_fit_runs_the_display_unless_it_is_switched_off(tmp_path, capsys):
    task = TinyTask(n=16, batch_size=4)
    on = torchloom.Engine(max_epochs=1, log_every_n_steps=1, output_dir=str(tmp_path / "on"))
    on.fit(task)
    shown = capsys.readouterr().out
    assert "fit summary" in shown and (Path(on.run_dir) / "summary.json").is_file()

    off = torchloom.Engine(
        max_epochs=1, log_every_n_steps=1, output_dir=str(tmp_path / "off"), plugins={"progress": {"enabled": False}}
    )
    off.fit(TinyTask(n=16, batch_size=4))
    assert capsys.readouterr().out == ""
    assert not (Path(off.run_dir) / "summary.json").exists()


def test_the_command_and_the_python_api_enable_the_same_plugins(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = {
        "engine": {"max_epochs": 1, "output_dir": "runs"},
        "task": {"class_path": "torchloom.testing.TinyTask", "init_args": {"n": 16, "batch_size": 4}},
        "plugins": {"grad_clip": {"max_norm": 1.0}},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["fit", "--config", "run.yaml"]) == 0
    recorded = yaml.safe_load((tmp_path / "runs" / "version_0" / "config.yaml").read_text())["plugins"]
    python = torchloom.Engine(plugins=config["plugins"]).resolved_plugin_settings()
    assert recorded == python
    assert list(recorded) == ["grad_clip", *DEFAULT_PLUGINS]


def test_a_config_switches_a_default_off_as_python_does(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(
        textwrap.dedent("""
        engine: {max_epochs: 1, output_dir: runs}
        task: {class_path: torchloom.testing.TinyTask, init_args: {n: 16, batch_size: 4}}
    """)
    )
    assert cli.main(["fit", "--config", "run.yaml", "--plugins.progress.enabled=false"]) == 0
    recorded = yaml.safe_load((tmp_path / "runs" / "version_0" / "config.yaml").read_text())["plugins"]
    python = torchloom.Engine(plugins={"progress": {"enabled": False}}).resolved_plugin_settings()
    assert recorded == python and recorded["progress"]["enabled"] is False
    assert "fit summary" not in capsys.readouterr().out


def test_the_config_as_given_shows_no_default(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("plugins: {grad_clip: {max_norm: 1.0}}\n")
    assert cli.main(["plugins", "--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["enabled"] == ["grad_clip"]
