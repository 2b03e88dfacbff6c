"""The checks a contributor relies on, run by the suite itself, so the one test command is the
one CI runs: the `e2e` marker on every test that starts processes of the system.

The import rules are checked by tests/test_layers.py (lint-imports) and the docs build by
tests/test_docs.py (mkdocs --strict).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.stack import Stack


def test_a_test_that_starts_a_worker_unmarked_e2e_fails_before_starting_it(tmp_path: Path) -> None:
    stack = Stack(tmp_path, {})
    with pytest.raises(AssertionError, match="mark it `pytest.mark.e2e`"):
        stack.worker(0, "http://127.0.0.1:9")
    with pytest.raises(AssertionError, match="mark it `pytest.mark.e2e`"):
        stack.sim("sim0")
    with pytest.raises(AssertionError, match="mark it `pytest.mark.e2e`"):
        stack.producer("jobs")
    assert stack.procs == []
