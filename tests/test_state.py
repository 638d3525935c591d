"""Plugin state without pickle: `torchloom.save_plugin_state` / `torchloom.load_plugin_state`.

The contract (tensors and plain values only, a clear error naming the plugin and the path otherwise), the
on-disk format (safetensors + JSON, written atomically), exact round-trips (floats, NaN, big ints, dtypes,
devices), the errors of a directory that does not match the enabled plugins, and the security property: no file
in the directory is ever unpickled. Every built-in stateful plugin round-trips.
"""

from __future__ import annotations

import enum
import importlib.metadata
import json
import math
import pickle
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import torchloom
from torchloom.testing import tiny_fit


class Stateful:
    """A minimal stateful plugin: returns ``state`` and records what it is given."""

    def __init__(self, name: str = "counter", state: Any = None) -> None:
        self.name = name
        self.state = {"steps": 0} if state is None else state
        self.loaded: list[Any] = []

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.loaded.append(state)


class Stateless:
    name = "stateless"


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types; tensors bitwise (dtype, shape, device too); NaN equals NaN; -0.0 != 0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def rich_state() -> dict[str, Any]:
    base = torch.arange(12, dtype=torch.float32)
    return {
        "steps": 7,
        "big": 2**80,
        "floats": [0.1, 1 / 3, -0.0, 1e-308, 5e-324, 1.7976931348623157e308, math.nan, math.inf, -math.inf],
        "flags": [True, False, None],
        "text": "naïve ✓",
        "shadow": [torch.randn(3, 2, generator=torch.Generator().manual_seed(0)), torch.tensor(2.5)],
        "dtypes": {
            "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
            "f16": torch.tensor([65504.0], dtype=torch.float16),
            "f64": torch.tensor([1 / 3], dtype=torch.float64),
            "i64": torch.tensor([2**62], dtype=torch.int64),
            "bool": torch.tensor([True, False]),
            "empty": torch.zeros(0, 4),
        },
        "views": [base[:6], base[6:], base.view(3, 4).t()],  # share memory; the last one is not contiguous
        "same_twice": [base, base],
        "nested": {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}},  # dotted key vs nested path
        "empty_list": [],
        "empty_dict": {},
    }


# ------------------------------------------------------------------------------------------- round trips


def test_round_trip_is_exact(tmp_path):
    state = rich_state()
    saved = Stateful(state=state)
    assert torchloom.save_plugin_state([saved], tmp_path) == ["counter"]
    fresh = Stateful()
    assert torchloom.load_plugin_state([fresh], tmp_path) == ["counter"]
    (loaded,) = fresh.loaded
    assert same(loaded, state)


def test_tuples_come_back_as_lists_and_mapping_subclasses_as_dicts(tmp_path):
    torchloom.save_plugin_state([Stateful(state={"shape": (2, 3), "od": OrderedDict(a=1)})], tmp_path)
    fresh = Stateful()
    torchloom.load_plugin_state([fresh], tmp_path)
    assert fresh.loaded == [{"shape": [2, 3], "od": {"a": 1}}]
    assert type(fresh.loaded[0]["od"]) is dict


def test_the_files_on_disk(tmp_path):
    """<name>.json holds the structure with tensor placeholders (strict JSON: no NaN literal); <name>.safetensors
    holds the tensors under their dotted path."""
    state = {"steps": 3, "shadow": [torch.ones(2), torch.zeros(1)], "scale": math.nan}
    torchloom.save_plugin_state([Stateful("ema", state)], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ema.json", "ema.safetensors"]
    document = json.loads((tmp_path / "ema.json").read_text(), parse_constant=pytest.fail)
    assert document == {
        "format": "torchloom.plugin_state",
        "version": 2,
        "plugin": "ema",
        "state": {
            "steps": 3,
            "shadow": [{"__tensor__": "shadow.0"}, {"__tensor__": "shadow.1"}],
            "scale": {"__float__": "NaN"},
        },
    }
    tensors = load_file(tmp_path / "ema.safetensors")
    assert sorted(tensors) == ["shadow.0", "shadow.1"] and torch.equal(tensors["shadow.0"], torch.ones(2))


def test_a_string_that_names_a_non_finite_float_stays_a_string(tmp_path):
    """The tag keeps the float NaN apart from the string "NaN" (the user-facing files cannot: they hold numbers)."""
    state = {"as_float": [math.nan, math.inf, -math.inf], "as_text": ["NaN", "Infinity", "-Infinity", "nan"]}
    torchloom.save_plugin_state([Stateful(state=state)], tmp_path)
    fresh = Stateful()
    torchloom.load_plugin_state([fresh], tmp_path)
    assert same(fresh.loaded[0], state)


def test_version_1_files_still_load(tmp_path):
    """Version 1 spelt the tagged floats as Python's repr ("nan", "inf", "-inf")."""
    torchloom.save_plugin_state([Stateful()], tmp_path)
    (tmp_path / "counter.json").write_text(
        HEADER + '"state": {"x": [{"__float__": "nan"}, {"__float__": "inf"}, {"__float__": "-inf"}], "s": "nan"}}'
    )
    fresh = Stateful()
    torchloom.load_plugin_state([fresh], tmp_path)
    assert same(fresh.loaded[0], {"x": [math.nan, math.inf, -math.inf], "s": "nan"})


def test_a_state_without_tensors_still_writes_both_files(tmp_path):
    torchloom.save_plugin_state([Stateful(state={"steps": 1})], tmp_path)
    assert load_file(tmp_path / "counter.safetensors") == {}
    fresh = Stateful()
    torchloom.load_plugin_state([fresh], tmp_path)
    assert fresh.loaded == [{"steps": 1}]


def test_tensors_load_onto_the_device_of_the_current_state(tmp_path):
    """Each tensor goes where the tensor at the same path of the plugin's current state is (here the meta
    device, which every machine has), else onto the CPU."""
    torchloom.save_plugin_state([Stateful(state={"a": [torch.ones(2), torch.ones(3)], "b": torch.ones(1)})], tmp_path)
    fresh = Stateful(state={"a": [torch.empty(2, device="meta")]})  # no current tensor at a.1 or b
    torchloom.load_plugin_state([fresh], tmp_path)
    (loaded,) = fresh.loaded
    assert [t.device.type for t in loaded["a"]] == ["meta", "cpu"] and loaded["b"].device.type == "cpu"


def test_non_stateful_plugins_are_skipped(tmp_path):
    class OnlySave:
        name = "only_save"

        def state_dict(self):
            return {"x": 1}

    plugins = [Stateless(), OnlySave(), Stateful()]
    assert torchloom.save_plugin_state(plugins, tmp_path) == ["counter"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counter.json", "counter.safetensors"]
    assert torchloom.load_plugin_state(plugins, tmp_path) == ["counter"]


def test_saving_again_replaces_the_files_atomically(tmp_path):
    torchloom.save_plugin_state([Stateful(state={"steps": 1, "t": torch.ones(1)})], tmp_path)
    torchloom.save_plugin_state([Stateful(state={"steps": 2, "t": torch.zeros(1)})], tmp_path)
    fresh = Stateful()
    torchloom.load_plugin_state([fresh], tmp_path)
    assert same(fresh.loaded, [{"steps": 2, "t": torch.zeros(1)}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counter.json", "counter.safetensors"]  # no temp files


def test_a_failed_write_leaves_the_previous_files_and_no_temporary_file(tmp_path, monkeypatch):
    torchloom.save_plugin_state([Stateful(state={"steps": 1})], tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        torchloom.save_plugin_state([Stateful(state={"steps": 2})], tmp_path)
    monkeypatch.undo()
    assert {p.name for p in tmp_path.iterdir()} == set(before)
    assert (tmp_path / "counter.json").read_bytes() == before["counter.json"]


def test_only_the_main_process_writes_but_every_process_checks(tmp_path):
    assert torchloom.save_plugin_state([Stateful()], tmp_path / "ckpt", is_main_process=False) == ["counter"]
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(torchloom.PluginError, match=r"counter: state\['x'\] is a set"):
        torchloom.save_plugin_state([Stateful(state={"x": {1}})], tmp_path / "ckpt", is_main_process=False)


# --------------------------------------------------------------------------------------------- contract


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            {"shadow": [torch.ones(1), 1, 2, np.zeros(2)]},
            r"ema: state\['shadow'\]\[3\] is a numpy.ndarray; plugin state",
        ),
        ({"lr": np.float64(0.1)}, r"ema: state\['lr'\] is a numpy.float64"),
        ({"color": Color.RED}, r"ema: state\['color'\] is a test_state.Color"),
        ({"seen": {1, 2}}, r"ema: state\['seen'\] is a set"),
        ({"a": {"b": [object()]}}, r"ema: state\['a'\]\['b'\]\[0\] is a object"),
        ({"raw": b"bytes"}, r"ema: state\['raw'\] is a bytes"),
        ({"by_step": {3: 1.0}}, r"ema: state\['by_step'\] has the key 3 \(int\); keys must be str"),
        ({"x": {"__tensor__": "y"}}, r"ema: state\['x'\] is a dict with the single key '__tensor__', which the file"),
        ({"s": torch.ones(2).to_sparse()}, r"ema: state\['s'\] is a torch.sparse_coo tensor; save a dense one"),
        ([1, 2], r"ema: state_dict\(\) returned a list; expected a dict"),
    ],
)
def test_state_outside_the_contract_is_an_error_naming_the_plugin_and_the_path(tmp_path, state, message):
    with pytest.raises(torchloom.PluginError, match=message):
        torchloom.save_plugin_state([Stateful("ema", state)], tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()  # checked before anything is written


def test_a_state_that_contains_itself_is_an_error(tmp_path):
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(torchloom.PluginError, match=r"counter: state\['loop'\]\[0\] contains itself"):
        torchloom.save_plugin_state([Stateful(state={"loop": loop})], tmp_path)


def test_no_file_is_written_when_a_later_plugin_fails_the_contract(tmp_path):
    with pytest.raises(torchloom.PluginError, match="bad: state"):
        torchloom.save_plugin_state([Stateful("good"), Stateful("bad", {"x": object()})], tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("name", ["a/b", "..", ".hidden", "c:d"])
def test_a_name_that_cannot_be_a_file_name_is_an_error(tmp_path, name):
    with pytest.raises(torchloom.PluginError, match="cannot be a file name"):
        torchloom.save_plugin_state([Stateful(name)], tmp_path)


def test_two_stateful_plugins_with_one_name_is_an_error(tmp_path):
    with pytest.raises(torchloom.PluginError, match="two stateful plugins are named 'counter'"):
        torchloom.save_plugin_state([Stateful(), Stateful()], tmp_path)


# -------------------------------------------------------------------------------- the directory must match


def test_missing_state_for_an_enabled_plugin_names_it_and_loads_nothing(tmp_path):
    torchloom.save_plugin_state([Stateful("counter")], tmp_path)
    counter, ema = Stateful("counter"), Stateful("ema")
    with pytest.raises(torchloom.PluginError, match=r"no saved state for the enabled plugin\(s\) 'ema'.*'counter'"):
        torchloom.load_plugin_state([counter, ema], tmp_path)
    assert counter.loaded == []  # all files are checked before any plugin loads


def test_state_for_a_plugin_that_is_not_enabled_names_both(tmp_path):
    torchloom.save_plugin_state([Stateful("counter"), Stateful("ema")], tmp_path)
    with pytest.raises(
        torchloom.PluginError, match=r"state for the plugin\(s\) 'ema', which are not enabled.*'counter'"
    ):
        torchloom.load_plugin_state([Stateful("counter"), Stateless()], tmp_path)


def test_half_a_pair_is_an_error(tmp_path):
    torchloom.save_plugin_state([Stateful(state={"t": torch.ones(1)})], tmp_path)
    (tmp_path / "counter.safetensors").unlink()
    with pytest.raises(torchloom.PluginError, match=r"counter.safetensors' is missing"):
        torchloom.load_plugin_state([Stateful()], tmp_path)


def test_files_from_different_saves_are_an_error(tmp_path):
    torchloom.save_plugin_state([Stateful(state={"a": torch.ones(1)})], tmp_path / "one")
    torchloom.save_plugin_state([Stateful(state={"b": torch.ones(1)})], tmp_path / "two")
    (tmp_path / "one" / "counter.safetensors").replace(tmp_path / "two" / "counter.safetensors")
    with pytest.raises(torchloom.PluginError, match=r"has no tensor 'b'.*different saves"):
        torchloom.load_plugin_state([Stateful()], tmp_path / "two")


HEADER = '{"format": "torchloom.plugin_state", "version": 1, "plugin": "counter", '


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "is not valid JSON"),
        ('{"state": {}}', "is not torchloom plugin state"),
        (
            '{"format": "torchloom.plugin_state", "version": 1, "plugin": "other", "state": {}}',
            "state of plugin 'other'",
        ),
        ('{"format": "torchloom.plugin_state", "version": 99, "plugin": "counter", "state": {}}', "version 99"),
        (HEADER + '"state": {"x": {"__float__": 1}}}', "has the float 1; expected 'nan', 'inf' or '-inf'"),
        (HEADER + '"state": {"x": {"__tensor__": []}}}', r"has no tensor \[\]"),
        (
            HEADER.replace('"version": 1', '"version": 2') + '"state": {"x": {"__float__": "nan"}}}',
            "has the float 'nan'; expected 'NaN', 'Infinity' or '-Infinity'",
        ),
        ('{"format": "torchloom.plugin_state", "version": [2], "plugin": "counter", "state": {}}', r"version \[2\]"),
    ],
)
def test_a_json_file_that_is_not_this_plugins_state_is_an_error(tmp_path, text, message):
    torchloom.save_plugin_state([Stateful()], tmp_path)
    (tmp_path / "counter.json").write_text(text)
    with pytest.raises(torchloom.PluginError, match=message):
        torchloom.load_plugin_state([Stateful()], tmp_path)


def test_a_directory_that_does_not_exist_is_an_error(tmp_path):
    with pytest.raises(torchloom.PluginError, match="is not a directory"):
        torchloom.load_plugin_state([Stateful()], tmp_path / "nope")


def test_an_error_in_load_state_dict_names_the_plugin(tmp_path):
    class Picky(Stateful):
        def load_state_dict(self, state):
            raise ValueError("wrong shape")

    torchloom.save_plugin_state([Stateful("picky")], tmp_path)
    with pytest.raises(ValueError, match="wrong shape") as info:
        torchloom.load_plugin_state([Picky("picky")], tmp_path)
    assert any("load_state_dict of plugin 'picky'" in note for note in getattr(info.value, "__notes__", ["(3.10)"]))


# ------------------------------------------------------------------------------------------------ security


class Planted:
    """Unpickling this creates ``marker``: a stand-in for arbitrary code in a planted checkpoint file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_is_never_loaded(tmp_path, monkeypatch):
    """Accelerate's ``load_state`` unpickles ``custom_checkpoint_<i>.pkl`` with ``weights_only=False`` for every
    registered object, so a planted file runs code. Plugin state loads from JSON and safetensors only: planted
    pickles next to it (under Accelerate's names and under the plugin's) are never opened, and neither pickle
    nor torch.load is called at all."""
    ckpt = tmp_path / "ckpt"
    torchloom.save_plugin_state([Stateful(state={"steps": 5, "t": torch.ones(2)})], ckpt)
    marker = tmp_path / "code_ran"
    payload = pickle.dumps(Planted(marker))
    for planted in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "counter.pkl", "counter.pt", "counter.bin"):
        (ckpt / planted).write_bytes(payload)

    def refuse(*args, **kwargs):
        raise AssertionError("plugin state must load without pickle")

    for module, function in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(module, function, refuse)
    fresh = Stateful()
    torchloom.load_plugin_state([fresh], ckpt)
    assert same(fresh.loaded, [{"steps": 5, "t": torch.ones(2)}])
    assert not marker.exists()
    monkeypatch.undo()
    pickle.loads(payload)  # the planted file is live: unpickling it would have run its code
    assert marker.exists()


# ----------------------------------------------------------------------------- every built-in stateful plugin


def _builtin_stateful_plugins() -> list[str]:
    eps = importlib.metadata.distribution("torchloom").entry_points
    names = []
    for ep in eps:
        if ep.group == "torchloom.plugins":
            cls = ep.load()
            if callable(getattr(cls, "state_dict", None)) and callable(getattr(cls, "load_state_dict", None)):
                names.append(ep.name)
    return sorted(names)


def test_the_builtin_stateful_plugins_are_found():
    assert "local_sgd" in _builtin_stateful_plugins()


@pytest.mark.parametrize("name", _builtin_stateful_plugins())
def test_every_builtin_stateful_plugin_round_trips(tmp_path, name):
    """After a short fit, save; a new instance that loads the files returns the same state, bitwise."""
    (plugin,) = torchloom.enable_plugins([name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # local_sgd on one process warns that it does nothing
        tiny_fit([plugin], max_steps=5, output_dir=str(tmp_path / "run"))
    before = plugin.state_dict()
    torchloom.save_plugin_state([plugin], tmp_path / "state")
    (fresh,) = torchloom.enable_plugins([name])
    assert torchloom.load_plugin_state([fresh], tmp_path / "state") == [name]
    assert same(fresh.state_dict(), before)
    assert same(plugin.state_dict(), before)  # saving does not change the plugin
