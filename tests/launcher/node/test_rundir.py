"""The run directory's files as typed records: each written by its `to_json` and read back by
its `from_json` unchanged, and one restart followed through node.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.node._errors import NodeError
from launcher.node._restart import follow_restart
from launcher.node._rundir import (
    STATE_FILE,
    NodeState,
    ProcessEntry,
    Rejected,
    RestartRequest,
    Rollout,
    ServerEntry,
    TuneRecord,
    TuneStep,
    read_state,
    write_atomic,
)
from launcher.node._watch import Reading

READING = Reading(version="0.5.23", weights_gb=51.2, kv_tokens=500_000, mamba_slots=80,
                  max_total_num_tokens=500_000, context_length=262_144,
                  chunked_prefill_size=8192, cuda_graph_max_bs=256, requested=128, effective=16,
                  binding="mamba", reason="asked 128, got 16", concurrency=16)


def a_node() -> NodeState:
    server = ProcessEntry(name="gpu0", pid=41, state="ready", since=10.0, restarts=1,
                          log="/run/logs/sglang_gpu0.log", argv=("sglang", "serve", "--x", "1"))
    worker = ProcessEntry(name="worker0", pid=42, state="running", since=12.0,
                          log="/run/logs/worker_gpu0.log", argv=("celery",))
    tune = TuneRecord("done", ["--x", "2"], [
        TuneStep(at=1.0, kind="baseline", gpu=0, tokens_per_s=2325.0, note="16 running"),
        TuneStep(at=2.0, kind="rolled-out", gpu=(1, 2), flags=("--x", "2"))])
    return NodeState(run_dir="/run", log_dir="/run/logs", sim=True, workers=True,
                     started_at=1.5, sglang_version="0.5.23", supervisor_pid=40, updated_at=20.0,
                     gpus=(ServerEntry(0, server, gpus=(0,), port=30000,
                                       url="http://127.0.0.1:30000", ready_s=3.2,
                                       capacity=READING, peak_running=16, worker=worker),),
                     rollout=Rollout("r1", "done", gpus=(0,), done=(0,)), tune=tune)


def test_node_json_reads_back_as_it_was_written() -> None:
    state = a_node()
    assert NodeState.from_json(state.to_json()) == state
    data = json.loads(state.to_json())
    assert list(data["gpus"][0])[:6] == ["gpu", "gpus", "port", "url", "name", "pid"]
    assert "pid_alive" not in data["gpus"][0] and "supervisor_alive" not in data
    assert data["tune"]["steps"][0] == {"at": 1.0, "kind": "baseline", "gpu": 0,
                                        "tokens_per_s": 2325.0, "note": "16 running"}
    assert data["rollout"] == {"id": "r1", "state": "done", "rolling": True, "gpus": [0],
                               "done": [0], "current": None, "reason": None}


def test_a_rejection_before_any_restart_is_all_the_rollout_shows() -> None:
    rollout = Rollout(rejected=Rejected("r2", "GPU [7] not on this node"))
    state = NodeState(rollout=rollout)
    assert json.loads(state.to_json())["rollout"] == {
        "rejected": {"id": "r2", "reason": "GPU [7] not on this node"}}
    assert NodeState.from_json(state.to_json()).rollout == rollout


def test_restart_json_and_tune_json_read_back_as_written() -> None:
    request = RestartRequest("r3", rolling=False, args=("--x", "1"), gpus=(0, 2))
    assert RestartRequest.from_json(request.to_json()) == request
    assert json.loads(request.to_json()) == {"id": "r3", "rolling": False, "args": ["--x", "1"],
                                             "replace": False, "gpus": [0, 2], "profile": None,
                                             "gpu_args": None, "drain_s": None}
    tune = a_node().tune
    assert tune is not None and TuneRecord.from_json(tune.to_json()) == tune


def test_a_file_that_is_not_the_launchers_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a launcher file"):
        NodeState.from_json("[1, 2]")
    (tmp_path / STATE_FILE).write_text('{"gpus": 3}')
    with pytest.raises(NodeError, match="node.json: not a launcher file"):
        read_state(tmp_path)


def test_following_a_restart_ends_with_its_rejection_or_its_end(tmp_path: Path) -> None:
    write_atomic(tmp_path / STATE_FILE, NodeState(rollout=Rollout(
        "r4", "running", rejected=Rejected("r5", "restart r4 is still running"))).to_json())
    assert follow_restart(tmp_path, "r5", 5).state == "rejected"
    seen: list[Rollout] = []
    accepted = follow_restart(tmp_path, "r4", 5, seen.append, until_accepted=True)
    assert accepted.state == "running" and seen[-1].id == "r4"
    write_atomic(tmp_path / STATE_FILE, NodeState(rollout=Rollout(
        "r4", "failed", reason="GPU 0: exited")).to_json())
    assert follow_restart(tmp_path, "r4", 5).reason == "GPU 0: exited"
    assert follow_restart(tmp_path, "r4", 0.3).state == "failed"
    assert follow_restart(tmp_path, "r9", 0.3).state == "timed-out"
