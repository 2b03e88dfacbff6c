"""`launcher tune`'s steps: what a rollback restores and the smaller step after a failure.

tests/launcher/node/test_node.py runs tune against a simulated node during a job.
"""

from __future__ import annotations

import json
from pathlib import Path

from fleetgen.fleet import tuning
from fleetgen.ledger import Ledger
from launcher.node._rundir import NodeState, ServerEntry
from launcher.node._tune import previous_values, smaller_step
from launcher.node._tunelog import TuneLog, TuningNotes


def entry(*argv: str, slots: int = 80) -> ServerEntry:
    """GPU 0's node.json entry, as the file would have it."""
    gpu = {"gpu": 0, "argv": ["sglang", "serve", *argv],
           "capacity": {"mamba_slots": slots, "effective": 16}}
    return NodeState.from_json(json.dumps({"gpus": [gpu]})).gpus[0]


def test_a_rollback_restores_the_values_the_server_ran_with_given_or_resolved() -> None:
    candidate = ["--max-mamba-cache-size", "85", "--mem-fraction-static", "0.93"]
    before = previous_values(entry("--max-running-requests", "128"), candidate,
                             {"mem_fraction_static": 0.841})
    assert before == ["--max-mamba-cache-size", "80", "--mem-fraction-static", "0.841"]
    given = previous_values(entry("--mem-fraction-static", "0.9"), candidate, {})
    assert given == ["--max-mamba-cache-size", "80", "--mem-fraction-static", "0.9"]


def test_after_a_failure_the_next_candidate_is_halfway_until_nothing_is_left() -> None:
    before = ["--max-mamba-cache-size", "116"]
    assert smaller_step(["--max-mamba-cache-size", "285"], before) == ["--max-mamba-cache-size",
                                                                  "200"]
    assert smaller_step(["--max-mamba-cache-size", "117"], before) is None


def test_the_log_is_written_and_published_after_every_step(tmp_path: Path, ledger: Ledger) -> None:
    notes = TuningNotes(ledger)
    log = TuneLog(tmp_path / "tune.json", notes=notes)
    try:
        log.add("baseline", 0, tokens_per_s=1361.0)
    finally:
        notes.close()
    assert '"kind": "baseline"' in (tmp_path / "tune.json").read_text()
    assert [n.line for n in tuning(ledger)] == ["gpu0 baseline: 1,361 tokens/s"]
