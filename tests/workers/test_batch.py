"""BatchRunner's order of effects (workers/batch.py), in process: a fake server client, a
folder sink and the real Valkey fixture.

Every prompt's record is in the checkpoint before anything is written; the errors object
before the results object; the batch is recorded done while its lease is still held, and the
lease given back last. A re-run resumes from the checkpoint or, once written, from the sink,
so no prompt is sent or counted twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import orjson
import pytest

from fleetgen import keys
from fleetgen.endpoints import Endpoint
from fleetgen.errors import (
    BadRequestError,
    OverloadedError,
    RetryableError,
    ServerDownError,
    ServerSickError,
)
from fleetgen.ledger import Batches, Jobs, Leases, Ledger
from fleetgen.poll import wait_until
from fleetgen.servers import KINDS, Server, parse_server_info
from fleetgen.settings import Settings
from fleetgen.sink import LocalSink, open_sink
from tests.stack import make_job
from workers.batch import BatchRunner
from workers.flow import PROBE_BACKOFF_S, PROBE_MIN_S
from workers.runtime import WorkerRuntime

JOB = "order"
BATCH = keys.batch_id(1)
PROMPTS = [f"p{i}" for i in range(6)]
BAD = "p3"  # the fake server refuses this one (HTTP 400): an errors object is written too


class FakeServer:
    """Stands in for workers.client.ServerClient: answers at once, refuses BAD, logs sends."""

    sent: ClassVar[list[str]] = []  # what the test reads: one list for every instance
    # The models `/v1/models` lists (SGLang's /server_info names none here).
    models: ClassVar[tuple[str, ...]] = ()
    # Errors raised for a prompt's tries before it is answered, in order.
    faults: ClassVar[dict[str, list[Exception]]] = {}
    # Raised for every request, probes included, while set.
    broken: ClassVar[Exception | None] = None
    # Each request as (prompt, n, seed): how a prompt's answers were asked.
    asked: ClassVar[list[tuple[str, int, int | None]]] = []
    # The kind the server is found to be, and whether it refuses `n` (as a 400).
    kind: ClassVar[str] = "sglang"
    refuses_n: ClassVar[bool] = False
    # Prompts whose request waits while listed (a long answer); /health fails while `down`.
    hold: ClassVar[set[str]] = set()
    down: ClassVar[bool] = False

    def __init__(self, base_url: str, **_: Any) -> None:
        self.base_url = base_url
        self.api_key: str | None = None
        # Only the registry's reading uses it: a closed port reads as a server that is down.
        self.http = httpx.AsyncClient(base_url="http://127.0.0.1:9", timeout=1)

    async def post(self, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
        assert endpoint.name == "chat", endpoint
        return await self.chat(body)

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt, n, seed = body["messages"][0]["content"], body.get("n", 1), body.get("seed")
        FakeServer.sent.append(prompt)
        FakeServer.asked.append((prompt, n, seed))
        await asyncio.sleep(0)
        while prompt in FakeServer.hold:
            await asyncio.sleep(0.01)
        if FakeServer.broken is not None:
            raise FakeServer.broken
        if n > 1 and FakeServer.refuses_n:
            raise BadRequestError("HTTP 400: n > 1 is not supported", status=400)
        if FakeServer.faults.get(prompt):
            raise FakeServer.faults[prompt].pop(0)
        if prompt == BAD:
            raise BadRequestError("HTTP 400: prompt is too long", status=400)
        if n == 1:
            return {"choices": [{"finish_reason": "stop",
                                 "message": {"content": f"re {prompt} seed {seed}"}}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
        # As SGLang answers n: choice i drawn apart, usage summed, the prompt counted once.
        return {"choices": [{"index": i, "finish_reason": "stop",
                             "message": {"content": f"re {prompt} seed {seed} choice {i}"}}
                            for i in range(n)],
                "usage": {"prompt_tokens": 3, "completion_tokens": 5 * n}}

    async def ready(self) -> bool:
        return not FakeServer.down

    def forget(self) -> None:
        """The server restarted: nothing learned of it to drop here."""

    async def detect(self) -> Server:
        return Server(KINDS[FakeServer.kind], FakeServer.models, info=parse_server_info({
            "max_running_requests": 4,
            "internal_states": [{"effective_max_running_requests_per_dp": 4}]}))

    async def aclose(self) -> None:
        await self.http.aclose()


class Events:
    """What happened, in order, with the ledger's state at each step."""

    def __init__(self, r: Any) -> None:
        self.r = r
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, what: str) -> None:
        self.seen.append((what, {
            "checkpointed": int(self.r.hlen(keys.checkpoint(JOB, BATCH))),
            "done": bool(self.r.sismember(keys.job_part(JOB, "done"), BATCH)),
            "leased": bool(self.r.exists(keys.lease(JOB, BATCH))),
        }))

    def names(self) -> list[str]:
        return [what for what, _ in self.seen]

    def at(self, what: str) -> dict[str, Any]:
        return next(state for name, state in self.seen if name == what)


class RecordingSink(LocalSink):
    def __init__(self, root: Path, events: Events) -> None:
        super().__init__(str(root), root)
        self.events = events

    def put_new(self, key: str, data: bytes) -> bool:
        self.events(f"put_new {key.split('/')[1]}")
        return super().put_new(key, data)


class RecordingBatches(Batches):
    def __init__(self, client: Any, jobs: Jobs, events: Events) -> None:
        super().__init__(client, jobs)
        self.events = events

    def finish_and_settle(self, *args: Any, **kwargs: Any) -> bool:
        self.events("finish")
        return super().finish_and_settle(*args, **kwargs)


class RecordingLeases(Leases):
    def __init__(self, client: Any, events: Events) -> None:
        super().__init__(client)
        self.events = events

    def release(self, *args: Any, **kwargs: Any) -> bool:
        self.events("release")
        return super().release(*args, **kwargs)


class RecordingLedger(Ledger):
    def __init__(self, client: Any, events: Events) -> None:
        super().__init__(client)
        self.batches = RecordingBatches(client, self.jobs, events)
        self.leases = RecordingLeases(client, events)


@pytest.fixture
def events(redis_client: Any) -> Events:
    return Events(redis_client)


@pytest.fixture
def runner(redis_url: str, redis_client: Any, tmp_path: Path, events: Events,
           monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
           ) -> Iterator[BatchRunner]:
    """A worker's BatchRunner on FakeServer, with one batch of PROMPTS; parametrized
    indirectly, its checkpoint window in seconds (else the settings' default)."""
    monkeypatch.setattr("workers.backend.ServerClient", FakeServer)
    monkeypatch.setattr("workers.batch.open_sink",
                        lambda uri, **_: RecordingSink(Path(uri), events))
    FakeServer.sent, FakeServer.models, FakeServer.faults, FakeServer.broken = [], (), {}, None
    FakeServer.asked, FakeServer.kind, FakeServer.refuses_n = [], "sglang", False
    FakeServer.hold, FakeServer.down = set(), False
    ledger = RecordingLedger(redis_client, events)
    make_job(ledger, JOB, str(tmp_path / "out"), prompts=len(PROMPTS), batch_size=len(PROMPTS))
    rows = [{"id": p, "line": i + 1, "body": {"messages": [{"role": "user", "content": p}]}}
            for i, p in enumerate(PROMPTS)]
    open_sink(str(tmp_path / "out")).put(keys.sink_input(JOB, BATCH),
                                         b"".join(orjson.dumps(r) + b"\n" for r in rows))
    # Built as a worker builds it; retries at once: the tests count tries, not waits.
    runtime = WorkerRuntime()
    window: dict[str, float] = ({"checkpoint_window_s": request.param}
                                if hasattr(request, "param") else {})
    runtime.configure(Settings(redis_url=redis_url, retry_backoff_s=0.0, retry_backoff_max_s=0.0,
                               **window), "w0@test", [], "http://fake:30000")
    assert runtime.ledger is not None
    runtime.ledger.close()
    runtime.ledger = ledger
    try:
        yield runtime.runner()
    finally:
        runtime.shutdown()


def written(tmp_path: Path, kind: str) -> list[str]:
    path = tmp_path / "out" / JOB / kind / f"{BATCH}.jsonl"
    records = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    return [r.get("custom_id") or r["id"] for r in records]


def test_checkpoint_then_errors_then_results_then_finish_then_release(
        runner: BatchRunner, events: Events, redis_client: Any, tmp_path: Path) -> None:
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 5, 1)
    assert events.names() == ["put_new errors", "put_new results", "finish", "release"]
    # Every prompt reached the checkpoint before the first write, under the lease.
    assert events.at("put_new errors") == {"checkpointed": 6, "done": False, "leased": True}
    # Recorded done while still leased: no other worker can take it in between.
    assert events.at("finish") == {"checkpointed": 6, "done": False, "leased": True}
    # Released last, its checkpoint dropped by the finish.
    assert events.at("release") == {"checkpointed": 0, "done": True, "leased": True}
    assert not redis_client.exists(keys.lease(JOB, BATCH))
    assert written(tmp_path, "results") == [p for p in PROMPTS if p != BAD]
    assert written(tmp_path, "errors") == [BAD]
    written_counts = {k.decode(): float(v) for k, v in
                      redis_client.hgetall(keys.job_part(JOB, "written")).items()}
    assert written_counts["prompts_done"] == 5 and written_counts["prompts_failed"] == 1
    assert runner.ledger.leases.attempts(JOB, BATCH) == 0  # a finished batch spends no attempt


@pytest.mark.parametrize("runner", [3600.0], indirect=True)
def test_a_batch_ends_when_its_last_answer_is_in_not_a_checkpoint_window_later(
        runner: BatchRunner, redis_client: Any, tmp_path: Path) -> None:
    # A checkpoint window of an hour: the batch's last answer closes its group, so the batch
    # is written and recorded now (the future's wait is far under the window).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        outcome = pool.submit(runner.run, JOB, BATCH).result(timeout=120)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 5, 1)
    assert written(tmp_path, "results") == [p for p in PROMPTS if p != BAD]


def test_a_rerun_sends_only_the_prompts_missing_from_the_checkpoint(
        runner: BatchRunner, redis_client: Any, tmp_path: Path) -> None:
    # A worker died after checkpointing p0 and p1: their records stay, nothing is sent again.
    for p in ("p0", "p1"):
        redis_client.hset(keys.checkpoint(JOB, BATCH), p, orjson.dumps(
            {"id": p, "line": 1, "content": "earlier", "finish_reason": "stop", "usage": {}}))
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.resumed) == ("done", 2)
    assert sorted(FakeServer.sent) == ["p2", "p3", "p4", "p5"]
    assert written(tmp_path, "results") == ["p0", "p1", "p2", "p4", "p5"]
    stats = {k.decode(): float(v) for k, v in
             redis_client.hgetall(keys.job_part(JOB, "stats")).items()}
    assert stats["prompts_done"] == 3 and stats["prompts_failed"] == 1  # only this run's


def test_a_batch_written_but_not_recorded_is_counted_from_the_sink_and_not_sent_again(
        runner: BatchRunner, events: Events, redis_client: Any, tmp_path: Path) -> None:
    runner.run(JOB, BATCH)
    # As if the worker died between the write and the finish: the sink says it is done.
    redis_client.delete(keys.job_part(JOB, "done"), keys.job_part(JOB, "written"))
    FakeServer.sent, events.seen = [], []
    outcome = runner.run(JOB, BATCH)
    assert outcome.status == "already-done" and FakeServer.sent == []
    assert events.names() == ["finish", "release"]
    written_counts = {k.decode(): float(v) for k, v in
                      redis_client.hgetall(keys.job_part(JOB, "written")).items()}
    assert written_counts["prompts_done"] == 5 and written_counts["prompts_failed"] == 1


def test_a_batch_leased_by_another_worker_is_left_untouched(
        runner: BatchRunner, events: Events, redis_client: Any) -> None:
    runner.ledger.leases.acquire(JOB, BATCH, "w1@other/t", ttl_s=30)
    assert runner.run(JOB, BATCH).status == "owned-elsewhere"
    assert FakeServer.sent == [] and events.names() == []
    assert runner.ledger.leases.token(JOB, BATCH) == "w1@other/t"


def test_a_server_with_several_models_pauses_a_job_that_names_none_and_sends_nothing(
        runner: BatchRunner, events: Events) -> None:
    FakeServer.models = ("qwen-8b", "qwen-32b")
    runner.loop.run(runner.backend.discovery.refresh())  # as the next periodic reading would
    assert runner.run(JOB, BATCH).status == "handed-back"
    assert FakeServer.sent == [] and events.names() == ["release"]
    state, reason = runner.ledger.jobs.state(JOB)
    assert state == "paused"
    assert reason == ("model: the server serves 2 models (qwen-8b, qwen-32b) and the job names "
                      "none: cancel it and enqueue the prompts as a new job with --model NAME")


# A server under stress: each cause has its one response.

def test_a_full_server_is_sent_again_after_its_retry_after_and_spends_nothing(
        runner: BatchRunner, tmp_path: Path) -> None:
    full = [OverloadedError("HTTP 429: Model is overloaded", status=429, retry_after_s=0.0)
            for _ in range(3)]
    FakeServer.faults = {"p2": full}
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 5, 1)
    assert FakeServer.sent.count("p2") == 4
    assert runner.ledger.leases.attempts(JOB, BATCH) == 0
    health = runner.backend.checks.report()
    assert health.overloaded == {"HTTP 429": 3} and health.failed == {}
    assert written(tmp_path, "errors") == [BAD]  # the prompt too long, not the full server


def test_a_prompt_failing_while_its_server_answers_others_fails_alone(
        runner: BatchRunner, tmp_path: Path) -> None:
    FakeServer.faults = {"p1": [RetryableError("HTTP 500: Failed to parse reasoning content",
                                               status=500) for _ in range(4)]}
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 4, 2)
    assert sorted(written(tmp_path, "errors")) == sorted(["p1", BAD])
    assert runner.backend.checks.in_rotation
    assert runner.backend.checks.report().failed == {"HTTP 500": 4}


def test_a_server_failing_everything_goes_out_of_rotation_and_back_with_no_attempt_spent(
        runner: BatchRunner, redis_client: Any, tmp_path: Path) -> None:
    FakeServer.broken = RetryableError("HTTP 502: Bad Gateway", status=502)
    with pytest.raises(ServerSickError, match="out of rotation"):
        runner.run(JOB, BATCH)
    backend = runner.backend
    assert not backend.checks.in_rotation
    assert "failed in a row (HTTP 502)" in (backend.watch.rotation.reason or "")
    assert runner.ledger.leases.attempts(JOB, BATCH) == 0
    assert not redis_client.exists(keys.checkpoint(JOB, BATCH))  # no prompt failed for it
    assert not (tmp_path / "out" / JOB / "errors").exists()
    FakeServer.broken = None  # the proxy's backend is back: a probe puts the server back
    wait_until(lambda: backend.checks.in_rotation, 30, what="the server back in rotation")
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 5, 1)


def test_a_restart_announced_mid_batch_hands_back_what_is_cut_at_no_attempt_and_rejoins(
        runner: BatchRunner, redis_client: Any, tmp_path: Path) -> None:
    import concurrent.futures

    FakeServer.hold = {"p2"}  # a long answer, running when the restart is announced
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(runner.run, JOB, BATCH)
        wait_until(lambda: "p2" in FakeServer.sent and len(set(FakeServer.sent)) == 6, 30,
                   what="every prompt sent, p2 still running")
        backend = runner.backend
        runner.loop.call_soon(backend.checks.restarting)  # the worker's RESTART_SIGNAL
        wait_until(lambda: not backend.checks.in_rotation, 10, what="out of rotation")
        # The drain ends and cuts p2: the server is gone.
        FakeServer.down, FakeServer.broken = True, ServerDownError("connection refused")
        FakeServer.hold = set()
        with pytest.raises(ServerSickError, match="restarting: its supervisor drains it"):
            running.result(30)
    assert runner.ledger.leases.attempts(JOB, BATCH) == 0  # handed back, no attempt spent
    kept = redis_client.hkeys(keys.checkpoint(JOB, BATCH))
    assert sorted(k.decode() for k in kept) == ["p0", "p1", "p3", "p4", "p5"]
    # A probe answering a draining server must not put it back: only its restart does.
    FakeServer.broken = None
    wait_until(lambda: backend.checks.failures > 0, 10, what="the restart seen")
    assert not backend.checks.in_rotation
    FakeServer.down = False
    wait_until(lambda: backend.checks.in_rotation, 10, what="back in rotation after the restart")
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 5, 1)
    assert FakeServer.sent.count("p2") == 2 and FakeServer.sent.count("p0") == 1


def test_a_restart_announced_while_out_of_rotation_is_waited_for_not_probed(
        runner: BatchRunner) -> None:
    FakeServer.broken = RetryableError("HTTP 502: Bad Gateway", status=502)
    with pytest.raises(ServerSickError, match="out of rotation"):
        runner.run(JOB, BATCH)
    backend = runner.backend
    runner.loop.call_soon(backend.checks.restarting)  # the worker's RESTART_SIGNAL
    wait_until(lambda: backend.watch.rotation.awaiting_restart, 10, what="the restart noted")
    # Draining, the server refuses with 503: a probe would take it for full and fit.
    FakeServer.broken = OverloadedError("HTTP 503: draining", status=503)
    rotation = backend.watch.rotation
    # The probe under way when the restart was announced ends within its second backoff
    # (at most 2 x PROBE_BACKOFF_S); a probe then would put the server back.
    time.sleep(2 * PROBE_BACKOFF_S + PROBE_MIN_S)
    assert not backend.checks.in_rotation
    FakeServer.down = True  # it restarts ...
    wait_until(lambda: backend.checks.failures > 0, 10, what="the restart seen")
    FakeServer.down, FakeServer.broken = False, None  # ... and is back
    wait_until(lambda: backend.checks.in_rotation, 10, what="back in rotation after the restart")
    assert not rotation.awaiting_restart


# Several answers per prompt: one request with `n` where the server takes it.

SAMPLES = 4
SAMPLED = ["q0", "q1"]


def sampled_input(tmp_path: Path) -> None:
    """The batch's input as enqueue stores a job of four answers per prompt: each answer its
    own item, in index order, seeded with its line's seed plus its index."""
    rows = [{"id": p, "sample": i, "line": n + 1,
             "body": {"messages": [{"role": "user", "content": p}], "seed": 100 * n + i}}
            for n, p in enumerate(SAMPLED) for i in range(SAMPLES)]
    open_sink(str(tmp_path / "out")).put(keys.sink_input(JOB, BATCH),
                                         b"".join(orjson.dumps(r) + b"\n" for r in rows))


def results(tmp_path: Path, kind: str = "results") -> list[dict[str, Any]]:
    path = tmp_path / "out" / JOB / kind / f"{BATCH}.jsonl"
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


def start(runner: BatchRunner, kind: str) -> None:
    FakeServer.kind = kind
    runner.loop.run(runner.backend.discovery.refresh())  # found as this kind


def test_a_prompts_four_answers_go_as_one_request_with_n_to_an_sglang_server(
        runner: BatchRunner, redis_client: Any, tmp_path: Path) -> None:
    sampled_input(tmp_path)
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 8, 0)
    # One request per prompt, n = its answers, with the seed of its first answer.
    assert sorted(FakeServer.asked) == [("q0", 4, 0), ("q1", 4, 100)]
    out = results(tmp_path)
    assert [(r["id"], r["sample"]) for r in out] == [(p, i) for p in SAMPLED for i in range(4)]
    # Choice i is answer i's record.
    assert [r["content"] for r in out[:4]] == [f"re q0 seed 0 choice {i}" for i in range(4)]
    # The completion tokens are split over the answers and add up to the engine's total; the
    # prompt is counted once per answer, as one request per answer would count it.
    assert sum(r["usage"]["completion_tokens"] for r in out[:4]) == 20
    assert all(r["usage"]["prompt_tokens"] == 3 for r in out)
    stats = {k.decode(): float(v) for k, v in
             redis_client.hgetall(keys.job_part(JOB, "stats")).items()}
    assert (stats["prompts_done"], stats["output_tokens"], stats["input_tokens"]) == (8, 40, 24)


def test_a_prompts_four_answers_go_as_four_requests_to_a_server_of_unknown_kind(
        runner: BatchRunner, tmp_path: Path) -> None:
    sampled_input(tmp_path)
    start(runner, "openai")
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 8, 0)
    assert sorted(FakeServer.asked) == sorted((p, 1, 100 * n + i) for n, p in enumerate(SAMPLED)
                                              for i in range(SAMPLES))
    assert [r["content"] for r in results(tmp_path)[:2]] == ["re q0 seed 0", "re q0 seed 1"]


def test_a_partly_answered_prompt_asks_only_its_missing_answers_with_n(
        runner: BatchRunner, redis_client: Any, tmp_path: Path) -> None:
    sampled_input(tmp_path)
    # A worker died after checkpointing q0's answers 0 and 1: the restart asks for 2 and 3.
    for i in (0, 1):
        redis_client.hset(keys.checkpoint(JOB, BATCH), f"q0/{i}", orjson.dumps(
            {"id": "q0", "sample": i, "line": 1, "content": "earlier", "finish_reason": "stop",
             "usage": {}}))
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.resumed) == ("done", 8, 2)
    assert sorted(FakeServer.asked) == [("q0", 2, 2), ("q1", 4, 100)]
    out = results(tmp_path)
    assert [r["content"] for r in out[:4]] == ["earlier", "earlier", "re q0 seed 2 choice 0",
                                               "re q0 seed 2 choice 1"]
    assert [r["sample"] for r in out[:4]] == [0, 1, 2, 3]


def test_an_n_request_failing_for_the_server_is_retried_whole_and_then_fails_each_answer(
        runner: BatchRunner, tmp_path: Path) -> None:
    sampled_input(tmp_path)
    # q0's request fails once, then is answered whole; q1's fails every try while the server
    # answers others: each of q1's answers fails, with its tries, as a lone answer's would.
    FakeServer.faults = {
        "q0": [RetryableError("HTTP 500: blip", status=500)],
        "q1": [RetryableError("HTTP 500: Failed to parse", status=500) for _ in range(4)]}
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 4, 4)
    assert FakeServer.asked.count(("q0", 4, 0)) == 2
    assert FakeServer.asked.count(("q1", 4, 100)) == 4
    errors = results(tmp_path, "errors")
    assert [e["custom_id"] for e in errors] == [f"q1/{i}" for i in range(SAMPLES)]
    assert {(e["error"]["code"], e["tries"]) for e in errors} == {("server_error", 4)}
    assert runner.backend.checks.in_rotation


def test_an_n_request_refused_for_its_prompt_fails_each_of_its_answers(
        runner: BatchRunner, tmp_path: Path) -> None:
    sampled_input(tmp_path)
    FakeServer.faults = {"q1": [BadRequestError("HTTP 400: prompt is too long", status=400)]}
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 4, 4)
    assert FakeServer.asked.count(("q1", 4, 100)) == 1  # a 4xx is never sent again
    errors = results(tmp_path, "errors")
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (f"q1/{i}", "context_length_exceeded") for i in range(SAMPLES)]


def test_a_server_that_refuses_n_is_sent_one_request_per_answer_and_fails_nothing(
        runner: BatchRunner, tmp_path: Path) -> None:
    sampled_input(tmp_path)
    FakeServer.refuses_n = True
    outcome = runner.run(JOB, BATCH)
    assert (outcome.status, outcome.done, outcome.failed) == ("done", 8, 0)
    singles = [a for a in FakeServer.asked if a[1] == 1]
    assert sorted(singles) == sorted((p, 1, 100 * n + i) for n, p in enumerate(SAMPLED)
                                     for i in range(SAMPLES))
    server = runner.backend.discovery.server
    assert server is not None and "n" in server.refused and not server.takes_n
    # Learned for the worker's life: the next batch asks no n at all.
    FakeServer.asked = []
    runner.ledger.r.delete(keys.job_part(JOB, "done"))
    for kind in ("results", "errors"):
        (tmp_path / "out" / JOB / kind / f"{BATCH}.jsonl").unlink(missing_ok=True)
    runner.run(JOB, BATCH)
    assert FakeServer.asked and all(n == 1 for _, n, _ in FakeServer.asked)
