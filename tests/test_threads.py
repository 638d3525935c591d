"""`EngineConfig.num_threads`: torch's intra-op thread count is a setting of the run, applied when a call starts
and undone when it ends (issue 24, item 1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchloom
from torchloom._threads import resolve_num_threads
from torchloom.testing import TinyTask


@pytest.fixture
def two_threads():
    """Start every test from a known count (2) that differs from the one the runs set (1), and restore the
    session's own count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class Recording(TinyTask):
    """Records torch's thread count in each of its steps."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: dict[str, set[int]] = {}

    def _note(self, stage: str) -> None:
        self.seen.setdefault(stage, set()).add(torch.get_num_threads())

    def configure_model(self) -> torch.nn.Module:
        self._note("configure_model")
        return super().configure_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._note("train")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._note("validate")
        return super().validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        self._note("predict")
        return self.model(batch[0])


@pytest.mark.parametrize(
    ("setting", "environ", "expected"),
    [
        (3, {"OMP_NUM_THREADS": "8", "LOCAL_WORLD_SIZE": "2"}, 3),  # the setting wins over everything
        (None, {"OMP_NUM_THREADS": "4", "LOCAL_WORLD_SIZE": "2"}, None),  # the user's / the launcher's choice
        (None, {}, None),  # one process: torch's own count
        (None, {"LOCAL_WORLD_SIZE": "1"}, None),
        (None, {"LOCAL_WORLD_SIZE": "2"}, 1),  # 2 threads shared by 2 processes
        (None, {"LOCAL_WORLD_SIZE": "3"}, 1),  # never 0
        (None, {"OMP_NUM_THREADS": " ", "LOCAL_WORLD_SIZE": "2"}, 1),  # blank is unset
        (None, {"LOCAL_WORLD_SIZE": "two"}, None),  # not a launcher's value: torch's own count
    ],
)
def test_the_thread_count_of_a_call(two_threads, setting, environ, expected):
    assert resolve_num_threads(setting, environ) == expected


def test_several_local_processes_divide_torchs_count(two_threads):
    torch.set_num_threads(8)
    assert resolve_num_threads(None, {"LOCAL_WORLD_SIZE": "2"}) == 4
    assert resolve_num_threads(None, {"LOCAL_WORLD_SIZE": "3"}) == 2  # rounded down: no oversubscription


def test_fit_validate_and_predict_run_with_the_setting_and_give_the_count_back(two_threads, tmp_path):
    task = Recording()
    engine = torchloom.Engine(max_epochs=1, num_threads=1, output_dir=str(tmp_path), default_plugins=False)
    engine.fit(task)
    assert task.seen == {"configure_model": {1}, "train": {1}, "validate": {1}}
    assert torch.get_num_threads() == 2
    engine.validate(task)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=2)
    engine.predict(task, dataloader=data)
    assert task.seen["validate"] == {1} and task.seen["predict"] == {1}
    assert torch.get_num_threads() == 2


def test_unset_keeps_torchs_count(two_threads, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    task = Recording()
    torchloom.Engine(max_epochs=1, output_dir=str(tmp_path), default_plugins=False).fit(task)
    assert task.seen["train"] == {2}


class Failing(Recording):
    def configure_model(self) -> torch.nn.Module:
        self._note("configure_model")
        raise RuntimeError("no model today")


class FailingStep(Recording):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise RuntimeError("no step today")


@pytest.mark.parametrize("task_class", [Failing, FailingStep], ids=["set-up fails", "training fails"])
def test_a_failed_call_gives_the_count_back_too(two_threads, tmp_path, task_class):
    task = task_class()
    engine = torchloom.Engine(max_epochs=1, num_threads=1, output_dir=str(tmp_path), default_plugins=False)
    with pytest.raises(RuntimeError, match="today"):
        engine.fit(task)
    assert task.seen["configure_model"] == {1}
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "engine: setting 'num_threads' = 0; expected a positive integer"),
        (-2, "engine: setting 'num_threads' = -2; expected a positive integer"),
        ("two", "engine: setting 'num_threads' = 'two'"),
        (True, "engine: setting 'num_threads' = True"),
    ],
)
def test_a_bad_thread_count_is_one_clear_error(value, message):
    with pytest.raises(torchloom.ConfigError) as info:
        torchloom.Engine(num_threads=value)
    assert str(info.value).startswith(message)
