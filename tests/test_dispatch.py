"""Hook dispatch: the relay calls what pluggy would, in the same order (tryfirst, trylast, wrappers, reversed hooks)
with the same results, from call lists rebuilt on every (un)registration; a plugin's ``inactive_hooks`` are never
registered (so the loop never calls them)."""

from __future__ import annotations

import pluggy
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from torchloom import hookspecs
from torchloom.hookspecs import PROJECT_NAME
from torchloom.plugins import TRACE_ENV, HookRelay, _is_reversed


class Recorder:
    def __init__(self, name: str, calls: list, result=None) -> None:
        self.name, self.calls, self.result = name, calls, result

    @torchloom.hookimpl
    def before_optimizer_step(self, model, progress) -> None:
        self.calls.append((self.name, "before_optimizer_step", model, progress))

    @torchloom.hookimpl
    def after_optimizer_step(self, log) -> None:
        self.calls.append((self.name, "after_optimizer_step", log))

    @torchloom.hookimpl
    def configure_accelerator(self):
        return self.result


def _pluggy_manager(plugins, hook_name: str) -> pluggy.PluginManager:
    """A bare pluggy manager registered so that pluggy calls ``hook_name`` in the relay's documented order
    (pluggy calls the last registered first): what the relay's dispatch must equal."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for plugin in plugins if _is_reversed(hook_name) else reversed(plugins):
        pm.register(plugin, name=torchloom.plugins.plugin_name(plugin))
    return pm


KWARGS = {"model": "M", "optimizer": None, "accelerator": None, "progress": "P", "log": "L"}
CALLS = [
    ("before_optimizer_step", KWARGS),
    ("after_optimizer_step", {"scheduler": None, **KWARGS}),
    ("configure_accelerator", {"config": None}),
    ("on_train_batch_start", {"batch": None, "accelerator": None, "progress": None}),  # nobody implements it
]


def test_the_relay_calls_what_pluggy_calls_in_the_same_order(monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    calls: list = []
    plugins = [Recorder("a", calls, {"x": 1}), Recorder("b", calls), Recorder("c", calls, {"y": 2})]
    relay = HookRelay(plugins)
    results = [relay.call(name, **kwargs) for name, kwargs in CALLS]
    through_relay, calls[:] = list(calls), []
    expected = [getattr(_pluggy_manager(plugins, name).hook, name)(**kwargs) for name, kwargs in CALLS]
    assert through_relay == calls and results == expected
    assert [c[0] for c in through_relay] == ["a", "b", "c", "c", "b", "a"]  # forward, then reversed for after_*
    assert results[0] == [] and results[3] == []
    assert results[2] == [{"x": 1}, {"y": 2}]  # results that are not None, in call order


class Marked:
    """Implementations of two hooks, one run forward and one reversed, with pluggy's ordering marks and wrappers;
    each records its name as it runs and returns it."""

    def __init__(self, name: str, kind: str, calls: list) -> None:
        self.name, self.kind, self.calls = name, kind, calls
        for hook in ("on_train_epoch_start", "on_train_epoch_end"):
            setattr(self, hook, self._impl())

    def _impl(self):
        kind, calls, name = self.kind, self.calls, self.name
        if kind in ("wrapper", "hookwrapper"):

            def wrap(progress):
                calls.append(f"{name}>")
                outcome = yield
                calls.append(f"<{name}")
                return [*outcome, name] if kind == "wrapper" else None

            return torchloom.hookimpl(**{kind: True})(wrap)

        def impl(progress):
            calls.append(name)
            return name

        return torchloom.hookimpl(tryfirst=kind == "tryfirst", trylast=kind == "trylast")(impl)


KINDS = ["plain", "tryfirst", "trylast", "plain", "wrapper", "trylast", "hookwrapper", "tryfirst", "plain"]


@pytest.mark.parametrize("hook", ["on_train_epoch_start", "on_train_epoch_end"])
def test_tryfirst_trylast_and_wrappers_order_as_pluggy_orders_them(monkeypatch, hook):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    calls: list = []
    plugins = [Marked(f"p{i}_{kind}", kind, calls) for i, kind in enumerate(KINDS)]
    relay = HookRelay(plugins)
    got = relay.call(hook, accelerator=None, progress=None, log=None)
    through_relay, calls[:] = list(calls), []
    expected = getattr(_pluggy_manager(plugins, hook).hook, hook)(accelerator=None, progress=None, log=None)
    assert (through_relay, got) == (calls, expected)
    assert relay.call_order(hook) == [c.rstrip(">") for c in calls if not c.startswith("<")]
    assert relay.wrappers(hook) == [c[:-1] for c in calls if c.endswith(">")]


def test_a_reversed_hook_runs_the_forward_list_reversed(monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    calls: list = []
    plugins = [Marked(f"p{i}", "plain", calls) for i in range(4)]
    relay = HookRelay(plugins)
    forward, backward = relay.call_order("on_train_epoch_start"), relay.call_order("on_train_epoch_end")
    assert forward == ["p0", "p1", "p2", "p3"] and backward == forward[::-1]
    assert relay.call_all("on_train_epoch_end", accelerator=None, progress=None) == []
    assert calls == backward  # the clean-up order is the same list, one implementation at a time


def test_the_call_lists_are_rebuilt_when_a_plugin_is_registered_or_unregistered(monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    calls: list = []
    a, b, c = (Recorder(name, calls) for name in "abc")
    relay = HookRelay([a])
    kept = relay.hook("before_optimizer_step")  # as StepHooks and the loop keep it
    assert not relay.implemented("on_train_epoch_start")
    relay.call("before_optimizer_step", **KWARGS)
    relay.register(b)
    relay.register(c)
    assert [impl.plugin_name for impl in kept.impls] == ["a", "b", "c"]
    relay.call("before_optimizer_step", **KWARGS)
    relay.call("after_optimizer_step", scheduler=None, **KWARGS)
    assert [call[0] for call in calls] == ["a", "a", "b", "c", "c", "b", "a"]
    relay.unregister(b)
    calls.clear()
    relay.call("before_optimizer_step", **KWARGS)
    assert [call[0] for call in calls] == ["a", "c"]
    assert relay.call_order("after_optimizer_step") == ["c", "a"] and relay.plugins == [a, c]
    assert kept is relay.hook("before_optimizer_step") and [impl.plugin_name for impl in kept.impls] == ["a", "c"]
    with pytest.raises(torchloom.PluginError, match="cannot be registered"):
        relay.register(Recorder("a", calls))  # a second plugin named 'a'


def test_a_plain_hook_that_raises_is_named_in_a_note(monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)

    class Broken:
        name = "broken"

        @torchloom.hookimpl
        def before_optimizer_step(self) -> None:
            raise RuntimeError("boom")

    relay = HookRelay([Recorder("a", []), Broken()])
    with pytest.raises(RuntimeError, match="boom") as info:
        relay.call("before_optimizer_step", model=None, optimizer=None, accelerator=None, progress=None, log=None)
    assert "torchloom: raised in hook 'before_optimizer_step' of plugin 'broken'" in info.value.__notes__


class Quiet(torchloom.Plugin):
    name = "quiet"

    def __init__(self, active: bool) -> None:
        super().__init__()
        self.calls = 0
        if not active:
            self.inactive_hooks = frozenset({"on_train_batch_end"})

    @torchloom.hookimpl
    def on_train_batch_end(self) -> None:
        self.calls += 1


class Task(torchloom.TaskModule):
    def configure_model(self):
        return torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.model(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


@pytest.mark.parametrize("active", [True, False])
def test_inactive_hooks_are_not_registered(tmp_path, active):
    data = DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=2)
    plugin = Quiet(active)
    engine = torchloom.Engine(max_epochs=1, output_dir=str(tmp_path), plugins=[plugin])
    assert ("quiet" in engine.hook_order().get("on_train_batch_end", [])) is active
    engine.fit(Task(), train_dataloader=data)
    assert plugin.calls == (4 if active else 0)


@pytest.mark.parametrize(
    ("name", "settings", "inactive"),
    [
        ("grad_accum", {"steps": 1}, {"run_train_step", "before_backward", "before_optimizer_step"}),
        ("grad_accum", {"steps": 2}, {"before_backward"}),
        ("grad_accum", {"steps": 1, "normalization": "items"}, set()),
        ("checkpoint", {"every_n_epochs": 1, "save_on_interrupt": False}, {"on_train_step_end"}),
        ("checkpoint", {"every_n_epochs": 1}, set()),
        ("checkpoint", {"every_n_steps": 5, "save_on_interrupt": False}, set()),
        ("progress", {"enabled": False}, {"on_train_batch_end", "on_predict_batch_end"}),
        ("progress", {}, set()),
    ],
)
def test_builtins_whose_settings_make_a_hook_a_no_op_do_not_register_it(name, settings, inactive):
    order = torchloom.Engine(plugins={name: settings}).hook_order()
    registered = {hook for hook, plugins in order.items() if name in plugins}
    assert not registered & inactive
    plugin_cls = torchloom.installed_plugins()[name][0].load()
    assert all(hasattr(getattr(plugin_cls, hook), "torchloom_impl") for hook in inactive)  # hooks it does implement


def test_enabling_several_plugins_by_name_scans_the_entry_points_once(monkeypatch):
    import torchloom.plugins as plugins_module

    scans = []
    real = plugins_module.metadata.entry_points

    def counted(**kwargs):
        scans.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(plugins_module.metadata, "entry_points", counted)
    enabled = torchloom.enable_plugins(["grad_clip", {"grad_accum": {"steps": 2}}, "optimizer", "checkpoint"])
    assert [torchloom.plugins.plugin_name(p) for p in enabled] == ["grad_clip", "grad_accum", "optimizer", "checkpoint"]
    assert len(scans) == 1


def _hand_loop(data, model, make_optimizer):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    optimizer = make_optimizer(model)
    model, optimizer, loader = accelerator.prepare(model, optimizer, data)
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()  # through Accelerate's wrapper
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True),
    ],
    ids=["adamw", "sgd-nesterov"],
)
def test_the_default_step_equals_a_loop_through_accelerates_optimizer_wrapper_bit_for_bit(tmp_path, make_optimizer):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    def model():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    class Regression(torchloom.TaskModule):
        def configure_model(self):
            return model()

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.model(batch[0]), batch[1])

        def configure_optimizers(self):
            return make_optimizer(self.model)

    expected = _hand_loop(data, model(), make_optimizer)
    task = Regression()
    torchloom.Engine(max_epochs=1, output_dir=str(tmp_path)).fit(task, train_dataloader=data)
    assert all(torch.equal(a, b) for a, b in zip(task.model.parameters(), expected, strict=True))


def test_the_inner_optimizer_is_called_directly_only_where_the_wrapper_adds_nothing():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from torchloom.step import direct_optimizer

    for mixed_precision, direct in (("no", True), ("fp16", False)):
        AcceleratorState._reset_state()
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
        if mixed_precision == "fp16":  # Accelerate makes no scaler on CPU; the mixed_precision plugin does
            from torchloom_plugins.mixed_precision import install_cpu_grad_scaler

            install_cpu_grad_scaler(accelerator)
        model = torch.nn.Linear(2, 1)
        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        assert (direct_optimizer(optimizer, accelerator) is optimizer.optimizer) is direct
        assert direct_optimizer(optimizer.optimizer, accelerator) is None  # not Accelerate's wrapper
