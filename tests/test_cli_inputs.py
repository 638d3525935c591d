"""Bad input to the ``torchloom`` command is one line, a config means the same to every command, and a config is
data: every way a config, a plugin option or a plugin setting can be wrong ends in ``torchloom: error: ...`` with
exit status 2 and no traceback; nothing next to a config replaces a library (pickles: tests/test_no_pickle.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import torchloom
from cli_util import SOURCE_PATHS, run_cli, run_cli_process  # run_cli: in this process (tests/cli_util.py)
from torchloom import cli
from torchloom.cli import _environment
from torchloom.cli import plugins as plugins_command

ROOT = Path(__file__).resolve().parents[1]

BASE = {"engine": {"max_epochs": 1, "log_every_n_steps": 1}, "task": {"class_path": "torchloom.testing.TinyTask"}}


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("torchloom: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr)
    return proc.stderr


def write_config(directory: Path, config: object, name: str = "config.yaml") -> Path:
    path = directory / name
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))
    return path


def printed_plugins(proc: subprocess.CompletedProcess[str]) -> object:
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)["plugins"]


# --------------------------------------------------------------------------------------- plugin options


def test_plugin_setting_option_without_a_plugins_section(tmp_path: Path) -> None:
    write_config(tmp_path, BASE)
    proc = run_cli("fit", "--config", "config.yaml", "--plugins.grad_clip.max_norm=2", "--print_config", cwd=tmp_path)
    assert printed_plugins(proc) == {"grad_clip": {"max_norm": 2}}


def test_plugin_setting_option_with_a_list_of_plugins(tmp_path: Path) -> None:
    write_config(tmp_path, {**BASE, "plugins": ["grad_accum", {"grad_clip": {"norm_type": 1.0}}]})
    proc = run_cli("fit", "--config", "config.yaml", "--plugins.grad_clip.max_norm=2", "--print_config", cwd=tmp_path)
    # The list keeps its order; the option changes one setting of grad_clip and keeps the other.
    assert printed_plugins(proc) == {"grad_accum": None, "grad_clip": {"norm_type": 1.0, "max_norm": 2}}


ITEMS_TASK = """
from torchloom.testing import TinyTask


class Items(TinyTask):
    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx), "num_items": len(batch[0])}
"""


def test_plugin_setting_option_keeps_the_other_settings_of_the_file(tmp_path: Path) -> None:
    (tmp_path / "items.py").write_text(ITEMS_TASK)
    config = {
        "engine": {"max_epochs": 1, "output_dir": str(tmp_path / "run")},
        "task": {"class_path": "items.Items"},
        "plugins": {"grad_accum": {"steps": 4, "normalization": "items"}},
    }
    write_config(tmp_path, config)
    proc = run_cli("fit", "--config", "config.yaml", "--plugins.grad_accum.steps", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    recorded = yaml.safe_load((tmp_path / "run" / "version_0" / "config.yaml").read_text())
    assert recorded["plugins"]["grad_accum"] == {"steps": 2, "normalization": "items"}


# ------------------------------------------------------------- option values mean what they mean in a file

MAPPING_DATA = """
from typing import Any

import torchloom


class MappingData(torchloom.DataModule):
    \"\"\"Takes a free-form mapping (as AudioClassificationData's feature_args), or a path in its place.\"\"\"

    def __init__(self, options: dict[str, Any] | str | None = None, batch_size: int = 4):
        self.options, self.batch_size = options, batch_size
"""

#: A value as written after ``KEY:`` in a file or after ``=`` on the command line -> what both mean.
OPTION_VALUES = [
    ("1e-3", 0.001),
    ("-2.5E-4", -0.00025),
    ("1e5", 100000.0),
    ("3", 3),
    ("-7", -7),
    ("true", True),
    ("no", False),
    ("null", None),
    ("~", None),
    ("[1, 2e-3, null, x]", [1, 0.002, None, "x"]),
    ("{a: 1e-5, b: [true]}", {"a": 1e-05, "b": [True]}),
    ("2024-01-01", "2024-01-01"),
    ("'1e-3'", "1e-3"),
    ("hello", "hello"),
]


def parsed_run(monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    """The config ``torchloom fit ARGS`` would run (its ``fit`` section), parsed in this process; nothing runs."""
    seen: dict[str, Any] = {}

    def capture(parser: Any, cfg: Any, command: str, **options: Any) -> int:
        seen["run"] = cfg[command]
        return 0

    monkeypatch.setattr(cli, "_run_command", capture)
    assert cli.main(["fit", *args]) == 0
    return seen["run"]


@pytest.mark.parametrize(("text", "expected"), OPTION_VALUES, ids=[text for text, _ in OPTION_VALUES])
def test_a_value_on_the_command_line_means_what_it_means_in_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, expected: object
) -> None:
    """A plugin setting and a key of a data's free-form mapping argument (``dict[str, Any]``) read a value as the
    config file does, which is YAML: ``--plugins.optimizer.lr=1e-3`` is the float of ``lr: 1e-3``, ``null`` is
    None, a list is a list."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mapping_data.py").write_text(MAPPING_DATA)
    base = "task: {class_path: torchloom.testing.TinyTask}\ndata:\n  class_path: mapping_data.MappingData\n"
    write_config(tmp_path, base, "base.yaml")
    write_config(
        tmp_path,
        f"{base}  init_args:\n    options:\n      key: {text}\n"
        f"plugins:\n  optimizer:\n    scheduler_kwargs:\n      key: {text}\n",
        "file.yaml",
    )
    from_file = parsed_run(monkeypatch, "--config", "file.yaml")
    options = [f"--plugins.optimizer.scheduler_kwargs.key={text}", f"--data.init_args.options.key={text}"]
    on_the_line = parsed_run(monkeypatch, "--config", "base.yaml", *options)
    for run in (from_file, on_the_line):
        value = run.plugins["optimizer"]["scheduler_kwargs"]["key"]
        assert value == expected and type(value) is type(expected), (run is on_the_line, value)
    # jsonargparse reads a quoted string inside a file's dict[str, Any] as YAML once more ('1e-3' -> 0.001); a value
    # on the command line is YAML, read once.
    checked = (on_the_line,) if text.startswith("'") else (from_file, on_the_line)
    for run in checked:
        value = run.data.init_args.options["key"]
        assert value == expected and type(value) is type(expected), (run is on_the_line, value)


def test_plugin_and_mapping_options_read_e_notation_and_keep_the_other_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mapping_data.py").write_text(MAPPING_DATA)
    config = {
        **BASE,
        "data": {"class_path": "mapping_data.MappingData", "init_args": {"options": {"inner": {"a": 1, "b": 2}}}},
        "plugins": {"optimizer": {"name": "adamw"}},
    }
    write_config(tmp_path, config)
    run = parsed_run(
        monkeypatch,
        "--config",
        "config.yaml",
        "--plugins.optimizer.lr=1e-3",  # the line of the report: rejected as the string '1e-3' before
        "--plugins.optimizer.eps",
        "1e-8",
        "--data.init_args.options.inner.a=3e-1",  # a key under a key: its siblings stay
        "--data.options.inner.c",  # without init_args, and the value after a space
        "null",
        "--data.init_args.batch_size=8",  # a typed argument: jsonargparse's
    )
    assert run.plugins["optimizer"] == {"name": "adamw", "lr": 0.001, "eps": 1e-08}
    assert run.data.init_args.options == {"inner": {"a": 0.3, "b": 2, "c": None}}
    assert run.data.init_args.batch_size == 8


def test_a_mapping_option_on_an_argument_that_holds_no_mapping_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mapping_data.py").write_text(MAPPING_DATA)
    write_config(
        tmp_path, {**BASE, "data": {"class_path": "mapping_data.MappingData", "init_args": {"options": "opts.json"}}}
    )
    assert cli.main(["fit", "--config", "config.yaml", "--data.init_args.options.key=1", "--print_config"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "torchloom: error: --data.init_args.options.key: data.init_args.options = 'opts.json' is not a mapping, so "
        "it has no key 'key'; set the whole value instead: --data.init_args.options='{key: ...}'\n"
    )
    assert cli.main(["fit", "--config", "config.yaml", "--data.init_args.options.key=[1", "--print_config"]) == 2
    assert "--data.init_args.options.key: value '[1' is not valid YAML" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "fragments"),
    [
        ("--plugins=grad_clip", ["--plugins: got the string 'grad_clip'", "expected a mapping", "[grad_clip]"]),
        ("--plugins={grad_clip: [1.0]}", ["settings of plugin 'grad_clip' = [1.0] (list)", "max_norm, norm_type"]),
        ("--plugins={grad_clip: 1.0}", ["settings of plugin 'grad_clip' = 1.0 (float)", "max_norm, norm_type"]),
        ("--plugins={grad_clip:1.0}", ["'grad_clip:1.0' is not a plugin name", "{grad_clip: 1.0}"]),
        ("--plugins=3", ["--plugins: got 3 (int)", "expected a mapping"]),
        ("--plugins=[grad_clip, 3]", ["entry 3 (int) is not a plugin"]),
        ("--plugins=[grad_clip, grad_clip]", ["plugin 'grad_clip' is listed twice"]),
        ("--plugins={3: {}}", ["3 (int) is not a plugin name"]),
        ("--plugins.grad_clip=[1.0]", ["--plugins.grad_clip: settings of plugin 'grad_clip' = [1.0]"]),
        ("--plugins.grad_clip.max_norm=-1", ["plugin 'grad_clip': setting 'max_norm' = -1.0"]),
        ("--plugins.grad_clip.max_nrm=1", ["unknown setting 'max_nrm'; did you mean 'max_norm'?"]),
        ("--plugins={grad_clip: {max_norm: [", ["--plugins: value '{grad_clip: {max_norm: [' is not valid YAML"]),
        ("--plugins.grad_clip.max_norm", ["--plugins.grad_clip.max_norm: expected a value"]),
        ("--plugins..max_norm=1", ["empty name"]),
    ],
)
def test_malformed_plugins_on_the_command_line(tmp_path: Path, option: str, fragments: list[str]) -> None:
    write_config(tmp_path, BASE)
    assert_one_line_error(run_cli("fit", "--config", "config.yaml", option, cwd=tmp_path), *fragments)


@pytest.mark.parametrize(
    ("plugins", "fragments"),
    [
        ("grad_clip", ["plugins: got the string 'grad_clip'"]),
        ({"grad_clip": 1.0}, ["plugins: settings of plugin 'grad_clip' = 1.0 (float)", "max_norm, norm_type"]),
        ({"grad_clip": [1.0]}, ["plugins: settings of plugin 'grad_clip' = [1.0] (list)"]),
        (["grad_clip", None], ["plugins: entry None (NoneType) is not a plugin"]),
        (True, ["plugins: got True (bool)"]),
    ],
)
def test_malformed_plugins_in_the_config(tmp_path: Path, plugins: object, fragments: list[str]) -> None:
    write_config(tmp_path, {**BASE, "plugins": plugins})
    assert_one_line_error(run_cli("fit", "--config", "config.yaml", cwd=tmp_path), *fragments)


def test_setting_option_on_settings_that_are_no_mapping(tmp_path: Path) -> None:
    write_config(tmp_path, {**BASE, "plugins": {"optimizer": {"name": "adamw", "extra": 3}}})
    # A setting's own keys can be set too, but only inside a mapping.
    proc = run_cli("fit", "--config", "config.yaml", "--plugins.optimizer.extra.inner=1", cwd=tmp_path)
    assert_one_line_error(proc, "--plugins.optimizer.extra.inner: plugins.optimizer.extra = 3 is not a mapping")


# ----------------------------------------------------------------------------------------------- configs

BAD_FILES = {
    "empty": ("", ["is empty; expected a mapping with the sections engine, task, data and plugins"]),
    "only a comment": ("# nothing yet\n", ["is empty"]),
    "a list": ("- engine\n- task\n", ["holds a list", "expected a mapping with the sections"]),
    "a string": ("engine\n", ["holds a str"]),
    "not YAML": ("engine: {max_epochs: 1\n", ["is not valid YAML (line 2)"]),
    "duplicate section": (
        "engine:\n  output_dir: runs/x\ntask:\n  class_path: torchloom.testing.TinyTask\nengine:\n  max_epochs: 1\n",
        ["key 'engine' appears twice (lines 1 and 5)"],
    ),
    "duplicate setting": (
        "engine:\n  max_epochs: 1\n  max_epochs: 2\ntask: {class_path: torchloom.testing.TinyTask}\n",
        ["key 'max_epochs' appears twice (lines 2 and 3)"],
    ),
    "duplicate plugin": (
        "task: {class_path: torchloom.testing.TinyTask}\nplugins:\n  grad_clip: {}\n  grad_clip: {max_norm: 2}\n",
        ["key 'grad_clip' appears twice (lines 3 and 4)"],
    ),
    "bad plugins": ("task: {class_path: torchloom.testing.TinyTask}\nplugins: grad_clip\n", ["got the string"]),
    "bad engine value": (
        "engine: {max_epochs: 0}\ntask: {class_path: torchloom.testing.TinyTask}\n",
        ["engine: setting 'max_epochs' = 0; expected a positive integer"],
    ),
    "bad plugin setting": (
        "task: {class_path: torchloom.testing.TinyTask}\nplugins: {grad_clip: {max_norm: -1}}\n",
        ["plugin 'grad_clip': setting 'max_norm' = -1.0"],
    ),
}
COMMANDS = [
    ("fit", "--config", "c.yaml"),
    ("validate", "--config", "c.yaml"),
    ("predict", "--config", "c.yaml"),
    ("fit", "--config", "c.yaml", "--print_config"),
    ("plugins", "--config", "c.yaml"),
]


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_every_command_rejects_a_bad_config_with_the_same_line(tmp_path: Path, case: str) -> None:
    text, fragments = BAD_FILES[case]
    write_config(tmp_path, text, "c.yaml")
    lines = {assert_one_line_error(run_cli(*command, cwd=tmp_path), *fragments) for command in COMMANDS}
    assert len(lines) == 1, lines


def test_a_missing_config_file_is_one_line(tmp_path: Path) -> None:
    proc = run_cli("fit", "--config", "missing.yaml", cwd=tmp_path)
    assert_one_line_error(proc, "config 'missing.yaml': cannot read it: No such file or directory")


def test_plugins_config_accepts_a_config_with_plugins_only_and_a_run_needs_a_task(tmp_path: Path) -> None:
    write_config(tmp_path, {"plugins": ["grad_accum", "grad_clip"]}, "c.yaml")
    proc = run_cli("plugins", "--config", "c.yaml", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["enabled"] == ["grad_accum", "grad_clip"]
    assert_one_line_error(run_cli("fit", "--config", "c.yaml", cwd=tmp_path), "fit: no task", "--task=")


# ----------------------------------------------------------------------------------- plugin settings classes

CHECKING_PLUGIN = '''
import dataclasses
import torchloom


class Checked(torchloom.Plugin):
    """A plugin whose settings class checks its values the way some plugins do."""

    name = "fixture_checked"

    @dataclasses.dataclass
    class Config:
        level: int = 1
        how: str = "assert"

        def __post_init__(self):
            if self.how == "assert":
                assert self.level > 0
            elif self.how == "assert_message":
                assert self.level > 0, "level must be positive"
            elif self.how == "key":
                {}["level"]
            elif self.how == "runtime":
                raise RuntimeError(f"level {self.level} is not supported")
            elif self.how == "zero":
                1 / (self.level - self.level)
            elif self.how == "value":
                raise ValueError()
'''


@pytest.fixture
def checking_plugin(tmp_path: Path) -> Path:
    """A directory that, on the path, installs the ``fixture_checked`` plugin by entry point."""
    site = tmp_path / "site"
    (site / "fixture_checked-0.1.dist-info").mkdir(parents=True)
    (site / "fixture_checked-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fixture-checked\nVersion: 0.1\n"
    )
    (site / "fixture_checked-0.1.dist-info" / "entry_points.txt").write_text(
        "[torchloom.plugins]\nfixture_checked = fixture_checked:Checked\n"
    )
    (site / "fixture_checked.py").write_text(CHECKING_PLUGIN)
    return site


@pytest.mark.parametrize(
    ("how", "fragment"),
    [
        ("assert", "AssertionError at `assert self.level > 0`"),
        ("assert_message", 'AssertionError at `assert self.level > 0, "level must be positive"`: level must be'),
        ("key", "KeyError at `{}[\"level\"]`: 'level'"),
        ("runtime", 'RuntimeError at `raise RuntimeError(f"level {self.level} is not supported")`: level -1 is'),
        ("zero", "ZeroDivisionError at `1 / (self.level - self.level)`: division by zero"),
        ("value", "ValueError at `raise ValueError()`"),
    ],
)
def test_a_settings_class_that_raises_anything_is_one_line(
    tmp_path: Path, checking_plugin: Path, how: str, fragment: str
) -> None:
    write_config(tmp_path, BASE)
    option = f"--plugins={{fixture_checked: {{level: -1, how: {how}}}}}"
    proc = run_cli("fit", "--config", "config.yaml", option, cwd=tmp_path, env={"PYTHONPATH": str(checking_plugin)})
    assert_one_line_error(
        proc, "plugin 'fixture_checked': Checked.Config rejected the settings (level=-1, how=", fragment
    )


def test_build_config_turns_any_exception_of_a_settings_class_into_a_config_error() -> None:
    namespace: dict[str, object] = {}
    exec(CHECKING_PLUGIN, namespace)  # the same class, from Python
    checked = namespace["Checked"]
    for how in ("assert", "assert_message", "key", "runtime", "zero", "value"):
        with pytest.raises(
            torchloom.ConfigError, match=r"plugin 'fixture_checked': Checked.Config rejected the settings"
        ):
            torchloom.build_config(checked, {"level": -1, "how": how})
    assert torchloom.build_config(checked, {"level": 2}).level == 2


def test_settings_that_are_no_mapping_name_the_valid_settings() -> None:
    with pytest.raises(torchloom.ConfigError, match=r"settings 1\.0 \(float\); .*Valid settings: max_norm, norm_type"):
        torchloom.enable_plugins({"grad_clip": 1.0})


# ------------------------------------------------------------------------------------------------- logging

LOGGING_TASK = """
import torch
from torchloom.testing import TinyTask


class Logs(TinyTask):
    def __init__(self, what: str = "text"):
        super().__init__()
        self.what = what

    def training_step(self, batch, batch_idx):
        values = {"text": "text", "none": None, "vector": torch.ones(3), "bool": True, "complex": torch.tensor(1j)}
        self.log("note", values[self.what])
        return super().training_step(batch, batch_idx)
"""


@pytest.mark.parametrize(
    ("what", "fragment"),
    [
        ("text", "log('note'): value 'text' is a str; expected a number, a one-element tensor or a torchmetrics"),
        ("none", "log('note'): value None is a NoneType"),
        ("bool", "log('note'): value True is a bool"),
        ("vector", "log('note'): value is a torch.float32 tensor of shape (3,); expected a single real number"),
        ("complex", "log('note'): value is a torch.complex64 tensor of shape ()"),
    ],
)
def test_logging_a_value_that_is_no_number_is_one_line(tmp_path: Path, what: str, fragment: str) -> None:
    (tmp_path / "logs.py").write_text(LOGGING_TASK)
    config = {
        "engine": {"max_epochs": 1, "output_dir": str(tmp_path / "run")},
        "task": {"class_path": "logs.Logs", "init_args": {"what": what}},
    }
    write_config(tmp_path, config)
    assert_one_line_error(run_cli("fit", "--config", "config.yaml", cwd=tmp_path), fragment)


# ------------------------------------------------------------------------------------------- allow-list


def test_an_empty_allow_list_says_it_filters_every_plugin(tmp_path: Path) -> None:
    env = {"TORCHLOOM_PLUGINS": ""}
    listing = run_cli("plugins", cwd=tmp_path, env=env)
    assert listing.returncode == 0, listing.stderr
    assert "TORCHLOOM_PLUGINS='' allows none of the installed plugins (" in listing.stdout
    assert "grad_clip" in listing.stdout and "no torchloom plugins installed" not in listing.stdout
    write_config(tmp_path, BASE)
    proc = run_cli("fit", "--config", "config.yaml", "--plugins.grad_clip.max_norm=1", cwd=tmp_path, env=env)
    assert_one_line_error(proc, "plugin 'grad_clip' is installed but not allowed by TORCHLOOM_PLUGINS=''", "allows no")
    proc = run_cli("fit", "--config", "config.yaml", "--plugins.nothing_like_it={}", cwd=tmp_path, env=env)
    assert_one_line_error(proc, "unknown plugin 'nothing_like_it': TORCHLOOM_PLUGINS='' allows none of the installed")


# ------------------------------------------------------------------------------------------- entry points


def test_version_and_python_dash_m_torchloom(tmp_path: Path) -> None:
    """The entry points themselves, in processes of their own: ``python -m torchloom.cli`` and ``-m torchloom``."""
    proc = run_cli_process("--version", cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (0, f"torchloom {torchloom.__version__}\n"), proc.stderr
    proc = run_cli_process("--version", cwd=tmp_path, module="torchloom")
    assert (proc.returncode, proc.stdout) == (0, f"torchloom {torchloom.__version__}\n"), proc.stderr
    proc = run_cli_process("plugins", "--json", cwd=tmp_path, module="torchloom")
    assert proc.returncode == 0 and {"grad_clip", "grad_accum"} <= {row["name"] for row in json.loads(proc.stdout)}


def test_plugin_summaries_are_plain_text(tmp_path: Path) -> None:
    proc = run_cli("plugins", "--json", cwd=tmp_path)
    rows = {row["name"]: row for row in json.loads(proc.stdout) if row["distribution"] == "torchloom"}
    assert (
        rows["grad_clip"]["summary"]
        == "Clip the total gradient norm once per optimizer step and log it as grad_norm (or clip by value)."
    )
    for row in rows.values():
        assert "`" not in row["summary"] and row["summary"].endswith("."), row


def test_summary_drops_rst_markup() -> None:
    doc = """Wraps :class:`~torch.optim.Adam` and ``torch.compile``; see `the paper <https://x.org>`_ and
    :func:`torchloom.Engine.fit`.

    Details that are not the summary.
    """
    assert plugins_command._summary(doc) == "Wraps Adam and torch.compile; see the paper and fit."
    assert plugins_command._summary(None) == ""


# ------------------------------------------------------------------------------------- other processes

CHATTER = """
import sys, warnings
from torchloom import cli
try:
    cli.main(["--version"])
except SystemExit:
    pass
import transformers
warnings.warn("a python warning")
transformers.logging.get_logger("transformers.modeling_utils").warning("a load report")
"""


@pytest.mark.parametrize(("rank", "world_size", "quiet"), [("1", "2", True), ("0", "2", False), ("0", "1", False)])
def test_processes_other_than_the_main_one_are_quiet(tmp_path: Path, rank: str, world_size: str, quiet: bool) -> None:
    """In a process of its own: transformers reads TRANSFORMERS_VERBOSITY when it is first imported."""
    env = {**os.environ, "RANK": rank, "WORLD_SIZE": world_size}
    env["PYTHONPATH"] = os.pathsep.join(SOURCE_PATHS)
    for variable in ("TRANSFORMERS_VERBOSITY", "DATASETS_VERBOSITY", "PYTHONWARNINGS"):
        env.pop(variable, None)
    proc = subprocess.run(
        [sys.executable, "-c", CHATTER], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert ("a python warning" not in proc.stderr) is quiet, proc.stderr
    assert ("a load report" not in proc.stderr) is quiet, proc.stderr


def test_which_processes_are_quiet() -> None:
    assert _environment.is_other_process({"RANK": "1", "WORLD_SIZE": "2"})
    assert _environment.is_other_process({"RANK": "3", "WORLD_SIZE": "4"})
    assert not _environment.is_other_process({"RANK": "0", "WORLD_SIZE": "2"})
    assert not _environment.is_other_process({})
    assert not _environment.is_other_process({"RANK": "1"})
    assert not _environment.is_other_process({"RANK": "x", "WORLD_SIZE": "2"})


# ----------------------------------------------------------------------------------------------- safety

SHADOW = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


@pytest.mark.parametrize("library", ["jsonargparse", "yaml", "torch"])
def test_a_file_next_to_the_config_never_replaces_a_library(tmp_path: Path, library: str) -> None:
    """In a process of its own: in this one the libraries are imported already, so no file could replace them."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    marker = tmp_path / "ran"
    (project / f"{library}.py").write_text(SHADOW.format(marker=str(marker)))
    write_config(project, {**BASE, "plugins": {"grad_clip": {}}})
    for command in (["fit", "--config", str(project / "config.yaml"), "--print_config"], ["plugins", "--config"]):
        if command[0] == "plugins":
            command = [*command, str(project / "config.yaml")]
        proc = run_cli_process(*command, cwd=elsewhere)
        assert proc.returncode == 0, proc.stderr
        assert not marker.exists(), f"{library}.py next to the config ran for {' '.join(command)}"


def test_a_task_next_to_the_config_still_imports(tmp_path: Path) -> None:
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "mytask.py").write_text("from torchloom.testing import TinyTask as MyTask\n")
    write_config(project, {"task": {"class_path": "mytask.MyTask"}})
    proc = run_cli("fit", "--config", str(project / "config.yaml"), "--print_config", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr


def test_plugins_imports_no_plugin_and_not_torch(tmp_path: Path) -> None:
    proc = run_cli_process("plugins", cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    assert "torchloom.cli" in imported  # the import log is there
    assert not {name for name in imported if name == "torch" or name.startswith("torchloom_plugins.")}
    assert "grad_clip  (torchloom" in proc.stdout and "hooks: configure_model, before_optimizer_step" in proc.stdout
