"""The ``peft`` plugin's tasks (tests/plugins/test_peft.py) and its 2-process resume script.

`LoraTask`: a tiny LlamaForCausalLM built from a config (seeded: the same base in every run), ids ``0..n-1`` with
6 tokens each, shuffled by a seeded DataLoader generator, AdamW + StepLR; the ``peft`` plugin adapts it.
`HandLoraTask`: the same with the adapter written by hand (``peft.inject_adapter_in_model`` in the task's own
``configure_model``), the reference of the composition tests.

As a script (``torchrun --nproc_per_node 2 peft_fit.py OUT``): the resume scenarios of `MP_SCENARIOS`, each an
uninterrupted run A and runs B (stops right after a checkpoint) + C (resumes it), compared by the test with
tests/test_resume.py's ``assert_resumed_exactly``, then the plugin's run against `HandLoraTask`'s (``by_hand``);
each rank writes ``result-<rank>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchloom

VOCAB, SEQ = 32, 6
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}


def tiny_llama(seed: int = 0, hidden: int = 32, layers: int = 2) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).float()


def token_data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.arange(n), torch.randint(0, VOCAB, (n, SEQ), generator=g))


class LoraTask(torchloom.TaskModule):
    """Causal LM loss on `token_data`; ``base_seed`` builds another base (same shapes, other weights)."""

    def __init__(self, n: int = 12, batch_size: int = 2, base_seed: int = 0, hidden: int = 32, lr: float = 1e-2):
        super().__init__()
        self.n, self.batch_size, self.base_seed, self.hidden, self.lr = n, batch_size, base_seed, hidden, lr

    def build(self) -> torch.nn.Module:
        return tiny_llama(self.base_seed, self.hidden)

    def configure_model(self) -> torch.nn.Module:
        return self.build()

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        _, tokens = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        return {"loss": loss, "num_items": tokens[:, 1:].numel()}  # the labelled (shifted) tokens

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, tokens = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("val/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.1)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        return DataLoader(token_data(self.n), batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(token_data(4, seed=5), batch_size=2)


class HandLoraTask(LoraTask):
    """`LoraTask` with the adapter injected by the task itself (``peft.inject_adapter_in_model``), as a user would."""

    def __init__(self, lora: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lora = dict(LORA if lora is None else lora)

    def configure_model(self) -> torch.nn.Module:
        import peft

        model = self.build()
        peft.inject_adapter_in_model(peft.LoraConfig(**self.lora), model)
        model.enable_input_require_grads()
        return model


class PredictLoraTask(LoraTask):
    """`LoraTask` that predicts the logits of 3 fixed sequences (`token_data` seed 9), for ``torchloom predict``."""

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(list(token_data(3, seed=9).tensors[1]), batch_size=3)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(input_ids=batch).logits


# ------------------------------------------------------------------------------------ torchrun scenarios


MP_SCENARIOS: dict[str, dict[str, Any]] = {
    # 16 ids, 2 per process and step: 4 steps per epoch, 12 in all: mid-epoch 1 and the end of epoch 0.
    "lora": {"hidden": 32, "plugins": [{"peft": LORA}], "stops": [{"save_at": [6]}, {"save_epoch_end": [0]}]},
    # hidden 64: bitsandbytes' CPU inference path (the validation passes) needs in_features >= its block size 64
    "qlora": {"hidden": 64, "plugins": [{"peft": {**LORA, "load_in_4bit": True}}], "stops": [{"save_at": [5]}]},
}


def main(argv: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from resume_fit import fit, record, stop_and_resume

    out = Path(argv[0])
    results: dict[str, Any] = {}
    for name, spec in MP_SCENARIOS.items():

        def make(hidden: int = spec["hidden"]) -> torchloom.TaskModule:
            return LoraTask(n=16, hidden=hidden)

        a = fit(make, out / name / "a", spec["plugins"])
        results[name] = []
        for i, stop in enumerate(spec["stops"]):
            b, c = stop_and_resume(make, out / name / f"bc{i}", spec["plugins"], **stop)
            results[name].append({"stop": stop, **record(a, b, c)})
    # The plugin against the adapter written by hand, under DDP: parameters, optimizer state and history.
    from resume_fit import _plain, snapshot

    hand = fit(lambda: HandLoraTask(n=16, hidden=32), out / "hand", [])
    plugin = fit(lambda: LoraTask(n=16, hidden=32), out / "plugin", [{"peft": LORA}])
    results["by_hand"] = {
        "hand": snapshot(hand.engine),
        "plugin": snapshot(plugin.engine),
        "hand_history": _plain(list(hand.engine.history)),
        "plugin_history": _plain(list(plugin.engine.history)),
        "hand_ids": hand.probe.ids,
        "plugin_ids": plugin.probe.ids,
    }
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_initialized() else 0
    results["rank"], results["world_size"] = rank, dist.get_world_size() if dist.is_initialized() else 1
    (out / f"result-{rank}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
