"""One settings-validation path (`torchloom._settings`): engine, plugin and data-module settings are checked the
same way (unknown names with a suggestion, types by annotation, the class's own ranges) and fail with one message
shape, ``<owner>: ...``."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

import torchloom
from torchloom import _settings


@dataclasses.dataclass
class HelloConfig:
    times: int = 1  # how often
    greeting: str = "hi"  # what
    scale: float = 1.0  # a float takes an int

    def __post_init__(self) -> None:
        if self.times < 1:
            raise torchloom.ConfigError(f"setting 'times' = {self.times!r}; expected an integer >= 1")


class Hello(torchloom.Plugin):
    name = "hello"
    Config = HelloConfig


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: torchloom.Engine(max_epoch=2),
            "engine: unknown setting 'max_epoch'; did you mean 'max_epochs'? Valid settings: max_epochs, max_steps, "
            "val_check_interval, log_every_n_steps, seed, output_dir, save_model, num_sanity_val_steps, nonfinite_loss",
        ),
        (
            lambda: Hello(tims=2),
            "plugin 'hello': unknown setting 'tims'; did you mean 'times'? Valid settings: times, greeting, scale",
        ),
        (lambda: torchloom.Engine(zzz=1), "engine: unknown setting 'zzz'. Valid settings: max_epochs, "),
        (lambda: Hello(zzz=1), "plugin 'hello': unknown setting 'zzz'. Valid settings: times, greeting, scale"),
        (lambda: torchloom.Engine(max_epochs="2"), "engine: setting 'max_epochs' = '2' (str); expected int"),
        (lambda: Hello(times="2"), "plugin 'hello': setting 'times' = '2' (str); expected int"),
        (lambda: torchloom.Engine(max_epochs=0), "engine: setting 'max_epochs' = 0; expected a positive integer"),
        (lambda: Hello(times=0), "plugin 'hello': setting 'times' = 0; expected an integer >= 1"),
        (lambda: torchloom.Engine(seed=True), "engine: setting 'seed' = True (bool); expected int | None"),
        (
            lambda: torchloom.Engine(nonfinite_loss="skp"),
            "engine: setting 'nonfinite_loss' = 'skp'; expected one of 'error', 'skip', 'ignore'",
        ),
        (lambda: torchloom.EngineConfig(max_steps=0), "engine: setting 'max_steps' = 0; expected a positive integer"),
        (lambda: torchloom.EngineConfig(save_model="yes"), "engine: setting 'save_model' = 'yes' (str); expected bool"),
        (lambda: torchloom.EngineConfig.from_settings([1]), "engine: settings [1] (list); expected a mapping"),
    ],
)
def test_engine_and_plugin_settings_fail_in_one_shape(build, message):
    with pytest.raises(torchloom.ConfigError) as info:
        build()
    assert str(info.value).startswith(message)


def test_values_are_coerced_alike():
    assert Hello(scale=2).config.scale == 2.0 and type(Hello(scale=2).config.scale) is float
    assert torchloom.EngineConfig.from_settings({"output_dir": pathlib.Path("runs/x")}).output_dir == "runs/x"
    assert torchloom.EngineConfig(output_dir=pathlib.Path("runs/y")).output_dir == "runs/y"
    assert torchloom.EngineConfig.from_settings(None) == torchloom.EngineConfig()


def test_a_data_module_constructor_checks_its_arguments_the_same_way():
    class ToyData:
        def __init__(self, *, batch_size: int = 16, max_length: int | None = None, columns: tuple[str, ...] = ()):
            owner = type(self).__name__
            values = _settings.check_arguments(
                owner, type(self).__init__, {"batch_size": batch_size, "max_length": max_length, "columns": columns}
            )
            if batch_size < 1:
                raise _settings.invalid("batch_size", batch_size, "a positive integer", owner=owner)
            self.columns = values["columns"]

    assert ToyData(columns=["a"]).columns == ("a",)
    with pytest.raises(
        torchloom.ConfigError, match=r"^ToyData: setting 'batch_size' = 0; expected a positive integer$"
    ):
        ToyData(batch_size=0)
    with pytest.raises(
        torchloom.ConfigError, match=re.escape("ToyData: setting 'batch_size' = 2.5 (float); expected int")
    ):
        ToyData(batch_size=2.5)
    with pytest.raises(torchloom.ConfigError, match=re.escape("ToyData: unknown setting 'batchsize'; did you mean")):
        _settings.check_arguments("ToyData", ToyData.__init__, {"batchsize": 1})


# ------------------------------------------------- a settings class that rejects with something else (mutation)


@dataclasses.dataclass
class _Checked:
    rate: float = 0.5
    name: str = "x"

    def __post_init__(self) -> None:
        assert 0 < self.rate < 1, "rate must lie in (0, 1)"
        if self.name == "boom":
            raise RuntimeError()
        if self.name == "value":
            raise ValueError("name 'value' is taken")


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        # an assert: the class, every given value, the exception type, the failing line and its message
        (
            {"rate": 2.0, "name": "y"},
            "thing: _Checked rejected the settings (rate=2.0, name='y'): AssertionError at "
            '`assert 0 < self.rate < 1, "rate must lie in (0, 1)"`: rate must lie in (0, 1)',
        ),
        # an exception without a message: the type and the line only
        (
            {"name": "boom"},
            "thing: _Checked rejected the settings (name='boom'): RuntimeError at `raise RuntimeError()`",
        ),
        # a ValueError with a message: the documented way, its message alone
        ({"name": "value"}, "thing: name 'value' is taken"),
    ],
    ids=["assert", "no-message", "value-error"],
)
def test_a_rejection_by_the_settings_class_is_one_message_with_the_values_type_and_line(settings, expected):
    with pytest.raises(torchloom.ConfigError) as info:
        _settings.build_settings(_Checked, settings, "thing")
    assert str(info.value).startswith(expected)  # (pytest adds its own explanation to the assert's message here)
    assert str(info.value) == expected or "AssertionError" in expected


def test_a_rejection_of_the_defaults_says_so():
    @dataclasses.dataclass
    class Never:
        def __post_init__(self) -> None:
            raise KeyError

    with pytest.raises(torchloom.ConfigError) as info:
        _settings.build_settings(Never, None, "thing")
    assert str(info.value).startswith(
        "thing: "
    ) and "rejected the settings (the defaults): KeyError at `raise KeyError`" in str(info.value)
