"""The hook contract stays honest: every hook documented, named by family, and fired by a test.

Coverage follows datasette's pattern (tests/test_plugins.py::test_plugin_hooks_have_tests): the names a
`RecordingPlugin` sees across a fit, a validate, a predict and a failing fit must cover every hookspec.
"""

from __future__ import annotations

import inspect
import re

import pluggy
import pytest
import torch
from torch.utils.data import DataLoader

import torchloom
from torchloom import hookspecs
from torchloom.testing import RecordingPlugin, TinyTask


def _spec_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


PM = _spec_manager()
HOOKS = {name: getattr(PM.hook, name) for name in dir(PM.hook) if not name.startswith("_")}


def test_there_are_hooks():
    assert len(HOOKS) >= 20
    assert {"configure_accelerator", "run_train_step", "on_fit_end", "teardown"} <= set(HOOKS)


def docstring_problems(name: str, spec: pluggy.HookSpec) -> list[str]:
    """What the hook's docstring lacks, per STYLE.md 2.4 (summary, Fires, one :param per argument)."""
    doc = inspect.getdoc(spec.function)
    if not doc:
        return [f"{name}: no docstring"]
    problems = []
    lines = doc.splitlines()
    if not lines[0].strip().endswith("."):
        problems.append(f"{name}: the first line must be a one-line summary ending with a period")
    if len(lines) < 2 or lines[1] != "":
        problems.append(f"{name}: a blank line must follow the summary")
    if "**Fires:**" not in doc:
        problems.append(f"{name}: no **Fires:** section")
    documented = re.findall(r"^:param (\w+):", doc, flags=re.MULTILINE)
    if sorted(documented) != sorted(spec.argnames):
        problems.append(f"{name}: :param entries {documented} do not match the arguments {list(spec.argnames)}")
    if name.startswith(("configure_", "run_")) and "**Returns:**" not in doc:
        problems.append(f"{name}: set-up and run_* hooks must say what they return and how results combine")
    if spec.opts.get("firstresult") and "first non-None" not in doc.replace("\n", " "):
        problems.append(f"{name}: a firstresult hook must say that the first non-None result wins")
    return problems


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hook_docstring(name):
    assert docstring_problems(name, HOOKS[name].spec) == []


def test_docstring_check_catches_drift():
    class Specs:
        @staticmethod
        @hookspecs.hookspec
        def on_thing_end(alpha, beta) -> None:
            """Called at the end of the thing.

            :param alpha: the alpha.
            :param gamma: a parameter that no longer exists.
            """

        @staticmethod
        @hookspecs.hookspec(firstresult=True)
        def configure_thing(alpha):
            """Return the thing
            :param alpha: the alpha.
            """

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(Specs)
    assert docstring_problems("on_thing_end", pm.hook.on_thing_end.spec) == [
        "on_thing_end: no **Fires:** section",
        "on_thing_end: :param entries ['alpha', 'gamma'] do not match the arguments ['alpha', 'beta']",
    ]
    assert len(docstring_problems("configure_thing", pm.hook.configure_thing.spec)) == 5


FAMILIES = [
    ("configure", r"^configure_[a-z_]+$"),
    ("notification", r"^on_[a-z_]+_(start|end)$"),
    ("other on_", r"^on_[a-z_]+$"),
    ("around", r"^(before|after)_[a-z_]+$"),
    ("run", r"^run_[a-z_]+$"),
    ("lifecycle", r"^(setup|teardown)$"),
]


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hook_name_follows_a_family(name):
    assert any(re.match(pattern, name) for _, pattern in FAMILIES), f"hook {name} is in no naming family"
    returns = inspect.signature(HOOKS[name].spec.function).return_annotation
    if name.startswith(("on_", "before_", "after_")) or name in ("setup", "teardown"):
        assert returns == "None", f"{name}: notifications and before_/after_ hooks return None"
        assert not HOOKS[name].spec.opts.get("firstresult")
    if name.startswith("run_"):
        assert HOOKS[name].spec.opts.get("firstresult"), f"{name}: a run_* step has one result"


def test_family_check_rejects_bad_names():
    for bad in ("train_step", "set_up", "onfit_start", "configure", "before"):
        assert not any(re.match(pattern, bad) for _, pattern in FAMILIES), bad


def test_recording_plugin_implements_every_hook():
    implemented = {
        name for name in dir(RecordingPlugin) if getattr(getattr(RecordingPlugin, name), "torchloom_impl", None)
    }
    assert implemented == set(HOOKS)


# ------------------------------------------------------------------------------------------- coverage


def _fire_everything(tmp_path) -> tuple[list[str], list[str]]:
    """Names the recorder saw in a fit; and over that fit, validate, predict and a fit that raises."""
    rec = RecordingPlugin()
    engine = torchloom.Engine(plugins=[rec], log_every_n_steps=1, save_model=True, output_dir=str(tmp_path / "ok"))
    task = TinyTask(n=8, batch_size=4)
    engine.fit(task)
    fit_calls = list(rec.calls)
    engine.validate(task)
    engine.predict(task, DataLoader(torch.zeros(3, 4), batch_size=2))

    class Failing(TinyTask):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    failing = torchloom.Engine(plugins=[rec], output_dir=str(tmp_path / "fail"))
    with pytest.raises(RuntimeError, match="boom"):
        failing.fit(Failing(n=8, batch_size=4))
    torchloom.Engine(plugins=[rec, DiscardOnce()], output_dir=str(tmp_path / "discard")).fit(
        TinyTask(n=8, batch_size=4)
    )
    return fit_calls, rec.calls


class DiscardOnce:
    """Discards the first micro-batch's (empty) window before the default step runs it: a step's redo, as the
    ``auto_batch`` plugin does after an out-of-memory error (``StepHooks.discard_window``)."""

    name = "test.discard_once"

    def __init__(self) -> None:
        self.done = False

    @torchloom.hookimpl(wrapper=True)
    def run_train_step(self, optimizer, accelerator, progress, hooks):
        if not self.done:
            self.done = True
            hooks.discard_window(optimizer, accelerator, progress)
        return (yield)


def test_every_hook_is_fired(tmp_path):
    fired = set(_fire_everything(tmp_path)[1])
    assert fired == set(HOOKS), f"never fired: {sorted(set(HOOKS) - fired)}; unknown: {sorted(fired - set(HOOKS))}"


def test_documented_firing_order_matches_a_fit(tmp_path):
    """The order diagram in the hookspecs module docstring lists the hooks in the order a fit first fires them."""
    diagram = inspect.getdoc(hookspecs).split("Firing order of ``Engine.fit``")[1]
    listed = []
    for match in re.finditer(r"^\s+([a-z_]+)\s{2,}", diagram, flags=re.MULTILINE):
        if match.group(1) in HOOKS and match.group(1) not in listed:
            listed.append(match.group(1))
    assert len(listed) >= 15
    # on_exception comes only from a failing fit, between on_train_epoch_end and on_fit_end
    assert listed.index("on_train_epoch_end") < listed.index("on_exception") < listed.index("on_fit_end")
    listed.remove("on_exception")
    listed.remove("after_window_discard")  # only a step that redoes its window fires it (a discarding fit)
    first_seen: list[str] = []
    for name in _fire_everything(tmp_path)[0]:
        if name not in first_seen:
            first_seen.append(name)
    assert first_seen == listed


#: hook -> the calls that fire it, over one engine: a fit (save_model: true), then a validate and a predict of the same
#: task (which reuse the fitted model), then a fit whose training_step raises. `test_hook_fires` checks each hook
#: against it, so every hook has a named test that fires it: ``tests/test_hookspecs.py::test_hook_fires[<hook>]``.
FIRED_IN = {
    "setup": {"fit", "validate", "predict", "failing fit"},
    "configure_accelerator": {"fit", "failing fit"},
    "configure_model": {"fit", "failing fit"},
    "configure_optimizers": {"fit", "failing fit"},
    "on_run_start": {"fit", "validate", "predict", "failing fit"},
    "on_fit_start": {"fit", "failing fit"},
    "on_train_epoch_start": {"fit", "failing fit"},
    "on_train_batch_start": {"fit", "failing fit"},
    "run_train_step": {"fit", "failing fit"},
    "before_backward": {"fit"},  # the failing training_step raises before it
    "after_window_discard": {"fit"},  # DiscardOnce's redo of the first micro-batch
    "before_optimizer_step": {"fit"},
    "after_optimizer_step": {"fit"},
    "on_train_batch_end": {"fit"},
    "on_train_step_end": {"fit"},
    "on_train_epoch_end": {"fit"},
    "on_validation_start": {"fit", "validate"},
    "on_validation_batch_end": {"fit", "validate"},
    "on_validation_end": {"fit", "validate"},
    "on_predict_start": {"predict"},
    "run_predict_step": {"predict"},
    "on_predict_batch_end": {"predict"},
    "on_predict_end": {"predict"},
    "on_log": {"fit", "validate"},
    "on_train_end": {"fit"},  # not after an exception
    "on_save_model": {"fit"},  # save_model: true, after a completed fit
    "on_exception": {"failing fit"},
    "on_fit_end": {"fit", "failing fit"},  # whether training completed or raised
    "teardown": {"fit", "validate", "predict", "failing fit"},
}


@pytest.fixture(scope="module")
def fired_in(tmp_path_factory) -> dict[str, set[str]]:
    """hook -> the calls (of the four in `FIRED_IN`'s comment) in which a `RecordingPlugin` saw it."""
    tmp = tmp_path_factory.mktemp("fired")
    rec = RecordingPlugin()
    seen: dict[str, set[str]] = {}

    def mark(call: str) -> None:
        for name in rec.calls:
            seen.setdefault(name, set()).add(call)
        rec.records.clear()

    engine = torchloom.Engine(
        plugins=[rec, DiscardOnce()], log_every_n_steps=1, save_model=True, output_dir=str(tmp / "ok")
    )
    task = TinyTask(n=8, batch_size=4)
    engine.fit(task)
    mark("fit")
    engine.validate(task)
    mark("validate")
    engine.predict(task, DataLoader(torch.zeros(3, 4), batch_size=2))
    mark("predict")

    class Failing(TinyTask):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        torchloom.Engine(plugins=[rec], output_dir=str(tmp / "fail")).fit(Failing(n=8, batch_size=4))
    mark("failing fit")
    return seen


def test_every_hook_has_a_firing_expectation():
    assert set(FIRED_IN) == set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_fires(hook, fired_in):
    assert fired_in.get(hook, set()) == FIRED_IN[hook], f"{hook} fired in {sorted(fired_in.get(hook, set()))}"
