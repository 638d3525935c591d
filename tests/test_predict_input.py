"""``torchloom predict --input FILE`` (issue 29, item 5): the raw rows of a JSON lines or CSV file, preprocessed as
the data module preprocesses its validation split, predicted in the file's order; every bad input is one error
line naming it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml

from cli_util import run_cli

PROJECT = '''
import torch

import torchloom
from torchloom.data import CachedDataModule, fingerprint, read_table, require_column


class Rows(CachedDataModule):
    """Columns a and b (and y, the target, in the training rows); preprocessing makes x = [a, 2 b]."""

    train_description = "a table with columns a, b and y"

    def __init__(self, train=None, validation=None, *, batch_size=3, cache_dir=None):
        super().__init__(train, validation, label_column=None, batch_size=batch_size, cache_dir=cache_dir)

    def read_split(self, split, source):
        return read_table(source, self.split_name(split))

    def cache_settings(self):
        return {"kind": "test.Rows", "data": {s: fingerprint(src) for s, src in self.sources().items()}}

    def preprocess(self, split, table):
        for column in ("a", "b"):
            require_column(table, column, "column", self.split_name(split))
        keep = ["x"] + (["y"] if "y" in table.column_names else [])
        return table.map(lambda row: {"x": [float(row["a"]), 2.0 * float(row["b"])]}).select_columns(keep)

    def format_split(self, dataset):
        return dataset.with_format("torch")


class Fit(torchloom.TaskModule):
    def configure_model(self):
        torch.manual_seed(0)
        return torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.model(batch["x"]).squeeze(-1), batch["y"].float())

    def predict_step(self, batch, batch_idx):
        return self.model(batch["x"]).squeeze(-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.01)
'''

ROWS = [{"a": 0.5 * i - 2, "b": (-1) ** i * 0.25 * i} for i in range(7)]  # 7 rows: batches of 3, 3, 1


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("predict_input")
    (root / "rows_project.py").write_text(PROJECT)
    train = [{"a": float(i), "b": float(i % 3), "y": 0.5 * i} for i in range(12)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    config = {
        "engine": {"max_epochs": 1, "output_dir": "runs", "save_model": True},
        "task": {"class_path": "rows_project.Fit"},
        "data": {
            "class_path": "rows_project.Rows",
            "init_args": {"train": "train.jsonl", "cache_dir": str(root / "cache")},
        },
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    done = run_cli("fit", "--config", "run.yaml", cwd=root)
    assert done.returncode == 0, done.stderr
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with open(root / "rows.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["a", "b"])
        writer.writeheader()
        writer.writerows(ROWS)
    return root


def _expected(project: Path) -> list[float]:
    from safetensors.torch import load_file

    weights = load_file(str(project / "runs" / "version_0" / "model" / "model.safetensors"))
    x = torch.tensor([[r["a"], 2.0 * r["b"]] for r in ROWS])
    return (x @ weights["weight"].T + weights["bias"]).squeeze(-1).tolist()


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.csv"])
def test_predict_input_gives_one_output_per_raw_row_in_the_files_order(project, name) -> None:
    done = run_cli("predict", "--config", "run.yaml", "--ckpt_path", "runs/version_0", "--input", name, cwd=project)
    assert done.returncode == 0, done.stderr
    assert "  batches = 3" in done.stdout  # 7 rows in batches of 3
    run_dir = project / done.stdout.split("torchloom predict: output in ")[1].split("\n")[0]
    lines = (run_dir / "predictions.jsonl").read_text().splitlines()
    got = [json.loads(line)["prediction"] for line in lines]
    assert got == pytest.approx(_expected(project), rel=1e-6)  # preprocessed as the data module does: x = [a, 2 b]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["input"] == name


def test_a_bad_input_is_one_error_line_naming_it(project) -> None:
    (project / "rows.txt").write_text("a,b\n1,2\n")
    (project / "no_b.jsonl").write_text('{"a": 1}\n')
    cases = [
        ("missing.jsonl", "predict: --input 'missing.jsonl': no such file; expected a file of raw rows: .jsonl, .json"),
        ("runs", "predict: --input 'runs' is a directory; expected a file of raw rows"),
        ("rows.txt", "predict: --input 'rows.txt' has the suffix '.txt'; expected a file of raw rows: .jsonl"),
        ("no_b.jsonl", "predict input 'no_b.jsonl': "),
    ]
    for name, message in cases:
        done = run_cli("predict", "--config", "run.yaml", "--input", name, cwd=project)
        assert done.returncode == 2, (name, done.stderr)
        assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert "'b'" in done.stderr  # the missing column is named


def test_predict_input_without_a_data_module_is_refused(project) -> None:
    config = yaml.safe_load((project / "run.yaml").read_text())
    del config["data"]
    (project / "nodata.yaml").write_text(yaml.safe_dump(config))
    done = run_cli("predict", "--config", "nodata.yaml", "--input", "rows.jsonl", cwd=project)
    assert done.returncode == 2
    assert "predict: --input 'rows.jsonl' needs a data module that preprocesses raw rows" in done.stderr
    assert "the config has no data module" in done.stderr
