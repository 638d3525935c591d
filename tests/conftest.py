"""Test configuration: offline, deterministic, and no plugin is enabled unless a test enables it."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch):
    """No test leaks TORCHLOOM_* variables into another, nor the progress-bar variables the ``torchloom`` command
    sets for its process (`torchloom.quiet_libraries`) when a test runs it in this one."""
    for var in ("TORCHLOOM_PLUGINS", "TORCHLOOM_TRACE_HOOKS"):
        monkeypatch.delenv(var, raising=False)
    for var in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):  # kept, restored afterwards
        if var in os.environ:
            monkeypatch.setenv(var, os.environ[var])
        else:
            monkeypatch.delenv(var, raising=False)
