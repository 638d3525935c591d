"""`RankAgreement`: how the processes of a run decide alike at a step boundary.

A decision that one process makes alone (stop now, save on a signal, skip this step) leaves the others in a
collective it never joins: they wait forever. Every such decision goes through one mechanism: each process gives
its own value at the same point of the loop, and every process gets the same answer back. The values travel on a
CPU (gloo) process group of the run's own, never interleaved with the model's collectives (DDP's, LocalSGD's), so
a decision costs no device synchronisation and works whatever the device backend (NCCL) is. On one process every
method returns its own value at once, with no collective.

Used by the engine (stop requests, the non-finite-loss skip, the logged names of an interval, a failed checkpoint
write) and by plugins (the ``checkpoint`` plugin's interrupt signal), through `torchloom.rank_agreement`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

__all__ = ["PendingMax", "RankAgreement"]

T = TypeVar("T")

# One gloo group per default process group (several fits in one process share it; a group is created collectively,
# so every process creates it at the same point: the first agreement of its first run).
_GROUPS: dict[int, Any] = {}


class PendingMax:
    """The result of `RankAgreement.max_later`: the all-reduce runs in the background until `result` is asked."""

    def __init__(self, work: Any, value: torch.Tensor | int) -> None:
        self._work, self._value = work, value

    def result(self) -> int:
        """The largest value over the processes (waits for the all-reduce if it has not finished)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return int(self._value.item()) if isinstance(self._value, torch.Tensor) else int(self._value)


class RankAgreement:
    """One answer on every process to a question each process answers for itself. Every process must call the
    same method at the same point of the run (as the hooks that fire on every rank do): a call made on some
    processes only waits for the others.

    Args:
        num_processes (`int`): the run's processes (``accelerator.num_processes``).

    Example (a plugin that stops every process when any of them sees a file appear):

    .. code-block:: python

        @torchloom.hookimpl
        def on_train_step_end(self):
            if torchloom.rank_agreement().any(os.path.exists("STOP")):
                torchloom.request_stop("STOP file")
    """

    def __init__(self, num_processes: int) -> None:
        self.num_processes = num_processes

    @property
    def _group(self) -> Any:
        import torch.distributed as dist

        key = id(dist.group.WORLD)
        if key not in _GROUPS:
            _GROUPS.clear()  # a group of an earlier, destroyed default group is useless
            _GROUPS[key] = dist.new_group(backend="gloo")
        return _GROUPS[key]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any process."""
        return self.max(int(bool(flag))) > 0

    def max(self, value: int) -> int:
        """The largest of the processes' integers (one all-reduce of one integer)."""
        return self.max_later(value).result()

    def max_later(self, value: int) -> PendingMax:
        """Start the reduction of `max` and return at once; ``.result()`` gives the answer. Start it at one step
        and read it at the next: the reduction has long finished, so no step waits for it (the ``checkpoint``
        plugin's interrupt flag)."""
        if self.num_processes == 1:
            return PendingMax(None, int(value))
        import torch.distributed as dist

        tensor = torch.tensor([int(value)], dtype=torch.int64)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return PendingMax(work, tensor)

    def gather(self, value: T) -> list[T]:
        """Every process's ``value`` (a small picklable object), in rank order, on every process."""
        if self.num_processes == 1:
            return [value]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.num_processes
        dist.all_gather_object(gathered, value, group=self._group)
        return gathered

    def first(self, value: T | None) -> T | None:
        """The first value that is not ``None``, in rank order (the reason of the first process that asked to
        stop), or ``None`` when no process has one."""
        return next((v for v in self.gather(value) if v is not None), None)
