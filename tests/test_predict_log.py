"""A value logged during predict is refused with one clear error, never dropped without a word (issue 39: a
value logged with ``self.log`` in ``predict_step`` reached no record, no ``on_log`` and no file).

Lightning refuses ``self.log`` in ``predict_step`` too. The refusal ends with the prediction pass: a fit after it
logs as before, and a validate run's logged values are recorded as before.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import torchloom
from torchloom.testing import TinyTask


class LogsInPredict(TinyTask):
    def predict_step(self, batch, batch_idx):
        out = self.model(batch)
        self.log("predict/mean", out.mean())
        return out


def _loader() -> DataLoader:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(x, batch_size=4)


def test_a_value_logged_in_predict_step_is_a_task_error(tmp_path):
    engine = torchloom.Engine(default_plugins=False, output_dir=str(tmp_path))
    with pytest.raises(torchloom.TaskError, match=r"log\('predict/mean'\) during predict: .* Return the value"):
        engine.predict(LogsInPredict(), dataloader=_loader())


def test_after_a_prediction_run_the_same_engine_logs_a_fit_and_a_validation_as_before(tmp_path):
    engine = torchloom.Engine(default_plugins=False, output_dir=str(tmp_path), max_steps=2, log_every_n_steps=1)
    task = TinyTask()
    assert len(engine.predict(task, dataloader=_loader())) == 2
    engine.fit(task)
    assert [record["step"] for record in engine.history if "train/loss" in record] == [1, 2]
    assert "val/loss" in engine.validate(task)
