"""torchloom's warnings name the user's line (`torchloom.utils.warn`): from the loop, from a resume, from a plugin's
settings, from a built-in plugin's hook, and from a plugin defined in the same file as the fit that runs it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import torchloom
from torchloom.testing import TinyTask


def caught(match: str, run) -> warnings.WarningMessage:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run()
    found = [w for w in record if match in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in record]
    return found[0]


def test_a_built_in_plugins_warning_names_the_line_that_called_fit(tmp_path):
    engine = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1, plugins={"grad_accum": {"steps": 64}})
    warning = caught("fewer than steps=64", lambda: engine.fit(TinyTask()))
    assert warning.filename == __file__ and warning.category is UserWarning


def test_a_resume_with_reset_optimizer_names_the_line_that_called_fit(tmp_path):
    """It named a line of contextlib (Engine.fit's decorator added a frame to a fixed stacklevel)."""
    first = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1, plugins={"checkpoint": {"every_n_steps": 4}})
    first.fit(TinyTask())
    again = torchloom.Engine(output_dir=str(tmp_path), max_epochs=2)
    warning = caught("reset_optimizer=True", lambda: again.fit(TinyTask(), ckpt_path=tmp_path, reset_optimizer=True))
    assert warning.filename == __file__


def test_a_settings_warning_names_the_line_that_built_the_engine(tmp_path):
    warning = caught(
        "reads as lower-is-better",
        lambda: torchloom.Engine(plugins={"early_stopping": {"monitor": "val/loss", "mode": "max"}}),
    )
    assert warning.filename == __file__


class Noisy(torchloom.Plugin):
    """A third-party plugin in the same file as the fit that runs it."""

    name = "test.noisy"

    @torchloom.hookimpl
    def on_fit_start(self) -> None:
        self._say()

    def _say(self) -> None:
        torchloom.utils.warn("noisy: hello")


def test_a_plugin_in_the_users_own_file_names_the_fit_line_not_its_hook(tmp_path):
    engine = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1, plugins=[Noisy()])
    line = (
        Path(__file__)
        .read_text()
        .splitlines()
        .index('    warning = caught("noisy: hello", lambda: engine.fit(TinyTask()))')
        + 1
    )
    warning = caught("noisy: hello", lambda: engine.fit(TinyTask()))
    assert (warning.filename, warning.lineno) == (__file__, line)


def test_warn_takes_a_category():
    with pytest.warns(DeprecationWarning, match="old"):
        torchloom.utils.warn("old", DeprecationWarning)
