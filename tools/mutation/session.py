"""Mutation testing of the modules a change touches (``nox -s mutation``; CONTRIBUTING.md says when and how).

    python tools/mutation/session.py [--base REV] [--tests PATH ...] [--max-children N] [--fresh] [--list]
                                     [MODULE.py ...]

The modules: the ones given, else the Python modules under src/torchloom and plugins/torchloom_plugins that differ
from where this branch left ``--base`` (``origin/main`` if it exists, else ``main``), uncommitted edits and new
files included. mutmut (configured in pyproject.toml's ``[tool.mutmut]``) mutates only those, records in one stats
run over the tests (``--tests``, default: the whole suite) which tests call each mutated function, then runs for
each mutant only the tests that call its function. At the end the score of each module (killed / total) and every
mutant that no test killed are printed, with its diff, and written to build/mutation/report.md and report.json.

How mutmut is fitted to this repository:

- mutmut names a module by its path under ``src/``; the built-in plugins live in ``plugins/``. While the session
  runs, ``src/torchloom_plugins`` is a link to ``plugins/torchloom_plugins`` (git-ignored, removed at the end), and
  ``[tool.mutmut] source_paths`` names both packages under ``src/``, so ``mutants/src`` holds a copy of each,
  imported as ``torchloom`` and ``torchloom_plugins``.
- ``PYTHONPATH`` starts with ``mutants/src``, so the processes that tests start (the CLI in a subprocess, torchrun
  workers) import the mutated copies too, and see the mutant under test (mutmut sets ``MUTANT_UNDER_TEST`` in the
  environment they inherit). ``mutants/src/sitecustomize.py`` and the ``subprocess_hits`` pytest plugin (both in
  this folder) carry the functions those processes call in the stats run back to the test that started them.
- Every run tests every mutant of the chosen modules again (they are named to ``mutmut run``), so the score is never
  a stale cached one; the stats run is reused while the modules, their source and the test selection are the same
  (mutmut adds tests that are new since then on its own; ``--fresh`` starts from nothing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
#: repository folder of each package -> the folder mutmut sees it under (its module names come from ``src/...``)
PACKAGES = {"src/torchloom": "src/torchloom", "plugins/torchloom_plugins": "src/torchloom_plugins"}
LINK = ROOT / "src" / "torchloom_plugins"
MUTANTS = ROOT / "mutants"
REPORT = ROOT / "build" / "mutation"
#: the session's own record of what the cached stats run was collected for
SELECTION = MUTANTS / "torchloom-mutation-selection.json"
#: mutmut's verdicts that count as caught (a timeout: the mutant made the tests hang)
CAUGHT = {"killed", "timeout", "caught by type check", "segfault"}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def default_base() -> str:
    for rev in ("origin/main", "main"):
        probe = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True
        )
        if probe.returncode == 0:
            return rev
    raise SystemExit("mutation: neither origin/main nor main exists; name a base revision with --base REV")


def changed_modules(base: str) -> list[str]:
    """The package modules that differ from the merge base of ``base`` and HEAD, in the working tree."""
    try:
        fork_point = git("merge-base", base, "HEAD").strip()
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"mutation: no merge base of {base!r} and HEAD: {exc.stderr.strip()}") from None
    folders = list(PACKAGES)
    changed = git("diff", "--name-only", "--diff-filter=d", fork_point, "--", *folders).split()
    new = git("ls-files", "--others", "--exclude-standard", "--", *folders).split()
    return sorted({path for path in changed + new if path.endswith(".py")})


def mutmut_path(path: str) -> str:
    """``plugins/torchloom_plugins/x.py`` -> ``src/torchloom_plugins/x.py``; a core path stays as it is."""
    for folder, seen_as in PACKAGES.items():
        if path.startswith(folder + "/"):
            return seen_as + path[len(folder) :]
    raise SystemExit(f"mutation: {path} is not a module of src/torchloom or plugins/torchloom_plugins")


def module_name(path: str) -> str:
    """``src/torchloom/data/__init__.py`` -> ``torchloom.data``: the prefix of its mutants' names."""
    dotted = mutmut_path(path).removeprefix("src/").removesuffix(".py").replace("/", ".")
    return dotted.removesuffix(".__init__")


def normalise(path: str) -> str:
    resolved = (Path.cwd() / path).resolve()
    try:
        relative = resolved.relative_to(ROOT).as_posix()
    except ValueError:
        raise SystemExit(f"mutation: {path} is outside the repository") from None
    if not relative.endswith(".py") or not resolved.is_file():
        raise SystemExit(f"mutation: {path} is not a Python file")
    mutmut_path(relative)  # in one of the packages
    return relative


def link_plugins() -> bool:
    """Make ``src/torchloom_plugins`` -> ``../plugins/torchloom_plugins``; whether this call made it."""
    if LINK.is_symlink():
        return False
    if LINK.exists():
        raise SystemExit(f"mutation: {LINK} exists and is not the session's link; move it away")
    LINK.symlink_to(Path("..") / "plugins" / "torchloom_plugins", target_is_directory=True)
    return True


def prepare_cache(paths: list[str], tests: list[str], fresh: bool) -> None:
    """Make ``mutants/`` safe to reuse for this selection.

    mutmut keeps a module's mutated copy while its source is older than the copy, and copies a module it does not
    mutate over its mutated one: a module mutated by an earlier run but not by the last one would look mutated while
    it is a plain copy. So the chosen modules are always generated again, no other module keeps mutation results, and
    the stats run is collected again when the modules, their source or the tests differ from those it was made for.
    """
    if fresh:
        shutil.rmtree(MUTANTS, ignore_errors=True)
        return
    if not MUTANTS.is_dir():
        return
    for meta in MUTANTS.rglob("*.py.meta"):
        meta.unlink()
    for path in paths:
        for suffix in ("", ".spans"):
            (MUTANTS / (mutmut_path(path) + suffix)).unlink(missing_ok=True)
    selection = {
        "modules": {path: hashlib.sha256((ROOT / path).read_bytes()).hexdigest() for path in paths},
        "tests": tests,
    }
    previous = json.loads(SELECTION.read_text()) if SELECTION.is_file() else None
    if previous != selection:
        (MUTANTS / "mutmut-stats.json").unlink(missing_ok=True)
    SELECTION.write_text(json.dumps(selection, indent=2))


def run_mutmut(paths: list[str], tests: list[str] | None, max_children: int) -> None:
    """``mutmut run --max-children N <the chosen modules' mutants>``, with ``only_mutate`` = the chosen modules."""
    os.environ["PYTHONPATH"] = os.pathsep.join([str(MUTANTS / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    from mutmut.__main__ import cli
    from mutmut.configuration import config
    from mutmut.state import state
    from mutmut.workers.isolation import ForkServerRunner

    submit = ForkServerRunner.submit

    def fastest_first(runner: ForkServerRunner, name: str, tests: list[str], cpu: int, estimate: float) -> None:
        # mutmut hands the fork server a mutant's tests in no order; pytest -x stops at the first failure, so a
        # mutant that a quick test kills need not wait for a torchrun test
        durations = state().duration_by_test
        submit(runner, name, sorted(tests, key=lambda test: (durations.get(test, 0.0), test)), cpu, estimate)

    ForkServerRunner.submit = fastest_first  # type: ignore[method-assign]
    cfg = config()  # pyproject.toml's [tool.mutmut], read once; mutmut and its forked workers use this object
    cfg.only_mutate = [mutmut_path(path) for path in paths]
    if tests is not None:
        cfg.pytest_add_cli_args_test_selection = tests
    (MUTANTS / "src").mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "sitecustomize.py", MUTANTS / "src" / "sitecustomize.py")
    names = [f"{module_name(path)}.{kind}*" for path in paths for kind in ("x_", "xǁ")]
    cli(["run", "--max-children", str(max_children), *names], standalone_mode=False)


def mutants_of(path: str) -> dict[str, str]:
    """mutant name -> mutmut's verdict, for one chosen module (empty: it has no mutants)."""
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.stats import status_by_exit_code

    data = SourceFileMutationData(path=mutmut_path(path))
    data.load()
    return {name: status_by_exit_code[code] for name, code in sorted(data.exit_code_by_key.items())}


def diff_of(name: str, path: str) -> str:
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    return get_diff_for_mutant(name, path=mutmut_path(path)).replace(mutmut_path(path), path)


def report(paths: list[str], seconds: float, base: str | None, tests: list[str] | None) -> dict[str, object]:
    modules = {}
    for path in paths:
        verdicts = mutants_of(path)
        counts = Counter(verdicts.values())
        caught = sum(n for status, n in counts.items() if status in CAUGHT)
        modules[path] = {
            "module": module_name(path),
            "caught": caught,
            "total": len(verdicts),
            "counts": dict(sorted(counts.items())),
            "not_caught": {
                name: {"status": status, "diff": diff_of(name, path)}
                for name, status in verdicts.items()
                if status not in CAUGHT
            },
        }
    return {
        "base": base,
        "tests": tests or "the default selection of [tool.mutmut]",
        "seconds": round(seconds),
        "modules": modules,
    }


def changed_lines(diff: str) -> str:
    """The changed lines of a mutant's diff, ``-old`` / ``+new``, on one line."""
    lines = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    return " / ".join(" ".join(line.split()) for line in lines)


def markdown(result: dict[str, object]) -> str:
    modules = result["modules"]
    assert isinstance(modules, dict)
    minutes, seconds = divmod(int(result["seconds"]), 60)  # type: ignore[call-overload]
    out = [
        "# Mutation score",
        "",
        f"Base: {result['base'] or 'modules given by hand'}; tests: {result['tests']}; {minutes} min {seconds} s.",
        "",
        "| module | caught / total | score | verdicts |",
        "| --- | --- | --- | --- |",
    ]
    for path, m in modules.items():
        score = f"{100 * m['caught'] / m['total']:.0f} %" if m["total"] else "no mutants"
        verdicts = ", ".join(f"{status} {n}" for status, n in m["counts"].items())
        out.append(f"| {path} | {m['caught']} / {m['total']} | {score} | {verdicts} |")
    for path, m in modules.items():
        if not m["not_caught"]:
            continue
        out += ["", f"## {path}: not caught", ""]
        for name, mutant in m["not_caught"].items():
            out += [f"- `{name}` ({mutant['status']}): `{changed_lines(mutant['diff'])}`"]
        out += ["", "```diff", *[mutant["diff"] for mutant in m["not_caught"].values()], "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="modules to mutate (default: those changed since --base)")
    parser.add_argument("--base", help="git revision to compare with (default: origin/main, else main)")
    parser.add_argument("--tests", nargs="+", help="the tests of the stats run (default: [tool.mutmut]'s selection)")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1, help="mutants tested at once")
    parser.add_argument("--fresh", action="store_true", help="remove mutants/ first (no cached stats run)")
    parser.add_argument("--list", action="store_true", help="print the modules it would mutate, and stop")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    if args.modules and args.base:
        parser.error("give modules or --base, not both")
    base = None if args.modules else (args.base or default_base())
    paths = [normalise(p) for p in args.modules] if args.modules else changed_modules(base or "")
    if not paths:
        print(f"mutation: no module of src/torchloom or plugins/torchloom_plugins differs from {base}")
        return 0
    print("mutation: mutating", *paths, sep="\n    ")
    if args.list:
        return 0
    tests = [t.rstrip("/") for t in args.tests] if args.tests else None
    start = time.monotonic()
    signal.signal(signal.SIGTERM, stop)  # a timeout or kill: mutmut stops its workers, the link is removed
    made_link = link_plugins()
    try:
        prepare_cache(paths, tests or [], args.fresh)
        run_mutmut(paths, tests, args.max_children)
        result = report(paths, time.monotonic() - start, base, tests)
    finally:
        if made_link:
            LINK.unlink()
    REPORT.mkdir(parents=True, exist_ok=True)
    (REPORT / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (REPORT / "report.md").write_text(text)
    print("\n" + text)
    print(f"mutation: written to {(REPORT / 'report.md').relative_to(ROOT)} and report.json")
    unchecked = sum(m["counts"].get("not checked", 0) for m in result["modules"].values())  # type: ignore[attr-defined]
    if unchecked:
        print(f"mutation: stopped before the end: {unchecked} mutant(s) not checked")
        return 1
    return 0


def stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
