"""Copied to ``mutants/src/`` by tools/mutation/session.py, so that every Python process a test starts while mutmut
runs (a CLI subprocess, a torchrun launcher and its workers) imports it at start-up: those processes find the
mutated ``torchloom`` there, through the ``PYTHONPATH`` the session sets or that a test builds from
``torchloom.__file__``.

It matters only in mutmut's stats run (``MUTANT_UNDER_TEST=stats``), where each mutated function records that it was
called. mutmut records into the memory of the process that runs pytest, and in another process its recorder fails (it
reads the mutmut settings from ``pyproject.toml`` in the working directory, which a test's subprocess usually runs
outside of). Here the recorder appends the function's name to the file named by ``TORCHLOOM_MUTATION_HITS`` instead,
which tools/mutation/subprocess_hits.py reads after each test: a test that reaches a function only in a subprocess is
then selected for that function's mutants too. In every other mode this file does nothing.
"""

from __future__ import annotations

import os

if os.environ.get("MUTANT_UNDER_TEST") == "stats":
    try:
        import mutmut.mutation.trampoline as _trampoline
    except ImportError:  # a process of another interpreter: nothing to record
        pass
    else:
        _hits_file = os.environ.get("TORCHLOOM_MUTATION_HITS")
        _seen: set[str] = set()

        def _record_in_file(name: str, caller: str | None = None) -> None:
            if _hits_file is None or name in _seen:
                return
            _seen.add(name)
            try:
                fd = os.open(_hits_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError:  # a process that cannot write there (a test's child that dropped to another user)
                return
            try:
                os.write(fd, f"{name}\n".encode())  # one short append: lines of several processes do not mix
            finally:
                os.close(fd)

        _trampoline.record_trampoline_hit = _record_in_file
