"""What the metrics of ``eval_metrics`` accept as ``update(preds, target)``, checked without a host-device sync.

torchmetrics checks its inputs itself (``validate_args=True``), but with ``torch.unique`` and Python ``if``s on
tensors (a host-device sync per batch), with messages that do not name the metric, and not completely: a
multiclass target above ``num_classes`` or negative is counted as some class (accuracy and F1 of 0 without a
word), and on a GPU an index out of range is a device-side assert. Here:

- **Shapes and dtypes** (metadata, free) are checked on the host for every batch, against the rule of the
  metric's family: `rule_for` knows torchmetrics' binary / multiclass / multilabel classification metrics of the
  stat-scores (accuracy, F1, precision, recall, specificity ...), confusion-matrix (Matthews, Cohen's kappa,
  Jaccard), curve (AUROC, average precision, ROC, ... at fixed ...) and calibration-error families, and
  perplexity.
- **Values** (class indices in range, binary labels 0 or 1) are checked on the device: each batch adds its
  number of invalid values, and their smallest and largest, to counters that are read once, at the end of the
  validation pass; invalid values are replaced (by 0) before the update, so that nothing crashes before then.

For a metric with a rule, torchmetrics' own checks are then redundant and are turned off (``validate_args``);
every other metric keeps them, and whatever its ``update`` raises is reported naming the metric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Rule", "describe", "expected_values", "highest", "host_problem", "invalid_values", "number", "rule_for"]

#: torchmetrics.classification base classes whose inputs `Rule` describes completely -> whether they need float
#: scores (and an integer target, as the multiclass and multilabel ones all do).
_FAMILIES = {
    "StatScores": False,
    "ConfusionMatrix": False,
    "PrecisionRecallCurve": True,  # AUROC, average precision, ROC ... rank float scores
    "CalibrationError": True,
}


@dataclass(frozen=True)
class Rule:
    """The inputs one metric accepts.

    Attributes:
        task (`str`): ``"binary"``, ``"multiclass"``, ``"multilabel"`` or ``"tokens"`` (perplexity).
        classes (`int` or ``None``): ``num_classes`` / ``num_labels`` (``None``: not fixed).
        ignore_index (`int` or ``None``): a target value that is skipped rather than checked.
        scores (`bool`): ``preds`` must be float scores (probabilities or logits), not labels.
        int_target (`bool`): ``target`` must be an integer tensor (binary labels may be 0. / 1. floats).
        samplewise (`bool`): ``multidim_average="samplewise"`` (one value per sample: more dimensions needed).
        top_k (`int`): ``top_k`` of a multiclass metric (above 1: scores needed).
    """

    task: str
    classes: int | None = None
    ignore_index: int | None = None
    scores: bool = False
    int_target: bool = False
    samplewise: bool = False
    top_k: int = 1


def rule_for(metric: Any) -> Rule | None:
    """The `Rule` of a torchmetrics ``Metric`` (a subclass of one counts), or ``None`` where torchmetrics' own
    checks stay in charge."""
    from torchmetrics import classification
    from torchmetrics.text import Perplexity

    if isinstance(metric, Perplexity):
        return Rule("tokens", ignore_index=getattr(metric, "ignore_index", None), scores=True, int_target=True)
    for task in ("Binary", "Multiclass", "Multilabel"):
        for family, scores in _FAMILIES.items():
            base = getattr(classification, f"{task}{family}", None)
            if isinstance(base, type) and isinstance(metric, base):
                classes = getattr(metric, "num_classes" if task == "Multiclass" else "num_labels", None)
                ignore_index = getattr(metric, "ignore_index", None)
                return Rule(
                    task.lower(),
                    classes=classes if isinstance(classes, int) else None,
                    ignore_index=ignore_index if isinstance(ignore_index, int) else None,
                    scores=scores,
                    int_target=scores or task != "Binary",
                    samplewise=getattr(metric, "multidim_average", "global") == "samplewise",
                    top_k=getattr(metric, "top_k", 1) or 1,
                )
    return None


def describe(x: Any) -> str:
    """``a float32 tensor of shape (4, 3)``, or the type of something that is not a tensor."""
    if isinstance(x, torch.Tensor):
        dtype = str(x.dtype).removeprefix("torch.")
        return f"a{'n' if dtype[0] in 'aeiou' else ''} {dtype} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def host_problem(rule: Rule, preds: Any, target: Any) -> tuple[str, str] | None:
    """``(tensor, what is wrong and what is valid)`` for inputs that ``rule`` rejects by their shape or dtype, where
    the tensor is ``"preds"`` or ``"target"``; ``None`` when they pass (their values are checked on the device)."""
    for role, x in (("preds", preds), ("target", target)):
        if not isinstance(x, torch.Tensor):
            return role, f"is {describe(x)}; expected a tensor"
        if x.is_complex():
            return role, f"is {describe(x)}; expected real numbers"
    with_target = f", with target of shape {tuple(target.shape)}"
    if rule.scores and not preds.is_floating_point():
        what = "token scores (logits)" if rule.task == "tokens" else "scores (probabilities or logits), not labels"
        return "preds", f"is {describe(preds)}; expected float {what}"
    if rule.int_target and target.is_floating_point():
        kind = {"tokens": "token ids", "multiclass": "class indices"}.get(rule.task, "labels 0 / 1")
        return "target", f"is {describe(target)}; expected an integer tensor of {kind}"
    if rule.task == "tokens":
        if preds.ndim != 3 or target.ndim != 2 or tuple(preds.shape[:2]) != tuple(target.shape):
            return "preds", (
                f"is {describe(preds)}{with_target}; expected logits of shape (batch, sequence, vocabulary) and "
                "target of shape (batch, sequence)"
            )
        if target.dtype != torch.int64:
            return "target", f"is {describe(target)}; expected an int64 (torch.long) tensor of token ids"
        return None
    if rule.task == "binary":
        if preds.shape != target.shape:
            return "preds", f"is {describe(preds)}{with_target}; expected target's shape (one score or label each)"
        if rule.samplewise and preds.ndim < 2:
            return "preds", f"is {describe(preds)}; expected at least 2 dimensions (multidim_average='samplewise')"
        return None
    if rule.task == "multilabel":
        labels = f"(N, {rule.classes}, ...)" if rule.classes is not None else "(N, labels, ...)"
        least = 3 if rule.samplewise else 2
        if (
            preds.shape != target.shape
            or preds.ndim < least
            or (rule.classes is not None and preds.shape[1] != rule.classes)
        ):
            return "preds", (
                f"is {describe(preds)}{with_target}; expected preds and target of the same shape {labels} "
                f"(num_labels={rule.classes})" + (", at least 3 dimensions (samplewise)" if rule.samplewise else "")
            )
        return None
    # multiclass
    classes = rule.classes if rule.classes is not None else "C"
    scores_shape = f"({', '.join(['N', str(classes), *('...' for _ in range(target.ndim - 1))])})"
    expected = f"float scores of shape {scores_shape} (num_classes={classes})"
    if not (rule.scores or rule.top_k > 1):
        expected += f", or class indices of target's shape {tuple(target.shape)}"
    if target.ndim == 0:
        return "target", f"is {describe(target)}; expected class indices of shape (N, ...)"
    if preds.ndim == target.ndim + 1:
        if (
            not preds.is_floating_point()
            or (rule.classes is not None and preds.shape[1] != rule.classes)
            or preds.shape[0] != target.shape[0]
            or preds.shape[2:] != target.shape[1:]
            or (rule.samplewise and preds.ndim < 3)
        ):
            return "preds", f"is {describe(preds)}{with_target}; expected {expected}"
        return None
    if preds.ndim == target.ndim and not (rule.scores or rule.top_k > 1):
        if preds.shape != target.shape or (rule.samplewise and preds.ndim < 2):
            return "preds", f"is {describe(preds)}{with_target}; expected {expected}"
        return None
    return "preds", f"is {describe(preds)}{with_target}; expected {expected}"


def highest(rule: Rule, preds: torch.Tensor) -> int | None:
    """One more than the largest valid class index, label or token id (``None``: no upper bound known)."""
    if rule.task == "tokens":
        return preds.shape[-1]
    return rule.classes if rule.task == "multiclass" else 2


def invalid_values(
    rule: Rule, role: str, preds: torch.Tensor, target: torch.Tensor, high: int | None
) -> torch.Tensor | None:
    """A boolean mask of the values of ``role`` (of inputs that passed `host_problem`) that are not labels, class
    indices or token ids in ``[0, high)`` (the target's ``ignore_index`` excepted), computed on the device; ``None``
    when no value can be invalid (scores, booleans, an empty tensor). Labels and indices held in a float tensor
    must be whole numbers."""
    x = preds if role == "preds" else target
    labels = not x.is_floating_point() or (rule.task == "multiclass" and preds.ndim == target.ndim)
    if x.dtype == torch.bool or x.numel() == 0 or (role == "preds" and not labels):
        return None
    return _outside(x, 0, high, rule.ignore_index if role == "target" else None)


def _outside(x: torch.Tensor, low: int, high: int | None, ignore_index: int | None) -> torch.Tensor:
    bad = x < low
    if high is not None:
        bad |= x >= high
    if x.is_floating_point():
        bad |= x != x.trunc()  # a class index held in a float tensor must still be a whole number
    if ignore_index is not None:
        bad &= x != ignore_index
    return bad


def expected_values(rule: Rule, role: str, high: int | None) -> str:
    """What valid values of ``role`` are, in words."""
    if rule.task == "tokens":
        what = f"token ids 0..{high - 1} (preds.shape[-1] = {high} scores per token)" if high else "token ids >= 0"
    elif rule.task == "multiclass":
        kind = "class indices" if role == "target" else "predicted class indices"
        what = f"{kind} 0..{high - 1} (num_classes={high})" if high else f"{kind} >= 0"
    else:
        what = "labels 0 or 1" + (f" (num_labels={rule.classes})" if rule.task == "multilabel" else "")
    if role == "target" and rule.ignore_index is not None:
        what += f", or ignore_index={rule.ignore_index}"
    return what


def number(value: float) -> str:
    """``5`` for a whole number, else ``0.5``."""
    return str(int(value)) if math.isfinite(value) and value == int(value) else repr(value)
