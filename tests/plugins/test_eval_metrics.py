"""The ``eval_metrics`` plugin in one process: every value equals torchmetrics' functional metric over the whole
validation set, each validation pass counts only its own samples, the task's own metrics (a MetricCollection with
compute groups, one Metric, a mapping) work, and bad settings or outputs are one clear error each.

The values on several processes (uneven shards, padding copies) are in ``test_eval_metrics_mp.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.functional.classification import multiclass_accuracy, multiclass_auroc, multiclass_f1_score

import torchloom
from torchloom.testing import TinyTask, tiny_fit
from torchloom_plugins.eval_metrics import METRICS, EvalMetrics, metric_class

CLASSES = 3


def classes_dataset(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())  # 3 classes, learnable


class Classifier(torchloom.TaskModule):
    """3 classes from 4 features; validation returns class probabilities and targets."""

    def __init__(self, metrics=None, val_n: int = 22, out: str = "mapping"):
        super().__init__()
        self.metrics, self.val_n, self.out = metrics, val_n, out

    def configure_model(self):
        torch.manual_seed(0)
        return torch.nn.Linear(4, CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        probs = self.model(x).softmax(-1)
        if self.out == "bf16":
            return {"preds": probs.bfloat16(), "target": y}
        if self.out == "tensor":
            return probs
        return {"preds": probs, "target": y}

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.5)

    def configure_metrics(self):
        self.returned = self.metrics() if callable(self.metrics) else self.metrics
        return self.returned

    def train_dataloader(self):
        return DataLoader(classes_dataset(32, 0), batch_size=4)

    def val_dataloader(self):
        return DataLoader(classes_dataset(self.val_n, 1), batch_size=4)  # 22 = 5 * 4 + 2: an uneven last batch


def _probs_and_targets(task: Classifier, dataset: TensorDataset) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = dataset.tensors
    model = task.accelerator.unwrap_model(task.model)
    with torch.no_grad():
        return model(x).softmax(-1), y


NAMED = {
    "accuracy": {"task": "multiclass", "num_classes": CLASSES},
    "f1_macro": {"metric": "f1", "task": "multiclass", "num_classes": CLASSES, "average": "macro"},
    "auroc": {"task": "multiclass", "num_classes": CLASSES},
}


def test_named_metrics_equal_torchmetrics_on_the_whole_validation_set_after_fit(tmp_path):
    task = Classifier()
    engine = tiny_fit({"eval_metrics": {"metrics": NAMED}}, task, max_epochs=2, output_dir=str(tmp_path))
    probs, y = _probs_and_targets(task, classes_dataset(22, 1))
    expected = {
        "val/accuracy": multiclass_accuracy(probs, y, CLASSES, average="micro").item(),  # Accuracy's default
        "val/f1_macro": multiclass_f1_score(probs, y, CLASSES, average="macro").item(),
        "val/auroc": multiclass_auroc(probs, y, CLASSES).item(),
    }
    validations = [record for record in engine.history if "val/accuracy" in record]
    assert [record["step"] for record in validations] == [8, 16]  # one pass per epoch: fresh values each time
    assert validations[0]["val/auroc"] != validations[1]["val/auroc"]
    for name, value in expected.items():
        assert validations[-1][name] == pytest.approx(value, rel=1e-6), name  # the model that fit returns
    assert 0.5 < expected["val/auroc"] < 1.0


class Count(torchmetrics.Metric):
    def __init__(self):
        super().__init__()
        self.add_state("n", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds, target):
        self.n += target.numel()

    def compute(self):
        return self.n


def test_each_validation_pass_counts_only_its_own_samples(tmp_path):
    task = Classifier(metrics=lambda: {"count": Count()})
    engine = torchloom.Engine(output_dir=str(tmp_path), plugins={"eval_metrics": {}}, num_sanity_val_steps=2)
    fitted = engine.fit(task)  # the sanity pass runs 2 batches first: they must not be counted
    assert fitted["val/count"] == 22
    assert engine.validate(task, DataLoader(classes_dataset(10, 2), batch_size=4))["val/count"] == 10
    assert engine.validate(task, DataLoader(classes_dataset(7, 3), batch_size=4))["val/count"] == 7


def test_a_task_metric_collection_with_compute_groups_gives_each_members_own_value(tmp_path):
    def collection():
        return torchmetrics.MetricCollection(
            {  # accuracy / precision / recall share one state (a compute group); auroc has its own
                "acc": torchmetrics.classification.MulticlassAccuracy(CLASSES, average="micro"),
                "precision": torchmetrics.classification.MulticlassPrecision(CLASSES, average="macro"),
                "recall": torchmetrics.classification.MulticlassRecall(CLASSES, average="macro"),
                "auroc": torchmetrics.classification.MulticlassAUROC(CLASSES),
            },
            prefix="cls_",
        )

    task = Classifier(metrics=collection)
    engine = torchloom.Engine(output_dir=str(tmp_path), plugins={"eval_metrics": {}})
    loader = DataLoader(classes_dataset(22, 1), batch_size=4)
    engine.validate(task, DataLoader(classes_dataset(9, 5), batch_size=4))  # another set first: reset between
    got = engine.validate(task, loader)
    probs, y = _probs_and_targets(task, classes_dataset(22, 1))
    reference = collection()
    reference.update(probs, y)
    expected = {f"val/{name}": value.item() for name, value in reference.compute().items()}
    assert got.keys() == expected.keys() == {"val/cls_acc", "val/cls_precision", "val/cls_recall", "val/cls_auroc"}
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-6), name
    # precision and recall share one state (a compute group) and still give their own values
    assert any({"precision", "recall"} <= set(group) for group in task.returned.compute_groups.values())
    assert got["val/cls_precision"] != got["val/cls_recall"]


@pytest.mark.parametrize(
    ("returned", "logged"),
    [
        (lambda: torchmetrics.classification.MulticlassAccuracy(CLASSES), "val/multiclass_accuracy"),
        (lambda: {"acc": torchmetrics.classification.MulticlassAccuracy(CLASSES)}, "val/acc"),
    ],
)
def test_a_task_may_return_one_metric_or_a_mapping(tmp_path, returned, logged):
    task = Classifier(metrics=returned)
    got = torchloom.Engine(output_dir=str(tmp_path), plugins={"eval_metrics": {"prefix": "val/"}}).validate(task)
    probs, y = _probs_and_targets(task, classes_dataset(22, 1))
    assert got == {logged: pytest.approx(multiclass_accuracy(probs, y, CLASSES).item(), rel=1e-6)}  # both macro


def test_mse_of_the_outputs_equals_the_tasks_own_validation_loss(tmp_path):
    class Regression(TinyTask):
        def validation_step(self, batch, batch_idx):
            super().validation_step(batch, batch_idx)  # logs val/loss, the exact mean squared error
            x, y = batch
            return {"preds": self.model(x), "target": y}

    settings = {"metrics": {"mse": None, "mae": {}, "rmse": {"metric": "mse", "squared": False}}}
    got = torchloom.Engine(output_dir=str(tmp_path), plugins={"eval_metrics": settings}).validate(Regression(n=44))
    assert got["val/mse"] == pytest.approx(got["val/loss"], rel=1e-6)
    assert got["val/rmse"] == pytest.approx(math.sqrt(got["val/loss"]), rel=1e-6)
    assert 0 < got["val/mae"] < got["val/rmse"]


class LanguageModel(torchloom.TaskModule):
    """Next-token logits from an embedding; padding positions (-100) are ignored."""

    def configure_model(self):
        torch.manual_seed(0)
        return torch.nn.Embedding(11, 11)

    def validation_step(self, batch, batch_idx):
        (tokens,) = batch
        return {"preds": self.model(tokens[:, :-1].clamp(min=0)), "target": tokens[:, 1:]}

    def val_dataloader(self):
        tokens = torch.randint(0, 11, (10, 6), generator=torch.Generator().manual_seed(0))
        tokens[::3, 4:] = -100  # padded sequences
        return DataLoader(TensorDataset(tokens), batch_size=4)


def test_perplexity_is_exp_of_the_mean_token_cross_entropy(tmp_path):
    task = LanguageModel()
    settings = {"metrics": {"perplexity": {"ignore_index": -100}}}
    got = torchloom.Engine(output_dir=str(tmp_path), plugins={"eval_metrics": settings}).validate(task)
    (tokens,) = task.val_dataloader().dataset.tensors
    model = task.accelerator.unwrap_model(task.model)
    with torch.no_grad():
        logits = model(tokens[:, :-1].clamp(min=0))
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1), ignore_index=-100)
    assert got["val/perplexity"] == pytest.approx(math.exp(ce.item()), rel=1e-5)


def test_half_precision_predictions_are_passed_as_float32(tmp_path):
    task = Classifier(out="bf16")
    got = torchloom.Engine(output_dir=str(tmp_path), plugins={"eval_metrics": {"metrics": NAMED}}).validate(task)
    probs, y = _probs_and_targets(task, classes_dataset(22, 1))
    assert got["val/auroc"] == pytest.approx(multiclass_auroc(probs.bfloat16().float(), y, CLASSES).item(), rel=1e-6)


def test_targets_can_come_from_the_batch(tmp_path):
    class FromBatch(torchloom.TaskModule):
        def configure_model(self):
            return torch.nn.Identity()

        def validation_step(self, batch, batch_idx):
            return {"preds": batch["guess"]}

        def val_dataloader(self):
            rows = [{"guess": torch.tensor(i % 2), "labels": torch.tensor(1)} for i in range(9)]
            return DataLoader(rows, batch_size=4)

    settings = {"metrics": {"accuracy": {"task": "binary"}}, "target_key": "labels"}
    got = torchloom.Engine(output_dir=str(tmp_path), plugins={"eval_metrics": settings}).validate(FromBatch())
    assert got == {"val/accuracy": pytest.approx(4 / 9)}


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("tensor", r"validation_step must return a mapping with 'preds' .* it returned Tensor"),
        (
            "mapping",
            r"no targets: neither validation_step's outputs \(keys \['preds', 'target'\]\) nor the batch have 'y'",
        ),
    ],
)
def test_outputs_without_the_keys_are_a_task_error(tmp_path, out, message):
    settings = {"metrics": NAMED, "target_key": "y" if out == "mapping" else "target"}
    engine = torchloom.Engine(output_dir=str(tmp_path), plugins={"eval_metrics": settings})
    with pytest.raises(torchloom.TaskError, match=message):
        engine.validate(Classifier(out=out))


class FailsFirst(Count):
    failed = False

    def compute(self):
        if not self.failed:
            self.failed = True
            raise ValueError("no samples")
        return self.n


def test_a_failing_compute_fails_the_pass_and_leaves_the_metrics_usable(tmp_path):
    task = Classifier(metrics=lambda: {"count": FailsFirst(), "ok": Count()})
    engine = torchloom.Engine(output_dir=str(tmp_path), plugins={"eval_metrics": {}})
    with pytest.raises(torchloom.TaskError, match=r"metric 'val/count' \(FailsFirst\): compute failed: no samples"):
        engine.validate(task)
    plugin = engine.plugins[0]  # the defaults (progress) come after the plugins a run names
    assert int(plugin.metrics["val/ok"].n) == 0  # computed and reset although another metric failed first
    assert int(plugin.metrics["val/count"].n) == 22  # its own state, left as it was
    # The same metric objects serve the next pass (the engine reuses the prepared run): reset, then exact.
    assert engine.validate(task) == {"val/count": 22, "val/ok": 22}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"metrics": {"acuracy": {}}}, r"unknown metric 'acuracy'; valid names: accuracy, f1,"),
        ({"metrics": {"accuracy": {}}}, r"'accuracy' \(Accuracy\) rejects no arguments: .*task"),
        ({"metrics": {"f1": {"task": "multiclass"}}}, r"'f1' \(F1Score\) rejects task='multiclass': .*num_classes"),
        ({"metrics": {"auroc": {"task": "binary", "colour": 1}}}, r"'auroc' \(AUROC\) rejects .*colour"),
        ({"metrics": {"x": {"metric": 3}}}, r"x.metric = 3; expected a metric name"),
        ({"metrics": {" ": {}}}, r"name ' '; expected a non-empty name"),
        ({"preds_key": ""}, r"setting 'preds_key' = ''"),
    ],
)
def test_bad_settings_are_one_config_error_each(settings, message):
    with pytest.raises(torchloom.ConfigError, match=message):
        EvalMetrics(**settings)


def test_metrics_by_torchmetrics_class_name_and_the_short_names_all_resolve():
    assert metric_class("MulticlassAccuracy") is torchmetrics.classification.MulticlassAccuracy
    assert metric_class("BinaryAUROC") is torchmetrics.classification.BinaryAUROC
    for name in METRICS:
        assert issubclass(metric_class(name), torchmetrics.Metric), name
    with pytest.raises(torchloom.ConfigError, match="unknown metric 'Tensor'"):
        metric_class("Tensor")  # a torchmetrics attribute that is not a Metric


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (None, r"no metrics; name them in the plugin's 'metrics' setting"),
        (lambda: [torchmetrics.classification.MulticlassAccuracy(CLASSES)], r"configure_metrics\(\) returned list"),
        (lambda: {}, r"configure_metrics\(\) returned dict; expected"),
        (lambda: {"accuracy": torchmetrics.classification.MulticlassAccuracy(CLASSES)}, r"'accuracy' is both"),
    ],
)
def test_missing_or_bad_task_metrics_are_config_errors(tmp_path, returned, message):
    settings = {"metrics": {"accuracy": NAMED["accuracy"]}} if "both" in message else {}
    engine = torchloom.Engine(output_dir=str(tmp_path), plugins={"eval_metrics": settings})
    with pytest.raises(torchloom.ConfigError, match=message):
        engine.validate(Classifier(metrics=returned))
