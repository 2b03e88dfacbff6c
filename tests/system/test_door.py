"""What a worker makes of servers it was not built against, end to end: one door to the server
(workers/backend.py `Backend.send`) and one table of causes (fleetgen/causes.py), driven
against the simulator's misbehaviours (docs/development/simulator.md):

- a server that hangs (connections taken, /health 200, nothing answered; or headers and half a
  body, then silence): out of rotation as hung, its batches done by the other GPU, no attempt
  spent, status naming it; a warm shutdown beside a hung server ends within its grace;
- a job-wide refusal in each engine's words, request ids included: the job pauses within the
  failure breaker's streak instead of ending `done` with every prompt failed;
- TGI's words for prompts too long: they fail alone, the job never pauses;
- poison prompts (a 500 every time for them, answers for the rest): they fail alone after
  their tries, the server is never taken out;
- a burst of 500s, Anthropic's 529, a per-minute request budget: the job runs to the end,
  nothing failed, no attempt spent, the server never taken out, no probe spent on the budget.

The figures (time to finish beside a hung GPU, wall time against a plain asyncio client) are in
tests/perf/flow.py; nothing here asserts a time or a rate of the machine.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from fleetgen.jobview import JobStatus, job_status
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from tests.stack import Stack, chat_rows
from tests.system.test_flow_control import (
    QUICK,
    done_clean,
    done_never_paused,
    enqueue,
    exactly_once,
    exported,
    first_attempts_only,
    marked_rows,
    misbehave,
    sim_stats,
)

pytestmark = pytest.mark.e2e

# A hang is suspected after this much quiet (the usual gap between replies sets more).
HANG_ENV = {"FLEETGEN_HANG_AFTER_S": "3"}
# Answers of a few seconds: a hang strikes while many are in flight.
SLOW = ("--decode-tps", "40", "--mean-output-tokens", "80", "--speed", "1",
        "--max-running-requests", "16")


def paused(stack: Stack, job: str, timeout: float) -> JobStatus:
    """Wait until the job is paused with nothing running; fail if it ends done."""
    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])

    def paused_and_idle() -> bool:
        status = job_status(ledger, job)
        assert status.state != "done", f"the job ended done:\n{status}\n{stack.logs()}"
        return bool(status.state == "paused" and status.batches.running == 0)

    wait_until(paused_and_idle, timeout, what=f"job {job} paused by the failure breaker")
    return job_status(ledger, job)


@pytest.mark.parametrize("hang", ["chat", "partial"])
def test_a_hung_server_is_taken_out_and_its_batches_finish_on_the_other_gpu(
        stack: Stack, tmp_path: Path, hang: str) -> None:
    _, healthy = stack.sim("sim0", *SLOW)
    _, hung = stack.sim("sim1", *SLOW)
    stack.worker(0, healthy, HANG_ENV)
    worker = stack.worker(1, hung, HANG_ENV)
    rows = chat_rows(240)
    enqueue(stack, tmp_path, "hung", rows)
    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])
    wait_until(lambda: sim_stats(hung)["answered"] >= 10, 120, what="the second GPU under way")
    misbehave(hung, hang=hang)
    status = done_never_paused(stack, "hung", timeout=400)
    lines = exported(stack, tmp_path, "hung")
    exactly_once(lines, rows)
    assert status.failed == 0 and not any("error" in x for x in lines)
    # Abandoned requests go back with their batch at no attempt.
    first_attempts_only(lines)
    log = worker.log_path.read_text()
    assert "taken out of rotation: hung: " in log, worker.log()
    assert sim_stats(hung)["hung"] > 0
    screen = stack.producer("status", "hung").stdout
    assert "gpu1@test: out of rotation: hung: " in screen, screen
    row = next(r for r in orjson.loads(stack.producer("status", "hung", "--json").stdout)["fleet"]
               if r["worker"] == "gpu1@test")
    assert row["worker_state"] == "out-of-rotation"
    assert job_status(ledger, "hung").in_flight == 0


def test_a_warm_shutdown_beside_a_hung_server_hands_its_batch_back_within_the_grace(
        stack: Stack, tmp_path: Path) -> None:
    _, url = stack.sim("sim0", *SLOW)
    # A hang far longer than the grace: only the grace ends the wait.
    worker = stack.worker(0, url, {"FLEETGEN_HANG_AFTER_S": "600",
                                   "FLEETGEN_SHUTDOWN_GRACE_S": "3"})
    enqueue(stack, tmp_path, "stop", chat_rows(60))
    wait_until(lambda: sim_stats(url)["answered"] >= 5, 120, what="the job under way")
    misbehave(url, hang="chat")
    wait_until(lambda: sim_stats(url)["hanging"] >= 3, 60, what="requests hanging")
    os.kill(worker.pid, signal.SIGTERM)
    wait_until(lambda: not worker.alive(), 60, what="the worker gone after its grace")
    log = worker.log_path.read_text()
    assert "is stopping; batch stop/" in log and "handed back" in log, log
    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])
    status = job_status(ledger, "stop")
    assert status.failed == 0 and status.state == "running"


# (flags of the server, flags of the job, the code the failures carry)
JOB_WIDE = {
    # max_tokens above an 8,192-token server, in vLLM's words, every message with its own id.
    "vllm-max-tokens-with-ids": (("--flavor", "vllm", "--context-length", "8192",
                                  "--error-request-ids"), ("--max-tokens", "16384"),
                                 "max_tokens_too_large"),
    "sglang-max-tokens": (("--context-length", "8192"), ("--max-tokens", "16384"),
                          "max_tokens_too_large"),
    "tgi-max-new-tokens": (("--flavor", "strict", "--wording", "tgi", "--context-length", "8192"),
                           ("--max-tokens", "16384"), "max_tokens_too_large"),
    "openai-max-tokens": (("--flavor", "strict", "--wording", "openai", "--context-length",
                           "8192", "--error-request-ids"), ("--max-tokens", "16384"),
                          "max_tokens_too_large"),
}


@pytest.mark.parametrize("case", sorted(JOB_WIDE))
def test_a_refusal_every_prompt_meets_pauses_the_job_whatever_its_words(
        stack: Stack, tmp_path: Path, case: str) -> None:
    sim_flags, job_flags, code = JOB_WIDE[case]
    _, url = stack.sim("sim0", *QUICK, *sim_flags)
    stack.worker(0, url)
    # Lines with no max_tokens of their own: the job's applies to every one.
    rows = [{"id": f"w{i:04d}", "prompt": f"Question {i}."} for i in range(300)]
    enqueue(stack, tmp_path, "wide", rows, *job_flags)
    status = paused(stack, "wide", timeout=180)
    assert status.reason.startswith("failures: "), status.reason
    # The cause, quoted as repr quotes it (its message may hold either quote).
    assert f"failed with {code}: " in status.reason.replace('"', "").replace("'", ""), \
        status.reason
    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])
    failed = int(ledger.counters.stats("wide")["prompts_failed"])
    # The breaker's streak (20), and what was at the server when it tripped (its queue margin).
    assert 20 <= failed <= 40, failed


def test_prompts_too_long_in_tgis_words_fail_alone_and_never_pause_the_job(
        stack: Stack, tmp_path: Path) -> None:
    marker = "far too long"
    _, url = stack.sim("sim0", *QUICK, "--flavor", "strict", "--wording", "tgi",
                       "--fail-prompt", marker)
    stack.worker(0, url)
    # A dataset sorted by length: 25 too long in a row.
    rows = marked_rows(120, marker, range(40, 65))
    enqueue(stack, tmp_path, "tgi-long", rows)
    status = done_never_paused(stack, "tgi-long", timeout=240)
    assert (status.done, status.failed) == (95, 25)
    lines = exported(stack, tmp_path, "tgi-long")
    exactly_once(lines, rows)
    failures = [x for x in lines if "error" in x]
    assert sorted(x["custom_id"] for x in failures) == [f"q{i:04d}" for i in range(40, 65)]
    assert {x["error"]["code"] for x in failures} == {"context_length_exceeded"}
    assert all("`inputs` tokens + `max_new_tokens`" in x["error"]["message"] for x in failures)


def test_poison_prompts_fail_alone_after_their_tries_and_never_take_the_server_out(
        stack: Stack, tmp_path: Path) -> None:
    marker = "poison pill"
    _, url = stack.sim("sim0", *QUICK, "--poison", marker)
    worker = stack.worker(0, url)
    rows = marked_rows(300, marker, range(100, 160))
    enqueue(stack, tmp_path, "poison", rows)
    status = done_never_paused(stack, "poison", timeout=300)
    assert (status.done, status.failed) == (240, 60)
    lines = exported(stack, tmp_path, "poison")
    exactly_once(lines, rows)
    failures = [x for x in lines if "error" in x]
    assert {x["error"]["code"] for x in failures} == {"server_error"}
    assert {x["tries"] for x in failures} == {4}
    first_attempts_only(lines)
    assert "taken out of rotation" not in worker.log_path.read_text(), worker.log()
    # Each poison prompt was sent its four tries, no more.
    assert sim_stats(url)["poisoned"] == 60 * 4


def test_a_burst_of_500s_is_ridden_out_with_nothing_failed(
        stack: Stack, tmp_path: Path) -> None:
    _, url = stack.sim("sim0", "--decode-tps", "100", "--mean-output-tokens", "100",
                       "--speed", "2", "--max-running-requests", "16")
    stack.worker(0, url)
    rows = chat_rows(200)
    enqueue(stack, tmp_path, "burst", rows)
    wait_until(lambda: sim_stats(url)["answered"] >= 20, 120, what="the job under way")
    misbehave(url, status=500, seconds=8, scope="chat")
    done_clean(stack, tmp_path, "burst", rows, timeout=300)


def test_a_529_overloaded_server_is_waited_out_never_failed_nor_taken_out(
        stack: Stack, tmp_path: Path) -> None:
    _, url = stack.sim("sim0", *QUICK, "--max-running-requests", "16")
    worker = stack.worker(0, url)
    rows = chat_rows(200)
    enqueue(stack, tmp_path, "overloaded", rows)
    wait_until(lambda: sim_stats(url)["answered"] >= 20, 120, what="the job under way")

    def overloaded() -> bool:
        # 8 s of 529s, again if none of the job's requests met the last window (a stalled
        # machine): the test is of a server refusing requests, not of an idle window.
        if sim_stats(url)["refused"].get("529", 0) > 0:
            return True
        misbehave(url, status=529, seconds=8, scope="chat")
        return False

    wait_until(overloaded, 120, interval=9.0, what="requests refused with 529")
    done_clean(stack, tmp_path, "overloaded", rows, timeout=300)
    assert "taken out of rotation" not in worker.log_path.read_text(), worker.log()


def test_an_endpoint_with_a_request_budget_gets_no_timing_probes(
        stack: Stack, tmp_path: Path) -> None:
    _, url = stack.sim("sim0", *QUICK, "--flavor", "strict", "--rpm", "600")
    worker = stack.worker(0, url)
    rows = chat_rows(120)
    enqueue(stack, tmp_path, "budget", rows)
    done_clean(stack, tmp_path, "budget", rows, timeout=300)
    stats: dict[str, Any] = sim_stats(url)
    assert "has a request budget" in worker.log_path.read_text(), worker.log()
    # The prompts, their resends after a 429, and the probes before the budget was seen: no
    # probe a second for the job's length.
    assert stats["answered"] <= len(rows) + 3, stats


def router_stats(url: str) -> list[dict[str, Any]]:
    backends: list[dict[str, Any]] = httpx.get(f"{url}/router/stats", timeout=5).json()["backends"]
    return backends


def test_a_router_over_unequal_backends_is_sized_as_one_server_of_servers(
        stack: Stack, tmp_path: Path) -> None:
    slow = ("--decode-tps", "40", "--mean-output-tokens", "60", "--speed", "1")
    _, large = stack.sim("sim-large", *slow, "--max-running-requests", "32")
    _, small = stack.sim("sim-small", *slow, "--max-running-requests", "8")
    _, url = stack.router("router", [large, small], "--flavor", "sglang-router")
    worker = stack.worker(0, url)
    rows = chat_rows(600)
    enqueue(stack, tmp_path, "routed", rows)
    done_clean(stack, tmp_path, "routed", rows, timeout=400)
    log = worker.log_path.read_text()
    assert "(router" in log, worker.log()
    by_url = {b["url"]: b for b in router_stats(url)}
    # Sized by the router, not by its smaller backend: the large one was kept full.
    assert by_url[large]["peak_in_flight"] >= 32, by_url
    assert by_url[small]["answered"] > 0


def test_one_dead_backend_behind_a_router_never_takes_the_router_out(
        stack: Stack, tmp_path: Path) -> None:
    sim0, first = stack.sim("sim0", *QUICK, "--max-running-requests", "16")
    _, second = stack.sim("sim1", *QUICK, "--max-running-requests", "16")
    _, url = stack.router("router", [first, second])
    # Tries a second or more apart, as by default: the router's own health check drops the
    # dead backend within two seconds.
    worker = stack.worker(0, url, {"FLEETGEN_RETRY_BACKOFF_S": "1",
                                   "FLEETGEN_RETRY_BACKOFF_MAX_S": "4"})
    rows = chat_rows(300)
    enqueue(stack, tmp_path, "one-dead", rows)
    wait_until(lambda: sim_stats(first)["answered"] >= 30, 120, what="the job under way")
    sim0.kill()
    done_never_paused(stack, "one-dead", timeout=300)
    exactly_once(exported(stack, tmp_path, "one-dead"), rows)
    assert "taken out of rotation" not in worker.log_path.read_text(), worker.log()
    by_url = {b["url"]: b for b in router_stats(url)}
    assert not by_url[first]["alive"] and by_url[first]["failed"] > 0, by_url
