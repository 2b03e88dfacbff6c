"""The worker's view of its server (workers/flow.py), on a test clock: the overload ceiling's
cut and growth, the resend budget, taking a server out of rotation, and what `status` is told."""

from __future__ import annotations

import asyncio

import pytest

from fleetgen.errors import OverloadedError, RetryableError
from fleetgen.fleet import ServerHealth
from workers.flow import (
    EJECT_AFTER,
    OVERLOAD_BACKOFF_MAX_S,
    Ceiling,
    Outcomes,
    Progress,
    RetryBudget,
    Rotation,
    ServerWatch,
    label,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_an_overload_cuts_the_ceiling_once_a_burst_and_quiet_seconds_grow_it_back() -> None:
    clock = Clock()
    ceiling = Ceiling(now=clock)
    assert ceiling.cut(in_flight=20, limit=24) == 18  # a tenth under what was in flight
    assert ceiling.good == 19  # what the server took when it first refused
    assert ceiling.cut(in_flight=18, limit=24) is None  # the same burst of refusals
    clock.t += 1.5
    assert ceiling.cut(in_flight=3, limit=24) == 2  # an outage: it took none of them
    assert not ceiling.grow(limit=24)  # an answer in the same second
    values = []
    while ceiling.value is not None:
        clock.t += 1.0
        ceiling.grow(limit=24)
        values.append(ceiling.value)
    # Doubling back to what the server took, then one more a second; lifted once it is the
    # limit.
    assert values == [4, 8, 16, 19, 20, 21, 22, 23, None]


def test_resends_are_a_fifth_of_first_tries_plus_one_a_second() -> None:
    clock = Clock()
    budget = RetryBudget(now=clock)
    budget.tokens = 0.0
    assert budget.take() == pytest.approx(1.0)  # the next token trickles in within a second
    for _ in range(10):
        budget.first_try()
    assert budget.take() == 0.0  # ten first tries earned two resends
    assert budget.take() == 0.0
    assert budget.take() > 0
    clock.t += 1.0
    assert budget.take() == 0.0


def test_a_server_answering_again_earns_its_backlog_back_doubling_each_round_trip() -> None:
    budget = RetryBudget(now=Clock())
    budget.sized(64)
    budget.tokens = 0.0
    out = 1  # the trickle's resend
    for _ in range(6):
        for _ in range(out):
            budget.answered()
        out = 0
        while budget.take() == 0.0:
            out += 1
    assert out == 64  # 1, 2, 4, ... up to the in-flight limit: the server's own pace


def test_a_server_a_probe_showed_working_gets_a_full_budget_for_the_prompts_resends() -> None:
    budget = RetryBudget(now=Clock())
    budget.sized(40)
    budget.tokens = 0.0
    budget.refill()
    assert sum(1 for _ in range(50) if budget.take() == 0.0) == 40


def test_failures_of_many_prompts_make_a_server_suspect_and_an_answer_resets_the_count() -> None:
    rotation = Rotation()
    for n in range(EJECT_AFTER - 1):
        assert not rotation.failed("HTTP 500", prompt=f"p{n}")
    rotation.answered()
    assert [rotation.failed("HTTP 500", prompt=f"q{n}") for n in range(EJECT_AFTER)] == \
        [False] * 4 + [True]
    # Suspect, not out: a probe decides (workers/healthcheck.py).
    assert rotation.in_rotation
    assert rotation.suspicion is not None and rotation.suspicion.startswith(
        "5 requests of 5 prompts failed in a row (HTTP 500)")
    rotation.eject(rotation.suspicion)
    assert not rotation.in_rotation
    delays = [rotation.next_probe_s() for _ in range(8)]
    assert all(1 <= d <= 10 for d in delays)
    rotation.rejoin()
    assert rotation.in_rotation and rotation.reason is None and rotation.ejections == 1


def test_one_prompt_failing_again_and_again_is_never_evidence_about_the_server() -> None:
    rotation = Rotation()
    assert not any(rotation.failed("HTTP 500", prompt="poison") for _ in range(50))
    rotation.answered()
    assert not any(rotation.failed("HTTP 500", prompt=f"p{n % 4}") for n in range(50))
    assert rotation.failed("HTTP 500", prompt="p4")  # a fifth prompt: now it may be the server


def test_a_probe_that_answers_clears_the_suspicion_and_the_next_needs_a_new_run() -> None:
    rotation = Rotation()
    assert [rotation.failed("HTTP 500", prompt=f"p{n}") for n in range(5)][-1]
    rotation.cleared()
    assert rotation.suspicion is None and rotation.checks_passed == 1
    assert [rotation.failed("HTTP 500", prompt=f"p{n}") for n in range(5)] == [False] * 4 + [True]


def test_only_an_answer_to_a_request_sent_after_a_prompts_first_try_clears_the_server() -> None:
    # At an outage's onset the requests already running still come back; they say nothing of
    # the server since a prompt's first try, which then asks a probe instead.
    rotation = Rotation()
    first_try_at = 100.0
    rotation.answered(sent_at=90.0)  # sent before, answered after the first try
    rotation.answered()  # a refusal: when it was sent is not known
    assert not rotation.newest_answered_sent > first_try_at
    rotation.answered(sent_at=101.0)
    assert rotation.newest_answered_sent > first_try_at
    rotation.answered(sent_at=95.0)  # a slow earlier request does not move it back
    assert rotation.newest_answered_sent == 101.0


def test_a_run_of_fast_failures_among_requests_still_running_keeps_the_server() -> None:
    # Two thirds answered, but the failures come back first: the run is not the server's
    # whole story while most of what was sent is still running.
    rotation = Rotation()
    assert not any(rotation.failed("HTTP 500", running=20, prompt=f"p{n}") for n in range(10))
    assert rotation.in_rotation
    # the rest failed too: it fails everything
    assert rotation.failed("HTTP 500", running=1, prompt="p10")


def test_progress_waits_many_usual_gaps_and_at_least_the_floor_before_a_hang_is_suspected() -> None:
    clock = Clock()
    progress = Progress(30.0, now=clock)
    assert progress.quiet_s(0) is None
    progress.sending(0)
    clock.t += 100
    # No reply yet since the server went busy: a first answer may take minutes.
    assert progress.quiet_s(40) == 100 and progress.stall_s() == 300
    for _ in range(50):
        clock.t += 0.5
        progress.replied(40)
    assert progress.stall_s() == 30  # 8 gaps of half a second are under the floor
    for _ in range(300):
        clock.t += 10
        progress.replied(40)
    assert progress.stall_s() == 80  # one reply every 10 s: 8 of those
    clock.t += 50
    assert progress.quiet_s(40) == 50
    progress.heard()
    assert progress.quiet_s(40) == 0
    progress.replied(0)  # idle: the next busy period starts over
    assert progress.quiet_s(0) is None


def test_a_healthy_server_keeps_only_the_last_ten_seconds_of_answers() -> None:
    clock = Clock()
    rotation = Rotation(now=clock)
    for _ in range(1000):
        rotation.answered()
        clock.t += 0.1
    assert len(rotation._answered) <= 101  # the window, not every answer ever


def test_outcomes_are_kept_for_the_window_only() -> None:
    clock = Clock()
    outcomes = Outcomes(window_s=60, now=clock)
    outcomes.add("failed", "HTTP 500")
    clock.t += 30
    outcomes.add("answered")
    assert outcomes.counts() == {("failed", "HTTP 500"): 1, ("answered", ""): 1}
    clock.t += 45
    assert outcomes.counts() == {("answered", ""): 1}


def test_a_refused_request_waits_for_retry_after_else_a_growing_jittered_backoff() -> None:
    watch = ServerWatch()
    told = OverloadedError("HTTP 429: full", status=429, retry_after_s=5.0)
    assert all(5.0 <= watch.overload_wait_s(told, 1) <= 5.5 for _ in range(20))
    untold = OverloadedError("HTTP 503: The request queue is full.", status=503)
    assert all(0 <= watch.overload_wait_s(untold, n) <= OVERLOAD_BACKOFF_MAX_S
               for n in range(1, 12))


def test_the_health_says_what_the_requests_met_by_cause() -> None:
    watch = ServerWatch()
    for _ in range(7):
        watch.answered(limit=16)
    watch.failed(RetryableError("HTTP 500: boom", status=500))
    watch.failed(RetryableError("server aborted the generation (finish_reason 'abort')"))
    watch.overloaded(OverloadedError("HTTP 429: full", status=429), in_flight=16, limit=16)
    health = watch.health(limit=8, limit_reason="probe")
    assert (health.answered, health.failed, health.overloaded) == (
        7, {"HTTP 500": 1, "aborted": 1}, {"HTTP 429": 1})
    assert health.failed_share == pytest.approx(2 / 9)
    assert health.limit_reason == "cut to 14 after HTTP 429 (server full)"
    assert health.summary()[0].startswith("22% of requests failed in the last 5 min")
    assert ServerHealth.quiet().summary() == []


def test_requests_are_named_by_status_or_by_what_ended_them() -> None:
    assert label(RetryableError("HTTP 502: Bad Gateway", status=502)) == "HTTP 502"
    assert label(RetryableError("POST /v1/chat/completions: timed out (ReadTimeout)")) == "timeout"
    assert label(RetryableError("POST /v1/chat/completions: connection lost")) == "reset"


def test_rotation_changes_wake_whoever_waits_for_them() -> None:
    async def run() -> None:
        rotation = Rotation()
        waiter = asyncio.create_task(rotation.changed.wait())
        await asyncio.sleep(0)
        rotation.eject("a probe failed")
        await asyncio.wait_for(waiter, 1)

    asyncio.run(run())
