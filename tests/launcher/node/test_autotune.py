"""`launcher up --tune`: the advice tried and kept by itself, one GPU at a time, while work waits.

The unit tests check the pieces tune adds on its own (more memory before a smaller step, the
status line); the end-to-end test starts `up --sim --tune` on two simulated GPUs started like
the reference run, keeps their queues full, and reads node.json until the tuning is done.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from launcher.node._commands import render_status
from launcher.node._rundir import NodeState, TuneRecord
from launcher.node._tune import MAX_MEM_FRACTION, TuneSettings, more_memory
from tests.launcher.node.test_node import (
    REFERENCE_SIM,
    Node,
    keep_busy,
    run_cli,
    start_node,  # noqa: F401 (the fixture, shared)
)

NOT_ENOUGH = "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static"


def test_a_candidate_that_lacked_memory_is_retried_with_more_before_a_smaller_step() -> None:
    flags = ["--max-mamba-cache-size", "500", "--mem-fraction-static", "0.93"]
    assert more_memory(flags, NOT_ENOUGH, "0.84") == ["--max-mamba-cache-size", "500",
                                                      "--mem-fraction-static", "0.95"]
    # a candidate that leaves the fraction alone starts from the server's own
    assert more_memory(["--max-mamba-cache-size", "500"], NOT_ENOUGH, "0.93") == [
        "--max-mamba-cache-size", "500", "--mem-fraction-static", "0.95"]


def test_more_memory_stops_at_the_ceiling_and_for_other_failures() -> None:
    top = ["--max-mamba-cache-size", "500", "--mem-fraction-static", str(MAX_MEM_FRACTION)]
    assert more_memory(top, NOT_ENOUGH, "0.93") is None
    assert more_memory(["--max-mamba-cache-size", "500"], NOT_ENOUGH, None) is None
    assert more_memory(["--mem-fraction-static", "0.9"], "CUDA out of memory", "0.9") is None


def test_tune_settings_scale_with_the_window() -> None:
    s = TuneSettings.for_window(6.0)
    assert (s.window_s, s.interval_s, s.warmup_s) == (6.0, 0.2, 1.0)
    assert TuneSettings.for_window(600.0).interval_s == 2.0


def test_launcher_status_shows_the_tuning_in_one_line() -> None:
    tune = {"state": "done", "chosen": ["--max-mamba-cache-size", "200"],
            "steps": [{"at": 0, "kind": "rolled-out", "gpu": [1, 2],
                       "flags": ["--max-mamba-cache-size", "200"]}]}
    line = TuneRecord.from_json(json.dumps(tune)).describe()
    assert line == ("tune: done, chosen `--max-mamba-cache-size 200`; last gpu[1, 2] "
                    "rolled-out `--max-mamba-cache-size 200`")
    state = {"supervisor_pid": 1, "supervisor_alive": True, "updated_at": 0, "gpus": [],
             "rollout": None, "tune": tune}
    assert line in render_status(NodeState.from_json(json.dumps(state)), now=0)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_up_with_tune_tunes_a_busy_reference_node_by_itself_one_gpu_at_a_time(
        start_node: Callable[..., Node]) -> None:  # noqa: F811 (the fixture imported above)
    server = (*REFERENCE_SIM, "--speed", "20", "--mean-output-tokens", "1500",
              "--output-sigma", "0.3", "--force-shutdown")
    n = start_node(2, "--tune", "--tune-window", "2", "--drain-timeout", "2",
                   "--stop-timeout", "2", server_args=server)
    out_at_once: list[int] = []

    def ready(s: dict[str, Any]) -> bool:
        out_at_once.append(sum(g["state"] != "ready" for g in s["gpus"]))
        return len(s["gpus"]) == 2 and all(g["state"] == "ready" for g in s["gpus"])

    state = n.wait(ready, 60, "both ready")
    assert (state.get("tune") or {}).get("state") in (None, "waiting")  # no work, no restart
    stop = threading.Event()
    for g in state["gpus"]:
        keep_busy(g["url"], g["capacity"]["effective"] * 4, stop)
    out_at_once.clear()
    try:
        def tuned(s: dict[str, Any]) -> bool:
            out_at_once.append(sum(g["state"] != "ready" for g in s["gpus"]))
            return (s.get("tune") or {}).get("state") == "done"

        state = n.wait(tuned, 400, "tuning done")
    finally:
        stop.set()
    tune = state["tune"]
    kinds = [s["kind"] for s in tune["steps"]]
    assert kinds[0] == "baseline" and "won" in kinds, kinds
    assert "rolled-out" in kinds and tune["chosen"][:1] == ["--max-mamba-cache-size"]
    assert max(out_at_once) == 1  # never two GPUs out at once
    assert all(g["capacity"]["effective"] > 16 for g in state["gpus"])  # both run the winner
    status = run_cli("status", "--run-dir", str(n.run_dir))
    assert TuneRecord.from_json(json.dumps(tune)).describe() in status.stdout
    assert "tune: gpu0 won" in n.output()  # logged by `up` itself
    assert json.loads(Path(n.run_dir / "tune.json").read_text())["state"] == "done"
    assert n.stop() == 0


def test_producer_status_says_when_servers_run_different_caps() -> None:
    import dataclasses

    from fleetgen.fleet import FleetRow
    from producer.status import render_fleet

    blank = {f.name: None for f in dataclasses.fields(FleetRow)}
    base = FleetRow(**{**blank, "worker": "gpu0@n1", "worker_state": "online",
                       "server_state": "up", "effective_max": 47, "requested_max": 128,
                       "job_prompts_done": 0, "job_prompts_failed": 0,
                       "job_output_tokens": 0})
    rows = [base, dataclasses.replace(base, worker="gpu1@n1", effective_max=16),
            dataclasses.replace(base, worker="gpu2@n1", effective_max=16)]
    assert render_fleet(rows)[-1] == ("  tuning: servers run different caps (16 on gpu1, gpu2; "
                                      "47 on gpu0): `launcher status` on their node names the "
                                      "flags")
    assert not any("tuning" in line for line in render_fleet(rows[1:]))


def test_producer_status_says_what_each_nodes_tuning_does(ledger: Any) -> None:
    from fleetgen.fleet import THIS_HOST, TUNING_SHOWN_S, TuningNote, tuning
    from fleetgen.poll import wait_until
    from launcher.node._rundir import TuneStep
    from launcher.node._tunelog import TuningNotes

    at = 1_000_000.0
    record = TuneRecord(chosen=[], steps=[
        TuneStep(at=at, kind="baseline", gpu=0, tokens_per_s=2300.0),
        TuneStep(at=at, kind="trying", gpu=0, flags=("--max-mamba-cache-size", "235"),
                 expected=0.571, until=at + 40),
        TuneStep(at=at, kind="trying", gpu=1, flags=("--max-mamba-cache-size", "230"),
                 expected=0.560, until=at + 40)])
    notes = TuningNotes(ledger, beat_s=0.05)
    try:
        notes.publish(record)
        running = read_note(ledger)
        assert tuning(ledger, now=running.updated) == [running]
        line = running.describe(at + 10)
        assert line == (f"tuning on {THIS_HOST}: running; gpu0 trying `--max-mamba-cache-size "
                        "235`, expected +57.1%; gpu1 trying `--max-mamba-cache-size 230`, "
                        "expected +56.0%, ~30 s left")
        # Done, it stays a while with the flags chosen, then leaves the status.
        record.state, record.chosen = "done", ["--max-mamba-cache-size", "230"]
        record.steps.append(TuneStep(at=at + 50, kind="rolled-out", gpu=(0, 2),
                                     flags=("--max-mamba-cache-size", "230")))
        notes.publish(record)
        # A finished tuning has nothing more to say.
        wait_until(lambda: not notes.beating, 10, what="the beats to stop")
    finally:
        notes.close()
    done = tuning(ledger, now=at + 60)[0]
    assert done.describe(at + 60).endswith("rolled-out `--max-mamba-cache-size 230` (chosen "
                                           "`--max-mamba-cache-size 230`)")
    assert tuning(ledger, now=at + 50 + TUNING_SHOWN_S + 1) == []
    assert TuningNote.from_json(done.to_json()) == done
    with pytest.raises(ValueError, match="not a tuning note"):
        TuningNote.from_json(b"{}")


def test_a_running_tunings_note_beats_while_its_tuner_lives_then_leaves_the_status(
        ledger: Any) -> None:
    from fleetgen import keys
    from fleetgen.fleet import LOST_AFTER_S, TUNING_SHOWN_S, tuning
    from fleetgen.poll import wait_until
    from launcher.node._rundir import TuneStep
    from launcher.node._tunelog import TuningNotes

    notes = TuningNotes(ledger, beat_s=0.05)
    record = TuneRecord(steps=[TuneStep(at=1_000_000.0, kind="baseline", gpu=0,
                                        tokens_per_s=1361.0)])
    ended = threading.Event()
    tuner = threading.Thread(target=lambda: (notes.publish(record), ended.wait(60)))
    tuner.start()
    try:
        wait_until(lambda: ledger.registry.tuning(), 10, what="the first note")
        first = read_note(ledger)
        wait_until(lambda: read_note(ledger).updated > first.updated, 10, what="a beat")
        assert notes.beating
    finally:
        ended.set()  # the tuner dies without a last word, as a killed `launcher tune`
        tuner.join()
    try:
        wait_until(lambda: not notes.beating, 10, what="the beats to stop with their tuner")
    finally:
        notes.close()
    last = read_note(ledger)
    assert (last.state, last.at) == ("running", 1_000_000.0)
    assert tuning(ledger, now=last.updated + LOST_AFTER_S) == [last]
    assert tuning(ledger, now=last.updated + LOST_AFTER_S + 1) == []
    # Redis forgets the notes too, once the last tuner has stopped writing.
    assert 0 < ledger.r.ttl(keys.TUNING) <= TUNING_SHOWN_S


def test_a_running_note_whose_tuner_does_not_beat_is_not_shown(ledger: Any) -> None:
    import time

    from fleetgen import keys
    from fleetgen.fleet import LOST_AFTER_S, TuningNote, tuning

    silent = TuningNote("n2", 1_000_000.0, time.time() - LOST_AFTER_S - 5, "running",
                        "gpu0 baseline: 1,361 tokens/s")
    ledger.r.hset(keys.TUNING, "n2", silent.to_json())
    # One that never says when its tuner last beat is no note at all.
    ledger.r.hset(keys.TUNING, "vm", b'{"node": "vm", "at": 1000000.0, "state": "running", '
                  b'"line": "gpu0 baseline: 1,361 tokens/s", "until": null}')
    assert tuning(ledger) == []


def test_a_tuning_note_that_cannot_reach_redis_costs_nothing_but_the_note(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.node._rundir import TuneStep
    from launcher.node._tunelog import TuningNotes

    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:9/0")  # nothing listens there
    notes = TuningNotes()
    record = TuneRecord(steps=[TuneStep(at=0.0, kind="baseline", gpu=0)])
    try:
        notes.publish(record)
    finally:
        notes.close()
    assert notes.failed_at is not None  # tried again after RETRY_S


def read_note(ledger: Any) -> Any:
    """This node's tuning note as Redis holds it."""
    from fleetgen.fleet import THIS_HOST, TuningNote

    return TuningNote.from_json(ledger.registry.tuning()[THIS_HOST])
