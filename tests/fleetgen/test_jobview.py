"""A job's figures (fleetgen/jobview.py `job_status`): counts, rates, clock and ETA, read from
what workers write through their own Lua script."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict

import pytest

from fleetgen import keys
from fleetgen.fleet import (
    FleetRow,
)
from fleetgen.jobview import JobStatus, job_status
from fleetgen.ledger import STATE_RUNNING, Ledger
from tests.job_figures import (
    FLEET_FIELDS,
    MINUTE,
    NOW,
    STABLE_FIELDS,
    Fleet,
    Worker,
    half_done_job,
    ledger_time,
    register,
    run_fleet,
)
from tests.stack import make_job


def test_status_counts_prompts_rates_eta_tokens_and_finish_reasons(ledger: Ledger) -> None:
    half_done_job(ledger)
    # The live worker holding b000007 has 4 requests at its server; a lost one's count does
    # not matter, nor does a worker's that holds none of the job's batches.
    register(ledger, "gpu0@a", "http://127.0.0.1:30000", in_flight=4, updated=NOW - 3)
    register(ledger, "gpu1@b", "http://127.0.0.1:30001", in_flight=9, updated=NOW - 300)
    register(ledger, "gpu2@c", "http://127.0.0.1:30002", in_flight=7, updated=NOW - 3)
    s = job_status(ledger, "half", NOW)
    # done and failed are what the sink holds; the 4 answers of the running batch are
    # checkpointed until it is written.
    assert (s.state, s.total, s.done, s.failed) == ("running", 100, 58, 2)
    assert (s.checkpointed, s.in_flight, s.in_hand, s.queued, s.held) == (
        4, 4, 6, 30, 0)
    assert asdict(s.batches) == {"total": 10, "done": 6, "running": 1, "queued": 3}
    # Started 600 s ago: 64 answered in 600 s; 24 in the last five minutes.
    assert s.elapsed_s == 600
    assert s.rate.prompts_per_s_all == pytest.approx(64 / 600, abs=1e-3)
    # The job went on in the last minute after 7 idle ones: its recent window starts there.
    assert s.rate.window_s == 60
    assert s.rate.prompts_per_s_5m == pytest.approx(24 / 60, abs=1e-3)
    # 22 of those 24 are answers of 100 tokens (2 were failures).
    assert s.rate.output_tokens_per_s_5m == pytest.approx(22 * 100 / 60, abs=0.1)
    assert s.rate.output_tokens_per_s_all == pytest.approx(62 * 100 / 600, abs=0.1)
    # 36 prompts are not answered yet, 4 of them in flight: 32 to send at the rate the fleet
    # answers now, then one mean answer time (0.5 s). 4 requests in flight answered in 0.5 s
    # each are 8 prompts/s, more than the window's 0.4.
    assert s.eta_s == math.ceil(32 / max(24 / 60, 4 / 0.5) + 0.5) == 5
    assert asdict(s.tokens) == {"input": 620, "output": 6200, "reasoning": 3720, "avg_output": 100.0,
                           "reasoning_share": 0.6}
    assert s.finish_reasons == {"length": 3, "stop": 59}
    assert s.errors == {"context_length_exceeded": 2}
    assert s.bytes_written == 6000
    assert s.workers["gpu0@a"]["prompts_done"] == 34 and s.workers["gpu1@b"]["prompts_failed"] == 2
    assert s.fleet is None and s.quality is None


def test_the_status_and_its_fleet_rows_carry_the_stable_fields() -> None:
    assert {f.name for f in dataclasses.fields(JobStatus)} == STABLE_FIELDS
    assert {f.name for f in dataclasses.fields(FleetRow)} == FLEET_FIELDS


def test_a_finished_job_reads_done_and_its_clock_stops_with_its_last_write(ledger: Ledger) -> None:
    make_job(ledger, "fin", "/tmp/out", prompts=20, created_at=NOW - 800)
    w = Worker(ledger, "gpu0@a")
    for i, minute in ((1, MINUTE - 12), (2, MINUTE - 11)):
        for _ in range(10):
            w.answer("fin", keys.batch_id(i), minute)
        w.finish_batch("fin", keys.batch_id(i), minute)
    later = job_status(ledger, "fin", NOW + 3600)
    assert later.state == "done" and later.eta_s == 0
    assert (later.done, later.checkpointed) == (20, 0)
    assert (later.queued, later.held, later.in_flight) == (0, 0, 0)
    # Started at NOW - 800, last batch written at the end of minute MINUTE - 11 (NOW - 600).
    assert later.elapsed_s == 200
    assert later.rate.prompts_per_s_all == pytest.approx(20 / 200, abs=1e-3)
    # The recent window ends with the clock: its first answers came in MINUTE - 12, so the
    # job's last two minutes, as read at its end.
    assert later.rate.window_s == 120
    assert later.rate.prompts_per_s_5m == pytest.approx(20 / 120, abs=1e-3)


def test_a_paused_jobs_clock_stops_at_the_pause_and_runs_again_once_resumed(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from producer.control import pause

    half_done_job(ledger)
    with ledger_time(monkeypatch, NOW + 100):
        pause(ledger, "half")
    assert job_status(ledger, "half", NOW + 3600).elapsed_s == 700
    # b000007, running at the pause, finishes its requests and is written after it (NOW + 120):
    # the clock stops at that write.
    w = Worker(ledger, "gpu0@a")
    for _ in range(6):
        w.answer("half", "b000007", MINUTE + 1)
    w.finish_batch("half", "b000007", MINUTE + 1)
    paused = job_status(ledger, "half", NOW + 3600)
    assert (paused.elapsed_s, paused.eta_s) == (720, None)
    # Resumed (what `resume` sets last): the clock runs from the job's start again, the paused
    # time included; nothing answered lately, so no ETA yet rather than a lifetime average.
    with ledger_time(monkeypatch, NOW + 3600):
        ledger.jobs.set_state("half", STATE_RUNNING)
    resumed = job_status(ledger, "half", NOW + 3630)
    assert (resumed.state, resumed.elapsed_s, resumed.eta_s) == ("running", 4230, None)


@pytest.mark.parametrize("after_s", [24, 30, 45, 70, 120, 600])
def test_eta_of_a_fleet_raising_its_concurrency_is_the_time_it_takes_at_its_rate_now(
    ledger: Ledger, after_s: int,
) -> None:
    # Answers of 20 s on 64 slots, the flow controller doubling from one slot every 4 s: the
    # window counts the 20 s before the first answer and the ramp (23x too long, as users saw).
    fleet = Fleet(prompts=3000, slots=64, answer_s=20.0, doubling_s=4.0)
    start = NOW - 5
    make_job(ledger, "ramp", "/tmp/out", prompts=3000, batch_size=100, created_at=start)
    run_fleet(ledger, "ramp", fleet, start, 0, 100, since=0, until=after_s)
    s = job_status(ledger, "ramp", start + after_s)
    left = max(fleet.answered) - after_s
    assert s.eta_s is not None and left / 1.5 <= s.eta_s <= left * 1.5, (s.eta_s, left)


@pytest.mark.parametrize("after_s", [30, 45, 60, 90])
def test_eta_after_a_rebuild_is_the_time_the_rest_takes_at_the_fleets_rate_now(
    ledger: Ledger, after_s: int,
) -> None:
    # The job ran an hour; Redis lost its data; `rebuild` put back what the sink holds (27,000
    # prompts written) and the workers went on at a second 40 of a minute, their concurrency
    # back at 128 after 28 s: the window counts the 20 s before the first answer.
    manifest = make_job(ledger, "lost", "/tmp/out", prompts=30000, batch_size=100,
                        created_at=NOW - 3600)
    written = 27000
    ledger.r.flushdb()
    ledger.rounds.restore(manifest, done=[keys.batch_id(i) for i in range(1, written // 100 + 1)],
                   rounds=[], last_round=0,
                   written={"prompts_done": written, "prompts_failed": 0},
                   live={"prompts_done": written, "latency_s": written * 20.0,
                         "output_tokens": written * 100.0, "finish_stop": written})
    fleet = Fleet(prompts=3000, slots=128, answer_s=20.0, doubling_s=4.0)
    went_on = NOW + 40
    run_fleet(ledger, "lost", fleet, went_on, written, 100, since=0, until=after_s)
    s = job_status(ledger, "lost", went_on + after_s)
    assert s.done == written
    left = max(fleet.answered) - after_s
    assert s.eta_s is not None and left / 1.5 <= s.eta_s <= left * 1.5, (s.eta_s, left)


@pytest.mark.parametrize("shared", [True, False], ids=["one-worker-runs-both", "a-worker-each"])
@pytest.mark.parametrize("after_s", [45, 120, 300])
def test_jobs_sharing_the_fleet_each_count_only_their_own_requests_in_flight_for_the_eta(
    ledger: Ledger, shared: bool, after_s: int,
) -> None:
    # Two jobs of 20 s answers, each getting 64 of the fleet's 128 slots: on one worker running
    # both jobs' batches side by side, or on a worker each. The registry counts each worker's
    # requests of every job (128 in all); each job answers at 64 / 20 s, not 128 / 20 s.
    fleet = Fleet(prompts=2000, slots=64, answer_s=20.0, doubling_s=4.0)
    start = NOW - 5
    for job, worker in (("one", "gpu0@a"), ("two", "gpu0@a" if shared else "gpu1@b")):
        make_job(ledger, job, "/tmp/out", prompts=2000, batch_size=100, created_at=start)
        run_fleet(ledger, job, fleet, start, 0, 100, since=0, until=after_s, worker=worker)
    if shared:
        register(ledger, "gpu0@a", "http://127.0.0.1:30000", updated=start + after_s - 1,
                 in_flight=2 * fleet.in_flight(after_s))
    left = max(fleet.answered) - after_s
    for job in ("one", "two"):
        s = job_status(ledger, job, start + after_s)
        assert s.in_flight == fleet.in_flight(after_s) == 64
        assert s.eta_s is not None and left / 1.5 <= s.eta_s <= left * 1.5, (job, s.eta_s, left)


def test_a_paused_jobs_recent_rate_is_the_one_it_was_paused_at(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from producer.control import pause

    half_done_job(ledger)  # its last minute: 24 answers, b000006 written at NOW
    with ledger_time(monkeypatch, NOW):
        pause(ledger, "half")
    rates = {(s.rate.window_s, s.rate.prompts_per_s_5m)
             for s in (job_status(ledger, "half", NOW + t) for t in (1, 90, 400, 3600))}
    assert rates == {(60, 0.4)}
