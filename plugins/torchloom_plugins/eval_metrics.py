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
  predictions are passed as float32. A metric object returned under two names is updated once and logged
  under both.
- **Checked inputs:** every invalid input is one `TaskError` naming the metric, the tensor, what it got and
  what it expects (`_metric_inputs`): shapes and dtypes on the host (metadata: free), class indices, labels and
  token ids out of range counted on the device and read once, at the end of the pass. With several processes
  the first problem of any process is raised by every process there, before any metric is computed (no process
  is left in a collective). torchmetrics' own per-batch checks (a host sync each) are off for the metrics the
  rules cover; whatever another metric's ``update`` raises is reported naming it.
- **Cost:** one collective per metric state at the end of each validation pass, plus one small gather of the
  input checks (several processes) and one host copy of their counters; nothing per step, no host sync per
  batch (torchmetrics' updates and the checks stay on the device).
- **Sources:** torchmetrics' "Metrics and distributed computations" and ``MetricCollection`` documentation;
  Lightning's ``self.log(name, metric)`` with torchmetrics objects; Accelerate's ``gather_for_metrics`` (the
  padding it removes is the padding cut here).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather_object

import torchloom
from torchloom_plugins._metric_inputs import (
    Rule,
    describe,
    expected_values,
    highest,
    host_problem,
    invalid_values,
    number,
    rule_for,
)

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
        # What update() is called on: each metric once, except that a task's MetricCollection is updated (and
        # reset) as one object, so that its compute groups keep sharing state between members.
        self._updated: list[torchmetrics.Metric | torchmetrics.MetricCollection] = []
        self._what: dict[int, str] = {}  # id(updated) -> "metric 'val/x' (Class)", for messages
        # The input rules of the metrics (`_metric_inputs`), each with the names of the metrics it applies to.
        self._rules: dict[Rule, list[str]] = {}
        # Per rule and tensor (preds, target): [invalid values, smallest, largest], on the device, read once a pass.
        self._invalid: torch.Tensor | None = None
        self._seen: dict[str, Any] = {}  # what the messages need: the tensors' sources, the largest valid values
        self._problem: str | None = None  # the first shape / dtype / update problem of this pass on this process

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
        updated = [*named.values(), *([collection] if collection is not None else from_task.values())]
        self._updated = list({id(u): u for u in updated}.values())  # one object under two names: updated once
        names: dict[int, list[str]] = {}
        for name, metric in self.metrics.items():
            names.setdefault(id(metric), []).append(name)
        self._what = {id(m): f"metric {_names(names[id(m)])} ({type(m).__name__})" for m in self.metrics.values()}
        if collection is not None:
            self._what[id(collection)] = f"{type(task).__name__}.configure_metrics()'s MetricCollection"
        self._rules = {}
        for name, metric in self.metrics.items():
            rule = rule_for(metric)
            if rule is not None:
                self._rules.setdefault(rule, []).append(name)
                if getattr(metric, "validate_args", False):
                    metric.validate_args = False  # checked here, without its per-batch host-device sync
        for item in self._updated:
            item.to(accelerator.device)

    @torchloom.hookimpl
    def on_validation_start(self, accelerator) -> None:
        for updated in self._updated:
            updated.reset()
        dtype = torch.float32 if accelerator.device.type == "mps" else torch.float64  # MPS has no float64
        invalid = torch.tensor([[0.0, math.inf, -math.inf]], dtype=dtype, device=accelerator.device)
        self._invalid = invalid.repeat(2 * len(self._rules), 1)
        self._seen, self._problem = {}, None

    @torchloom.hookimpl
    def on_validation_batch_end(self, outputs: Any, batch: Any, accelerator) -> None:
        if self._problem is not None:  # this pass already failed on this process: reported at its end
            return
        try:
            preds, target, sources = self._inputs(outputs, batch)
        except torchloom.TaskError as exc:
            return self._fail(str(exc), accelerator)
        self._seen["sources"] = sources
        rules = list(self._rules.items())
        for rule, names in rules:
            found = host_problem(rule, preds, target)
            if found is not None:
                role, problem = found
                return self._fail(f"{self._about(names)}: {role} ({sources[role]}) {problem}", accelerator)
        # Values: counted on the device (read at the end of the pass); invalid ones replaced by 0 meanwhile.
        masks: dict[str, torch.Tensor] = {}
        for i, (rule, _names) in enumerate(rules):
            high = highest(rule, preds)
            self._seen[f"high{i}"] = high
            for j, (role, x) in enumerate((("preds", preds), ("target", target))):
                bad = invalid_values(rule, role, preds, target, high)
                if bad is not None:
                    self._count(2 * i + j, bad, x)
                    masks[role] = bad | masks[role] if role in masks else bad
        if "preds" in masks:
            preds = torch.where(masks["preds"], torch.zeros_like(preds), preds)
        if "target" in masks:
            target = torch.where(masks["target"], torch.zeros_like(target), target)
        for updated in self._updated:
            try:
                updated.update(preds, target)
            except Exception as exc:
                message = " ".join(str(exc).split())
                return self._fail(
                    f"eval_metrics: {self._what[id(updated)]}: update failed on preds ({sources['preds']}, "
                    f"{describe(preds)}) and target ({sources['target']}, {describe(target)}): {message}",
                    accelerator,
                )
        return None

    @torchloom.hookimpl
    def on_validation_end(self, log, accelerator) -> None:
        self._check_pass(accelerator)  # the same TaskError on every process, before any metric is computed
        for name, metric in self.metrics.items():
            log(name, metric)  # computed over every process, then reset, by the engine right after this hook

    def _fail(self, message: str, accelerator: Any) -> None:
        """Raise now on one process; with several, keep the first problem for `_check_pass`, where every process
        raises it alike (one that raised alone would leave the others waiting in a collective)."""
        if accelerator.num_processes == 1:
            raise torchloom.TaskError(message)
        self._problem = self._problem or message

    def _count(self, row: int, bad: torch.Tensor, x: torch.Tensor) -> None:
        """Add the invalid values ``bad`` marks in ``x`` to ``self._invalid[row]``: on the device, no sync."""
        assert self._invalid is not None
        top = torch.finfo(x.dtype).max if x.is_floating_point() else torch.iinfo(x.dtype).max
        low = torch.finfo(x.dtype).min if x.is_floating_point() else torch.iinfo(x.dtype).min
        counts = self._invalid[row]
        counts[0] += bad.sum()
        counts[1] = torch.minimum(counts[1], torch.where(bad, x, top).amin().to(counts.dtype))
        counts[2] = torch.maximum(counts[2], torch.where(bad, x, low).amax().to(counts.dtype))

    def _check_pass(self, accelerator: Any) -> None:
        """Raise the pass's first input problem, on every process alike: one small gather with several processes,
        and one host copy of the counters, once per validation pass."""
        local = self._invalid.tolist() if self._invalid is not None else []
        if accelerator.num_processes > 1:
            per_rank = gather_object([(self._problem, local, self._seen)])
            problems = [(rank, problem) for rank, (problem, _, _) in enumerate(per_rank) if problem]
            if problems:
                rank, problem = problems[0]
                raise torchloom.TaskError(f"{problem} (on process {rank})")
            tables = [table for _, table, _ in per_rank]
            local = [
                [sum(t[r][0] for t in tables), min(t[r][1] for t in tables), max(t[r][2] for t in tables)]
                for r in range(len(local))
            ]
            seen = {k: v for _, _, s in reversed(per_rank) for k, v in s.items()}
        else:
            seen = self._seen
        for i, (rule, names) in enumerate(self._rules.items()):
            for j, role in enumerate(("preds", "target")):
                count, smallest, largest = local[2 * i + j]
                if count:
                    found = number(smallest)
                    if smallest != largest:
                        found = f"from {found} to {number(largest)}"
                    raise torchloom.TaskError(
                        f"{self._about(names)}: {role} ({seen['sources'][role]}) holds {int(count)} invalid "
                        f"value{'s' if count > 1 else ''} ({found}) in this validation pass; expected "
                        f"{expected_values(rule, role, seen.get(f'high{i}'))}"
                    )

    def _about(self, names: list[str]) -> str:
        """``eval_metrics: metric 'val/f1' (MulticlassF1Score; also 'val/accuracy')``: the metrics a rule is of."""
        first = self.metrics[names[0]]
        also = [n for n in names[1:] if self.metrics[n] is not first]
        same = [n for n in names if self.metrics[n] is first]
        more = f"; also {', '.join(repr(n) for n in also)}" if also else ""
        return f"eval_metrics: metric {_names(same)} ({type(first).__name__}{more})"

    def _inputs(self, outputs: Any, batch: Any) -> tuple[Any, Any, dict[str, str]]:
        preds_key, target_key = self.config.preds_key, self.config.target_key
        if not isinstance(outputs, Mapping) or preds_key not in outputs:
            keys = sorted(map(str, outputs)) if isinstance(outputs, Mapping) else None
            got = f"a mapping with keys {keys}" if keys is not None else type(outputs).__name__
            raise torchloom.TaskError(
                f"eval_metrics: validation_step must return a mapping with {preds_key!r} (the predictions) and "
                f"{target_key!r} (the targets, or a batch entry of that name); it returned {got}. Set the plugin's "
                "'preds_key' / 'target_key' to use other names"
            )
        sources = {"preds": f"validation_step's outputs[{preds_key!r}]"}
        if target_key in outputs:
            target = outputs[target_key]
            sources["target"] = f"validation_step's outputs[{target_key!r}]"
        elif isinstance(batch, Mapping) and target_key in batch:
            target = batch[target_key]
            sources["target"] = f"the batch's {target_key!r}"
        else:
            batch_keys = f"; the batch has {sorted(map(str, batch))}" if isinstance(batch, Mapping) else ""
            raise torchloom.TaskError(
                f"eval_metrics: no targets: neither validation_step's outputs (keys {sorted(map(str, outputs))}) nor "
                f"the batch have {target_key!r}{batch_keys}. Set the plugin's 'target_key'"
            )
        preds = outputs[preds_key]
        if isinstance(preds, torch.Tensor) and preds.dtype in (torch.float16, torch.bfloat16):
            preds = preds.float()
        return preds, target, sources


def _names(names: list[str]) -> str:
    """``'val/a'`` or ``'val/a' (also logged as 'val/b')``."""
    also = f" (also logged as {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
    return f"{names[0]!r}{also}"


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
