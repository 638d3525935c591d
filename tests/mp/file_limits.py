"""``file_size_limit``: a real write failure for tests (tests/test_atomic_writes.py and its torchrun script)."""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Files of this process cannot grow past ``limit`` bytes inside the block: the kernel refuses the write
    (``EFBIG``, "File too large"), as a full disk refuses it with ``ENOSPC``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
