"""Evaluation metrics with torchmetrics: kept per process, combined over all the data at the end of each validation.

Method card
-----------
- **What:** the metrics named in the settings (``accuracy``, ``f1``, ``auroc``, ``mse``, ``perplexity``, ... or
  any torchmetrics class name, with its arguments) and those returned by `TaskModule.configure_metrics` are
  updated on every validation batch with ``metric.update(preds, target)`` and logged once per validation pass as
  ``val/<name>``.
- **Exact over several processes:** each process keeps its own metric state (counts, or the predictions
  themselves for AUROC / average precision); torchmetrics combines the states of all processes only inside
  ``compute()``, at the end of the pass. So a metric that is not a mean of per-batch values (AUROC, average
  precision, F1, Matthews) is computed on the whole validation set, never averaged over processes, and equals
  what one process would compute on the same data. The engine cuts the copies of samples with which
  Accelerate pads the last batch on some processes before ``on_validation_batch_end``, so every sample is
  counted exactly once.
- **Hooks:** ``configure_model`` builds the metrics (on the run's device) for ``fit`` and ``validate``;
  ``on_validation_start`` resets them (a pass stopped by an error leaves nothing behind);
  ``on_validation_batch_end`` updates them from ``validation_step``'s outputs; ``on_validation_end`` logs each
  with ``log(name, metric)``: the engine computes it on every process right after the hook (a failing compute
  is a `TaskError`, and the metric keeps its own process's state, not the synchronised one, so it stays usable)
  and resets it.
- **Inputs:** ``validation_step`` returns a mapping with the predictions under ``preds_key`` (default
  ``preds``) and the targets under ``target_key`` (default ``target``; when the outputs lack it, the batch's
  entry of that name is used, so ``target_key: labels`` reads a Hugging Face batch's labels). Half-precision
  predictions are passed as float32.
- **Cost:** one collective per metric state at the end of each validation pass; nothing per step, no host sync
  per batch (torchmetrics' updates stay on the device).
- **Sources:** torchmetrics' "Metrics and distributed computations" and ``MetricCollection`` documentation;
  Lightning's ``self.log(name, metric)`` with torchmetrics objects; Accelerate's ``gather_for_metrics`` (the
  padding it removes is the padding cut here).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import torchloom

if TYPE_CHECKING:  # imported where used: torchmetrics takes about a second to import (scipy, transformers)
    import torchmetrics

__all__ = ["METRICS", "EvalMetrics", "EvalMetricsConfig", "build_metric", "metric_class"]

#: Short names -> the torchmetrics class (by its path in torchmetrics). Any other torchmetrics class name
#: (``MulticlassAccuracy``, ``BinaryF1Score``, ``PearsonCorrCoef`` ...) works too.
METRICS: dict[str, str] = {
    "accuracy": "Accuracy",
    "f1": "F1Score",
    "precision": "Precision",
    "recall": "Recall",
    "specificity": "Specificity",
    "auroc": "AUROC",
    "average_precision": "AveragePrecision",
    "matthews_corrcoef": "MatthewsCorrCoef",
    "cohen_kappa": "CohenKappa",
    "calibration_error": "CalibrationError",
    "exact_match": "ExactMatch",
    "mse": "MeanSquaredError",
    "mae": "MeanAbsoluteError",
    "r2": "R2Score",
    "pearson": "PearsonCorrCoef",
    "spearman": "SpearmanCorrCoef",
    "perplexity": "text.Perplexity",
}

#: The torchmetrics modules searched for a class name that is not in `METRICS`.
_MODULES = ("", "classification", "regression", "text", "retrieval", "nominal")


def metric_class(kind: str) -> type:
    """The torchmetrics `Metric` class for a short name of `METRICS` or a torchmetrics class name.

    Raises:
        ConfigError: no such metric (the message lists the short names).
    """
    import torchmetrics

    path = METRICS.get(kind, kind)
    module_name, _, class_name = path.rpartition(".")
    modules = [module_name] if module_name else _MODULES
    for name in modules:
        module = getattr(torchmetrics, name) if name else torchmetrics
        cls = getattr(module, class_name, None) if isinstance(module, type(torchmetrics)) else None
        if isinstance(cls, type) and issubclass(cls, torchmetrics.Metric):
            return cls
    raise torchloom.ConfigError(
        f"setting 'metrics': unknown metric {kind!r}; valid names: {', '.join(METRICS)}, or a torchmetrics "
        "class name such as 'MulticlassAccuracy'"
    )


def build_metric(name: str, settings: Mapping[str, Any] | None) -> torchmetrics.Metric:
    """Build the metric ``name`` of the ``metrics`` setting.

    Args:
        name (`str`): the name it is logged under (after the prefix); also its kind, unless ``settings`` has a
            ``metric`` entry (a short name of `METRICS` or a torchmetrics class name).
        settings (`Mapping[str, Any]`, *optional*): the keyword arguments of the torchmetrics class (``task``,
            ``num_classes``, ``average``, ``ignore_index`` ...), plus the optional ``metric``.

    Raises:
        ConfigError: an unknown metric, or arguments the torchmetrics class rejects (its message is kept).
    """
    kwargs = dict(settings or {})
    kind = kwargs.pop("metric", name)
    if not isinstance(kind, str):
        raise torchloom.ConfigError(f"setting 'metrics': {name}.metric = {kind!r}; expected a metric name")
    cls = metric_class(kind)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no arguments"
        raise torchloom.ConfigError(
            f"setting 'metrics': {name!r} ({cls.__name__}) rejects {args}: {' '.join(str(exc).split())}"
        ) from None


@dataclass
class EvalMetricsConfig:
    """Settings of the ``eval_metrics`` plugin.

    Args:
        metrics (`dict[str, dict | None]`, defaults to ``{}``): name -> arguments of the torchmetrics class, e.g.
            ``{"accuracy": {"task": "multiclass", "num_classes": 3}}``. The name is also the metric, unless the
            arguments name one with ``metric`` (``{"f1_macro": {"metric": "f1", "average": "macro", ...}}``).
            Short names: see `METRICS`; any torchmetrics class name works too. Each is built here once, so bad
            arguments fail before training.
        preds_key (`str`, defaults to ``"preds"``): the entry of ``validation_step``'s outputs holding the
            predictions (first argument of ``update``).
        target_key (`str`, defaults to ``"target"``): the entry of the outputs, else of the batch, holding the
            targets (second argument of ``update``).
        prefix (`str`, defaults to ``"val/"``): put before every name when logged.

    Raises:
        ConfigError: an unknown metric, arguments its class rejects, an empty name or key.
    """

    metrics: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # name -> torchmetrics arguments
    preds_key: str = "preds"  # outputs[preds_key]: the predictions
    target_key: str = "target"  # outputs[target_key], else batch[target_key]: the targets
    prefix: str = "val/"  # logged as prefix + name

    def __post_init__(self) -> None:
        for setting in ("preds_key", "target_key"):
            if not getattr(self, setting):
                raise torchloom.ConfigError(f"setting {setting!r} = ''; expected the name of an output entry")
        for name, settings in self.metrics.items():
            if not name or name != name.strip():
                raise torchloom.ConfigError(f"setting 'metrics': name {name!r}; expected a non-empty name")
            build_metric(name, settings)  # fails now, with the setting named, rather than after training


class EvalMetrics(torchloom.Plugin):
    """Update torchmetrics objects on validation outputs; log them as ``val/<name>`` after each validation pass.

    Implements ``configure_model``, ``on_validation_start``, ``on_validation_batch_end`` and
    ``on_validation_end``. See the module docstring and ``docs/plugins/eval_metrics.md``.

    Example:

    .. code-block:: python

        class Classifier(torchloom.TaskModule):
            def validation_step(self, batch, batch_idx):
                return {"preds": self.model(batch["x"]).softmax(-1), "target": batch["y"]}

        engine = torchloom.Engine(plugins={"eval_metrics": {"metrics": {
            "accuracy": {"task": "multiclass", "num_classes": 3},
            "auroc": {"task": "multiclass", "num_classes": 3},
        }}})
        engine.fit(Classifier(...))  # engine.logged["val/auroc"]: AUROC over the whole validation set

    Attributes:
        metrics (`dict[str, torchmetrics.Metric]`): logged name -> metric, for the current run (empty before it).
    """

    name = "eval_metrics"
    Config = EvalMetricsConfig

    def __init__(self, config: EvalMetricsConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.metrics: dict[str, torchmetrics.Metric] = {}
        # What update() is called on: each metric, except that a task's MetricCollection is updated (and reset)
        # as one object, so that its compute groups keep sharing state between members.
        self._updated: list[torchmetrics.Metric | torchmetrics.MetricCollection] = []

    @torchloom.hookimpl
    def configure_model(self, task: torchloom.TaskModule, accelerator) -> None:
        # Built per run (fit, validate): a later run starts from fresh metrics on its own device.
        prefix = self.config.prefix
        named = {prefix + name: build_metric(name, s) for name, s in self.config.metrics.items()}
        own = task.configure_metrics()
        collection, from_task = _task_metrics(own, type(task).__name__)
        for name in from_task:
            if prefix + name in named:
                raise torchloom.ConfigError(
                    f"eval_metrics: metric {name!r} is both in the 'metrics' setting and returned by "
                    f"{type(task).__name__}.configure_metrics(); rename one"
                )
        if not named and not from_task:
            raise torchloom.ConfigError(
                "eval_metrics: no metrics; name them in the plugin's 'metrics' setting (e.g. {accuracy: {task: "
                f"binary}}}}) or return them from {type(task).__name__}.configure_metrics()"
            )
        self.metrics = {**named, **{prefix + name: metric for name, metric in from_task.items()}}
        self._updated = [*named.values(), *([collection] if collection is not None else from_task.values())]
        for updated in self._updated:
            updated.to(accelerator.device)

    @torchloom.hookimpl
    def on_validation_start(self) -> None:
        for updated in self._updated:
            updated.reset()

    @torchloom.hookimpl
    def on_validation_batch_end(self, outputs: Any, batch: Any) -> None:
        preds, target = self._inputs(outputs, batch)
        for updated in self._updated:
            updated.update(preds, target)

    @torchloom.hookimpl
    def on_validation_end(self, log) -> None:
        for name, metric in self.metrics.items():
            log(name, metric)  # computed over every process, then reset, by the engine right after this hook

    def _inputs(self, outputs: Any, batch: Any) -> tuple[Any, Any]:
        preds_key, target_key = self.config.preds_key, self.config.target_key
        if not isinstance(outputs, Mapping) or preds_key not in outputs:
            keys = sorted(map(str, outputs)) if isinstance(outputs, Mapping) else None
            got = f"a mapping with keys {keys}" if keys is not None else type(outputs).__name__
            raise torchloom.TaskError(
                f"eval_metrics: validation_step must return a mapping with {preds_key!r} (the predictions) and "
                f"{target_key!r} (the targets, or a batch entry of that name); it returned {got}. Set the plugin's "
                "'preds_key' / 'target_key' to use other names"
            )
        if target_key in outputs:
            target = outputs[target_key]
        elif isinstance(batch, Mapping) and target_key in batch:
            target = batch[target_key]
        else:
            batch_keys = f"; the batch has {sorted(map(str, batch))}" if isinstance(batch, Mapping) else ""
            raise torchloom.TaskError(
                f"eval_metrics: no targets: neither validation_step's outputs (keys {sorted(map(str, outputs))}) nor "
                f"the batch have {target_key!r}{batch_keys}. Set the plugin's 'target_key'"
            )
        preds = outputs[preds_key]
        if isinstance(preds, torch.Tensor) and preds.dtype in (torch.float16, torch.bfloat16):
            preds = preds.float()
        return preds, target


def _task_metrics(own: Any, task_name: str) -> tuple[torchmetrics.MetricCollection | None, dict[str, Any]]:
    """``(collection, name -> metric)`` of what `TaskModule.configure_metrics` returned.

    Raises:
        ConfigError: it returned something other than ``None``, a `Metric`, a `MetricCollection` or a
            ``{name: Metric}`` mapping.
    """
    if own is None:
        return None, {}
    import torchmetrics

    if isinstance(own, torchmetrics.MetricCollection):
        return own, dict(own.items(keep_base=False, copy_state=False))
    if isinstance(own, torchmetrics.Metric):
        return None, {_snake(type(own).__name__): own}
    if isinstance(own, Mapping) and all(isinstance(m, torchmetrics.Metric) for m in own.values()) and own:
        if not all(isinstance(k, str) and k for k in own):
            raise torchloom.ConfigError(
                f"{task_name}.configure_metrics() returned a mapping with a key that is not a name"
            )
        return None, dict(own)
    raise torchloom.ConfigError(
        f"{task_name}.configure_metrics() returned {type(own).__name__}; expected a torchmetrics MetricCollection, a "
        "Metric, a non-empty {name: Metric} mapping, or None"
    )


def _snake(class_name: str) -> str:
    """``MulticlassAUROC`` -> ``multiclass_auroc``: the name a single metric returned by the task is logged under."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", class_name).lower()
