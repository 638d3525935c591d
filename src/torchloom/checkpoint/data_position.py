"""Where a fit is in its training data, recorded in samples of the global order, and where a resume continues.

An epoch's training data is one global order of samples: the sampler's permutation of the dataset (drawn from
the sampler's seed and the epoch) cut into batches of ``total_batch_size`` = the per-process batch size x the
processes, of which each process takes its own share. After ``k`` batches on every process the fit has
consumed the first ``k x total_batch_size`` samples of that order, whatever the batch size and the number of
processes. A checkpoint records that count (``samples_done``) together with what defines the order (`DataOrder`).

A resume continues exactly where the rule allows and refuses otherwise (`resume_point`):

- at the end of an epoch, the next epoch starts from its first sample: the data may have changed (another
  dataset size or batch size): nothing is skipped or repeated;
- inside an epoch, the rest of the epoch is the rest of the same order: the dataset size and the sampler
  (shuffled or not; length-grouped or not, and then with the same megabatch and row lengths) must be the
  checkpoint's (its seed is taken from the checkpoint), and the samples done must
  be a whole number of the new global batches (24 samples done continue as batches of 8 or 3, not of 5);
  otherwise the resume is refused with one `torchloom.CheckpointError` naming the change.

A sample is then never skipped and never trained twice in an epoch. (The HF Trainer and Accelerate's
``skip_first_batches`` count batches, which a new batch size or dataset makes point at other samples.)

`DataPosition` is the fit's one object for all of it: it starts each epoch's loader (a resumed one where the
checkpoint stopped, with the random states of the look-ahead fetch restored: `torchloom.checkpoint.fetch_states`),
counts the batches done, holds the states of the generators the loader draws from as the epoch started, and is one
entry of a checkpoint (`DataPosition.state_dict` / `process_state_dict` / `load_state_dict`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from accelerate.data_loader import get_sampler

from torchloom._batch_limits import limited
from torchloom._guards import stop_iteration
from torchloom.checkpoint.fetch_states import Watch, resume_source
from torchloom.checkpoint.random_states import set_random_states

__all__ = ["DataOrder", "DataPosition", "data_generators", "data_order", "layout_problems", "position", "resume_point"]


@dataclass(frozen=True)
class DataOrder:
    """What defines the global order of an epoch's training samples, and how it is cut into batches.

    Attributes:
        dataset_length (`int` or ``None``): samples in the dataset (``None``: an iterable dataset without a length).
        total_batch_size (`int` or ``None``): samples per batch over all processes (``None``: a batch sampler
            without a fixed size).
        batches_per_epoch (`int` or ``None``): batches per epoch on each process (under a batch limit, the
            batches the limit leaves: a limited epoch ends there).
        world_size (`int`): processes.
        sampler (`str`): the sampler's class (``RandomSampler`` shuffles, ``SequentialSampler`` does not).
        sampler_seed (`int` or ``None``): the seed the sampler draws each epoch's permutation from (``seed +
            epoch``; Accelerate's ``SeedableRandomSampler``), ``None`` when it has none.
        sampler_order (`dict` or ``None``): what else defines the sampler's order, from its ``order_settings()``
            (`torchloom.data.LengthGroupedSampler`: ``group_by_length``, the megabatch size, a hash of the rows'
            lengths); ``None`` for a sampler without one (and in checkpoints written before it was recorded).
    """

    dataset_length: int | None
    total_batch_size: int | None
    batches_per_epoch: int | None
    world_size: int
    sampler: str
    sampler_seed: int | None
    sampler_order: dict[str, Any] | None = None


def data_order(loader: Any, world_size: int, limit: int | None = None) -> DataOrder:
    """The `DataOrder` of a prepared training dataloader (an Accelerate ``DataLoaderShard``, or any DataLoader);
    ``limit``: the batches per epoch and process a batch limit leaves (``limit_train_batches``,
    ``overfit_batches``, ``fast_dev_run``), which ``batches_per_epoch`` then records: the epoch the fit trains."""
    sampler = get_sampler(loader)
    seed = getattr(sampler, "initial_seed", None)
    settings = sampler.order_settings() if callable(getattr(sampler, "order_settings", None)) else None
    return DataOrder(
        dataset_length=_length(getattr(loader, "dataset", None)),
        total_batch_size=_total_batch_size(loader, world_size),
        batches_per_epoch=_limited_length(_length(loader), limit),
        world_size=world_size,
        sampler=type(sampler).__name__,
        sampler_seed=seed if isinstance(seed, int) else None,
        sampler_order=settings,
    )


def position(epoch: int, batches_done: int, epoch_finished: bool, order: DataOrder) -> dict[str, Any]:
    """The data position a checkpoint records: the epoch, the batches done in it on each process, the samples of
    its global order done (``None`` when the batch size is not fixed), whether it is finished, and the order
    (``sampler_order`` only where the sampler has one)."""
    samples = None if order.total_batch_size is None else batches_done * order.total_batch_size
    if samples is not None and order.dataset_length is not None:
        samples = min(samples, order.dataset_length)  # a last, smaller batch
    recorded = asdict(order)
    if recorded["sampler_order"] is None:
        del recorded["sampler_order"]  # a sampler without order settings: as checkpoints recorded it before
    return {
        "epoch": epoch,
        "batches_done": batches_done,
        "samples_done": samples,
        "epoch_finished": epoch_finished,
        "order": recorded,
    }


def layout_problems(saved: dict[str, Any], order: DataOrder) -> list[str]:
    """Why a run whose training data has ``order`` cannot continue the epoch a checkpoint stopped in (empty:
    it can). ``saved`` is the checkpoint's `position`. The sampler's seed is not compared: a resumed fit takes
    the checkpoint's (with its random states), so every later epoch is drawn as in the run that saved it."""
    if saved.get("epoch_finished") or _epoch_done(saved):
        return []  # nothing of the epoch is left: the next one starts from its first sample, on any data
    before = saved.get("order") or {}
    now = asdict(order)
    epoch, samples, batches = saved.get("epoch"), saved.get("samples_done"), saved.get("batches_done")
    where = (
        f"it stopped after {samples} samples of epoch {epoch}"
        if samples is not None
        else f"it stopped after {batches} batches of epoch {epoch}"
    )
    changes = []
    for key, what in (("dataset_length", "the training dataset's size"), ("sampler", "the training sampler")):
        if before.get(key) != now[key]:
            changes.append(f"{what} changed from {before.get(key)} to {now[key]}")
    changes += _grouping_changes(before.get("sampler_order"), now["sampler_order"])
    if changes:
        return [
            f"{where}, and {' and '.join(changes)}, so the rest of that epoch's order is another one (samples would "
            "be skipped or trained twice); resume with the same training data, or from a checkpoint at "
            "the end of an epoch"
        ]
    new_total = order.total_batch_size
    if before.get("total_batch_size") == new_total and before.get("batches_per_epoch") == order.batches_per_epoch:
        return []
    if samples is None or new_total is None:
        return [
            f"{where}, and the batches changed (global batch size {before.get('total_batch_size')} -> {new_total}, "
            f"batches per epoch {before.get('batches_per_epoch')} -> {order.batches_per_epoch}) with a batch sampler "
            "of no fixed size, so the samples done cannot be counted in the new batches; resume with the same "
            "batches, or from a checkpoint at the end of an epoch"
        ]
    if samples % new_total:
        return [
            f"{where}, which is not a whole number of the new global batches of {new_total} samples (batch size "
            f"{new_total // order.world_size} x {order.world_size} process(es); it was "
            f"{before.get('total_batch_size')}), so the next batch would skip or repeat samples; resume with a "
            f"global batch size that divides {samples}, or from a checkpoint at the end of an epoch"
        ]
    return []


def resume_point(saved: dict[str, Any], order: DataOrder) -> tuple[int, int]:
    """``(epoch, batches to skip in it)`` where a run whose training data has ``order`` continues a checkpoint's
    position (`layout_problems` must have found none)."""
    epoch = saved["epoch"]
    if saved.get("epoch_finished"):
        return epoch + 1, 0
    if _epoch_done(saved):  # every sample trained; the epoch's end (its validation, on_train_epoch_end) is to come
        return epoch, order.batches_per_epoch if order.batches_per_epoch is not None else saved["batches_done"]
    samples = saved.get("samples_done")
    if samples is None or order.total_batch_size is None:  # no fixed batch size: the same batches, as counted
        return epoch, saved["batches_done"]
    return epoch, samples // order.total_batch_size


class DataPosition:
    """Where the training data of one fit stands, and how an epoch's loader starts from there.

    The loop calls `start_epoch` at every epoch and iterates what it returns; `end_epoch` when the epoch ended. A
    checkpoint keeps the main process's `state_dict` (the ``position``: `position`) and every process's
    `process_state_dict` (its data generators' states as the epoch to resume in started, and inside an epoch the
    random states before the look-ahead fetch: `torchloom.checkpoint.fetch_states.Watch`); `load_state_dict` takes
    both merged (with the process's ``random_states``) and makes the next `start_epoch` continue there.

    Args:
        accelerator (`accelerate.Accelerator`): the run's.
        loader: the prepared training dataloader.
        limit (`int`, *optional*): the batches per epoch and process a batch limit leaves (``limit_train_batches``,
            ``overfit_batches``, ``fast_dev_run``).

    Attributes:
        epoch (`int`): the epoch in progress, or after `load_state_dict` the one to start with.
        batches_done (`int`): the batches of the epoch in progress done on each process (those a resume skipped
            included): the last batch yielded is done once the next is asked for or the epoch ends.
        finished (`bool`): the epoch in progress ran to its end (`end_epoch`).
        generators (`dict[str, torch.Tensor]`): this process's data generators' states as the epoch started
            (`data_generators`).
    """

    def __init__(self, accelerator: Any, loader: Any, limit: int | None = None) -> None:
        self.accelerator, self.loader, self.limit = accelerator, loader, limit
        self.epoch, self.batches_done, self.finished = 0, 0, False
        self.generators: dict[str, torch.Tensor] = {}
        self._resume: dict[str, Any] | None = None  # a loaded checkpoint's, until the first epoch starts
        self._watch = Watch()  # the epoch's states before the look-ahead fetch, for a checkpoint
        self._source: Any = loader  # what the epoch in progress iterates (a resumed epoch's skips batches)

    def order(self) -> DataOrder:
        """The `DataOrder` of the training data (`data_order`)."""
        return data_order(self.loader, self.accelerator.num_processes, self.limit)

    # ------------------------------------------------------------------------------------------------ epochs

    def start_epoch(self, loader: Any, epoch: int) -> Iterator[tuple[int, Any]]:
        """Start ``epoch`` of ``loader``; return the iterator of its ``(batch index, batch)`` pairs to train.

        Now: the loader's epoch (its shuffle: seed + epoch), its generators' states (a resume: as the saved run
        drew them) and, for a resume at an epoch's start, the saved random states. At the first batch asked for
        (after ``on_train_epoch_start``): a resume skips the batches the checkpoint trained (by index) and restores
        the random states around the look-ahead fetch (`torchloom.checkpoint.fetch_states.resume_source`)."""
        resume, self._resume = self._resume, None
        skip = resume["skip"] if resume else 0
        if hasattr(loader, "set_epoch"):  # the epoch's own shuffle (seed + epoch), also in a resumed fit
            loader.set_epoch(epoch)
        found = data_generators(loader)
        for name, saved in (resume["generators"] if resume else {}).items():  # as the saved run drew them
            if name in found:
                found[name].set_state(saved)
        self.generators = {name: generator.get_state() for name, generator in found.items()}
        rng = resume["random_states"] if resume else None
        if rng is not None and skip == 0:
            set_random_states(rng)
            rng = None
        self.epoch, self.batches_done, self.finished, self._source = epoch, skip, False, loader
        return self._batches(loader, skip, rng, resume["fetch"] if resume else None)

    def _batches(
        self, loader: Any, skip: int, rng: Mapping[str, Any] | None, fetch: Mapping[str, Any] | None
    ) -> Iterator[tuple[int, Any]]:
        """The epoch's batches from batch ``skip``: ``rng`` (the checkpoint's random states, restored once the
        loader started) and ``fetch`` (its `Watch.state_dict`) for a resume inside the epoch."""
        self._watch = watch = Watch(full=bool(fetch and not fetch["first"] and "python" in fetch["states"]))
        # A resume skips by index; the data's draws from the global generators are restored in its sampler, or it
        # starts the loader again and fetches one batch more (`again`), untrained.
        source, again, restoring = (
            resume_source(self.accelerator, loader, skip, fetch, rng or {}) if skip else (loader, 0, None)
        )
        self._source = source
        fresh = restoring is None and not (skip and not again)  # the loader starts from the epoch's start
        if fresh:
            watch.before_first()
        # Under a batch limit the epoch ends after its last batch, which ends an open accumulation window with an
        # optimizer step, as a whole epoch's last does.
        for batch_idx, batch in enumerate(limited(source, self.limit, skip - again, end_of_data=True), skip - again):
            if fresh:  # did the loader's first call (its first two fetches) move Python's or numpy's state?
                watch.after_first()
                fresh = False
            if rng is not None:  # as they were when the checkpoint was saved: starting the loader drew from them
                if restoring is None or not restoring.applied:
                    set_random_states(rng)
                if again:  # the batch the checkpoint trained: fetched again only for its draws, not trained
                    rng, again = None, 0
                    watch.before_next()
                    continue
                watch.continued(rng)
                rng = None
            self.batches_done = batch_idx + 1
            yield batch_idx, batch
            watch.before_next()
        if rng is not None:  # a checkpoint of the epoch's last step: nothing left to train in it
            set_random_states(rng)

    def stop(self) -> None:
        """The epoch in progress is left before its end (a stop): its loader is told (`stop_iteration`)."""
        stop_iteration(self._source)

    def end_epoch(self, finished: bool) -> None:
        """The epoch in progress ended; ``finished``: it ran to its end (not cut short by a stop)."""
        self.finished = finished

    # ------------------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The main process's part of a checkpoint: ``{"position": position(...)}`` of the epoch in progress (in the
        format of `torchloom.checkpoint.plugin_state`)."""
        return {"position": position(self.epoch, self.batches_done, self.finished, self.order())}

    def process_state_dict(self) -> dict[str, Any]:
        """This process's own part: its data generators' states as the epoch to resume in starts (the epoch in
        progress's, or at its end the next one's: the loader's now) and, inside the epoch, the random states before
        the look-ahead fetch (``None`` at its end)."""
        generators = (
            {name: g.get_state() for name, g in data_generators(self.loader).items()}
            if self.finished
            else dict(self.generators)
        )
        return {
            "epoch_generators": generators,
            "fetch_random_states": None if self.finished else self._watch.state_dict(),
        }

    def problems(self, manifest: Mapping[str, Any]) -> list[str]:
        """Why this run's training data cannot continue the epoch a checkpoint (its ``manifest``) stopped in
        (`layout_problems`; empty: it can), on another number of processes too: the position is in samples of the
        global order."""
        return layout_problems(manifest.get("position") or {}, self.order())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where a checkpoint stopped: ``state`` holds what `state_dict` and `process_state_dict` returned
        and the process's ``random_states`` (`torchloom.checkpoint.random_states`), merged; other keys are ignored.
        The checkpoint's sampler seed is taken (every later epoch is drawn as its run drew it), and the next
        `start_epoch` continues its position (`resume_point`).

        Raises:
            KeyError: a part is missing from ``state``.
        """
        saved, order = state["position"], self.order()
        sampler, seed = get_sampler(self.loader), saved["order"]["sampler_seed"]
        if seed is not None and hasattr(sampler, "initial_seed"):
            sampler.initial_seed = seed  # every later epoch is drawn as the checkpoint's run drew it
        self.epoch, skip = resume_point(saved, order)
        self._resume = {
            "skip": skip,
            "random_states": state["random_states"],
            "generators": state["epoch_generators"],
            "fetch": state.get("fetch_random_states"),
        }


def data_generators(loader: Any) -> dict[str, torch.Generator]:
    """The generators the training loader draws from as an epoch starts, each once, by name: the shuffling
    sampler's (Accelerate's ``synchronized_generator``: ``DataLoader(shuffle=True, generator=...)`` when ``seed`` is
    ``None``), the DataLoader's own (its workers' base seed), and torch's global one (a sampler without a generator
    seeds itself from it; so does the base seed then). A checkpoint keeps their states as its epoch started, so
    that the resumed epoch draws its order again exactly before the random states are restored."""
    found: dict[str, torch.Generator] = {}
    for name, generator in (
        ("sampler", getattr(loader, "synchronized_generator", None)),
        ("dataloader", getattr(loader, "generator", None)),
        ("torch", torch.default_generator),
    ):
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found.values()):
            found[name] = generator
    return found


def _grouping_changes(before: dict[str, Any] | None, now: dict[str, Any] | None) -> list[str]:
    """How the sampler's own order settings changed (``group_by_length``, its megabatch, the rows' lengths)."""
    before, now = before or {}, now or {}
    was, is_ = bool(before.get("group_by_length")), bool(now.get("group_by_length"))
    if was != is_:
        return [f"group_by_length changed from {was} to {is_}"]
    changes = []
    if before.get("megabatch") != now.get("megabatch"):
        changes.append(
            f"the length groups changed (megabatch of {before.get('megabatch')} rows -> {now.get('megabatch')}: "
            "another batch size)"
        )
    if before.get("lengths") != now.get("lengths"):
        changes.append("the rows' lengths changed (another tokenizer, max_length or data)")
    return changes


def _epoch_done(saved: dict[str, Any]) -> bool:
    """Every sample of the epoch was consumed (a step checkpoint after its last batch)."""
    length, samples = (saved.get("order") or {}).get("dataset_length"), saved.get("samples_done")
    return length is not None and samples is not None and samples >= length


def _limited_length(length: int | None, limit: int | None) -> int | None:
    if limit is None:
        return length
    return limit if length is None else min(length, limit)


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:  # an iterable dataset without a length
        return None


def _total_batch_size(loader: Any, world_size: int) -> int | None:
    """Samples per batch over all processes: Accelerate's ``total_batch_size``, else ``batch_size`` x processes."""
    try:
        total = loader.total_batch_size
    except (AttributeError, TypeError):  # a batch sampler without batch_size
        total = None
    if isinstance(total, int):
        return total
    size = getattr(loader, "batch_size", None)
    return size * world_size if isinstance(size, int) else None
