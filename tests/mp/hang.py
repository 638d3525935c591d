"""A launch that hangs (tests/test_multiprocess.py): each rank writes its pid to ``pid-<rank>``, ignores SIGTERM,
and sleeps far longer than the test's timeout."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a worker stuck in a collective may
out = Path(sys.argv[1])
(out / f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
print(f"rank {os.environ['RANK']} is waiting", flush=True)
time.sleep(600)
