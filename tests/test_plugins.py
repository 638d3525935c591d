"""Plugin discovery, enabling, settings and the errors a user can cause, against really installed distributions.

The distributions under tests/fixtures/ must be installed (see tests/fixtures/README.md); a test that needs
one fails, with the command to install it, when it is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

import torchloom
from torchloom.testing import TinyTask

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_DISTS = {
    "torchloom-hello": "torchloom-hello",
    "torchloom-twin": "torchloom-twin",
    "torchloom-broken": "torchloom-broken",
}


def need(dist: str, directory: str | None = None) -> None:
    """Fail (never skip) when a fixture distribution is not installed, saying how to install it."""
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        where = FIXTURES / (directory or dist)
        pytest.fail(
            f"test distribution {dist!r} is not installed. Install every fixture distribution with:\n"
            f"  for d in {FIXTURES}/*/; do {sys.executable} -m pip install --no-deps --no-build-isolation -q "
            f'"$d"; done\n(this one: pip install --no-deps --no-build-isolation {where}; see '
            f"{FIXTURES / 'README.md'})",
            pytrace=False,
        )


@pytest.fixture
def fixtures_installed() -> None:
    for dist in FIXTURE_DISTS:
        need(dist)


def small_task() -> TinyTask:
    return TinyTask(n=8, batch_size=4, validate=False)


def assert_nothing_written(out: Path) -> None:
    assert not list((out).rglob("config.yaml"))
    assert not out.exists() or not any(out.iterdir())


def test_missing_fixture_fails_with_install_instructions():
    with pytest.raises(pytest.fail.Exception, match=r"(?s)not installed.*pip install --no-deps --no-build-isolation"):
        need("torchloom-no-such-fixture-distribution")


# --------------------------------------------------------------------------------------------- discovery

DISCOVERY_SCRIPT = r"""
import json, sys
import torchloom

PREFIXES = ("torchloom_hello", "torchloom_twin", "torchloom_broken", "torchloom_plugins")
plugin_modules = lambda: sorted(m for m in sys.modules if m.split(".")[0] in PREFIXES)

infos = torchloom.installed_plugins()
after_discovery = plugin_modules()
engine = torchloom.Engine(plugins={"hello": {"times": 3}}, log_every_n_steps=1, output_dir=sys.argv[1])
after_enable = plugin_modules()
from torchloom.testing import TinyTask
engine.fit(TinyTask(n=8, batch_size=4, validate=False))
hello = engine.plugins[0]
print(json.dumps({
    "names": sorted(infos),
    "after_discovery": after_discovery,
    "after_enable": after_enable,
    "plugin_module": type(hello).__module__,
    "batches": hello.batches,
    "greeted": hello.greeted,
    "logged": engine.logged_metrics,
}))
"""


def test_discovery_imports_nothing_and_enabling_imports_only_the_enabled_plugin(tmp_path, fixtures_installed):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHLOOM_")}
    proc = subprocess.run(
        [sys.executable, "-c", DISCOVERY_SCRIPT, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"hello", "fixture_twin", "fixture_broken"} <= set(result["names"])
    assert result["after_discovery"] == []  # discovery read metadata only (the broken one would have raised)
    # only the enabled plugins' modules: hello's, and the default plugin's (progress, a built-in, with the module
    # of its summary's text)
    assert result["after_enable"] == [
        "torchloom_hello",
        "torchloom_plugins",
        "torchloom_plugins._summary_text",
        "torchloom_plugins.progress",
    ]
    assert result["plugin_module"] == "torchloom_hello"
    assert result["batches"] == 2  # its hooks ran in the fit
    assert result["greeted"] == ["hello"]
    assert result["logged"]["hello/times"] == 3.0


def test_installed_plugins_report_distribution_and_version(fixtures_installed):
    installed = torchloom.installed_plugins()
    assert installed["hello"] == [torchloom.PluginInfo("hello", "torchloom_hello:Hello", "torchloom-hello", "0.1.0")]
    assert sorted((i.distribution, i.version, i.value) for i in installed["fixture_twin"]) == [
        ("torchloom-hello", "0.1.0", "torchloom_hello:Twin"),
        ("torchloom-twin", "0.2.0", "torchloom_twin:Twin"),
    ]
    assert [i.distribution for i in installed["fixture_broken"]] == ["torchloom-broken"]


# ------------------------------------------------------------------------------------------ enabling


def test_enable_by_mapping_of_name_to_settings(fixtures_installed):
    (hello,) = torchloom.enable_plugins({"hello": {"times": 2, "greeting": "hi"}})
    assert type(hello).__module__ == "torchloom_hello"
    assert (hello.name, hello.config.times, hello.config.greeting) == ("hello", 2, "hi")
    (default,) = torchloom.enable_plugins({"hello": None})
    assert (default.config.times, default.config.greeting) == (1, "hello")


def test_enable_by_list_of_names_and_instances_keeps_order(fixtures_installed):
    from torchloom_hello import Hello

    class Mine:
        name = "mine"

    mine = Mine()
    plugins = torchloom.enable_plugins([mine, "hello"])
    assert plugins[0] is mine
    assert isinstance(plugins[1], Hello) and plugins[1].config.times == 1
    plugins = torchloom.enable_plugins([{"hello": {"times": 4}}, mine])
    assert plugins[0].config.times == 4 and plugins[1] is mine
    ready = Hello(times=5)
    assert torchloom.enable_plugins([ready]) == [ready]


def test_enabled_plugin_runs_in_a_fit_with_its_settings(tmp_path, fixtures_installed):
    engine = torchloom.Engine(plugins=[{"hello": {"times": 7}}], log_every_n_steps=1, output_dir=str(tmp_path))
    engine.fit(TinyTask(n=12, batch_size=4, validate=False))
    assert engine.plugins[0].batches == 3
    assert [r["hello/times"] for r in engine.history] == [7.0, 7.0, 7.0]


def test_plugins_as_a_string_is_a_clear_error():
    with pytest.raises(torchloom.ConfigError, match="got the string 'hello'; expected a list of names or a mapping"):
        torchloom.enable_plugins("hello")


def test_same_plugin_enabled_twice_is_an_error(fixtures_installed):
    with pytest.raises(torchloom.PluginError, match="plugin 'hello' is enabled twice"):
        torchloom.enable_plugins(["hello", {"hello": {"times": 2}}])


# --------------------------------------------------------------------------------------- bad names


def test_unknown_name_lists_installed_and_suggests_closest(tmp_path, fixtures_installed):
    out = tmp_path / "run"
    with pytest.raises(torchloom.PluginError) as info:
        torchloom.Engine(plugins=["helo"], output_dir=str(out))
    message = str(info.value)
    assert "unknown plugin 'helo'" in message
    assert "Did you mean 'hello'?" in message
    listed = message.split("Installed plugins:")[1]
    for name in torchloom.installed_plugins():
        assert name in listed
    assert_nothing_written(out)


def test_unknown_name_without_close_match_still_lists_installed(fixtures_installed):
    with pytest.raises(torchloom.PluginError, match=r"unknown plugin 'zzzzzz'\. Installed plugins: .*hello"):
        torchloom.enable_plugins(["zzzzzz"])


def test_name_registered_by_two_distributions_names_both(tmp_path, fixtures_installed, monkeypatch):
    for module in [m for m in sys.modules if m.split(".")[0] in ("torchloom_twin", "torchloom_hello")]:
        monkeypatch.delitem(sys.modules, module)  # an earlier test may have listed (imported) every plugin
    out = tmp_path / "run"
    with pytest.raises(torchloom.PluginError) as info:
        torchloom.Engine(plugins=["fixture_twin"], output_dir=str(out))
    message = str(info.value)
    assert "'fixture_twin'" in message
    assert "torchloom-hello 0.1.0" in message and "torchloom-twin 0.2.0" in message
    assert_nothing_written(out)
    assert "torchloom_twin" not in sys.modules  # neither registration was imported
    # the clash matters only when enabled: the other plugin of the same distribution works
    (hello,) = torchloom.enable_plugins(["hello"])
    assert hello.name == "hello"


def test_plugin_that_fails_to_import_is_named_with_the_reason(tmp_path, fixtures_installed):
    out = tmp_path / "run"
    with pytest.raises(torchloom.PluginError) as info:
        torchloom.Engine(plugins=["fixture_broken"], output_dir=str(out))
    message = str(info.value)
    assert "plugin 'fixture_broken'" in message
    assert "torchloom-broken 0.3.0" in message
    assert "ModuleNotFoundError" in message and "torchloom_fixture_missing_dependency" in message
    assert_nothing_written(out)
    # listing still works and other plugins keep working
    assert "fixture_broken" in torchloom.installed_plugins()
    engine = torchloom.Engine(plugins=["hello"], output_dir=str(tmp_path / "ok"))
    engine.fit(small_task())
    assert engine.plugins[0].batches == 2


# ------------------------------------------------------------------------------------------ settings


def test_bad_setting_names_plugin_field_value_and_expected_type(tmp_path, fixtures_installed):
    out = tmp_path / "run"
    with pytest.raises(torchloom.ConfigError) as info:
        torchloom.Engine(plugins={"hello": {"times": "three"}}, output_dir=str(out))
    assert str(info.value) == "plugin 'hello': setting 'times' = 'three' (str); expected int"
    assert_nothing_written(out)
    with pytest.raises(torchloom.ConfigError, match=r"plugin 'hello': setting 'greeting' = 3 \(int\); expected str"):
        torchloom.enable_plugins({"hello": {"greeting": 3}})
    with pytest.raises(torchloom.ConfigError, match=r"setting 'times' = True \(bool\); expected int"):
        torchloom.enable_plugins({"hello": {"times": True}})


def test_unknown_setting_suggests_closest(fixtures_installed):
    with pytest.raises(torchloom.ConfigError) as info:
        torchloom.enable_plugins({"hello": {"tims": 2}})
    message = str(info.value)
    assert "plugin 'hello': unknown setting 'tims'; did you mean 'times'?" in message
    assert "Valid settings: times, greeting" in message


def test_settings_are_validated_for_plugin_classes_too():
    class Scaled(torchloom.Plugin):
        name = "scaled"

        @dataclass
        class Config:
            factor: float = 1.0  # multiplier
            mode: str = "a"  # a or b

            def __post_init__(self):
                if self.mode not in ("a", "b"):
                    raise ValueError(f"mode must be 'a' or 'b', got {self.mode!r}")

    assert Scaled(factor=2).config.factor == 2.0 and isinstance(Scaled(factor=2).config.factor, float)
    with pytest.raises(torchloom.ConfigError, match=r"plugin 'scaled': setting 'factor' = '2' \(str\); expected float"):
        Scaled(factor="2")
    with pytest.raises(torchloom.ConfigError, match="plugin 'scaled': mode must be 'a' or 'b', got 'c'"):
        Scaled(mode="c")


# ------------------------------------------------------------------------------------ allow-list


def test_torchloom_plugins_allow_list(monkeypatch, tmp_path, fixtures_installed):
    monkeypatch.setenv("TORCHLOOM_PLUGINS", "hello, fixture_twin")
    assert sorted(torchloom.installed_plugins()) == ["fixture_twin", "hello"]
    with pytest.raises(
        torchloom.PluginError, match="'fixture_broken' is installed but not allowed by TORCHLOOM_PLUGINS"
    ):
        torchloom.enable_plugins(["fixture_broken"])
    with pytest.raises(
        torchloom.PluginError,
        match=r"unknown plugin 'helo'\. Did you mean 'hello'\? Installed plugins: "
        r"fixture_twin, hello$",
    ):
        torchloom.enable_plugins(["helo"])
    engine = torchloom.Engine(plugins=["hello"], output_dir=str(tmp_path))
    engine.fit(small_task())
    assert engine.plugins[0].batches == 2
    with pytest.raises(torchloom.PluginError, match="registered by two distributions"):  # allowed, still a clash
        torchloom.enable_plugins(["fixture_twin"])
    monkeypatch.setenv("TORCHLOOM_PLUGINS", "")
    assert torchloom.installed_plugins() == {}


# ---------------------------------------------------------------------------------------------- tracing


class Tracer:
    def __init__(self, name: str) -> None:
        self.name = name

    @torchloom.hookimpl
    def on_fit_start(self):
        pass

    @torchloom.hookimpl
    def teardown(self):
        pass


def _trace_lines(err: str, hook: str) -> list[str]:
    prefix = f"[torchloom] {hook}: "
    return [line[len(prefix) :] for line in err.splitlines() if line.startswith(prefix)]


def test_trace_hooks_prints_each_hook_with_its_plugins(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TORCHLOOM_TRACE_HOOKS", "1")
    plugins = [Tracer("tracer_a"), Tracer("tracer_b")]
    torchloom.Engine(plugins=plugins, output_dir=str(tmp_path)).fit(small_task())
    err = capsys.readouterr().err
    (fit_start,) = _trace_lines(err, "on_fit_start")
    assert "tracer_a, tracer_b" in fit_start  # the plugins that ran, in call order
    # teardown calls each plugin on its own (one failing teardown cannot skip another), in reverse order
    teardown = [line for line in _trace_lines(err, "teardown") if line.startswith("tracer_")]
    assert teardown == ["tracer_b", "tracer_a"]
    steps = _trace_lines(err, "run_train_step")
    assert len(steps) == 2 and all("torchloom.default_step" in line for line in steps)  # one per micro-batch


def test_no_trace_without_the_variable(capsys, tmp_path):
    torchloom.Engine(plugins=[Tracer("tracer")], output_dir=str(tmp_path)).fit(small_task())
    assert "[torchloom]" not in capsys.readouterr().err


# ------------------------------------------------------------------------------- start-up validation


def test_misspelt_hook_fails_at_start_up_naming_the_plugin(tmp_path):
    class Typo:
        name = "typo"

        @torchloom.hookimpl
        def on_fit_strat(self):
            pass

    out = tmp_path / "run"
    engine = torchloom.Engine(plugins=[Typo()], output_dir=str(out))
    with pytest.raises(torchloom.PluginError, match=r"plugin 'typo'.*on_fit_strat"):
        engine.fit(small_task())
    assert_nothing_written(out)


def test_hook_argument_not_in_spec_fails_at_start_up_naming_plugin_and_hook(tmp_path):
    class BadArgs:
        name = "bad_args"

        @torchloom.hookimpl
        def on_fit_start(self, modle):
            pass

    out = tmp_path / "run"
    with pytest.raises(
        torchloom.PluginError, match=r"(?s)plugin 'bad_args' cannot be registered: .*on_fit_start.*modle"
    ):
        torchloom.Engine(plugins=[BadArgs()], output_dir=str(out)).fit(small_task())
    assert_nothing_written(out)


class Needy(torchloom.Plugin):
    name = "needy"
    requires = ("helper",)


class Helper(torchloom.Plugin):
    name = "helper"


class Loner(torchloom.Plugin):
    name = "loner"
    conflicts = ("helper",)


def test_requires(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(torchloom.PluginError, match="plugin 'needy' requires plugin 'helper'; enable it too"):
        torchloom.Engine(plugins=[Needy()], output_dir=str(out))
    assert_nothing_written(out)
    assert [p.name for p in torchloom.enable_plugins([Needy(), Helper()])] == ["needy", "helper"]


def test_conflicts(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(torchloom.PluginError, match="plugins 'loner' and 'helper' cannot be enabled together"):
        torchloom.Engine(plugins=[Helper(), Loner()], output_dir=str(out))
    assert_nothing_written(out)
    assert [p.name for p in torchloom.enable_plugins([Loner()])] == ["loner"]


def _accelerator_plugin(name: str, **kwargs):
    class Fragment:
        @torchloom.hookimpl
        def configure_accelerator(self):
            return dict(kwargs)

    Fragment.name = name
    return Fragment()


def test_configure_accelerator_clash_names_both_plugins(tmp_path):
    out = tmp_path / "run"
    plugins = [
        _accelerator_plugin("accum_a", gradient_accumulation_steps=2),
        _accelerator_plugin("accum_b", gradient_accumulation_steps=3),
    ]
    with pytest.raises(torchloom.PluginError) as info:
        torchloom.Engine(plugins=plugins, output_dir=str(out)).fit(small_task())
    assert str(info.value).startswith(
        "plugins 'accum_a' and 'accum_b' both set Accelerator(gradient_accumulation_steps=...): 2 vs 3"
    )
    assert_nothing_written(out)


def test_configure_accelerator_fragments_merge(tmp_path):
    plugins = [
        _accelerator_plugin("accum_a", gradient_accumulation_steps=2),
        _accelerator_plugin("accum_b", gradient_accumulation_steps=2, step_scheduler_with_optimizer=False),
    ]
    engine = torchloom.Engine(plugins=plugins, output_dir=str(tmp_path))
    engine.fit(small_task())
    assert engine.accelerator.gradient_accumulation_steps == 2
    assert engine.accelerator.step_scheduler_with_optimizer is False


def test_configure_accelerator_returning_garbage_names_the_plugin(tmp_path):
    class Garbage:
        name = "garbage"

        @torchloom.hookimpl
        def configure_accelerator(self):
            return ["mixed_precision", "bf16"]

    with pytest.raises(torchloom.PluginError, match="plugin 'garbage': configure_accelerator returned"):
        torchloom.Engine(plugins=[Garbage()], output_dir=str(tmp_path / "run")).fit(small_task())
    assert_nothing_written(tmp_path / "run")


# ------------------------------------------------------------------------------- errors in hooks


class Exploder:
    """Raises in the hook named by ``where``."""

    name = "exploder"

    def __init__(self, where: str) -> None:
        self.where = where

    def _maybe_raise(self, hook: str) -> None:
        if hook == self.where:
            raise ValueError(f"exploded in {hook}")

    @torchloom.hookimpl
    def configure_model(self):
        self._maybe_raise("configure_model")

    @torchloom.hookimpl
    def on_train_epoch_start(self):
        self._maybe_raise("on_train_epoch_start")

    @torchloom.hookimpl
    def before_optimizer_step(self):
        self._maybe_raise("before_optimizer_step")

    @torchloom.hookimpl
    def on_fit_end(self):
        self._maybe_raise("on_fit_end")


class Bystander:
    name = "bystander"

    @torchloom.hookimpl
    def on_train_epoch_start(self):
        pass

    @torchloom.hookimpl
    def before_optimizer_step(self):
        pass


@pytest.mark.parametrize("hook", ["configure_model", "on_train_epoch_start", "before_optimizer_step", "on_fit_end"])
def test_exception_in_a_hook_has_a_note_naming_plugin_and_hook(tmp_path, hook):
    engine = torchloom.Engine(plugins=[Bystander(), Exploder(hook)], output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=f"exploded in {hook}") as info:
        engine.fit(small_task())
    notes = getattr(info.value, "__notes__", [])
    assert f"torchloom: raised in hook {hook!r} of plugin 'exploder'" in notes
    assert not any("bystander" in note for note in notes)


def test_every_builtin_settings_class_has_a_distinct_name_ending_in_config():
    """A settings object is a ``*Config`` (DESIGN: "settings objects are `*Config`"), and no two built-in plugins
    share a settings class name (``from ... import CheckpointConfig`` must say which plugin's)."""
    import importlib.metadata

    eps = [ep for ep in importlib.metadata.distribution("torchloom").entry_points if ep.group == "torchloom.plugins"]
    names: dict[str, list[str]] = {}
    for ep in eps:
        config = ep.load().Config
        assert config.__name__.endswith("Config"), f"plugin {ep.name!r}: settings class {config.__name__}"
        names.setdefault(config.__name__, []).append(ep.name)
    assert len(eps) >= 12 and {n: p for n, p in names.items() if len(p) > 1} == {}
