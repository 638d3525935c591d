"""`torchloom.utils.count_parameters` and `torchloom.utils.optimizer_state_bytes`: exact counts by hand, shared
parameters once, 4-bit weights counted as the weights they pack, a frozen part without optimizer state; and the run
summary's ``parameters`` / ``optimizer_state_bytes`` (the ``progress`` plugin) equal to them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import torchloom
from torchloom.testing import TinyTask


class FrozenFirst(TinyTask):
    """A 4 -> 3 -> 1 MLP whose first layer is frozen, trained with AdamW."""

    def configure_model(self) -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
        model[0].requires_grad_(False)
        return model

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.model.parameters(), lr=0.01, foreach=False)


def test_counts_by_hand_and_shared_parameters_once():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied: 40 weights, not 80
    model[0].requires_grad_(False)
    extra = torch.nn.Linear(4, 2).to(torch.float16)
    counts = torchloom.utils.count_parameters(torch.nn.ModuleList([model, extra]))
    held = 40 * 4 + 10 * 2
    assert counts == {
        "total": 50, "trainable": 10, "bytes": held, "process_bytes": held, "dtypes": {"float32": 40, "float16": 10}
    }  # fmt: skip


def test_optimizer_state_bytes_counts_only_what_stepped():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    assert torchloom.utils.optimizer_state_bytes(optimizer) == 0  # before the first step
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    # 4 trainable weights: exp_avg and exp_avg_sq in float32, and a float32 step per parameter tensor (2)
    assert torchloom.utils.optimizer_state_bytes(optimizer) == 2 * 4 * 4 + 2 * 4
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd.step()
    assert torchloom.utils.optimizer_state_bytes(sgd) == 0  # plain SGD keeps none


def test_a_4bit_layer_counts_the_weights_it_packs():
    pytest.importorskip("bitsandbytes")
    from torchloom_plugins.peft import quantize_linear_layers

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    before = torchloom.utils.count_parameters(model)
    quantize_linear_layers(model, 4, compute_dtype=torch.float32, skip=("2",))
    after = torchloom.utils.count_parameters(model)
    assert after["total"] == before["total"] == 64 * 32 + 32 + 32 * 2 + 2
    assert after["trainable"] == 0  # the quantised base is frozen
    # the 2048 weights packed two per byte; the biases and the skipped layer in float32
    assert after["bytes"] == 2048 // 2 + 4 * (32 + 64 + 2)
    assert after["dtypes"] == {"uint8": 2048, "float32": 32 + 64 + 2}


def test_the_fit_summary_records_the_parameters_and_the_optimizer_state(tmp_path, capsys):
    engine = torchloom.Engine(output_dir=str(tmp_path), max_epochs=1, seed=0, plugins=["progress"])
    engine.fit(FrozenFirst())
    summary = json.loads((Path(engine.run_dir) / torchloom.utils.SUMMARY_FILE).read_text())
    assert summary["parameters"] == {"total": 19, "trainable": 4, "bytes": 76, "process_bytes": 76}
    assert summary["optimizer_state_bytes"] == 40
    out = capsys.readouterr().out
    assert "parameters 19 (4 trainable, 21.1 %), 76 B; optimizer state 40 B\n" in out


def test_4bit_weights_in_a_wider_storage_dtype_count_the_weights_they_pack():
    """FSDP-QLoRA stores the packed 4-bit data in bf16 (``quant_storage``): 4 weights per element, not 2."""
    bnb = pytest.importorskip("bitsandbytes")
    weight = bnb.nn.Params4bit(
        torch.randn(32, 64), requires_grad=False, quant_type="nf4", quant_storage=torch.bfloat16
    ).to("cpu")
    assert weight.dtype == torch.bfloat16 and weight.numel() == 512
    module = torch.nn.Module()
    module.weight = weight
    counts = torchloom.utils.count_parameters(module)
    assert counts["total"] == 2048 and counts["bytes"] == 1024
    assert counts["dtypes"] == {"bfloat16": 2048}


def test_optimizer_state_bytes_reads_through_accelerates_wrapper_and_counts_shared_state_once():
    from accelerate.optimizer import AcceleratedOptimizer

    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    alone = torchloom.utils.optimizer_state_bytes(optimizer)
    assert alone == 2 * 4 * 4 + 2 * 4
    assert torchloom.utils.optimizer_state_bytes(AcceleratedOptimizer(optimizer, device_placement=False)) == alone
    shared = torch.zeros(256)  # one tensor in two parameters' state (as bitsandbytes' quantization maps)
    for state in optimizer.state.values():
        state["qmap"] = shared
    assert torchloom.utils.optimizer_state_bytes(optimizer) == alone + 256 * 4
