"""torchloom._output at its edges: `is_terminal` on the stream it is given, colour stripping in nested and later
blocks and with non-string arguments, the record factory put back, and datasets' bars already off staying off."""

from __future__ import annotations

import io
import logging
import sys

import pytest

import torchloom
from torchloom._output import quiet_libraries

VARIABLES = (
    "HF_DATASETS_DISABLE_PROGRESS_BARS",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "DATASETS_VERBOSITY",
    "TRANSFORMERS_VERBOSITY",
    "NO_COLOR",
    "TTY_COMPATIBLE",
    "TTY_INTERACTIVE",
    "FORCE_COLOR",
    "CI",
)


class Tty(io.StringIO):
    """An in-memory stream that says it is a terminal (as a real one's ``isatty`` does)."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def plain(monkeypatch):
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert not torchloom.utils.is_terminal(sys.stderr)  # pytest's capture


def test_is_terminal_asks_about_the_stream_it_is_given(plain, monkeypatch) -> None:
    assert torchloom.utils.is_terminal(Tty()) and not torchloom.utils.is_terminal(io.StringIO())
    monkeypatch.setattr(sys, "stdout", Tty())
    assert torchloom.utils.is_terminal()  # by default: sys.stdout
    monkeypatch.setenv("TERM", "dumb")  # a terminal that cannot redraw a line: not interactive
    assert not torchloom.utils.is_terminal(Tty())


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_logger():
    collect, logger = _Collect(), logging.getLogger("transformers.test_output_edges")
    logger.addHandler(collect)
    try:
        yield logger, collect.messages
    finally:
        logger.removeHandler(collect)


def test_nested_blocks_strip_until_the_outer_one_ends_and_a_later_block_strips_again(plain, transformers_logger):
    logger, messages = transformers_logger
    factory = logging.getLogRecordFactory()
    with quiet_libraries():
        with quiet_libraries():
            logger.warning("\x1b[1minner\x1b[0m")
        logger.warning("\x1b[1mouter\x1b[0m")
    assert logging.getLogRecordFactory() is factory  # put back
    logger.warning("\x1b[1mafter\x1b[0m")
    with quiet_libraries():
        logger.warning("\x1b[1mlater\x1b[0m %s %d %r", "\x1b[31marg\x1b[0m", 3, None)
    assert messages == ["inner", "outer", "\x1b[1mafter\x1b[0m", "later arg 3 None"]
    assert logging.getLogRecordFactory() is factory


def test_datasets_bars_already_off_stay_off(plain) -> None:
    import datasets

    datasets.disable_progress_bars()
    try:
        with quiet_libraries():
            assert datasets.are_progress_bars_disabled()
        assert datasets.are_progress_bars_disabled()
    finally:
        datasets.enable_progress_bars()


def test_hub_bars_the_user_turned_off_stay_off_and_transformers_bars_come_back(plain) -> None:
    from huggingface_hub import utils as hub
    from transformers.utils import logging as hf_logging

    hub.disable_progress_bars()
    try:
        assert hf_logging.is_progress_bar_enabled()
        with quiet_libraries():
            assert hub.are_progress_bars_disabled() and not hf_logging.is_progress_bar_enabled()
        assert hub.are_progress_bars_disabled() and hf_logging.is_progress_bar_enabled()
    finally:
        hub.enable_progress_bars()
        hf_logging.enable_progress_bar()
