"""How the worker runs one prompt's rollout (workers/rollouts.py `Programs.run`), against the
test Redis (the journal is real) with the door replaced by a scripted one: every way a rollout
ends, and what the journal keeps for a rerun. End to end, with the simulator, a real worker and
crashes: tests/system/test_rollouts.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.errors import BadRequestError, RequestHeldError, RetryableError
from fleetgen.job import GenerationParams, InputInfo, JobManifest
from fleetgen.liveledger import LiveLedger
from fleetgen.records import Origin, OutputRecord, is_failure
from fleetgen.rollouts import CallFailed, Generate, Prompt, RolloutSpec, prompt_body
from fleetgen.settings import Settings
from workers.backend import Request
from workers.backlog import Backlog
from workers.batch import Prompt as Item
from workers.rollouts import Programs

ORIGIN = Origin("http://sim", "gpu0@test", 1)


async def two_calls(prompt: Prompt, generate: Generate) -> dict[str, Any]:
    first = await generate(prompt_body(prompt))
    text = first["choices"][0]["message"]["content"]
    second = await generate(prompt_body(prompt, messages=[
        *prompt["messages"], {"role": "user", "content": f"more on {text}"}]))
    return {"content": second["choices"][0]["message"]["content"], "first": text}


async def tolerant(prompt: Prompt, generate: Generate) -> dict[str, Any]:
    """Catches what its one call raised and says so."""
    try:
        await generate(prompt_body(prompt))
    except CallFailed as exc:
        return {"content": f"refused: {exc.code}"}
    except Exception as exc:  # noqa: BLE001 (what a careless rollout does)
        return {"content": f"caught {type(exc).__name__}"}
    return {"content": "answered"}


async def divides(prompt: Prompt, generate: Generate) -> dict[str, Any]:
    await generate(prompt_body(prompt))
    return {"content": str(1 / 0)}


async def dawdles(prompt: Prompt, generate: Generate) -> dict[str, Any]:
    await generate(prompt_body(prompt))
    await generate.run(time.sleep, 5)
    return {"content": "late"}


async def returns_text(prompt: Prompt, generate: Generate) -> str:
    return "not a dict"


class Door:
    """A scripted server: `answer(body)` gives the completion, or raises what the real door
    would; every body sent is kept."""

    def __init__(self, answer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.answer = answer
        self.sent: list[dict[str, Any]] = []

    async def send(self, request: Request) -> tuple[dict[str, Any], float, int]:
        self.sent.append(dict(request.body))
        if request.delivery is not None:  # as the door does once a slot is taken
            request.delivery.leaves()
        await asyncio.sleep(0)
        return self.answer(dict(request.body)), 0.01, 1


def echo(body: dict[str, Any]) -> dict[str, Any]:
    said = body["messages"][-1]["content"]
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"re: {said}"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7}}


def manifest(name: str, rollout: str) -> JobManifest:
    spec = RolloutSpec.of(f"tests.workers.test_rollouts:{rollout}")
    return JobManifest(
        name=name, output="/tmp/out", input=InputInfo("in.jsonl", "0" * 64, 1, 10), prompts=1,
        batch_size=1, batches=1, queue=keys.SHARED_QUEUE, params=GenerationParams(max_tokens=64),
        rollout={"name": spec.name, "digest": spec.digest, "options": {}, "keep_calls": False})


def item(prompt_id: str = "p1") -> Item:
    return Item(id=prompt_id, line=1, body={"messages": [{"role": "user", "content": "hi"}]})


def run(redis_url: str, door: Door, job: JobManifest, *, limit_s: float = 60.0,
        journal: bool = True, backlog: Backlog | None = None) -> OutputRecord | RequestHeldError:
    """Run the rollout of `item()` once, as a batch run would, journal read first."""

    async def go() -> OutputRecord | RequestHeldError:
        live = LiveLedger.connect(Settings(redis_url=redis_url), "test-rollouts")
        programs = Programs(Settings(redis_url=redis_url, rollout_time_limit_s=limit_s), live,
                            backlog or Backlog(), door.send, lambda job: None)
        try:
            journaled = await programs.journal(job.name, "b000001") if journal else {}
            spec = job.rollout_spec
            assert spec is not None
            return await programs.run(job, spec, programs.require(job), "b000001", item(),
                                      ORIGIN, journaled.get(item().key, {}))
        finally:
            programs.close()
            await live.aclose()

    return asyncio.run(go())


def answer(outcome: OutputRecord | RequestHeldError) -> dict[str, Any]:
    assert isinstance(outcome, dict) and not is_failure(outcome), outcome
    return dict(outcome)


def failure(outcome: OutputRecord | RequestHeldError) -> dict[str, Any]:
    assert isinstance(outcome, dict) and is_failure(outcome), outcome
    return dict(outcome)


def test_a_rollout_run_again_gets_its_journaled_calls_back_without_sending_them(
        redis_url: str, redis_client: Any) -> None:
    job = manifest("again", "two_calls")
    door = Door(echo)
    # The batch counts its prompt unsent; each call the door sends counts sent.
    backlog = Backlog()
    backlog.add(unsent=1)
    first = answer(run(redis_url, door, job, backlog=backlog))
    assert (backlog.unsent, backlog.sent) == (0, 2)
    assert first["calls"] == 2 and first["result"]["first"] == "re: hi"
    assert first["content"] == "re: more on re: hi"
    assert first["usage"] == {"prompt_tokens": 10, "completion_tokens": 14, "reasoning_tokens": 0}
    # The job's defaults go under each call's body; the journal holds both calls.
    assert all(body["max_tokens"] == 64 for body in door.sent)
    assert redis_client.hlen(keys.calls("again", "b000001")) == 2
    rerun = Door(echo)
    again = answer(run(redis_url, rerun, job))
    assert {**again, "latency_s": 0} == {**first, "latency_s": 0}
    assert rerun.sent == []


def test_a_rerun_that_asks_another_call_fails_its_prompt_naming_the_call(
        redis_url: str, redis_client: Any) -> None:
    job = manifest("changed", "two_calls")
    run(redis_url, Door(echo), job)
    # The server answers otherwise now: the second call the rollout builds differs.
    redis_client.hdel(keys.calls("changed", "b000001"), keys.call_field("p1", 0))
    other = Door(lambda body: {**echo(body), "choices": [{"index": 0, "message": {
        "role": "assistant", "content": "something else"}, "finish_reason": "stop"}]})
    record = failure(run(redis_url, other, job))
    assert record["error"]["code"] == "rollout_changed"
    assert record["error"]["message"].startswith("rollout changed at call 1:")
    assert len(other.sent) == 1


def test_a_prompts_own_refusal_is_journaled_and_a_jobs_is_asked_again(
        redis_url: str, redis_client: Any) -> None:
    def refuse(code: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
        def answer(body: dict[str, Any]) -> dict[str, Any]:
            error = BadRequestError("no", status=400, code=code)
            error.tries = 1
            raise error
        return answer

    job = manifest("refused", "tolerant")
    assert answer(run(redis_url, Door(refuse("context_length_exceeded")), job))["content"] == (
        "refused: context_length_exceeded")
    assert redis_client.hlen(keys.calls("refused", "b000001")) == 1
    again = Door(echo)
    assert answer(run(redis_url, again, job))["content"] == "refused: context_length_exceeded"
    assert again.sent == []

    job = manifest("modelless", "tolerant")
    assert answer(run(redis_url, Door(refuse("model_not_found")), job))["content"] == (
        "refused: model_not_found")
    assert redis_client.hlen(keys.calls("modelless", "b000001")) == 0
    assert answer(run(redis_url, Door(echo), job))["content"] == "answered"


def test_a_call_uncaught_fails_its_prompt_with_the_calls_code(redis_url: str) -> None:
    def fail(body: dict[str, Any]) -> dict[str, Any]:
        raise RetryableError("server error 500", status=500, code="server_error")

    record = failure(run(redis_url, Door(fail), manifest("failing", "two_calls")))
    assert record["error"] == {"code": "server_error", "message": "call 0: server error 500"}
    assert record["calls"] == 1


def test_an_exception_fails_its_prompt_with_its_type(redis_url: str) -> None:
    record = failure(run(redis_url, Door(echo), manifest("raises", "divides")))
    assert record["error"]["code"] == "rollout_error"
    assert record["error"]["message"] == "ZeroDivisionError: division by zero (after 1 calls)"
    assert record["exception"] == "ZeroDivisionError" and record["calls"] == 1
    record = failure(run(redis_url, Door(echo), manifest("text", "returns_text")))
    assert record["error"]["message"] == "the rollout returned str, not a dict (after 0 calls)"


def test_a_held_call_hands_the_prompt_back_even_past_a_careless_except(
        redis_url: str) -> None:
    def held(body: dict[str, Any]) -> dict[str, Any]:
        raise RequestHeldError(RequestHeldError.OUT, "hung")

    outcome = run(redis_url, Door(held), manifest("held", "tolerant"))
    assert isinstance(outcome, RequestHeldError) and outcome.why == RequestHeldError.OUT


def test_a_rollouts_own_time_is_limited_and_its_calls_are_not_counted(redis_url: str) -> None:
    slow_server = Door(echo)

    async def slow(request: Request) -> tuple[dict[str, Any], float, int]:
        await asyncio.sleep(1.5)  # longer than the limit: a call's time is the server's
        return await Door.send(slow_server, request)

    slow_server.send = slow  # type: ignore[method-assign]
    record = failure(run(redis_url, slow_server, manifest("slow", "dawdles"), limit_s=1.0))
    assert record["error"]["code"] == "rollout_timeout"
    assert "ran out of time: 1 s of its own" in record["error"]["message"]
    assert record["calls"] == 1


@pytest.mark.parametrize("name, says", [
    ("tests.workers.test_rollouts", "name it as module:attribute"),
    ("tests.workers.no_such_module:f", "cannot import tests.workers.no_such_module"),
    ("tests.workers.test_rollouts:nothing", "has no nothing"),
    ("tests.workers.test_rollouts:echo", "not an async function of (prompt, generate)"),
])
def test_a_rollout_that_cannot_be_used_is_refused_saying_why(name: str, says: str) -> None:
    from fleetgen.errors import RolloutError

    with pytest.raises(RolloutError, match=says.replace("(", r"\(").replace(")", r"\)")):
        RolloutSpec.of(name)


def test_a_spec_with_another_digest_is_refused_naming_both(tmp_path: Any) -> None:
    from fleetgen.errors import RolloutError

    spec = RolloutSpec.of("tests.workers.test_rollouts:two_calls")
    other = RolloutSpec(spec.name, "f" * 64)
    with pytest.raises(RolloutError, match="is another version than the job's"):
        other.load()
    assert orjson.loads(orjson.dumps(spec.__dict__))["digest"] == spec.digest
