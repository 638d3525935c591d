"""A plugin's ``state_dict`` / ``load_state_dict`` that raises (issue 39, item 11): the error names that plugin and
the operation, and the hook it happened in without blaming the plugin whose hook called it (the ``checkpoint`` plugin
saves and loads every plugin's state)."""

from __future__ import annotations

import pytest
import torch

import torchloom
from torchloom.checkpoint.store import list_checkpoints
from torchloom.testing import TinyTask, tiny_fit


class Stateful(torchloom.Plugin):
    """A stateful plugin (a tensor and a number) whose ``state_dict`` raises once ``fail_save`` is set, and whose
    ``load_state_dict`` raises with ``fail_load``."""

    name = "stateful"

    def __init__(self, fail_save: bool = False, fail_load: bool = False) -> None:
        super().__init__()
        self.fail_save, self.fail_load = fail_save, fail_load

    def state_dict(self):
        if self.fail_save:
            raise RuntimeError("state_dict failed")
        return {"count": 3, "average": torch.ones(2)}

    def load_state_dict(self, state):
        if self.fail_load:
            raise ValueError("load_state_dict failed")


class Other(Stateful):
    name = "other"


def _notes(exc: BaseException) -> list[str]:
    return list(getattr(exc, "__notes__", []))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_state_dict_that_raises_during_a_checkpoint_save_names_its_plugin(tmp_path, async_save):
    with pytest.raises(RuntimeError, match="state_dict failed") as info:
        tiny_fit(
            [{"checkpoint": {"every_n_steps": 2, "async_save": async_save}}, Stateful(fail_save=True)],
            max_steps=3,
            output_dir=str(tmp_path),
        )
    assert _notes(info.value) == [
        "torchloom: raised in state_dict of plugin 'stateful' (called to save its state)",
        "torchloom: while hook 'on_train_step_end' of plugin 'checkpoint' ran",
    ]
    assert list_checkpoints(tmp_path / "version_0") == []


def test_save_plugin_state_names_the_plugin_whose_state_dict_raised(tmp_path):
    with pytest.raises(RuntimeError) as info:
        torchloom.save_plugin_state([Other(), Stateful(fail_save=True)], tmp_path)
    assert _notes(info.value) == ["torchloom: raised in state_dict of plugin 'stateful' (called to save its state)"]


def _checkpoint(tmp_path) -> str:
    tiny_fit([{"checkpoint": {"every_n_steps": 2}}, Stateful()], max_steps=2, output_dir=str(tmp_path))
    (checkpoint,) = list_checkpoints(tmp_path / "version_0")
    return checkpoint


@pytest.mark.parametrize(
    ("failing", "error", "match", "blame"),
    [
        ({"fail_load": True}, ValueError, "load_state_dict failed", "load_state_dict of plugin 'stateful' (state from"),
        (
            {"fail_save": True},
            RuntimeError,
            "state_dict failed",
            "state_dict of plugin 'stateful' (called to load its state from",
        ),
    ],
    ids=["load_state_dict", "state_dict"],
)
def test_a_plugin_state_method_that_raises_on_resume_names_its_plugin(tmp_path, failing, error, match, blame):
    checkpoint = _checkpoint(tmp_path)
    with pytest.raises(error, match=match) as info:
        torchloom.Engine(
            plugins=[{"checkpoint": {"every_n_steps": 2}}, Stateful(**failing)],
            max_steps=4,
            default_plugins=False,
            output_dir=str(tmp_path),
        ).fit(TinyTask(), ckpt_path=checkpoint)
    notes = _notes(info.value)
    assert notes[0] == f"torchloom: raised in {blame} '{checkpoint}/plugins')"
    assert not any("of plugin 'checkpoint'" in note and "raised in" in note for note in notes), notes
