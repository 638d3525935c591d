"""The PyTorch profiler over a few optimizer steps: a Chrome trace and a table of the top operations per cycle.

Method card
-----------
- **What:** `torch.profiler.profile` with `torch.profiler.schedule` (``wait``, ``warmup``, ``active``, ``repeat``)
  counted in optimizer steps: each cycle skips ``wait`` steps, records ``warmup`` steps and throws them away (the
  profiler's own start-up cost), then records ``active`` steps and writes them. CPU activity always, CUDA
  activity when the run's device is a GPU.
- **Mechanism:** the profiler starts in ``on_fit_start`` and ``prof.step()`` is called in ``after_optimizer_step``,
  so one profiler step is one optimizer step (all its micro-batches under gradient accumulation); at the end of each
  active phase ``on_trace_ready`` writes ``<run_dir>/profiler/trace-rank<R>-cycle<N>.json`` (open it in
  ``chrome://tracing`` or https://ui.perfetto.dev) and ``ops-rank<R>-cycle<N>.txt``, the table of
  ``key_averages()`` sorted by ``sort_by``, ``row_limit`` rows. Both are written atomically.
- **Off the hot path:** once the ``repeat`` cycles are done (``repeat * (wait + warmup + active)`` steps), the
  profiler is stopped; from then on ``after_optimizer_step`` only counts. A process that does not profile (every
  process but the main one, unless ``all_ranks``) never starts it.
- **Hooks:** ``on_run_start`` (the run directory), ``on_fit_start`` (start; a warning when the fit is too short for
  the schedule), ``after_optimizer_step`` (step, stop after the last cycle), ``on_train_end`` / ``teardown`` (stop if
  still running; an active phase cut short by the end of training is written as it is).
- **Checked at start-up:** every setting when the plugin is configured (``sort_by`` among `SORT_KEYS`, with the
  closest one), and at ``on_fit_start`` the schedule against the fit's optimizer steps (``task.num_training_steps``
  less the steps a resumed fit already took): a fit that ends before the first active step profiles no optimizer
  step, and one that ends before the last cycle records fewer cycles than ``repeat``; either is said once.
- **Sources:** PyTorch's profiler recipe ("PyTorch Profiler", ``torch.profiler.schedule``); Lightning's
  ``PyTorchProfiler``; HF Accelerate's ``ProfileKwargs``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

import torchloom
from torchloom import ConfigError

__all__ = ["Profiler", "ProfilerConfig"]

#: The folder of the run directory that the files go into.
PROFILER_DIR = "profiler"

#: The valid ``sort_by`` keys: the numeric columns of ``key_averages().table`` (torch 2.13,
#: ``torch.autograd.profiler_util._build_table`` sorts by the attribute of that name, ``cuda`` / ``xpu`` read as
#: ``device``).
SORT_KEYS: tuple[str, ...] = (
    "cpu_time",
    "cpu_time_total",
    "self_cpu_time_total",
    "cpu_memory_usage",
    "self_cpu_memory_usage",
    "count",
    *(
        key
        for device in ("cuda", "xpu", "device")
        for key in (
            f"{device}_time",
            f"{device}_time_total",
            f"self_{device}_time_total",
            f"{device}_memory_usage",
            f"self_{device}_memory_usage",
        )
    ),
)


@dataclass
class ProfilerConfig:
    """Settings of the ``profiler`` plugin.

    Args:
        wait (`int`, defaults to 1): optimizer steps skipped at the start of each cycle (the first one also holds
            the sanity validation pass and the first step's set-up); ``>= 0``.
        warmup (`int`, defaults to 1): optimizer steps recorded and discarded before the active ones; ``>= 0``.
        active (`int`, defaults to 3): optimizer steps recorded and written per cycle; ``>= 1``.
        repeat (`int`, defaults to 1): cycles; ``>= 1``. After the last one the profiler stops.
        all_ranks (`bool`, defaults to False): profile every process (files per rank), not only the main one.
        record_shapes (`bool`, defaults to False): record the input shapes of each operation (the table groups
            by them).
        profile_memory (`bool`, defaults to False): record the tensor memory each operation allocates.
        with_stack (`bool`, defaults to False): record the Python stack of each operation (larger traces).
        sort_by (`str`, *optional*): the table's sort key, a column of ``key_averages().table``: ``cpu_time``,
            ``cpu_time_total``, ``self_cpu_time_total``, ``cpu_memory_usage``, ``self_cpu_memory_usage``,
            ``count``, or the same with ``cuda`` (``xpu``, ``device``) for ``cpu``; ``None`` (the default) sorts by
            ``self_cuda_time_total`` on a GPU, else ``self_cpu_time_total``.
        row_limit (`int`, defaults to 20): rows of the table; ``>= 1``.

    Raises:
        ConfigError: a negative ``wait`` / ``warmup``, ``active`` / ``repeat`` / ``row_limit`` below 1, an unknown
            ``sort_by`` (with the closest valid key).
    """

    wait: int = 1  # steps skipped at the start of each cycle
    warmup: int = 1  # steps recorded and discarded
    active: int = 3  # steps recorded and written
    repeat: int = 1  # cycles
    all_ranks: bool = False  # every process, not only the main one
    record_shapes: bool = False  # input shapes of each operation
    profile_memory: bool = False  # tensor memory of each operation
    with_stack: bool = False  # Python stacks (larger traces)
    sort_by: str | None = None  # None: self_cuda_time_total on a GPU, else self_cpu_time_total
    row_limit: int = 20  # rows of the top-operations table

    def __post_init__(self) -> None:
        for name, least in (("wait", 0), ("warmup", 0), ("active", 1), ("repeat", 1), ("row_limit", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"setting {name!r} = {value!r}; expected an integer >= {least}")
        if self.sort_by is not None and self.sort_by not in SORT_KEYS:
            close = torchloom.utils.closest_name(str(self.sort_by), SORT_KEYS)
            hint = f"; did you mean {close!r}?" if close else ""
            raise ConfigError(
                f"setting 'sort_by' = {self.sort_by!r}: not a column of the operations table{hint} Valid: "
                f"{', '.join(SORT_KEYS)}, or null"
            )

    @property
    def cycle(self) -> int:
        """Optimizer steps per cycle."""
        return self.wait + self.warmup + self.active


class Profiler(torchloom.Plugin):
    """Profile a few optimizer steps with torch.profiler; write a Chrome trace and a top-operations table.

    Example:

    .. code-block:: python

        engine = torchloom.Engine(plugins={"profiler": {"wait": 1, "warmup": 1, "active": 3}})

    Attributes:
        steps (`int`): optimizer steps counted in this fit.
        written (`list[str]`): the files written in this fit, in order.
    """

    name = "profiler"
    Config = ProfilerConfig
    config: ProfilerConfig

    def __init__(self, config: ProfilerConfig | None = None, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.steps = 0
        self.written: list[str] = []
        self._run_dir: str | None = None
        self._profiler: torch.profiler.profile | None = None
        self._rank = 0
        self._cycles = 0
        self._sort_by = "self_cpu_time_total"

    @torchloom.hookimpl
    def on_run_start(self, run_dir: str) -> None:
        self._run_dir = run_dir

    @torchloom.hookimpl
    def on_fit_start(self, accelerator, task, progress) -> None:
        self.steps, self.written, self._cycles = 0, [], 0
        self._rank = accelerator.process_index
        total = task.num_training_steps
        if total is not None and total > progress.global_step and accelerator.is_main_process:
            self._warn_if_too_short(total - progress.global_step)
        if self._run_dir is None or not (self.config.all_ranks or accelerator.is_main_process):
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        on_gpu = accelerator.device.type == "cuda"
        if on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._sort_by = self.config.sort_by or ("self_cuda_time_total" if on_gpu else "self_cpu_time_total")
        cfg = self.config
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat),
            on_trace_ready=self._write,
            record_shapes=cfg.record_shapes,
            profile_memory=cfg.profile_memory,
            with_stack=cfg.with_stack,
        )
        self._profiler.start()

    def _warn_if_too_short(self, steps: int) -> None:
        """Warn once when a fit of ``steps`` optimizer steps profiles none of them, or fewer cycles than ``repeat``."""
        cfg = self.config
        first = cfg.wait + cfg.warmup  # 0-based index of the first active optimizer step of a cycle
        cycles = min(cfg.repeat, -(-(steps - first) // cfg.cycle)) if steps > first else 0
        schedule = f"wait {cfg.wait}, warmup {cfg.warmup}, active {cfg.active}, repeat {cfg.repeat}"
        if cycles == 0:
            torchloom.utils.warn(
                f"profiler: this fit takes {steps} optimizer step{'s' if steps != 1 else ''}, and the schedule "
                f"({schedule}) records from optimizer step {first + 1} on: no optimizer step will be profiled. Lower "
                f"wait + warmup to at most {steps - 1}, or train longer",
            )
        elif cycles < cfg.repeat:
            torchloom.utils.warn(
                f"profiler: this fit takes {steps} optimizer steps, enough for {cycles} of the {cfg.repeat} cycles of "
                f"the schedule ({schedule}, {cfg.cycle} steps a cycle): only {cycles} will be recorded. Lower repeat "
                f"to {cycles}, shorten the cycle, or train longer",
            )

    @torchloom.hookimpl
    def after_optimizer_step(self) -> None:
        self.steps += 1
        if self._profiler is None:  # not profiling (another rank, or the cycles are done): a counter only
            return
        with warnings.catch_warnings():  # each cycle's events are meant to be its own: they are written per cycle
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
            self._profiler.step()
        if self.steps >= self.config.repeat * self.config.cycle:
            self._stop()

    @torchloom.hookimpl
    def on_train_end(self) -> None:
        self._stop()

    @torchloom.hookimpl
    def teardown(self) -> None:
        self._stop()

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()  # an active phase still open is written as it is (on_trace_ready)

    def _write(self, profiler: torch.profiler.profile) -> None:
        """``on_trace_ready``: the cycle's trace and table, into ``<run_dir>/profiler/``."""
        assert self._run_dir is not None
        self._cycles += 1
        directory = os.path.join(self._run_dir, PROFILER_DIR)
        os.makedirs(directory, exist_ok=True)
        stem = f"rank{self._rank}-cycle{self._cycles}"
        trace = os.path.join(directory, f"trace-{stem}.json")
        torchloom.utils.write_atomically(trace, profiler.export_chrome_trace)
        table = profiler.key_averages(group_by_input_shape=self.config.record_shapes).table(
            sort_by=self._sort_by, row_limit=self.config.row_limit
        )
        ops = os.path.join(directory, f"ops-{stem}.txt")
        torchloom.utils.write_atomically(ops, table + "\n")
        self.written += [trace, ops]
