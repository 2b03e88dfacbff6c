"""The checks a contributor relies on, run by the suite itself, so the one test command is the
one CI runs: ruff (the rule set in pyproject.toml's [tool.ruff.lint]), mypy strict, and the
`e2e` marker on every test that starts processes of the system.

The import rules are checked by tests/system/test_layers.py (lint-imports) and the docs build by
tests/system/test_docs.py (mkdocs --strict). Each tool comes from the venv running the tests.
A tool's run is marked `checks` (`-m checks` runs them alone, `-m "not checks"` leaves them
out); the marker rule below is a behaviour of tests/stack.py and stays unmarked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import ROOT, Stack


def tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)


@pytest.mark.checks
def test_ruff_finds_nothing_in_the_repository() -> None:
    done = run(tool("ruff"), "check", "--no-cache", "--output-format", "concise", ".")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.checks
def test_mypy_strict_finds_nothing_in_the_packages() -> None:
    done = run(tool("mypy"), "fleetgen", "workers", "producer", "launcher")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout


def test_a_test_that_starts_a_worker_unmarked_e2e_fails_before_starting_it(tmp_path: Path) -> None:
    stack = Stack(tmp_path, {})
    with pytest.raises(AssertionError, match="mark it `pytest.mark.e2e`"):
        stack.worker(0, "http://127.0.0.1:9")
    with pytest.raises(AssertionError, match="mark it `pytest.mark.e2e`"):
        stack.sim("sim0")
    with pytest.raises(AssertionError, match="mark it `pytest.mark.e2e`"):
        stack.producer("jobs")
    assert stack.procs == []
