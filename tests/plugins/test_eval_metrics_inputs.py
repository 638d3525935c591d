"""Issue 21 items 3 and 4 in one process: every invalid input reaching ``eval_metrics`` is one `TaskError` that names
the metric, the tensor, what it got and what it expects (targets out of range gave accuracy and F1 of 0.0 without a
word; wrong shapes gave torchmetrics' raw tracebacks), checked without a host read per validation batch; the
input rules reject whatever torchmetrics' own checks reject (which they replace); one metric object under two
names is computed once and logged under both.

2 processes (an invalid input in one process's share): ``test_eval_metrics_joins_mp.py``.
"""

from __future__ import annotations

import copy
import itertools
import os
import sys
from collections import Counter

import pytest
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import classification as C
from torchmetrics.functional.classification import multiclass_accuracy

import torchloom
from torchloom_plugins._metric_inputs import highest, host_problem, invalid_values, rule_for

GEN = torch.Generator().manual_seed(0)
PROBS = torch.rand(6, 3, generator=GEN).softmax(-1)
LABELS = torch.tensor([0, 1, 2, 1, 0, 2])
SCORES = torch.rand(6, generator=GEN)
BINARY = torch.tensor([0, 1, 1, 0, 1, 0])
MULTICLASS = {"task": "multiclass", "num_classes": 3}
OUTPUTS = "validation_step's outputs"


class Fixed(torchloom.TaskModule):
    """validation_step returns the rows of fixed predictions and targets: 6 samples, batches of 3."""

    def __init__(self, preds, target, metrics=None):
        super().__init__()
        self.preds, self.target, self.metrics = preds, target, metrics

    def configure_model(self):
        return torch.nn.Identity()

    def validation_step(self, batch, batch_idx):
        (rows,) = batch
        preds = [self.preds[i] for i in rows.tolist()] if isinstance(self.preds, list) else self.preds[rows]
        return {"preds": preds, "target": self.target[rows]}

    def configure_metrics(self):
        return self.metrics() if self.metrics is not None else None

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(6)), batch_size=3)


def _validate(tmp_path, task, metrics=None):
    plugins = {"eval_metrics": {"metrics": metrics} if metrics is not None else {}}
    return torchloom.Engine(output_dir=str(tmp_path), plugins=plugins).validate(task)


ABOUT = "eval_metrics: metric 'val/accuracy' (MulticlassAccuracy; also 'val/f1')"
CASES = {
    "target above num_classes": (
        PROBS,
        torch.tensor([0, 1, 2, 3, 1, 7]),
        {"accuracy": MULTICLASS, "f1": MULTICLASS},
        f"{ABOUT}: target ({OUTPUTS}['target']) holds 2 invalid values (from 3 to 7) in this validation pass; "
        "expected class indices 0..2 (num_classes=3)",
    ),
    "negative target": (
        PROBS,
        torch.tensor([0, -1, 2, 1, 0, 2]),
        {"accuracy": MULTICLASS, "f1": MULTICLASS},
        f"{ABOUT}: target ({OUTPUTS}['target']) holds 1 invalid value (-1) in this validation pass; expected class "
        "indices 0..2 (num_classes=3)",
    ),
    "target neither a class nor ignore_index": (
        PROBS,
        torch.tensor([0, -100, 2, -1, 0, 2]),
        {"accuracy": {**MULTICLASS, "ignore_index": -100}},
        "eval_metrics: metric 'val/accuracy' (MulticlassAccuracy): target (validation_step's outputs['target']) "
        "holds 1 invalid value (-1) in this validation pass; expected class indices 0..2 (num_classes=3), or "
        "ignore_index=-100",
    ),
    "four class scores for three classes": (
        torch.rand(6, 4, generator=GEN),
        LABELS,
        {"accuracy": MULTICLASS, "f1": MULTICLASS},
        f"{ABOUT}: preds ({OUTPUTS}['preds']) is a float32 tensor of shape (3, 4), with target of shape (3,); expected "
        "float scores of shape (N, 3) (num_classes=3), or class indices of target's shape (3,)",
    ),
    "an extra dimension": (
        torch.rand(6, 3, 2, generator=GEN),
        LABELS,
        {"accuracy": MULTICLASS, "f1": MULTICLASS},
        f"{ABOUT}: preds ({OUTPUTS}['preds']) is a float32 tensor of shape (3, 3, 2), with target of shape (3,); "
        "expected float scores of shape (N, 3) (num_classes=3), or class indices of target's shape (3,)",
    ),
    "predicted class out of range": (
        torch.tensor([0, 1, 5, 1, 0, 2]),
        LABELS,
        {"accuracy": MULTICLASS},
        "eval_metrics: metric 'val/accuracy' (MulticlassAccuracy): preds (validation_step's outputs['preds']) holds "
        "1 invalid value (5) in this validation pass; expected predicted class indices 0..2 (num_classes=3)",
    ),
    "float class indices": (
        PROBS,
        LABELS.float(),
        {"accuracy": MULTICLASS},
        "eval_metrics: metric 'val/accuracy' (MulticlassAccuracy): target (validation_step's outputs['target']) is a "
        "float32 tensor of shape (3,); expected an integer tensor of class indices",
    ),
    "predicted classes that are not whole numbers": (
        torch.tensor([0.0, 1.0, 2.0, 1.5, 0.0, 2.0]),  # float class indices (preds of target's shape) must be whole
        LABELS,
        {"accuracy": MULTICLASS},
        "eval_metrics: metric 'val/accuracy' (MulticlassAccuracy): preds (validation_step's outputs['preds']) holds 1 "
        "invalid value (1.5) in this validation pass; expected predicted class indices 0..2 (num_classes=3)",
    ),
    "float targets to AUROC": (
        SCORES,
        BINARY.float(),
        {"auroc": {"task": "binary"}},
        "eval_metrics: metric 'val/auroc' (BinaryAUROC): target (validation_step's outputs['target']) is a float32 "
        "tensor of shape (3,); expected an integer tensor of labels 0 / 1",
    ),
    "binary target 2": (
        SCORES,
        torch.tensor([0, 1, 2, 0, 1, 0]),
        {"accuracy": {"task": "binary"}, "auroc": {"task": "binary"}},
        "eval_metrics: metric 'val/accuracy' (BinaryAccuracy): target (validation_step's outputs['target']) holds 1 "
        "invalid value (2) in this validation pass; expected labels 0 or 1",
    ),
    "labels to AUROC": (
        BINARY,
        BINARY,
        {"auroc": {"task": "binary"}},
        "eval_metrics: metric 'val/auroc' (BinaryAUROC): preds (validation_step's outputs['preds']) is an int64 "
        "tensor of shape (3,); expected float scores (probabilities or logits), not labels",
    ),
    "three labels for four": (
        PROBS,
        (PROBS > 0.3).long(),
        {"f1": {"task": "multilabel", "num_labels": 4}},
        "eval_metrics: metric 'val/f1' (MultilabelF1Score): preds (validation_step's outputs['preds']) is a float32 "
        "tensor of shape (3, 3), with target of shape (3, 3); expected preds and target of the same shape "
        "(N, 4, ...) (num_labels=4)",
    ),
    "a token id past the vocabulary": (
        torch.randn(6, 5, 11, generator=GEN),
        torch.randint(0, 11, (6, 5), generator=GEN).index_put_(
            (torch.tensor([4]), torch.tensor([2])), torch.tensor(11)
        ),
        {"perplexity": {}},
        "eval_metrics: metric 'val/perplexity' (Perplexity): target (validation_step's outputs['target']) holds 1 "
        "invalid value (11) in this validation pass; expected token ids 0..10 (preds.shape[-1] = 11 scores per token)",
    ),
    "a list": (
        [0.5] * 6,
        BINARY,
        {"accuracy": {"task": "binary"}},
        "eval_metrics: metric 'val/accuracy' (BinaryAccuracy): preds (validation_step's outputs['preds']) is a list; "
        "expected a tensor",
    ),
    "regression shapes (torchmetrics' own check)": (
        torch.rand(6, 2, generator=GEN),
        torch.rand(6, generator=GEN),
        {"mse": {}},
        "eval_metrics: metric 'val/mse' (MeanSquaredError): update failed on preds (validation_step's "
        "outputs['preds'], a float32 tensor of shape (3, 2)) and target (validation_step's outputs['target'], a "
        "float32 tensor of shape (3,)): Predictions and targets are expected to have the same shape, but got "
        "torch.Size([3, 2]) and torch.Size([3]).",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_invalid_input_is_one_task_error_naming_the_metric_the_tensor_and_what_is_valid(tmp_path, case):
    preds, target, metrics, message = CASES[case]
    with pytest.raises(torchloom.TaskError) as raised:
        _validate(tmp_path, Fixed(preds, target), metrics)
    assert str(raised.value) == message


def test_a_tasks_own_metrics_are_checked_the_same_way(tmp_path):
    def collection():
        return torchmetrics.MetricCollection({"acc": C.MulticlassAccuracy(3), "auroc": C.MulticlassAUROC(3)})

    with pytest.raises(torchloom.TaskError) as raised:
        _validate(tmp_path, Fixed(PROBS, torch.tensor([0, 1, 2, 3, 1, 2]), collection))
    assert str(raised.value) == (
        "eval_metrics: metric 'val/acc' (MulticlassAccuracy): target (validation_step's outputs['target']) holds 1 "
        "invalid value (3) in this validation pass; expected class indices 0..2 (num_classes=3)"
    )
    # ignore_index values are skipped, not refused: the value is torchmetrics' own
    target = torch.tensor([0, -100, 2, 1, -100, 2])
    got = _validate(tmp_path / "ignored", Fixed(PROBS, target), {"accuracy": {**MULTICLASS, "ignore_index": -100}})
    expected = multiclass_accuracy(PROBS, target, 3, average="micro", ignore_index=-100).item()  # Accuracy's default
    assert got == {"val/accuracy": pytest.approx(expected, rel=1e-6)}


class Reads:
    """Counts host reads of a tensor (.item(), .tolist(), float() ...) from torchloom's code during a validation
    pass's batches: from on_validation_start to the first on_validation_end implementation."""

    ROOTS = tuple(os.path.dirname(m.__file__) for m in (sys.modules["torchloom"], __import__("torchloom_plugins")))

    def __init__(self):
        self.active, self.found = False, Counter()

    @torchloom.hookimpl(tryfirst=True)
    def on_validation_start(self):
        self.active = True

    @torchloom.hookimpl(tryfirst=True)
    def on_validation_end(self):
        self.active = False


def test_inputs_are_checked_without_a_host_read_per_validation_batch(tmp_path, monkeypatch):
    reads = Reads()
    for method in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _method=method, **kwargs):
            caller = sys._getframe(1).f_code
            if reads.active and caller.co_filename.startswith(Reads.ROOTS):
                reads.found[(_method, os.path.basename(caller.co_filename), caller.co_name)] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    task = Fixed(PROBS, torch.tensor([0, 1, 2, 3, 1, 2]))
    task.validation_step = lambda batch, batch_idx: {"preds": PROBS[batch[0]], "target": task.target[batch[0]]}
    settings = {"metrics": {"accuracy": MULTICLASS, "auroc": MULTICLASS, "f1": {**MULTICLASS, "ignore_index": -1}}}
    engine = torchloom.Engine(output_dir=str(tmp_path), plugins=[reads, {"eval_metrics": settings}])
    with pytest.raises(torchloom.TaskError, match="holds 1 invalid value"):
        engine.validate(task)  # the invalid value was counted on the device, and read once, after the pass
    assert not reads.found, reads.found


# ------------------------------------------------------------------------ the rules against torchmetrics' own


RULED = [
    C.BinaryAccuracy(),
    C.BinaryF1Score(ignore_index=-1),
    C.BinaryF1Score(multidim_average="samplewise"),
    C.BinaryAUROC(),
    C.BinaryAveragePrecision(),
    C.BinaryCalibrationError(),
    C.BinaryMatthewsCorrCoef(),
    C.MulticlassAccuracy(3),
    C.MulticlassAccuracy(3, top_k=2),
    C.MulticlassF1Score(3, ignore_index=-100),
    C.MulticlassF1Score(3, multidim_average="samplewise"),
    C.MulticlassAUROC(3),
    C.MulticlassAveragePrecision(3),
    C.MulticlassCalibrationError(3),
    C.MulticlassCohenKappa(3),
    C.MulticlassJaccardIndex(3),
    C.MultilabelAccuracy(4),
    C.MultilabelF1Score(4, multidim_average="samplewise"),
    C.MultilabelAUROC(4),
    C.MultilabelMatthewsCorrCoef(4),
    torchmetrics.text.Perplexity(ignore_index=-100),
]


def _tensors():
    """Predictions and targets of many shapes, dtypes and values (valid and not)."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(6,), (6, 2), (6, 3), (6, 4), (6, 3, 2), (6, 4, 2), (6, 2, 3)]
    preds = []
    for shape in shapes:
        preds += [torch.rand(shape, generator=gen), torch.randn(shape, generator=gen)]
        preds += [torch.randint(0, 2, shape, generator=gen), torch.randint(0, 3, shape, generator=gen)]
        preds += [torch.randint(0, 6, shape, generator=gen)]
    preds += [torch.randn(6, 2, 3, generator=gen), torch.randn(6, 2, 11, generator=gen)]
    targets = []
    for shape in [(6,), (6, 2), (6, 3), (6, 4)]:
        for high in (2, 3, 4):
            targets.append(torch.randint(0, high, shape, generator=gen))
        targets += [torch.randint(0, 2, shape, generator=gen).float(), torch.full(shape, -1), torch.full(shape, -100)]
    return preds, targets


def _torchmetrics_rejects(metric, preds, target) -> bool:
    checked = copy.deepcopy(metric)
    checked.validate_args = True
    try:
        checked.update(preds, target)
    except Exception:
        return True
    return False


def _rule_rejects(metric, preds, target) -> bool:
    rule = rule_for(metric)
    if host_problem(rule, preds, target) is not None:
        return True
    high = highest(rule, preds)
    return any(
        (bad := invalid_values(rule, role, preds, target, high)) is not None and bool(bad.any())
        for role in ("preds", "target")
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_input_rules_reject_whatever_torchmetrics_own_checks_reject():
    """The rules replace torchmetrics' validate_args checks (turned off for these metrics), so they must reject at
    least what those reject, over many shapes, dtypes and values; and agree with them on each metric's usual
    inputs (accepting at least one)."""
    preds, targets = _tensors()
    missed = []
    for metric, p, t in itertools.product(RULED, preds, targets):
        if _torchmetrics_rejects(metric, p, t) and not _rule_rejects(metric, p, t):
            missed.append(f"{type(metric).__name__}: preds {p.dtype} {tuple(p.shape)}, target {tuple(t.shape)} {t}")
    assert not missed, "\n".join(missed[:20])
    probs, labels = torch.rand(6, 3).softmax(-1), torch.tensor([0, 1, 2, 0, 1, 2])
    usual = {
        "Binary": [(torch.rand(6), torch.tensor([0, 1, 1, 0, 1, 0])), (torch.randn(6, 2), torch.ones(6, 2).long())],
        "Multiclass": [(probs, labels), (torch.rand(6, 3, 2), torch.randint(0, 3, (6, 2)))],
        "Multilabel": [(torch.rand(6, 4, 2), torch.randint(0, 2, (6, 4, 2)))],
        "Perplexity": [(torch.randn(6, 2, 11), torch.tensor([[0, 10]] * 3 + [[-100, 4]] * 3))],
    }
    for metric in RULED:
        kind = next(k for k in usual if type(metric).__name__.startswith(k))
        verdicts = [(_torchmetrics_rejects(metric, p, t), _rule_rejects(metric, p, t)) for p, t in usual[kind]]
        assert all(theirs == ours for theirs, ours in verdicts), (metric, verdicts)
        assert (False, False) in verdicts, metric


def test_metrics_the_rules_cover_leave_their_per_batch_checks_to_the_plugin(tmp_path):
    def own():
        return {"acc": C.MulticlassAccuracy(3), "exact": C.MulticlassExactMatch(3)}

    task = Fixed(PROBS, LABELS, own)
    engine = torchloom.Engine(output_dir=str(tmp_path), plugins={"eval_metrics": {}})
    engine.validate(task)
    plugin = engine.plugins[0]  # the defaults (progress) come after the plugins a run names
    assert plugin.metrics["val/acc"].validate_args is False  # checked by the plugin, without a host sync
    assert plugin.metrics["val/exact"].validate_args is True  # no rule: torchmetrics' own checks stay


# ------------------------------------------------------------------------------- item 4: one object, two names


class TwoNames(Fixed):
    def __init__(self):
        super().__init__(PROBS, LABELS, lambda: {"count": self.count, "count_again": self.count})
        self.accuracy, self.count = C.MulticlassAccuracy(3, average="micro"), _Count()

    def validation_step(self, batch, batch_idx):
        outputs = super().validation_step(batch, batch_idx)
        self.accuracy.update(outputs["preds"], outputs["target"])
        self.log("val/accuracy", self.accuracy)
        self.log("val/accuracy_again", self.accuracy)
        return outputs


class _Count(torchmetrics.Metric):
    def __init__(self):
        super().__init__()
        self.add_state("n", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds, target):
        self.n += target.numel()

    def compute(self):
        return self.n


def test_one_metric_object_under_two_names_gives_both_names_its_value(tmp_path):
    got = _validate(tmp_path, TwoNames())
    accuracy = multiclass_accuracy(PROBS, LABELS, 3, average="micro").item()
    assert got == {
        "val/accuracy": pytest.approx(accuracy, rel=1e-6),
        "val/accuracy_again": pytest.approx(accuracy, rel=1e-6),  # was 0.0: computed again after its reset
        "val/count": 6,
        "val/count_again": 6,  # updated once per batch, not once per name (12)
    }
    assert 0 < accuracy < 1
