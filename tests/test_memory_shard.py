"""``estimate_memory(dp_shard_size=N)``: one process's memory under FSDP2 (issue 41, item 8).

The multi-process test trains a 4-layer Llama with the ``fsdp`` plugin on 2 CPU processes and measures each
process's allocations over one optimizer step (tests/mp/memory_shard_fit.py): the estimate's parameters and
optimizer state equal the measured bytes exactly (the odd vocabulary pads the embedding's shards), and its total is
within 5 % of the measured peak (the larger of the two processes'), without and with gradient accumulation (where
FSDP2 keeps full gradients). The measured peak varies between launches: on a quiet machine by up to one tensor the
size of the embedding (7 launches when written: the estimate 1.010-1.031 of it); under load by up to two layers'
buffers more, whose frees gloo's worker threads delay (in a full-suite run: 0.967).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import torchloom
from torchloom.errors import ConfigError
from torchloom.tools.memory_shard import as_shards, plan_units, shard_bytes
from torchrun_util import torchrun

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import memory_shard_fit as script


def _estimate(**settings):
    settings = {"batch_size": script.BATCH, "seq_len": script.LENGTH, "grad_checkpoint": False, **settings}
    return torchloom.estimate_memory(script.config(), optimizers="adamw", architecture="LlamaForCausalLM", **settings)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_estimate_per_process_matches_a_measured_fsdp2_step_on_two_processes(tmp_path):
    ranks = torchrun("memory_shard_fit.py", tmp_path)
    for label, accumulation in (("ga1", 1), ("ga2", 2)):
        row = _estimate(dp_shard_size=2, effective_batch_size=script.BATCH * accumulation).rows[0]
        first, second = (rank[label] for rank in ranks)
        # Every process stores the padded shards; the optimizer state is built on the unpadded ones (rank 0's, of
        # 251 embedding rows, is the largest).
        assert row.weights == first["parameters"] == second["parameters"], label
        assert row.optimizer_state == first["optimizer_state"] > second["optimizer_state"], label
        peak = max(r["parameters"] + r["optimizer_state"] + r["peak_over_start"] for r in (first, second))
        assert 0.95 * peak <= row.total <= 1.05 * peak, (label, row.total / peak)


def test_shards_are_padded_to_the_first_chunk():
    assert shard_bytes(torch.empty(501, 64), 2) == 251 * 64 * 4  # torch.chunk's first chunk, on every process
    assert shard_bytes(torch.empty(500, 64), 2) == 250 * 64 * 4  # a size that divides: no padding
    assert shard_bytes(torch.empty(1, 8), 4) == 8 * 4  # fewer rows than processes: one row each
    assert shard_bytes(torch.empty((), dtype=torch.float64), 2) == 8  # a 0-dim parameter is stored whole
    assert shard_bytes(torch.empty(7, 3, dtype=torch.bfloat16), 3) == 3 * 3 * 2


def test_the_optimizer_sees_shard_shapes_and_the_model_is_given_back():
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3))
    before = [p for p in model.parameters()]
    with as_shards(model, 2) as shards:
        assert [tuple(p.shape) for p in shards.parameters()] == [(3, 4), (3,), (2, 5), (2,)]
        assert all(p.device.type == "meta" for p in shards.parameters())
    assert [p for p in model.parameters()] == before


def test_units_are_the_layers_and_the_root_holds_the_rest():
    model = transformers_llama()
    plan = plan_units(model, None, 2, accumulating=False)  # _no_split_modules: LlamaDecoderLayer
    assert len(plan.layers) == 4 and all(type(m).__name__ == "LlamaDecoderLayer" for m in plan.layers)
    assert sum(p.numel() for g in plan.groups for p in g) == sum(p.numel() for p in model.parameters())
    assert {id(p) for p in plan.groups[0]} == {
        id(model.model.embed_tokens.weight),
        id(model.model.norm.weight),
        id(model.lm_head.weight),
    }
    full = sum(p.numel() * 4 for p in model.parameters())
    assert plan.gradient_bytes() < full
    assert plan_units(model, None, 2, accumulating=True).gradient_bytes() == full  # no_sync keeps them whole


def transformers_llama():
    with torch.device("meta"):
        import transformers

        return transformers.LlamaForCausalLM(script.config())


def test_accumulation_holds_full_gradients_and_the_suggestion_counts_them():
    one = _estimate(dp_shard_size=2, seq_len=8).rows[0]
    window = _estimate(dp_shard_size=2, seq_len=8, effective_batch_size=2 * script.BATCH).rows[0]
    params = sum(p.numel() for p in transformers_llama().parameters())
    assert window.gradients == 4 * params and one.gradients < window.gradients
    assert one.weights == window.weights and one.optimizer_state == window.optimizer_state
    # A budget between the two totals: the whole effective batch in one micro-batch (sharded gradients) may fit
    # where half of it with accumulation (full gradients) would not; the suggestion's totals are the rows' totals.
    est = _estimate(dp_shard_size=2, seq_len=8, effective_batch_size=2 * script.BATCH, budget=10**12)
    suggestion = est.rows[0].suggestion
    assert suggestion is not None and suggestion.micro_batch_size == 2 * script.BATCH
    whole = _estimate(dp_shard_size=2, seq_len=8, batch_size=2 * script.BATCH).rows[0]
    assert suggestion.total == whole.total and suggestion.gradient_accumulation_steps == 1
    assert est.rows[0].total == window.total


def test_sharding_lowers_the_static_part_and_the_table_says_per_process():
    whole, sharded = _estimate(), _estimate(dp_shard_size=2)
    assert sharded.dp_shard_size == 2 and whole.dp_shard_size == 1
    assert sharded.rows[0].optimizer_state < 0.51 * whole.rows[0].optimizer_state
    assert "FSDP2 over 2 processes, sizes per process" in sharded.table()
    assert "FSDP2" not in whole.table()
    assert sharded.to_dict()["dp_shard_size"] == 2


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dp_shard_size": 0}, "dp_shard_size = 0; expected an integer >= 1"),
        ({"dp_shard_size": True}, "dp_shard_size = True; expected an integer >= 1"),
        (
            {"dp_shard_size": 2, "transformer_layer_cls_to_wrap": ["LlamaLayer"]},
            "'LlamaLayer' matches no module of LlamaForCausalLM; its module classes: ",
        ),
        ({"dp_shard_size": 2, "transformer_layer_cls_to_wrap": [""]}, "expected class names of the model's layers"),
    ],
)
def test_bad_sharding_settings_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        _estimate(**settings)


def test_a_model_without_layer_classes_needs_them_named():
    def forward(model, batch_size, seq_len):
        return model(torch.randn(batch_size, 8)).sum()

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with pytest.raises(ConfigError, match="Sequential names no layer classes"):
        torchloom.estimate_memory(model, forward=forward, optimizers="adamw", grad_checkpoint=False, dp_shard_size=2)
    est = torchloom.estimate_memory(
        model, forward=forward, optimizers="adamw", grad_checkpoint=False, dp_shard_size=2,
        transformer_layer_cls_to_wrap=["Linear"],
    )  # fmt: skip
    assert est.rows[0].weights == (4 * 8 + 4) * 4 + (1 * 8 + 1) * 4  # Linear(8, 8): 4 of 8 rows; Linear(8, 1): 1 row


def test_the_command_takes_the_sharding_and_prints_what_the_api_gives(tmp_path, capsys):
    import json

    from torchloom.cli import main

    script.config().save_pretrained(tmp_path / "llama")
    args = ["--batch_size", "1", "--seq_len", "8", "--optimizer", "adamw", "--grad_checkpoint", "false"]
    sharding = ["--dp_shard_size", "2", "--transformer_layer_cls_to_wrap", "[LlamaDecoderLayer]"]
    assert main(["estimate-memory", str(tmp_path / "llama"), *args, *sharding, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = torchloom.estimate_memory(
        str(tmp_path / "llama"), batch_size=1, seq_len=8, optimizers="adamw", grad_checkpoint=False,
        dp_shard_size=2, transformer_layer_cls_to_wrap=["LlamaDecoderLayer"],
    )  # fmt: skip
    assert printed == json.loads(json.dumps(expected.to_dict())) and printed["dp_shard_size"] == 2
    whole = torchloom.estimate_memory(
        str(tmp_path / "llama"), batch_size=1, seq_len=8, optimizers="adamw", grad_checkpoint=False
    )
    assert printed["rows"][0]["weights"] < whole.rows[0].weights


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


@pytest.mark.parametrize("accumulating", [False, True])
def test_the_simulated_units_follow_fsdp2s_order_of_gathers_frees_and_reduce_scatters(accumulating):
    """One micro-batch of a root (input and output layers) and two layers, with every byte count the simulation
    adds, in order: what FSDP2 allocates and frees around each unit (`torchloom.tools.memory_shard`)."""
    from torchloom.tools.memory_shard import UnitSimulation

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), _Block(4), _Block(4), torch.nn.Linear(4, 1))
    plan = plan_units(model, ["_Block"], 2, accumulating=accumulating)
    root, first, second = (4 * sum(p.numel() for p in group) for group in plan.groups)
    assert (root, first, second) == (4 * (12 + 4 + 4 + 1), 4 * 20, 4 * 20)
    shard = [sum(shard_bytes(p, 2) for p in group) for group in plan.groups]
    added: list[tuple[str, int]] = []
    simulation = UnitSimulation(plan, lambda n: added.append(("add", n)))
    simulation.install()
    simulation.start()
    added.append(("forward", 0))
    model(torch.randn(5, 3)).sum().backward()
    added.append(("backward done", 0))
    simulation.finish()
    simulation.remove()
    gather = lambda full: [("add", full), ("add", full), ("add", -full)]  # noqa: E731 -- output, copy, output freed
    after_backward = lambda full, i: [  # noqa: E731 -- reduce-scatter copy in and out, the shard, reshard
        ("add", full),
        ("add", -full),
        *([] if accumulating else [("add", shard[i])]),
        ("add", -full),
    ]
    assert added == [
        *gather(root),
        ("forward", 0),
        *gather(first), ("add", -first),  # the first layer's forward, resharded after it
        *gather(second), ("add", -second),
        *gather(second), *gather(first),  # the second layer's backward, the first prefetched
        *after_backward(second, 2),
        *after_backward(first, 1),  # gathered already: no second all-gather
        ("backward done", 0),
        *after_backward(root, 0),
    ]  # fmt: skip
    assert all(p.grad is None for p in model.parameters())  # each micro-batch's full gradients are dropped
    # The hooks are gone: another backward adds nothing
    added.clear()
    model(torch.randn(5, 3)).sum().backward()
    assert added == []


def test_edges_of_the_plan_buffers_nested_layers_empty_parameters_and_missing_classes():
    model = transformers_llama()
    plan = plan_units(model, None, 2, accumulating=False)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert buffers > 0  # the rotary embedding's inverse frequencies: whole on every process
    shards = sum(shard_bytes(p, 2) for p in model.parameters())
    assert plan.parameter_bytes(model) == shards + buffers
    # An empty parameter (0 rows) takes nothing; the sizes are whole numbers of bytes
    assert shard_bytes(torch.empty(0, 5), 2) == 0
    assert isinstance(shard_bytes(torch.empty(5, 3), 2), int)
    # A layer class that also occurs inside a layer: the outer one is the unit, its inner match belongs to it
    outer = torch.nn.Sequential(_Block(4), torch.nn.Sequential(_Block(4), torch.nn.Linear(4, 4)))
    outer[1].__class__ = type("_Block", (torch.nn.Sequential,), {})  # an outer "_Block" holding an inner one
    nested = plan_units(outer, ["_Block"], 2, accumulating=False)
    assert [type(m).__name__ for m in nested.layers] == ["_Block", "_Block"]
    assert [len(g) for g in nested.groups] == [0, 2, 4]  # the second unit holds its inner block and the linear
    # _no_split_modules that name classes the model does not have
    model._no_split_modules = ["NoSuchLayer"]
    with pytest.raises(
        ConfigError, match=r"none of \['NoSuchLayer'\] is a module of LlamaForCausalLM; its module "
    ) as e:
        plan_units(model, None, 2, accumulating=False)
    assert str(e.value).endswith(
        "classes: Embedding, Linear, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, "
        "LlamaMLP, LlamaModel, LlamaRMSNorm, LlamaRotaryEmbedding, ModuleList, SiLUActivation"
    )
    model._no_split_modules = None
    with pytest.raises(ConfigError) as refused:
        plan_units(model, None, 2, accumulating=False)
    assert str(refused.value) == (
        "transformer_layer_cls_to_wrap: LlamaForCausalLM names no layer classes (_no_split_modules); give the class "
        "names of its repeated layers, e.g. ['LlamaDecoderLayer'], as the fsdp plugin takes them"
    )
    with pytest.raises(ConfigError) as refused:
        plan_units(model, ["LlamaMLP", "Nope", "Nada"], 2, accumulating=False)
    assert str(refused.value) == (
        "transformer_layer_cls_to_wrap = ['LlamaMLP', 'Nope', 'Nada']: 'Nope', 'Nada' matches no module of "
        "LlamaForCausalLM; its module classes: Embedding, Linear, LlamaAttention, LlamaDecoderLayer, "
        "LlamaForCausalLM, LlamaMLP, LlamaModel, LlamaRMSNorm, LlamaRotaryEmbedding, ModuleList, SiLUActivation"
    )
