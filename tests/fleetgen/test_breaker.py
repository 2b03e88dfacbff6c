"""The failure breaker (fleetgen/breaker.py): a job whose prompts keep failing for one reason
pauses itself, and `resume` sends those prompts again.

Fast: the cause of a failure, the trip rules over synthetic windows, the record group feeding
the window (first copies only), the worker's judge, taking failures out of a checkpoint, and
`resume` on a tripped job, against the session Valkey and a folder sink. End to end (`e2e`): a
server refusing every prompt pauses its job within 50 failures, and once the server is fixed
`resume` sends them again and the export holds every prompt once, as an answer; the measured
figures are printed (`pytest -s`) as `breaker: ...`.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from fleetgen import keys
from fleetgen.breaker import Breaker, Limits, Trip, cause, outcome, verdict
from fleetgen.checkpoints import RECORD_GROUP, CheckpointWriter, Entry, Outcomes, group_arguments
from fleetgen.errors import JobError
from fleetgen.jobview import job_status
from fleetgen.ledger import STATE_PAUSED, STATE_RUNNING, Ledger
from fleetgen.liveledger import LiveLedger
from fleetgen.poll import wait_until
from fleetgen.records import (
    UNSENT_ATTEMPTS_EXHAUSTED,
    Origin,
    counters,
    error_record,
    result_record,
    written_counts,
)
from fleetgen.settings import Settings, SettingsError
from fleetgen.sink import open_sink
from producer import control
from producer.status import render
from tests.stack import Stack, make_job, write_jsonl
from workers.quality import TRIPPED_HOLD_S, QualityWatch

LIMITS = Limits(streak=20, window=50, share=0.9)
ORIGIN = Origin("http://127.0.0.1:30000", "gpu0@test", 1)
UNSERVED = "model_not_found: HTTP N: The model Q does not exist."
REFUSED = "invalid_request: HTTP N: tool_choice is not supported"


def unserved(pid: str, tokens: int = 41000) -> dict[str, Any]:
    """A refusal every server would give (a model none serves): the job's fault."""
    return error_record(pid, 1, f"HTTP 404: The model `m{tokens}` does not exist.", 404,
                        ORIGIN, 1)


def too_long(pid: str, tokens: int = 41000) -> dict[str, Any]:
    return error_record(pid, 1, f"The input ({tokens} tokens) is longer than the model's "
                        "context length (40960 tokens).", 400, ORIGIN, 1)


def refused(pid: str) -> dict[str, Any]:
    return error_record(pid, 1, "HTTP 400: tool_choice is not supported", 400, ORIGIN, 1)


def answer(pid: str) -> dict[str, Any]:
    response = {"choices": [{"finish_reason": "stop", "message": {"content": f"re {pid}"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
    return result_record(pid, 1, response, 0.1, ORIGIN)


def entry(job: str, batch: str, record: dict[str, Any]) -> Entry:
    """A finished prompt as batch.py checkpoints it."""
    return Entry(job, batch, record.get("custom_id") or record["id"], orjson.dumps(record),
                 counters(record, thinking=False), b"", outcome(record))


# The cause

def test_a_cause_is_the_code_and_the_message_with_its_numbers_as_n() -> None:
    assert outcome(unserved("p1", 41000)) == outcome(unserved("p2", 52017)) == UNSERVED
    assert cause("invalid_request", "HTTP 401: Unauthorized") == "invalid_request: HTTP N: Unauthorized"


def test_every_run_of_digits_reads_as_one_n_wherever_it_is() -> None:
    assert cause("server_error", "HTTP 500: worker gpu12@node7 lost 4096 of 40960 slots") == \
        "server_error: HTTP N: worker gpuN@nodeN lost N of N slots"


def test_a_cause_is_cut_to_200_characters() -> None:
    assert len(cause("server_error", "x" * 5000)) == 200


def test_a_prompts_own_failure_is_not_counted_however_many_come() -> None:
    # Too long for the context, refused for its content, or a server error of one prompt
    # while its server answered others: that prompt fails alone.
    assert outcome(too_long("p1")) is None
    policy = error_record("p2", 1, "HTTP 400: flagged by the content policy", 400, ORIGIN, 1)
    assert outcome(policy) is None
    one_500 = error_record("p3", 1, "HTTP 500: Failed to parse reasoning content", 500, ORIGIN, 4)
    assert outcome(one_500) is None
    assert outcome(unserved("p4")) == UNSERVED


def test_an_answer_is_an_empty_outcome_and_a_failure_never_sent_is_not_counted() -> None:
    assert outcome(answer("p1")) == ""
    unsent = error_record("p2", 1, "not sent: batch b000003 was started 6 times", None, ORIGIN,
                          0, code=UNSENT_ATTEMPTS_EXHAUSTED)
    assert outcome(unsent) is None


# The trip rules (outcomes newest first)

def test_twenty_failures_in_a_row_with_one_cause_trip_it() -> None:
    assert verdict([UNSERVED] * 20, LIMITS) == Trip(UNSERVED, 20, 20)
    assert verdict([UNSERVED] * 19 + ["", "", ""], LIMITS) is None


def test_an_answer_or_another_cause_among_the_newest_twenty_breaks_the_streak() -> None:
    assert verdict([UNSERVED] * 10 + [""] + [UNSERVED] * 10, LIMITS) is None
    assert verdict([UNSERVED] * 10 + [REFUSED] + [UNSERVED] * 10, LIMITS) is None


def test_one_cause_making_ninety_percent_of_a_full_window_trips_it() -> None:
    mixed = ([UNSERVED] * 9 + [""]) * 5  # never 20 in a row
    assert verdict(mixed, LIMITS) == Trip(UNSERVED, 45, 50)
    assert verdict([""] + mixed[1:], LIMITS) is None  # 44 of 50


def test_the_share_is_not_judged_before_the_window_is_full() -> None:
    assert verdict(([UNSERVED] * 9 + [""]) * 4 + [UNSERVED] * 9, LIMITS) is None  # 45 of 49


def test_a_streak_of_zero_turns_the_breaker_off() -> None:
    off = Limits(streak=0, window=50, share=0.9)
    assert verdict([UNSERVED] * 50, off) is None
    assert off.kept == 0 and LIMITS.kept == 50


def test_an_accepted_cause_never_trips_it_and_another_still_does() -> None:
    assert verdict([UNSERVED] * 50, LIMITS, accepted=[UNSERVED]) is None
    assert verdict([REFUSED] * 20 + [UNSERVED] * 30, LIMITS, accepted=[UNSERVED]) == \
        Trip(REFUSED, 20, 20)


def test_the_limits_are_settings_validated_at_start() -> None:
    settings = Settings.from_env({"FLEETGEN_BREAKER_STREAK": "5", "FLEETGEN_BREAKER_WINDOW": "8",
                                  "FLEETGEN_BREAKER_SHARE": "0.75"})
    assert Limits.of(settings) == Limits(5, 8, 0.75)
    assert Limits.of(Settings()) == LIMITS
    for bad in ({"FLEETGEN_BREAKER_SHARE": "1.5"}, {"FLEETGEN_BREAKER_SHARE": "0"},
                {"FLEETGEN_BREAKER_WINDOW": "0"}):
        with pytest.raises(SettingsError, match="FLEETGEN_BREAKER_"):
            Settings.from_env(bad)
    assert Settings.from_env({"FLEETGEN_BREAKER_STREAK": "0", "FLEETGEN_BREAKER_WINDOW": "0"})


# The window, fed by the checkpoint script

JOB = "brk"


def outcomes(r: Any, job: str = JOB) -> list[str]:
    return [x.decode() for x in r.lrange(keys.job_part(job, "outcomes"), 0, -1)]


def record_group(r: Any, entries: list[Entry], kept: int = 50) -> list[Any]:
    script_keys, args = group_arguments(JOB, entries, "gpu0@test", 7, 0, kept)
    return list(r.register_script(RECORD_GROUP)(keys=script_keys, args=args))


def test_the_record_group_pushes_an_outcome_for_each_first_copy_only(redis_client: Any) -> None:
    r = redis_client
    group = [entry(JOB, "b1", answer("p1")), entry(JOB, "b1", unserved("p2")),
             entry(JOB, "b1", answer("p1"))]
    assert record_group(r, group)[:4] == [-1, 1, 1, 0]
    assert record_group(r, [entry(JOB, "b1", unserved("p2")), entry(JOB, "b2", refused("p3"))]) \
        [:3] == [-1, 0, 1]
    assert outcomes(r) == [REFUSED, UNSERVED, ""]  # newest first; no copy twice


def test_a_group_with_a_new_failure_gets_the_window_back_and_no_other_group_does(
        redis_client: Any) -> None:
    r = redis_client
    r.hset(keys.job(JOB), mapping={"state": "running", "breaker_accepted": '["x"]'})
    assert record_group(r, [entry(JOB, "b1", answer("p1"))]) == [-1, 1]
    assert record_group(r, [entry(JOB, "b1", answer("p2")), entry(JOB, "b1", unserved("p3"))]) \
        == [-1, 1, 1, b"running", b'["x"]', UNSERVED.encode(), b"", b""]
    assert record_group(r, [entry(JOB, "b1", unserved("p3"))]) == [-1, 0]  # a re-run's copy


def test_the_window_keeps_the_newest_outcomes_and_nothing_when_the_breaker_is_off(
        redis_client: Any) -> None:
    r = redis_client
    record_group(r, [entry(JOB, "b1", unserved(f"p{i}")) for i in range(30)], kept=20)
    assert len(outcomes(r)) == 20
    unsent = error_record("p99", 1, "not sent", None, ORIGIN, 0, code=UNSENT_ATTEMPTS_EXHAUSTED)
    record_group(r, [entry(JOB, "b1", unsent)], kept=20)
    assert len(outcomes(r)) == 20 and outcomes(r)[0] == UNSERVED  # not counted
    r.flushdb()
    record_group(r, [entry(JOB, "b1", unserved("p1"))], kept=0)
    assert outcomes(r) == [] and r.hlen(keys.checkpoint(JOB, "b1")) == 1


class Judged:
    """The writer's failure judge: records each call's failed prompt ids and window size."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int]] = []

    async def __call__(self, job: str, failures: list[Entry], seen: Outcomes) -> None:
        self.calls.append(([e.prompt_id for e in failures], len(seen.window)))


def test_the_writer_calls_the_judge_only_after_a_group_with_a_new_failure(
        redis_url: str, redis_client: Any) -> None:
    async def body() -> list[tuple[list[str], int]]:
        r = aioredis.Redis.from_url(redis_url)
        judged = Judged()
        writer = CheckpointWriter(r, "gpu0@test", _no_canary, lambda job: 0, 0.0, judged, 50)
        try:
            await writer.add(entry(JOB, "b1", answer("p1")))
            await writer.add(entry(JOB, "b1", unserved("p2")))
            await writer.add(entry(JOB, "b1", unserved("p2")))  # a re-run's copy
            await asyncio.gather(*(writer.add(entry(JOB, "b1", x))
                                   for x in (answer("p3"), refused("p4"), unserved("p5"))))
        finally:
            await r.aclose()
        return judged.calls

    assert asyncio.run(body()) == [(["p2"], 2), (["p4", "p5"], 5)]


async def _no_canary(job: str, before: int, after: int) -> None:
    raise AssertionError("the canary is off")


# The worker's judge

def judge(redis_url: str, job: str, window: list[str], failures: list[dict[str, Any]],
          limits: Limits = LIMITS) -> list[str]:
    """Run Breaker.judge once on a window (newest first) as the record script returns it
    with the job's state; returns the jobs it held."""
    held: list[str] = []

    async def body() -> None:
        r = aioredis.Redis.from_url(redis_url)
        try:
            state, accepted = await r.hmget(keys.job(job), "state", "breaker_accepted")
            seen = Outcomes(state, accepted, [o.encode() for o in window])
            await Breaker(LiveLedger(r), limits, held.append).judge(
                job, [entry(job, "b000001", x) for x in failures], seen)
        finally:
            await r.aclose()

    asyncio.run(body())
    return held


def test_a_trip_pauses_the_job_with_the_cause_the_count_and_one_example(
        redis_url: str, redis_client: Any) -> None:
    ledger = Ledger(redis_client)
    make_job(ledger, JOB, "/tmp/unused")
    held = judge(redis_url, JOB, [UNSERVED] * 20, [refused("p7"), unserved("p8", 41234)])
    assert held == [JOB]
    state, reason = ledger.jobs.state(JOB)
    assert state == STATE_PAUSED
    assert reason.startswith(f"failures: 20 of the last 20 prompts failed with {UNSERVED!r}; ")
    assert f"python -m producer resume {JOB}" in reason and "--accept-failures" in reason
    breaker = job_status(ledger, JOB).breaker
    assert breaker is not None
    assert asdict(breaker) == {"cause": UNSERVED, "accepted": [], "example": {
        "id": "p8", "code": "model_not_found",
        "message": "HTTP 404: The model `m41234` does not exist."}}


def test_the_judge_leaves_a_job_alone_that_is_not_running_or_whose_window_is_healthy(
        redis_url: str, redis_client: Any) -> None:
    ledger = Ledger(redis_client)
    make_job(ledger, JOB, "/tmp/unused")
    assert judge(redis_url, JOB, [UNSERVED] * 19 + [""], [unserved("p1")]) == []
    ledger.jobs.set_state(JOB, "cancelled", "cancelled by user")
    assert judge(redis_url, JOB, [UNSERVED], [unserved("p2")]) == []
    assert ledger.jobs.state(JOB)[0] == "cancelled"


# Taking failures out of a checkpoint (ledger)

def test_dropping_failures_takes_back_their_counters_once_and_waits_for_no_lease(
        redis_client: Any) -> None:
    r, ledger = redis_client, Ledger(redis_client)
    record_group(r, [entry(JOB, "b1", x) for x in (answer("p1"), unserved("p2"), refused("p3"))])
    failed = [unserved("p2"), refused("p3")]
    r.set(keys.lease(JOB, "b1"), "gpu1@test/abc")
    assert ledger.batches.drop_failures(JOB, "b1", failed) is None
    assert r.hlen(keys.checkpoint(JOB, "b1")) == 3
    r.delete(keys.lease(JOB, "b1"))
    assert ledger.batches.drop_failures(JOB, "b1", failed) == 2
    assert ledger.batches.drop_failures(JOB, "b1", failed) == 0
    assert set(ledger.batches.checkpoint(JOB, "b1")) == {"p1"}
    stats = ledger.counters.stats(JOB)
    assert (stats["prompts_done"], stats["prompts_failed"]) == (1, 0)
    assert stats["error_invalid_request"] == 0
    assert float(r.hget(keys.job_part(JOB, "workers"), "gpu0@test|prompts_failed")) == 0


# resume after a trip

def tripped_job(ledger: Ledger, tmp_path: Path) -> None:
    """A job of 8 prompts that the breaker paused on UNSERVED: b000001 written (p0-p2 too long,
    p3 refused), b000002 handed back with p4 answered, p5-p6 too long and p7 unsent."""
    r = ledger.r
    output = str(tmp_path / "out")
    make_job(ledger, JOB, output, prompts=8, batch_size=4)
    sink = open_sink(output)
    for batch, first in (("b000001", 0), ("b000002", 4)):
        rows = [{"id": f"p{i}", "line": i + 1, "body": {"messages": []}} for i in range(first, first + 4)]
        sink.put(keys.sink_input(JOB, batch), b"".join(orjson.dumps(x) + b"\n" for x in rows))
    one = [unserved("p0"), unserved("p1", 50000), unserved("p2"), refused("p3")]
    two = [answer("p4"), unserved("p5"), unserved("p6")]
    record_group(r, [entry(JOB, "b000001", x) for x in one] + [entry(JOB, "b000002", x) for x in two])
    sink.put_new(keys.sink_errors(JOB, "b000001"), b"".join(orjson.dumps(x) + b"\n" for x in one))
    sink.put_new(keys.sink_result(JOB, "b000001"), b"")
    ledger.batches.finish_and_settle(JOB, "b000001", written_counts(one), "gpu0@test", [])
    r.hset(keys.job(JOB), mapping={
        "state": STATE_PAUSED, "reason": Trip(UNSERVED, 5, 5).reason(JOB),
        "breaker_cause": UNSERVED,
        "breaker_example": orjson.dumps({"id": "p6", "code": "context_length_exceeded",
                                         "message": "The input (41000 tokens) is longer"})})


def test_resume_sends_the_causes_failures_again_from_checkpoints_and_written_batches(
        redis_client: Any, celery_app: Any, tmp_path: Path) -> None:
    ledger = Ledger(redis_client)
    tripped_job(ledger, tmp_path)
    screen = render(job_status(ledger, JOB))
    assert "failures  the failure breaker paused the job; example:" in screen
    assert "p6: The input (41000 tokens) is longer (context_length_exceeded)" in screen
    assert f"python -m producer resume {JOB} --accept-failures" in screen

    resumed = control.resume(ledger, celery_app, JOB, wait_s=1)
    assert (resumed.cause, resumed.resent, resumed.accepted) == (UNSERVED, 5, False)
    assert ledger.jobs.state(JOB) == (STATE_RUNNING, "")
    # b000002 sends p5 and p6 again; p0-p2 go in a new batch; the refused p3 stays failed.
    assert set(ledger.batches.checkpoint(JOB, "b000002")) == {"p4"}
    assert ledger.jobs.batches(JOB)[-1] == "r01-000001"
    sink = open_sink(str(tmp_path / "out"))
    again = [orjson.loads(x)["id"] for x in
             (sink.get(keys.sink_input(JOB, "r01-000001")) or b"").splitlines()]
    assert again == ["p0", "p1", "p2"]
    written, stats, _, _ = ledger.counters.counts(JOB)
    assert (stats["prompts_failed"], written["prompts_failed"]) == (1, 1)
    # What is left is p3's refusal, of another cause.
    assert stats["error_invalid_request"] == written["error_invalid_request"] == 1
    assert outcomes(redis_client) == []
    status = job_status(ledger, JOB)
    assert status.breaker is None
    assert (status.failed, status.checkpointed) == (1, 1)


def test_resume_accept_failures_keeps_them_and_the_breaker_ignores_that_cause_after(
        redis_url: str, redis_client: Any, celery_app: Any, tmp_path: Path) -> None:
    ledger = Ledger(redis_client)
    tripped_job(ledger, tmp_path)
    resumed = control.resume(ledger, celery_app, JOB, accept_failures=True, wait_s=1)
    assert (resumed.cause, resumed.resent, resumed.accepted) == (UNSERVED, 0, True)
    assert set(ledger.batches.checkpoint(JOB, "b000002")) == {"p4", "p5", "p6"}
    assert ledger.jobs.batches(JOB) == ["b000001", "b000002"]
    assert job_status(ledger, JOB).breaker.accepted == [UNSERVED]
    assert "failures  accepted, not pausing the job: " + UNSERVED in render(job_status(ledger, JOB))
    assert judge(redis_url, JOB, [UNSERVED] * 50, [unserved("p9")]) == []
    assert judge(redis_url, JOB, [REFUSED] * 20, [refused("p10")]) == [JOB]


def test_resume_of_a_tripped_job_waits_for_its_running_batches_and_changes_nothing_meanwhile(
        redis_client: Any, celery_app: Any, tmp_path: Path) -> None:
    ledger = Ledger(redis_client)
    tripped_job(ledger, tmp_path)
    assert ledger.leases.acquire(JOB, "b000002", "gpu1@test/abc", ttl_s=60) == 1
    with pytest.raises(JobError, match=r"1 batches still run after 0s \(b000002\).*run resume "
                                       "again once `status` shows 0 running"):
        control.resume(ledger, celery_app, JOB, wait_s=0.3)
    assert ledger.jobs.state(JOB)[0] == STATE_PAUSED
    assert len(ledger.batches.checkpoint(JOB, "b000002")) == 3


def test_a_job_the_worker_paused_itself_stays_held_against_a_state_read_sent_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("workers.quality.time.monotonic", lambda: now[0])
    watch = QualityWatch(None)  # type: ignore[arg-type]
    watch.trip("j")
    watch.hold("j", False)  # a batch that read `running` before the pause reached Redis
    assert "j" in watch.held
    now[0] += TRIPPED_HOLD_S
    watch.hold("j", False)  # resumed since
    assert "j" not in watch.held


# End to end

# Two slots (the worker keeps 6 in flight), so that few prompts are at the server when the
# breaker trips: it stops what is not sent yet, not what the server already has.
SIM = ("--max-running-requests", "2", "--decode-tps", "100", "--mean-output-tokens", "100",
       "--speed", "100")
PROMPTS = 300
MARKER = "step by step"  # in every prompt below
FAULTS = {
    # A model no server serves: vLLM answers 404 to every prompt, failed at once. In batches of
    # 16 the trip comes as the second batch runs, whose prompts at the server fail too: both
    # are written, and resume sends their failures again in new batches (a requeue round).
    "wrong-model": (("--flavor", "vllm"), ("--model", "nosuch"), 16,
                    "model_not_found: HTTP N: The model Q does not exist.",
                    "HTTP 404: The model `nosuch` does not exist."),
}
# The fixed server serves the model the job names.
FIXED = ("--flavor", "vllm", "--served-model-name", "nosuch")


@pytest.mark.e2e
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_refusal_every_server_gives_pauses_the_job_and_resume_sends_them_again(
        stack: Stack, tmp_path: Path, fault: str) -> None:
    flags, job_flags, batch_size, cause_text, message = FAULTS[fault]
    sim, url = stack.sim("sim0", *SIM, *flags)
    port = int(url.rsplit(":", 1)[1])
    stack.worker(0, url)
    rows = [{"id": f"q{i:05d}", "prompt": f"Explain idea number {i} {MARKER}."}
            for i in range(PROMPTS)]
    src = write_jsonl(tmp_path / "prompts.jsonl", rows)
    stack.producer("enqueue", str(src), "--job", fault, "--output", str(tmp_path / "out"),
                   "--batch-size", str(batch_size), "--no-canary", *job_flags)
    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])

    def paused_and_idle() -> bool:
        s = job_status(ledger, fault)
        assert s.state != "done", "a job whose every prompt failed ended done"
        return bool(s.state == "paused" and s.batches.running == 0)

    try:
        wait_until(paused_and_idle, 120, what="job paused by the breaker")
    except TimeoutError:
        raise AssertionError(f"{job_status(ledger, fault)}\n{stack.logs()}") from None
    status = job_status(ledger, fault)
    failed = int(ledger.counters.stats(fault)["prompts_failed"])
    assert 20 <= failed <= 50, failed
    assert status.reason.startswith("failures: ")
    assert f"prompts failed with {cause_text!r}; fix the cause" in status.reason
    assert status.breaker is not None and status.breaker.example is not None
    example = status.breaker.example
    screen = stack.producer("status", fault, "--no-servers").stdout
    assert "[paused]  failures: " in screen, screen
    assert f"{example.id}: {message}" in screen, screen
    assert f"resume {fault} --accept-failures" in screen, screen

    # The server is fixed: the same port, without the fault.
    sim.stop()
    stack.sim("sim0-fixed", *SIM, *FIXED, port=port)
    out = stack.producer("resume", fault).stdout
    sent = re.search(r"sending again (\d+) prompts that failed with ", out)
    assert sent and cause_text in out, out
    print(f"\nbreaker: {fault}, batches of {batch_size}: paused after {failed} failed prompts "
          f"({status.failed} in written batches, {status.checkpointed} checkpointed); "
          f"resume sent {sent[1]} again")
    assert int(sent[1]) == failed

    try:
        wait_until(lambda: job_status(ledger, fault).state == "done", 120,
                   what="job done after resume")
    except TimeoutError:
        raise AssertionError(f"{job_status(ledger, fault)}\n{stack.logs()}") from None
    stack.producer("export", fault, "--to", str(tmp_path / "export.jsonl"))
    lines = [orjson.loads(x) for x in (tmp_path / "export.jsonl").read_bytes().splitlines()]
    assert [x.get("id") for x in lines] == [r["id"] for r in rows]
    assert not any("custom_id" in x for x in lines)
