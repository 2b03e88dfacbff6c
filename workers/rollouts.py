"""Run a job's rollout (fleetgen/rollouts) for each prompt of a batch, durably and exactly once.

A rollout's every call goes through the worker's one door to its server (`send`, the batch
runner's: the prompt's attempts, flow control, rotation, causes), and its result is journaled
in Redis the moment it arrives, keyed by the prompt's answer key and the call's index
(`keys.call_field`). A rollout run again (its worker killed, its batch handed back) runs from
its start, and each journaled call returns its recorded result at once, so what was already
paid for is never asked again: a crash costs the calls that were in flight. A replayed call
must ask exactly what the journal recorded (`request_digest`); one that asks otherwise fails
its prompt alone, "rollout changed at call k". A call the server refused for the prompt's own
reason is journaled as that refusal; one refused for the job's reason or failed by the server
is not, so a resumed job asks it again.

Slots count calls, not rollouts: every rollout of a batch runs at once and its calls wait at
the door for the server's slots, so rollouts waiting on tools or on their next step leave the
server to the others. What the consumer gate sees unsent is the rollouts not started and the
calls waiting at the door. CPU work in a rollout (`generate.run`) goes to a bounded thread pool.
A rollout's own time (everything outside its calls) is limited by FLEETGEN_ROLLOUT_TIME_LIMIT_S.

How a rollout ends, as its prompt's record says:

    returns a dict        the prompt's answer (`records.rollout_record`)
    CallFailed uncaught   failed with the call's code and message, as a plain prompt would be
    raises anything else  failed, `rollout_error`, its type and message (the breaker pauses a
                          job whose rollouts keep raising the same)
    asks another call     failed, `rollout_changed` (a replay met another request)
    runs out of time      failed, `rollout_timeout`
    a call is held        not finished: handed back with the batch (the server out of
                          rotation, the worker stopping, the job paused), no attempt spent
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar, cast

import orjson

from fleetgen import keys
from fleetgen.causes import ROLLOUT_CHANGED, ROLLOUT_ERROR, ROLLOUT_TIMEOUT, job_caused
from fleetgen.errors import BadRequestError, RequestHeldError, RetryableError
from fleetgen.job import JobManifest
from fleetgen.liveledger import LiveLedger
from fleetgen.records import (
    Origin,
    OutputRecord,
    Usage,
    error_record,
    rollout_record,
    usage_of,
)
from fleetgen.retry import on_redis_async
from fleetgen.rollouts import (
    Body,
    CallFailed,
    Completion,
    Rollout,
    RolloutSpec,
    request_digest,
    rollout_prompt,
)
from fleetgen.servers import ChatCompletion, RequestBody
from fleetgen.settings import Settings
from workers import metrics
from workers.backend import Request
from workers.backlog import Backlog, Delivery

if TYPE_CHECKING:  # the batch runner imports this module
    from workers.batch import Prompt

log = logging.getLogger(__name__)
T = TypeVar("T")

# The door, as the batch runner keeps it: a request's completion, latency and tries, or its
# final failure (BadRequestError, RetryableError with `tries`) or RequestHeldError.
Send = Callable[[Request], Awaitable[tuple[ChatCompletion, float, int]]]
# Why a prompt's call must not go now (the job paused), checked before each send.
Hold = Callable[[str], str | None]

# A body whose `n` the server refuses in one request: a rollout asks its answers one by one.
N_REFUSED = "n_not_supported"


class _Held(BaseException):
    """A call was not sent, or was abandoned (RequestHeldError): raised through the rollout's
    own code, which no `except Exception` in it may swallow, and handed back with the batch."""

    def __init__(self, held: RequestHeldError) -> None:
        super().__init__(held.message)
        self.held = held


class _Changed(BaseException):
    """A replayed call asked another request than the journal's."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


class Programs:
    """The rollouts of one worker process: the loaded programs, their thread pool, and what
    runs now (for the registry and /metrics)."""

    def __init__(self, settings: Settings, live: LiveLedger, backlog: Backlog, send: Send,
                 hold: Hold) -> None:
        self._settings = settings
        self._live = live
        self._backlog = backlog
        self._send = send
        self._hold = hold
        self._pool = ThreadPoolExecutor(settings.rollout_threads,
                                        thread_name_prefix="fleetgen-rollout")
        self._loaded: dict[str, Rollout] = {}
        self._lock = threading.Lock()
        # Rollouts running and their calls at the server now (loop-only counts).
        self.running = 0
        self.calls_in_flight = 0

    def require(self, manifest: JobManifest) -> Rollout:
        """The job's rollout as this worker imports it (once per job); RolloutError when it
        cannot be imported here or is another version than the job's (the batch runner hands
        the batch back unstarted)."""
        spec = manifest.rollout_spec
        assert spec is not None
        key = orjson.dumps(manifest.rollout, option=orjson.OPT_SORT_KEYS).decode()
        with self._lock:
            if key not in self._loaded:
                self._loaded[key] = spec.load()
                log.info("job %s: rollout %s loaded (module sha256 %s)", manifest.name,
                         spec.name, spec.digest[:12])
            return self._loaded[key]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def journal(self, job: str, batch: str) -> dict[str, dict[int, bytes]]:
        """The batch's journaled calls: answer key -> call index -> the call's result."""
        raw = await on_redis_async(f"batch {job}/{batch}: read the rollouts' journal",
                                   lambda: self._live.journal(job, batch))
        out: dict[str, dict[int, bytes]] = {}
        for field, value in raw.items():
            key, _, index = field.rpartition("#")
            out.setdefault(key, {})[int(index)] = value
        return out

    async def run(self, manifest: JobManifest, spec: RolloutSpec, rollout: Rollout, batch: str,
                  prompt: Prompt, origin: Origin,
                  journaled: dict[int, bytes]) -> OutputRecord | RequestHeldError:
        """The prompt's record once its rollout (the job's `spec`, loaded: `require`) ended,
        or why it could not end here."""
        delivery = Delivery(self._backlog, 1)
        calls = _Calls(self, manifest, batch, prompt, origin, delivery, journaled,
                       spec.keep_calls)
        given = rollout_prompt(prompt.id, prompt.line, cast(Body, prompt.body))
        started = time.monotonic()
        self.running += 1
        metrics.rollout_started(manifest.name, origin.worker, origin.server)
        try:
            async with asyncio.timeout(self._settings.rollout_time_limit_s) as deadline:
                calls.deadline = deadline
                result = await rollout(given, calls)
            record = _answer(prompt, result, calls, time.monotonic() - started, origin)
        except _Held as held:
            return held.held
        except TimeoutError as exc:
            if calls.deadline is None or not calls.deadline.expired():
                record = _raised(prompt, exc, calls, origin)
            else:
                record = _failed(prompt, ROLLOUT_TIMEOUT, (
                    f"rollout {spec.name} ran out of time: {self._settings.rollout_time_limit_s:g} s "
                    f"of its own (outside its calls; FLEETGEN_ROLLOUT_TIME_LIMIT_S) after "
                    f"{calls.calls} calls"), None, calls, origin)
        except _Changed as changed:
            record = _failed(prompt, ROLLOUT_CHANGED, (
                f"rollout changed at call {changed.index}: run again, {spec.name} asked another "
                "request than the one journaled (a rollout must ask the same given the same "
                "answers; draw randomness from generate.random)"), None, calls, origin)
        except CallFailed as exc:
            record = _failed(prompt, exc.code, f"call {exc.index}: {exc.message}", exc.status,
                             calls, origin)
        except Exception as exc:  # noqa: BLE001 (the user's code: any exception fails its prompt)
            record = _raised(prompt, exc, calls, origin)
        finally:
            self.running -= 1
            delivery.ends()
            metrics.rollout_ended(manifest.name, origin.worker, origin.server)
        return record

    async def _call(self, calls: _Calls, index: int, body: Body, digest: str) -> dict[str, Any]:
        """Send call `index` through the door; its journal entry once final."""
        job, key = calls.job, calls.key
        stored = cast(RequestBody, body)
        # The rollout counts unsent until its first call leaves; each later call counts unsent
        # while it waits at the door, so the consumer gate takes no new batch while the calls
        # of rollouts already held wait for slots.
        delivery = calls.delivery
        if delivery.sent:
            self._backlog.add(unsent=1)
            delivery = Delivery(self._backlog, 1)
        request = Request(calls.manifest.params.request_body(stored), job,
                          f"{key} call {index}", key,
                          thinking=calls.manifest.params.thinking_of(stored),
                          hold=lambda: self._hold(job), delivery=delivery)
        self.calls_in_flight += 1
        try:
            completion, latency, _ = await self._send(request)
            entry: dict[str, Any] = {"digest": digest, "completion": completion,
                                     "latency_s": round(latency, 4)}
        except RequestHeldError as held:
            if held.why != RequestHeldError.SPLIT:
                raise _Held(held) from None
            entry = {"digest": digest, "error": {
                "code": N_REFUSED, "status": None, "message": (
                    "the server refuses several answers in one request (n); ask them "
                    "one call each")}}
        except (BadRequestError, RetryableError) as exc:
            code = exc.code or "generation_failed"
            error = {"code": code, "status": exc.status, "message": exc.message}
            if isinstance(exc, RetryableError) or job_caused(code):
                # Not the prompt's own: a resumed job asks it again, so it is not journaled.
                return {"digest": digest, "error": error}
            entry = {"digest": digest, "error": error}
        finally:
            self.calls_in_flight -= 1
            if delivery is not calls.delivery:
                delivery.ends()
        await on_redis_async(
            f"batch {job}/{calls.batch}: journal call {index} of {key}",
            lambda: self._live.journal_call(job, calls.batch, keys.call_field(key, index),
                                            orjson.dumps(entry)))
        return entry

    async def run_in_pool(self, fn: Callable[..., T], args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))


class _Calls:
    """The `generate` one rollout is given (fleetgen.rollouts.Generate): its calls, numbered
    in the order it makes them, answered from the journal first."""

    def __init__(self, programs: Programs, manifest: JobManifest, batch: str, prompt: Prompt,
                 origin: Origin, delivery: Delivery, journaled: dict[int, bytes],
                 keep: bool) -> None:
        self._programs = programs
        self.origin = origin
        self.manifest = manifest
        self.job = manifest.name
        self.batch = batch
        self.key = prompt.key
        self.delivery = delivery
        self._journaled = journaled
        self.random = random.Random(f"{manifest.name}\0{prompt.key}")
        self._made = 0
        self.usage: Usage = {"prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0}
        self.trajectory: list[dict[str, Any]] | None = [] if keep else None
        # The rollout's own-time limit: paused while a call is at the server.
        self.deadline: asyncio.Timeout | None = None

    @property
    def calls(self) -> int:
        return self._made

    async def __call__(self, body: Body) -> Completion:
        if not isinstance(body, dict):
            raise TypeError(f"generate takes a chat request body (a dict), not "
                            f"{type(body).__name__}")
        index = self._made
        self._made += 1
        digest = request_digest(body)
        raw = self._journaled.get(index)
        if raw is not None:
            entry: dict[str, Any] = orjson.loads(raw)
            if entry["digest"] != digest:
                raise _Changed(index)
        else:
            entry = await self._at_server(index, body, digest)
        metrics.rollout_call(self.job, self.origin.worker, self.origin.server,
                             journaled=raw is not None)
        return self._take(index, body, entry)

    async def _at_server(self, index: int, body: Body, digest: str) -> dict[str, Any]:
        deadline = self.deadline
        loop = asyncio.get_running_loop()
        left = deadline.when() if deadline is not None else None
        if deadline is not None and left is not None:
            left -= loop.time()
            deadline.reschedule(None)
        try:
            return await self._programs._call(self, index, body, digest)
        finally:
            if deadline is not None and left is not None:
                deadline.reschedule(loop.time() + left)

    def _take(self, index: int, body: Body, entry: dict[str, Any]) -> Completion:
        error = entry.get("error")
        if self.trajectory is not None:
            self.trajectory.append({"request": body, **(
                {"error": error} if error is not None else {"completion": entry["completion"]})})
        if error is not None:
            raise CallFailed(index, error["code"], error["message"], error.get("status"))
        completion: Completion = entry["completion"]
        usage = usage_of(completion)
        for name in ("prompt_tokens", "completion_tokens", "reasoning_tokens"):
            self.usage[name] += usage[name]
        # The rollout's own copy: what it changes is not what the trajectory keeps.
        return orjson.loads(orjson.dumps(completion)) if self.trajectory is not None else completion

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        return await self._programs.run_in_pool(fn, args, kwargs)


def _answer(prompt: Prompt, result: object, calls: _Calls, latency_s: float,
            origin: Origin) -> OutputRecord:
    if not isinstance(result, dict):
        return _failed(prompt, ROLLOUT_ERROR, (
            f"the rollout returned {type(result).__name__}, not a dict (after {calls.calls} "
            "calls)"), None, calls, origin, "TypeError")
    try:
        orjson.dumps(result)
    except TypeError as exc:
        return _failed(prompt, ROLLOUT_ERROR, (
            f"the rollout returned a dict JSON cannot hold ({exc}; after {calls.calls} calls)"),
            None, calls, origin, "TypeError")
    return rollout_record(prompt.id, prompt.line, result, calls.usage.copy(), latency_s, origin,
                          calls.calls, calls.trajectory)


def _raised(prompt: Prompt, exc: BaseException, calls: _Calls, origin: Origin) -> OutputRecord:
    kind = type(exc).__name__
    return _failed(prompt, ROLLOUT_ERROR, f"{kind}: {exc} (after {calls.calls} calls)", None,
                   calls, origin, kind)


def _failed(prompt: Prompt, code: str, message: str, status: int | None, calls: _Calls,
            origin: Origin, exception: str | None = None) -> OutputRecord:
    record = error_record(prompt.id, prompt.line, message, status, origin, calls.calls,
                          code=code)
    record["calls"] = calls.calls
    if exception is not None:
        record["exception"] = exception
    return record
