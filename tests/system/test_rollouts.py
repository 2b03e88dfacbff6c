"""Programs per prompt end to end (fleetgen/rollouts, workers/rollouts.py): real workers, a real
Redis killed and restarted, the simulator answering every call.

- 2,000 prompts × a three-call rollout (draft, critique, revise) over two GPUs, one worker
  killed with -9 mid-job and Redis restarted: every prompt's result exported once, and the calls
  the servers got are 3 × the prompts plus at most what the killed worker had in flight;
- a rollout that asks another call when run again fails those prompts alone, "rollout changed
  at call k", and the others are answered;
- a rollout whose code raises for every prompt pauses the job by the failure breaker, its
  exception named;
- a worker with another version of the rollout's module refuses the job's batches, saying so,
  and the other worker does the job.

The figures (slot use against a plain asyncio program, a tool loop's) are in tests/perf/
rollouts.py; nothing here asserts a time or a rate of the machine.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen.jobview import job_status
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from launcher.services import RedisServer, S3Server
from tests.stack import ROOT, Stack, chat_rows
from tests.system.test_door import paused
from tests.system.test_flow_control import QUICK, enqueue, exactly_once, exported, sim_stats

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

# The workers import the tests' rollouts (tests/rollout_flows.py) from the repository.
FLOWS_ENV = {"PYTHONPATH": str(ROOT)}
SERVER = (*QUICK, "--max-running-requests", "16")
PROMPTS = 2000


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[tuple[Stack, RedisServer]]:
    """A stack on its own Redis (restarted by the test) and S3."""
    redis_server = RedisServer(data_dir=tmp_path / "redis").start()
    s3_server = S3Server(data_dir=tmp_path / "s3").start()
    stack = Stack(tmp_path, {"REDIS_URL": redis_server.url, **s3_server.env()})
    try:
        yield stack, redis_server
    finally:
        stack.close()
        s3_server.stop()
        redis_server.stop()


def _requests(urls: list[str]) -> int:
    return sum(int(sim_stats(url)["requests"]) for url in urls)


def _in_flight_limit(log: str) -> int:
    """The worker's cap on requests in flight, from its ready line."""
    return int(log.split("requests in flight up to ", 1)[1].split(" ", 1)[0])


def test_three_call_rollouts_survive_a_worker_kill_and_a_redis_restart_exactly_once(
        own_stack: tuple[Stack, RedisServer], tmp_path: Path) -> None:
    stack, redis_server = own_stack
    urls = [stack.sim(f"sim{gpu}", *SERVER)[1] for gpu in (0, 1)]
    workers = {gpu: stack.worker(gpu, urls[gpu], FLOWS_ENV) for gpu in (0, 1)}
    limit = _in_flight_limit(workers[1].log_path.read_text())
    rows = chat_rows(PROMPTS, prefix="r")
    enqueue(stack, tmp_path, "revise", rows, "--rollout", "tests.rollout_flows:revise",
            "--batch-size", "50")
    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])

    def share_done(share: float) -> bool:
        status = job_status(ledger, "revise")
        return status.done + status.failed >= share * PROMPTS

    wait_until(lambda: share_done(0.25), 300, what="a quarter of the rollouts done")
    held = sim_stats(urls[1])
    in_flight = int(held["running"]) + int(held["waiting"])
    workers[1].kill()
    workers[1] = stack.worker(1, urls[1], FLOWS_ENV, name="gpu1r")
    wait_until(lambda: share_done(0.5), 300, what="half of the rollouts done")
    redis_server.kill()
    redis_server.restart()
    status = wait_job_done_quietly(stack, "revise", timeout=600)
    lines = exported(stack, tmp_path, "revise")
    exactly_once(lines, rows)
    failures = [x for x in lines if "error" in x]
    assert status.failed == 0 and not failures, failures[:3]
    assert all(x["calls"] == 3 and x["result"]["draft"] and x["result"]["critique"]
               and x["content"] == x["result"]["content"] for x in lines)
    # Every call journaled before the kill was answered from the journal, not asked again: the
    # servers got 3 calls a prompt, and what the killed worker had in flight (at most its cap).
    extra = _requests(urls) - 3 * PROMPTS
    assert 0 <= extra <= limit, (extra, in_flight, limit)

    # A rollout that asks another call when run again: the prompts it was in the middle of at
    # the kill fail alone, with the call named; the rest are answered.
    rows = chat_rows(300, prefix="u")
    enqueue(stack, tmp_path, "unstable", rows, "--rollout", "tests.rollout_flows:unstable",
            "--batch-size", "100")
    # Mid-batch (100 prompts a batch): rollouts of it are between their calls at the kill.
    wait_until(lambda: job_status(ledger, "unstable").checkpointed >= 30, 300,
               what="rollouts of the unstable job done")
    workers[0].kill()
    workers[1].kill()
    stack.worker(0, urls[0], FLOWS_ENV, name="gpu0r")
    status = wait_job_done_quietly(stack, "unstable", timeout=300)
    lines = exported(stack, tmp_path, "unstable")
    exactly_once(lines, rows)
    changed = [x for x in lines if "error" in x]
    assert changed, "no rollout was caught in the middle by the kill"
    assert {x["error"]["code"] for x in changed} == {"rollout_changed"}
    assert all(x["error"]["message"].startswith("rollout changed at call 1:") for x in changed)
    assert status.failed == len(changed) < len(rows)


def wait_job_done_quietly(stack: Stack, job: str, timeout: float) -> Any:
    from tests.stack import wait_job_done

    return wait_job_done(stack, job, timeout=timeout)


def test_a_rollout_that_raises_for_every_prompt_pauses_the_job_naming_its_exception(
        stack: Stack, tmp_path: Path) -> None:
    _, url = stack.sim("sim0", *SERVER)
    stack.worker(0, url, FLOWS_ENV)
    enqueue(stack, tmp_path, "crash", chat_rows(200), "--rollout", "tests.rollout_flows:crashes")
    status = paused(stack, "crash", timeout=300)
    assert status.reason.startswith("failures:"), status.reason
    assert "rollout_error: KeyError" in status.reason, status.reason
    assert status.failed < 200
    screen = stack.producer("status", "crash").stdout
    assert "KeyError" in screen, screen


def test_a_worker_with_another_version_of_the_rollout_refuses_the_jobs_batches(
        stack: Stack, tmp_path: Path) -> None:
    # The other version: the same module name, another source, first on the worker's path.
    other = tmp_path / "other"
    (other / "tests").mkdir(parents=True)
    (other / "tests" / "__init__.py").write_text("")
    source = (ROOT / "tests" / "rollout_flows.py").read_text()
    (other / "tests" / "rollout_flows.py").write_text(source + "\n# another version\n")
    shutil.copy(ROOT / "tests" / "__init__.py", other / "tests" / "__init__.py")
    _, url0 = stack.sim("sim0", *SERVER)
    _, url1 = stack.sim("sim1", *SERVER)
    stray = stack.worker(1, url1, {"PYTHONPATH": f"{other}:{ROOT}"})
    rows = chat_rows(120)
    enqueue(stack, tmp_path, "versions", rows, "--rollout", "tests.rollout_flows:revise")
    wait_until(lambda: "is another version than the job's" in stray.log_path.read_text(), 120,
               what="the stray worker refusing the job")
    assert sim_stats(url1)["requests"] == 0
    screen = stack.producer("status", "versions").stdout
    assert "another version than the job's" in screen, screen
    stack.worker(0, url0, FLOWS_ENV)
    status = wait_job_done_quietly(stack, "versions", timeout=300)
    lines = exported(stack, tmp_path, "versions")
    exactly_once(lines, rows)
    assert status.failed == 0
    assert {x["worker"] for x in lines} == {"gpu0@test"}
    assert sim_stats(url1)["requests"] == 0
    time.sleep(0)
    assert orjson.loads(stack.producer("status", "versions", "--json").stdout)["state"] == "done"


# The thinking model of the reference job: at a 512-token cap 87% of answers are thinking
# alone, cut at the cap with no content (docs/development/simulator.md).
THINKING = ("--mean-output-tokens", "1800", "--output-sigma", "0.6", "--decode-tps", "2000",
            "--speed", "50", "--max-running-requests", "32")
# Every answer calls a tool until two results are in.
TOOLS = (*SERVER, "--tool-call-rate", "1", "--max-tool-turns", "2")


def test_the_shipped_rollouts_end_to_end(stack: Stack, tmp_path: Path) -> None:
    _, thinking = stack.sim("sim0", *THINKING)
    _, tools = stack.sim("sim1", *TOOLS)
    stack.worker(0, thinking, FLOWS_ENV)
    stack.worker(1, tools, FLOWS_ENV)
    reask = [{"id": f"t{i:04d}", "prompt": f"Explain topic {i} at length."} for i in range(300)]
    enqueue(stack, tmp_path, "reask", reask, "--queue", "gpu0", "--max-tokens", "512",
            "--rollout", "fleetgen.rollouts:retry_unusable")
    sums = [{"id": f"s{i:03d}", "prompt": f"What is {i} plus {2 * i}?"} for i in range(60)]
    enqueue(stack, tmp_path, "tools", sums, "--queue", "gpu1",
            "--rollout", "tests.rollout_flows:tools")
    judged = chat_rows(60, prefix="j")
    enqueue(stack, tmp_path, "judge", judged, "--queue", "gpu1", "--keep-calls",
            "--rollout", "fleetgen.rollouts:BestOfN", "--rollout-options", '{"n": 3}')
    texts = [{"id": f"d{i:02d}", "prompt": " ".join(
        f"Sentence {k} of document {i} says something worth translating." for k in range(60))}
        for i in range(20)]
    enqueue(stack, tmp_path, "chunks", texts, "--queue", "gpu1",
            "--rollout", "fleetgen.rollouts:Chunked", "--rollout-options", '{"size": 1000}')
    for job in ("reask", "tools", "judge", "chunks"):
        assert wait_job_done_quietly(stack, job, timeout=400).failed == 0, job

    # The reference job's failure, re-asked: usable answers for (nearly) every prompt, and
    # status says how many rollouts needed more than one call.
    lines = exported(stack, tmp_path, "reask")
    exactly_once(lines, reask)
    usable = [x for x in lines if x["result"]["usable"] and x["content"].strip()]
    assert len(usable) >= 0.99 * len(reask), len(usable)
    reasked = sum(1 for x in lines if x["calls"] > 1)
    assert reasked >= 0.8 * len(reask)
    screen = stack.producer("status", "reask").stdout
    assert "rollouts  fleetgen.rollouts:retry_unusable: 300 ended, 0 running" in screen, screen
    status = orjson.loads(stack.producer("status", "reask", "--json").stdout)["rollouts"]
    assert status["by_calls"].get("1", 0) == len(reask) - reasked
    assert sum(status["by_calls"].values()) == len(reask)

    # Tools really executed: each tool message holds the sum of the arguments the model gave.
    lines = exported(stack, tmp_path, "tools")
    exactly_once(lines, sums)
    for line in lines:
        messages = line["result"]["messages"]
        calls = {c["id"]: orjson.loads(c["function"]["arguments"])
                 for m in messages for c in m.get("tool_calls") or []}
        results = [m for m in messages if m["role"] == "tool"]
        assert len(results) == 2 == line["result"]["tool_calls"], messages
        for result in results:
            args = calls[result["tool_call_id"]]
            assert result["content"] == str(args["a"] + args["b"])
        assert line["content"] == f"The tool returned: {results[-1]['content']}."

    # Best of three, judged: the chosen candidate is the answer; every call kept.
    parquet = tmp_path / "judge.parquet"
    stack.producer("export", "judge", "--to", str(parquet), "--format", "parquet")
    import pyarrow.parquet as pq

    table = pq.read_table(parquet).to_pylist()
    assert len(table) == len(judged)
    for row in table:
        result, trajectory = orjson.loads(row["result"]), orjson.loads(row["trajectory"])
        assert result["judged"] and 1 <= result["chosen"] <= 3
        assert row["content"] == result["candidates"][result["chosen"] - 1]
        assert row["calls"] == len(trajectory) == 4
        assert "BEST:" in trajectory[-1]["request"]["messages"][-1]["content"]
    openai = tmp_path / "judge-openai.jsonl"
    stack.producer("export", "judge", "--to", str(openai), "--format", "openai")
    body = orjson.loads(openai.read_bytes().splitlines()[0])["response"]["body"]
    assert body["calls"] == 4 and body["result"]["judged"]

    # A long text in pieces of at most 1,000 characters, the answers stitched in order.
    lines = exported(stack, tmp_path, "chunks")
    exactly_once(lines, texts)
    assert all(x["result"]["pieces"] >= 3 and x["calls"] == x["result"]["pieces"]
               for x in lines)
