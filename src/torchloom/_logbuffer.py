"""Buffers logged values on their device and reduces them in one sync at logging intervals."""

from __future__ import annotations

from typing import Any

import torch

from torchloom._metric_sync import even_list_states, gather_states, has_list_state, metric_is_synced, uneven
from torchloom._names import INTERNAL_PREFIX
from torchloom._warn import warn
from torchloom.errors import TaskError
from torchloom.parallel.dtensors import full

__all__ = ["REDUCTIONS", "WEIGHT_PREFIX", "LogBuffer", "compute_metric"]

#: The prefix of a summed weight that `LogBuffer.reduce` returns on request (an internal name of the engine's).
WEIGHT_PREFIX = INTERNAL_PREFIX + "weight/"
#: How the values of one name are combined over an interval and over the ranks (``log(..., reduce=...)``).
#: ``mean`` is weighted by ``weight``; ``last`` keeps the latest value of the interval, from the main process.
REDUCTIONS = ("mean", "sum", "max", "min", "last")


class LogBuffer:
    """Running reductions of logged values, kept on device until `reduce`; torchmetrics objects, kept until then too.

    A plain value is folded into a running sum (``mean``: with its weight), maximum, minimum or latest value
    on its own device, so logging never waits for the device. A `torchmetrics.Metric` is registered as it
    is; `reduce` computes it (torchmetrics synchronises its state over the ranks then) and resets it.
    A tensor logged with ``reduce="mean"`` (the engine's per-micro-batch loss, a gradient norm,
    a task's ``self.log`` in ``training_step``) is kept in a list and folded with the others of its name at
    once, with one stack, when the buffer is read or the list reaches `APPEND_FOLD` entries: logging a tensor
    every step costs no device operation until the logging step.

    Args:
        zero_weights (`bool`, defaults to False): a ``mean`` value logged with weight 0 counts for nothing, even a
            NaN one (the validation buffer's: a batch with no loss token, whose mean over no token is NaN, or a
            process whose share of the last batch is only padding copies). The training buffer keeps the product,
            so that the engine's non-finite check sees a NaN loss.

    Attributes:
        watch (`Callable[[str, Any, Any, str], None]`, *optional*): called with ``(name, value, weight, reduce)``
            for every plain value logged while it is set (the validation pass sets it while ``validation_step``
            runs on a batch padded with copies: `torchloom._padding.watch_hand_logged`).
    """

    #: Appended values kept per name before they are folded (bounds the memory held between logging steps).
    APPEND_FOLD = 256

    def __init__(self, zero_weights: bool = False) -> None:
        self.zero_weights = zero_weights
        self.watch: Any = None
        self._notes: list[tuple[str, str]] = []  # (name, warning) of this process, warned by `reduce` on the main one
        self._warned: set[str] = set()  # names warned about: once per buffer (per engine), kept by `clear`
        self._values: dict[str, Any] = {}  # name -> 0-dim tensor on the values' device, or float
        self._weights: dict[str, Any] = {}  # name -> summed weight (mean only)
        self._reductions: dict[str, str] = {}
        self.metrics: dict[str, Any] = {}  # name -> torchmetrics.Metric
        self._appended: dict[str, tuple[list[torch.Tensor], list[Any]]] = {}  # name -> (values, weights)
        self._failures: list[str] = []  # problems found during the interval, raised by `reduce` on every rank

    def _append(self, name: str, value: torch.Tensor, weight: torch.Tensor | float) -> None:
        """Keep ``value`` (a checked 0-dim tensor, detached) and its ``weight`` for the weighted mean of ``name``,
        to be folded with the others by `_fold`: no device operation now."""
        self._reductions[name] = "mean"
        values, weights = self._appended.setdefault(name, ([], []))
        values.append(value)
        weights.append(weight)
        if len(values) >= self.APPEND_FOLD:
            self._fold(name)

    def _fold(self, name: str | None = None) -> None:
        """Fold appended values (of ``name``, or of every name) into the running weighted sums: one stack each."""
        for key in [name] if name is not None else list(self._appended):
            values, weights = self._appended.pop(key, ((), ()))
            if not values:
                continue
            if all(v.dtype == values[0].dtype and v.device == values[0].device for v in values):
                stacked = torch.stack(values)
            else:
                stacked = torch.stack([v.to(values[0].device, torch.float64) for v in values])
            dtype = _sum_dtype(stacked.device)
            stacked = stacked.to(dtype)
            if all(isinstance(w, int | float) for w in weights):
                total_weight: Any = float(sum(weights))
                if all(w == 1 for w in weights):
                    total = stacked.sum()
                else:
                    w = torch.tensor(weights, dtype=dtype, device=stacked.device)
                    total = self._weighted(stacked, w).sum()
            else:
                w = torch.stack([torch.as_tensor(x).to(stacked.device, dtype).reshape(()) for x in weights])
                total, total_weight = self._weighted(stacked, w).sum(), w.sum()
            self._values[key] = self._values.get(key, 0.0) + total
            self._weights[key] = self._weights.get(key, 0.0) + total_weight

    def log(
        self, name: str, value: torch.Tensor | float | Any, weight: torch.Tensor | float = 1.0, reduce: str = "mean"
    ) -> None:
        """Fold ``value`` into the running ``reduce`` of ``name``, or register a torchmetrics ``Metric`` (see
        `TaskModule.log`)."""
        # A bad name or value is the task's input error: a `TaskError` (a TypeError and a ValueError too), one line.
        if not isinstance(name, str) or not name:
            raise TaskError(f"log({name!r}, ...): the name is a {type(name).__name__}; expected a non-empty string")
        if reduce not in REDUCTIONS:
            raise TaskError(f"log({name!r}): reduce={reduce!r} is not one of {', '.join(REDUCTIONS)}")
        deferred = reduce == "mean" and isinstance(value, torch.Tensor)  # appended, folded at the interval
        if name in self._appended and not deferred:
            self._fold(name)
        known = self._reductions.get(name)
        if _is_metric(value):
            if known is not None and known != "metric":
                raise TaskError(f"log({name!r}): already logged as a number in this interval; log a Metric or numbers")
            self._reductions[name] = "metric"
            self.metrics[name] = value
            return
        if known is not None and known != reduce:
            raise TaskError(f"log({name!r}): logged with reduce={known!r} and reduce={reduce!r} in one interval")
        value, weight = full(value), full(weight)  # a DTensor (a norm over FSDP2 shards) as its whole value
        for what, x in (("value", value), ("weight", weight)):
            if isinstance(x, bool) or not isinstance(x, torch.Tensor | int | float):
                kind = type(x).__name__
                raise TaskError(
                    f"log({name!r}): {what} {x!r:.60} is a {kind}; expected a number, a one-element tensor or a "
                    "torchmetrics Metric"
                )
            if isinstance(x, torch.Tensor) and (x.numel() != 1 or x.is_complex() or x.dtype == torch.bool):
                raise TaskError(
                    f"log({name!r}): {what} is a {x.dtype} tensor of shape {tuple(x.shape)}; expected a single real "
                    "number (a one-element tensor, or a float): reduce it, e.g. with .mean()"
                )
        if reduce != "mean" and not (isinstance(weight, int | float) and weight == 1):
            raise TaskError(f"log({name!r}): a weight applies to reduce='mean' only, not to reduce={reduce!r}")
        if self.watch is not None:
            self.watch(name, value, weight, reduce)
        if deferred and isinstance(value, torch.Tensor):  # no device operation now: one stack at the interval
            value = value.detach()
            self._append(name, value if value.ndim == 0 else value.reshape(()), weight)
            return
        if isinstance(value, torch.Tensor):
            value = value.detach().reshape(())
            value = value.to(_sum_dtype(value.device))
        self._reductions[name] = reduce
        if reduce == "mean":
            if isinstance(weight, torch.Tensor):
                weight = weight.detach().reshape(())
                weight = weight.to(value.dtype if isinstance(value, torch.Tensor) else torch.float64)
            weighted = value * weight
            if self.zero_weights and isinstance(weighted, torch.Tensor):  # 0 for weight 0, on the device
                zero = torch.as_tensor(weight, device=weighted.device) == 0
                weighted = torch.where(zero, torch.zeros_like(weighted), weighted)
            elif self.zero_weights and weight == 0:
                weighted = 0.0
            self._values[name] = self._values.get(name, 0.0) + weighted
            self._weights[name] = self._weights.get(name, 0.0) + weight
        elif known is None or reduce == "last":
            self._values[name] = value
        elif reduce == "sum":
            self._values[name] = self._values[name] + value
        else:  # max / min, on the device (a Python comparison of tensors would sync)
            previous = torch.as_tensor(self._values[name], dtype=torch.float64)
            current = torch.as_tensor(value, dtype=torch.float64)
            if isinstance(value, torch.Tensor):
                previous = previous.to(value.device)
            elif isinstance(self._values[name], torch.Tensor):
                current = current.to(previous.device)
            extreme = torch.maximum if reduce == "max" else torch.minimum
            self._values[name] = extreme(previous, current)

    def _weighted(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``values * weights``, on the device; with `zero_weights`, 0 where the weight is 0 (even for a NaN)."""
        product = values * weights
        return torch.where(weights == 0, torch.zeros_like(product), product) if self.zero_weights else product

    def note(self, name: str, message: str) -> None:
        """Record a warning about ``name`` that `reduce` gives once, on the main process, whichever process noted it
        (the notes travel with the reduction's gather); a name already warned about in this buffer is not again."""
        if name not in self._warned and all(name != n for n, _ in self._notes):
            self._notes.append((name, message))

    def fail(self, message: str) -> None:
        """Record a problem of this process that `reduce` raises as a `TaskError` on every process alike (a
        process that raised on its own would leave the others waiting in the reduction's collectives)."""
        self._failures.append(message)

    def clear(self) -> None:
        """Drop everything buffered (registered metrics are forgotten, not reset); the names already warned about
        are kept."""
        self._failures.clear()
        self._notes.clear()
        self._values.clear()
        self._weights.clear()
        self._reductions.clear()
        self.metrics.clear()
        self._appended.clear()

    def reset_metrics(self) -> None:
        """Reset every registered torchmetrics object and forget it (what the sanity pass logged)."""
        for metric in self.metrics.values():
            metric.reset()
        self.clear()

    def state_dict(self) -> dict[str, Any]:
        """The partial reductions not yet reduced: ``{"values", "weights", "reductions"}`` (0-dim tensors or floats).

        Logged torchmetrics objects are not part of it (a checkpoint cannot hold them): `reduce` after
        `load_state_dict` computes only the plain values.
        """
        self._fold()
        plain = {n: r for n, r in self._reductions.items() if r != "metric"}
        return {
            "values": {n: self._values[n] for n in plain},
            "weights": {n: self._weights[n] for n in plain if n in self._weights},
            "reductions": plain,
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Put back what `state_dict` returned; tensors move to ``device``."""

        def place(x: Any) -> Any:
            return x.to(device) if isinstance(x, torch.Tensor) and device is not None else x

        self.clear()
        self._reductions.update(state["reductions"])
        self._values.update({n: place(v) for n, v in state["values"].items()})
        self._weights.update({n: place(w) for n, w in state["weights"].items()})

    def __bool__(self) -> bool:
        return bool(self._reductions)

    def reduce(self, accelerator: Any, agreement: Any, weights: tuple[str, ...] = ()) -> dict[str, float]:
        """Return name -> value over everything buffered, the same on every rank, and clear the buffer.

        Plain values: one collective (a gather of every name's partial result) and one device-to-host copy,
        whatever the number of names; ``mean`` is the weighted mean over the interval and the ranks, ``sum``
        the total, ``max`` / ``min`` the extreme, ``last`` the main process's latest value. Metrics: each is
        computed (torchmetrics gathers its state over the ranks), then reset; one metric object logged under
        several names is computed once, and every name gets its value. For each ``mean`` name in ``weights``
        that was logged, the summed weight over the interval and the ranks is returned too, as
        ``WEIGHT_PREFIX + name`` (``torchloom/weight/train/loss``: the items the training loss is a mean over).

        Args:
            accelerator: the run's Accelerator (the values are gathered on its device).
            agreement (`RankAgreement`): the run's; the ranks' names and problems are compared through it.
            weights (`tuple[str, ...]`): ``mean`` names whose summed weight to return too.

        Raises:
            TaskError: the ranks logged different names or reductions; a rank recorded a problem with `fail`
                (every rank raises the first one, and the logged metrics are reset); a metric's compute failed or
                did not give a single number (the metric is left usable: its local state, not the synchronised
                one).
        """
        self._fold()
        names = sorted(n for n in self._reductions if n not in self.metrics)
        failures = [(accelerator.process_index, f) for f in self._failures]
        notes = list(self._notes)
        if accelerator.num_processes > 1:
            # One small object gather per logging interval turns a rank logging other names (which would make
            # the reduction below mismatch or hang) into a clear error, and a problem of one rank into the same
            # error on every rank.
            signature = sorted(n if r == "mean" else f"{n} ({r})" for n, r in self._reductions.items())
            per_rank = agreement.gather((signature, self._failures, self._notes))
            failures = [(rank, f) for rank, (_, found, _) in enumerate(per_rank) for f in found]
            notes = [note for _, _, noted in per_rank for note in noted]
            if not failures and any(other != signature for other, _, _ in per_rank):
                listing = "; ".join(f"rank {r}: {n}" for r, (n, _, _) in enumerate(per_rank))
                raise TaskError(f"every process must log the same names between two logging steps; got {listing}")
        if failures:
            for metric in {id(m): m for m in self.metrics.values()}.values():
                metric.reset()
            self.clear()
            rank, message = failures[0]
            where = f" (on process {rank})" if accelerator.num_processes > 1 else ""
            raise TaskError(f"{message}{where}")
        for name, message in notes:  # the first note of each name, in process order; once per buffer
            if name not in self._warned:
                self._warned.add(name)
                if accelerator.process_index == 0:
                    warn(message)
        reduced = self._reduce_values(names, accelerator, weights) if names else {}
        metrics, self.metrics = self.metrics, {}
        self.clear()
        # Every metric is computed on every rank even after one fails: each compute is a collective, so a rank
        # that stopped at the first failure would leave the others waiting in the next one. A metric logged under
        # several names is computed once (a second compute would follow its reset: 0, or NaN on several ranks).
        names_of: dict[int, list[str]] = {}
        for name in sorted(metrics):
            names_of.setdefault(id(metrics[name]), []).append(name)
        failure: TaskError | None = None
        for same in names_of.values():
            metric = metrics[same[0]]
            try:
                value = compute_metric(same[0], metric)
            except TaskError as exc:
                failure = failure or exc
            else:
                reduced.update(dict.fromkeys(same, value))
                metric.reset()
        if failure is not None:
            raise failure
        return reduced

    def _reduce_values(self, names: list[str], accelerator: Any, weights_of: tuple[str, ...]) -> dict[str, float]:
        dtype = _sum_dtype(accelerator.device)

        def column(values: list[Any]) -> torch.Tensor:
            return torch.stack([torch.as_tensor(v, dtype=dtype).to(accelerator.device) for v in values])

        values = column([self._values[n] for n in names])
        local = torch.stack([values, column([self._weights.get(n, 0) for n in names])])
        # (ranks, 2, names): row 0 the partial value, row 1 the summed weight (mean only)
        table = accelerator.gather(local[None]) if accelerator.num_processes > 1 else local[None]
        values, weights = table[:, 0], table[:, 1]
        combined = {
            "mean": values.sum(0) / weights.sum(0),
            "sum": values.sum(0),
            "max": values.max(0).values,
            "min": values.min(0).values,
            "last": values[0],
        }
        kinds = [self._reductions[n] for n in names]
        summed = [(i, n) for i, n in enumerate(names) if n in weights_of and kinds[i] == "mean"]
        columns = [combined[k][i] for i, k in enumerate(kinds)] + [weights[:, i].sum() for i, _ in summed]
        result = torch.stack(columns).tolist()  # one device-to-host copy for all of them
        return {**dict(zip(names, result)), **{WEIGHT_PREFIX + n: w for (_, n), w in zip(summed, result[len(names) :])}}


def _sum_dtype(device: torch.device) -> torch.dtype:
    """The dtype logged values are summed in on ``device``: float64, or float32 on MPS (which has no float64)."""
    return torch.float64 if device.type != "mps" else torch.float32


def _is_metric(value: Any) -> bool:
    if isinstance(value, torch.Tensor | int | float):
        return False
    from torchmetrics import Metric  # only when something that is not a number is logged

    return isinstance(value, Metric)


def compute_metric(name: str, metric: Any) -> float:
    """``metric.compute()`` as one float; a failure leaves the metric usable.

    torchmetrics (1.9) synchronises a metric's state over the ranks before compute and restores the local state
    after it, but not when compute raises: the metric stays synchronised and its next ``update`` raises. Here
    the local state is restored first. A metric with a list state (AUROC, average precision, Spearman, retrieval
    metrics ...) is synchronised with `gather_states`, which also works when a process holds no sample.

    Raises:
        TaskError: compute raised, or its result is not a single number.
    """
    own_sync = getattr(metric, "dist_sync_fn", None) is None and has_list_state(metric)
    padded: dict[str, int] = {}
    if own_sync:
        padded = even_list_states(metric)  # before dist_sync_fn is set: it checks that none of the user's is
        metric.dist_sync_fn = gather_states
    try:
        value = metric.compute()
    except Exception as exc:
        if metric_is_synced(metric):
            metric.unsync()
        raise TaskError(f"metric {name!r} ({type(metric).__name__}): compute failed: {exc}") from exc
    finally:
        if own_sync:
            metric.dist_sync_fn = None
            uneven(metric, padded)
    if not isinstance(value, torch.Tensor | int | float) or (isinstance(value, torch.Tensor) and value.numel() != 1):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise TaskError(
            f"metric {name!r} ({type(metric).__name__}) computed {shape}; expected a single number "
            "(e.g. average='macro' rather than None)"
        )
    return float(value.double().item()) if isinstance(value, torch.Tensor) else float(value)
