"""Noise the user did not cause stays out of output that is not a terminal (`torchloom.utils.quiet_libraries`): the
progress bars of datasets, transformers and huggingface_hub (``\\r`` lines of kilobytes in a log file), the ANSI codes
of transformers' load report, bitsandbytes' import-time line about the optional ``kernels`` package, and
transformers' ``use_cache`` note under gradient checkpointing. A library the user configured is left alone.

The end-to-end test runs a real ``torchloom fit`` (a datasets ``map`` and ``save_to_disk``, a GPT-2 loaded with a new
head, gradient checkpointing, 8-bit AdamW, the model saved) with stdout and stderr piped, as a log file gets them.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torchloom

ROOT = Path(__file__).resolve().parents[1]
#: Variables a caller's environment may hold that decide what the run prints: removed, so the test decides.
OUTPUT_VARIABLES = (
    "HF_DATASETS_DISABLE_PROGRESS_BARS",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "DATASETS_VERBOSITY",
    "TRANSFORMERS_VERBOSITY",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS",
    "NO_COLOR",
    "FORCE_COLOR",
    "TTY_COMPATIBLE",
    "TTY_INTERACTIVE",
    "CI",
)

NOISY_TASK = '''
import datasets
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

import torchloom


class Reviews(torchloom.DataModule):
    """2000 rows through datasets' map and save_to_disk, as a data step does (a bar each)."""

    def __init__(self, path: str):
        self.path = path

    def prepare_data(self):
        rows = datasets.Dataset.from_dict({"n": list(range(2000))})
        rows = rows.map(lambda b: {"ids": [[n % 50] * 8 for n in b["n"]]}, batched=True, batch_size=10, desc="Ids")
        rows.save_to_disk(self.path)

    def setup(self, stage):
        ids = torch.tensor(datasets.load_from_disk(self.path)["ids"][:8])
        self.data = TensorDataset(ids, ids[:, 0] % 2)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)


class Classifier(torchloom.TaskModule):
    """A GPT-2 body loaded with a new classification head (a load report: the head is missing)."""

    def __init__(self, body: str):
        super().__init__()
        self.net = transformers.GPT2ForSequenceClassification.from_pretrained(body, num_labels=2)

    def configure_model(self):
        return self.net

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss
'''


def _write_run(tmp_path: Path) -> Path:
    """The task module, a saved tiny GPT-2 body and the config of the noisy fit; returns the config."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, pad_token_id=0, bos_token_id=0, eos_token_id=0
    )
    body = tmp_path / "body"
    transformers.GPT2Model(config).save_pretrained(body)
    (tmp_path / "noisy_task.py").write_text(NOISY_TASK)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        textwrap.dedent(
            f"""\
            engine: {{max_steps: 2, output_dir: {tmp_path / "runs"}, save_model: true, seed: 0}}
            task: {{class_path: noisy_task.Classifier, init_args: {{body: {body}}}}}
            data: {{class_path: noisy_task.Reviews, init_args: {{path: {tmp_path / "ids"}}}}}
            plugins:
              grad_checkpoint: {{modules: hf}}
              optimizer: {{name: adamw8bit, lr: 1.0e-3}}
            """
        )
    )
    return cfg


def _fit(cfg: Path, tmp_path: Path, **variables: str) -> str:
    """Run ``torchloom fit`` on ``cfg`` with stdout and stderr piped (no terminal); return both, stdout first, as
    written (``\r`` kept)."""
    env = {k: v for k, v in os.environ.items() if k not in OUTPUT_VARIABLES}
    env.update(variables, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "plugins"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "torchloom", "fit", "--config", str(cfg)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,  # bytes: text mode would turn every \r into a newline
        timeout=300,
    )
    out = (done.stdout + done.stderr).decode()
    assert done.returncode == 0, out
    return out


def _kernels_line_expected() -> bool:
    """Whether importing bitsandbytes here logs its line about ``kernels`` (its CPU backend does on AVX-512 BF16)."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16())


@pytest.mark.slow
def test_a_fit_whose_output_is_not_a_terminal_carries_no_library_noise(tmp_path):
    pytest.importorskip("bitsandbytes")
    cfg = _write_run(tmp_path)
    out = _fit(cfg, tmp_path)

    assert "\r" not in out  # no progress bar of datasets (map, save) or transformers (loading, writing shards)
    assert "\x1b[" not in out  # no colour codes: neither transformers' load report nor the summary table
    assert "kernels-community" not in out  # bitsandbytes' import-time line
    assert "use_cache" not in out  # transformers' note under gradient checkpointing
    # What the libraries say that matters still reaches the log, in plain text.
    assert "GPT2ForSequenceClassification LOAD REPORT from:" in out
    assert "score.weight" in out and "MISSING" in out
    assert "fit summary" in out and "torchloom fit: output in" in out


@pytest.mark.slow
def test_a_users_own_settings_of_the_libraries_are_left_alone(tmp_path):
    cfg = _write_run(tmp_path)
    out = _fit(cfg, tmp_path, HF_DATASETS_DISABLE_PROGRESS_BARS="0", TRANSFORMERS_VERBOSITY="info")

    lines = out.split("\n")
    assert any("\r" in line and "Ids" in line for line in lines)  # datasets' map bar, as datasets draws it
    assert any("\r" in line and "Loading weights" in line for line in lines)  # transformers' bar
    assert "loading configuration file" in out  # transformers at info verbosity


def test_bitsandbytes_is_imported_without_its_kernels_line_unless_asked_for_more(tmp_path):
    """The filter around the optimizer plugin's import drops that one line; at INFO the user sees it."""
    if not _kernels_line_expected():
        pytest.skip("bitsandbytes logs no kernels line on this CPU (no AVX-512 BF16)")
    code = (
        "import logging, sys\n"
        "if sys.argv[1] == 'info': logging.basicConfig(level=logging.INFO)\n"
        "from torchloom_plugins.optimizer import _import_bitsandbytes\n"
        "_import_bitsandbytes()\n"
        "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('a later warning passes')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "plugins")])}
    quiet, asked = (
        subprocess.run([sys.executable, "-c", code, level], capture_output=True, text=True, env=env, timeout=120)
        for level in ("default", "info")
    )
    assert "kernels-community" not in quiet.stderr and "a later warning passes" in quiet.stderr
    assert "kernels-community" in asked.stderr


# ------------------------------------------------------------------------------------------ in-process checks


@pytest.fixture
def plain_stderr(monkeypatch):
    """No variable that decides the output is set; stderr (pytest's capture) is not a terminal."""
    for variable in OUTPUT_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert not torchloom.utils.is_terminal(sys.stderr)


def test_is_terminal_follows_rich_and_its_overrides(monkeypatch):
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_INTERACTIVE", raising=False)
    with open(os.devnull, "w") as devnull:
        assert not torchloom.utils.is_terminal(devnull)
        monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich's override: treat the stream as a terminal
        assert torchloom.utils.is_terminal(devnull)


def test_quiet_libraries_turns_the_bars_off_for_the_block_and_back_on(plain_stderr):
    import datasets
    from huggingface_hub import utils as hub
    from transformers.utils import logging as hf_logging

    assert datasets.is_progress_bar_enabled() and hf_logging.is_progress_bar_enabled()
    with torchloom.utils.quiet_libraries():
        assert datasets.are_progress_bars_disabled()
        assert not hf_logging.is_progress_bar_enabled() and hub.are_progress_bars_disabled()
    assert datasets.is_progress_bar_enabled() and hf_logging.is_progress_bar_enabled()
    assert not hub.are_progress_bars_disabled()


def test_a_library_the_user_configured_keeps_its_bars(plain_stderr, monkeypatch):
    import datasets
    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "0")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "warning")
    with torchloom.utils.quiet_libraries():
        assert datasets.is_progress_bar_enabled() and hf_logging.is_progress_bar_enabled()
    monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS")
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY")
    hf_logging.set_verbosity_info()  # a verbosity chosen in code counts too
    try:
        with torchloom.utils.quiet_libraries():
            assert hf_logging.is_progress_bar_enabled()
            assert datasets.are_progress_bars_disabled()  # datasets was not configured
    finally:
        hf_logging.set_verbosity_warning()


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_colour_codes_are_stripped_from_transformers_records_only_inside_the_block(plain_stderr):
    collect = _Collect()
    loggers = [logging.getLogger("transformers.modeling_utils"), logging.getLogger("someone.else")]
    for logger in loggers:
        logger.addHandler(collect)
    report = "\x1b[1mGPT2Model LOAD REPORT\x1b[0m from: %s"
    try:
        with torchloom.utils.quiet_libraries():
            loggers[0].warning(report, "\x1b[31mbody\x1b[0m")
            loggers[1].warning("\x1b[1mkept\x1b[0m")
        loggers[0].warning("\x1b[1mafter\x1b[0m")
    finally:
        for logger in loggers:
            logger.removeHandler(collect)
    messages = [r.getMessage() for r in collect.records]
    assert messages == ["GPT2Model LOAD REPORT from: body", "\x1b[1mkept\x1b[0m", "\x1b[1mafter\x1b[0m"]


def test_the_command_quiets_libraries_it_has_not_imported_through_their_variables(plain_stderr):
    """A process that has imported neither library gets their variables, which they read when imported."""
    code = (
        "import sys, torchloom\n"
        "env = {}\n"
        "with torchloom.utils.quiet_libraries(env):\n"
        "    pass\n"
        "print(sorted(env.items()), 'datasets' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in OUTPUT_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "plugins")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == (
        "[('HF_DATASETS_DISABLE_PROGRESS_BARS', '1'), ('HF_HUB_DISABLE_PROGRESS_BARS', '1')] False"
    ), done.stderr
