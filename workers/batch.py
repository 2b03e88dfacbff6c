"""Run one batch: lease it, resume from its checkpoint, generate, write once, then record it.

Order of effects is the whole point: a prompt's result reaches the Redis checkpoint the moment
it finishes (so a crash loses only requests in flight), the batch's objects are written to the
sink with create-if-absent, and only then is the batch marked done and its message acked.

The unit of work is one answer: a batch input's line (producer/answers.py), a prompt's id and,
in a job of several answers per prompt, its index. Everything here keys by the answer's key
(`records.answer_key`), so each answer is checkpointed, retried and written once.

The unit of sending is one request: the unanswered answers of one prompt that sit together in
the batch (`_asks`) go as one request with `n` where the server takes it (`Server.takes_n`:
SGLang, vLLM), else each as a request of its own. The request is the unit of failure: its
cause is classified once and every answer it carries is retried, failed or held by it, as a
lone answer's request would be; each choice of its reply is its answer's record, checkpointed
one by one. A server that refuses `n` is learned from and the request's answers go one by one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from fleetgen import breaker, keys
from fleetgen.checkpoints import CheckpointWriter, Entry
from fleetgen.errors import (
    BadRequestError,
    GenerationError,
    JobError,
    JobNotRunningError,
    LeaseLostError,
    ModelChoiceError,
    OverloadedError,
    RetryableError,
    ServerDownError,
    ServerSickError,
    SinkError,
    WorkerStoppingError,
)
from fleetgen.job import JobManifest
from fleetgen.ledger import STATE_PAUSED, STATE_RUNNING, Ledger
from fleetgen.records import (
    UNSENT_ATTEMPTS_EXHAUSTED,
    Origin,
    OutputRecord,
    answer_key,
    counters,
    error_record,
    is_failure,
    result_record,
    split_choices,
    written_counts,
)
from fleetgen.retry import on_redis, on_sink, with_attempts
from fleetgen.servers import ChatCompletion, RequestBody
from fleetgen.sink import Sink, batch_records, open_sink
from workers import metrics
from workers.engine import Backlog, Engine
from workers.heartbeat import cancel, follow, keep_lease, stop_heartbeat
from workers.preflight import SinkChecks
from workers.quality import QualityWatch

log = logging.getLogger(__name__)
T = TypeVar("T")
# A server whose /health answers within this of a lost connection was not down.
UP_AT_ONCE_S = 1.0


class _Split(Exception):
    """The server refused `n`: the request's answers go as one request each."""


class _Held(Exception):
    """The prompt's request was not sent, and why: its job was paused (`PAUSED`), its worker is
    stopping (`STOPPING`), or its server went out of rotation (`OUT`)."""

    PAUSED, STOPPING, OUT = "paused", "stopping", "out of rotation"

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@dataclass(frozen=True)
class Prompt:
    """One work item of a batch input: a prompt's answer to generate (`sample` is its index in
    a job of several answers per prompt, else None)."""

    id: str
    line: int
    body: RequestBody
    sample: int | None = None

    @property
    def key(self) -> str:
        return answer_key(self.id, self.sample)


@dataclass
class Outcome:
    status: str
    batch: str
    done: int = 0
    failed: int = 0
    resumed: int = 0
    attempt: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Ending:
    """How a leased run of a batch ended, as its release and its metrics need it (`ending`)."""

    status: str
    # The attempt taken with the lease counts toward FLEETGEN_BATCH_MAX_ATTEMPTS.
    spent: bool = False
    # The heartbeat found the lease taken over or could not renew it: the attempt is given back
    # by hand if the release finds the lease gone (a release refunds only a lease it holds).
    lease_lost: bool = False
    # The error ends here, as an Outcome of this status; otherwise it goes on to the task,
    # which requeues a hand-back and lets Celery record anything else.
    handled: bool = False


def ending(ended: Outcome | BaseException) -> Ending:
    """How a leased run that returned or raised `ended` ends; the one place that decides
    whether its attempt is spent or refunded.

    An attempt is spent only if the worker dies holding the batch (no release runs then) or
    the run meets an error nobody planned for; a finished batch and every planned hand-back
    give it back.
    """
    if isinstance(ended, Outcome):
        return Ending(ended.status)
    if isinstance(ended, LeaseLostError):
        # Another copy owns the batch now, or will. This worker is alive and noticed, so the
        # batch did not kill it (a Redis outage longer than the lease does this).
        return Ending("stopped", lease_lost=True, handled=True)
    if isinstance(ended, JobError):
        # Paused, cancelled, or its input is missing (the job was paused for that): `resume`
        # re-dispatches it.
        return Ending("handed-back", handled=True)
    if isinstance(ended, (ServerDownError, WorkerStoppingError, SinkError)):
        # The server or the sink stayed down, or this worker is stopping: not the batch's
        # fault, and the task requeues it.
        return Ending("handed-back")
    if isinstance(ended, Exception):
        return Ending("error", spent=True)
    # Interrupted (SystemExit, KeyboardInterrupt, a cancelled coroutine): the worker is going
    # away, and its release hands the batch back.
    return Ending("error")


@dataclass
class _Delivery:
    """One request on its way to the server, carrying `answers` answers: whether the backlog
    counts them sent, and how long its tries waited for slots."""

    backlog: Backlog
    answers: int = 1
    sent: bool = False
    queue_wait_s: float = 0.0

    def leaves(self) -> None:
        """Its request goes out now: the backlog counts it sent (once, whatever its tries)."""
        if not self.sent:
            self.sent = True
            self.backlog.add(unsent=-self.answers, sent=self.answers)

    def server_lost(self) -> None:
        """Its server went down: unsent again until the server is back, so the worker takes
        no new batch meanwhile (gate.py)."""
        if self.sent:
            self.sent = False
            self.backlog.add(unsent=self.answers)

    def hand_on(self) -> None:
        """Its answers go as requests of their own (`_Split`): theirs to count from here."""
        self.backlog.add(unsent=self.answers if self.sent else 0,
                         sent=-self.answers if self.sent else 0)
        self.answers, self.sent = 0, False

    def ends(self) -> None:
        """The request is done with (answered, failed or held): out of the unsent count."""
        if not self.sent:
            self.backlog.add(unsent=-self.answers)


class BatchRunner:
    """Executes batches for one worker process; shared by its Celery pool threads."""

    def __init__(self, engine: Engine, ledger: Ledger) -> None:
        self.engine = engine
        self.ledger = ledger
        self.settings = engine.settings
        self._sinks: dict[str, Sink] = {}
        self.sink_checks = SinkChecks(engine.worker, self.settings.sink_recheck_s)
        # Per pool thread: whether this thread's batch still counts as loading in the backlog.
        self._loading = threading.local()
        self._quality, self._checkpoints = engine.run(self._register())

    async def _register(self) -> tuple[QualityWatch, CheckpointWriter]:
        live = self.engine.live
        quality = QualityWatch(live)
        failures = breaker.Breaker(live, breaker.Limits.of(self.settings), quality.trip)
        writer = CheckpointWriter(live.r, self.engine.worker, quality.judge, quality.window,
                                  self.settings.checkpoint_window_s, failures.judge,
                                  failures.kept)
        return quality, writer

    async def _watch(self, job: str, manifest: JobManifest) -> None:
        # Runs on the loop, where the canary reads its thresholds and held jobs.
        self._quality.watch(job, manifest.canary, manifest.answers)
        self._quality.hold(job, False)  # the job is running again (checked in _run)

    def sink(self, uri: str) -> Sink:
        if uri not in self._sinks:
            self._sinks[uri] = open_sink(uri, addressing_style=self.settings.s3_addressing_style)
        return self._sinks[uri]

    def run(self, job: str, batch: str) -> Outcome:
        backlog = self.engine.backlog
        backlog.add(batches=1, loading=1)
        self._loading.value = True
        try:
            return self._run(job, batch)
        finally:
            if self._loading.value:
                backlog.add(loading=-1)
            backlog.add(batches=-1)

    def _run(self, job: str, batch: str) -> Outcome:
        manifest = self.ledger.jobs.load(job)
        state, _ = self.ledger.jobs.state(job)
        if state != STATE_RUNNING:
            # Paused or cancelled: drop this delivery; `resume` re-dispatches what is not done.
            self.ledger.batches.unqueue(job, batch)
            return Outcome(status=f"skipped-{state}", batch=batch)
        self.engine.run(self._watch(job, manifest))
        # Before the lease: a job whose output this worker cannot use goes back unstarted.
        sink = self.sink_checks.require(job, lambda: self.sink(manifest.output))
        if self.ledger.batches.is_done(job, batch):
            self.ledger.batches.finish(job, batch, {}, self.engine.worker, [])
            return Outcome(status="already-done", batch=batch)
        token = f"{self.engine.worker}/{uuid.uuid4().hex[:12]}"
        attempt = self.ledger.leases.acquire(job, batch, token, self.settings.lease_ttl_s)
        if attempt is None:
            return Outcome(status="owned-elsewhere", batch=batch)
        return self._run_leased(manifest, sink, batch, token, attempt)

    def _run_leased(self, manifest: JobManifest, sink: Sink, batch: str, token: str,
                    attempt: int) -> Outcome:
        """Run the batch under the lease `token` holds, then release it, its attempt spent or
        refunded as `ending` says."""
        job = manifest.name
        # Renewed from here to the release: reading the input, generating and writing may each
        # wait out a sink outage, and a lease that lapsed meanwhile would send the batch to
        # another worker and spend an attempt.
        heartbeat = self.engine.run(self._start_heartbeat(job, batch, token))
        started = time.monotonic()
        try:
            outcome = self._leased(manifest, sink, batch, heartbeat, attempt)
            end = ending(outcome)
            return outcome
        except BaseException as exc:
            end = ending(exc)
            if end.spent:
                self._note_cause(job, batch, exc)
            if not end.handled:
                raise
            # Stopped without writing: finished prompts stay in the checkpoint for whoever
            # runs the batch next.
            log.warning("batch %s/%s: %s (%s)", job, batch, end.status, exc)
            return Outcome(status=end.status, batch=batch, attempt=attempt)
        finally:
            self._release(job, batch, token, heartbeat, end)
            metrics.batch_finished(job, self.engine.worker, self.engine.server_url,
                                   duration_s=time.monotonic() - started, status=end.status)

    def _note_cause(self, job: str, batch: str, exc: BaseException) -> None:
        """Keep why the batch spent an attempt: the reason its prompts get at the limit."""
        cause = f"{self.engine.worker}: {type(exc).__name__}: {exc}"
        on_redis(f"batch {job}/{batch}: note cause",
                 lambda: self.ledger.leases.note_cause(job, batch, cause))

    def _release(self, job: str, batch: str, token: str, heartbeat: asyncio.Task[None],
                 end: Ending) -> None:
        """Stop the heartbeat and give the lease back, refunding the attempt unless the run
        spent it."""
        self.engine.run(stop_heartbeat(heartbeat))
        released = on_redis(f"batch {job}/{batch}: release",
                            lambda: self.ledger.leases.release(job, batch, token, refund=not end.spent))
        if end.lease_lost and not released:
            on_redis(f"batch {job}/{batch}: refund", lambda: self.ledger.leases.refund(job, batch))

    async def _start_heartbeat(self, job: str, batch: str, token: str) -> asyncio.Task[None]:
        return asyncio.create_task(keep_lease(self.engine.live, self.settings, job, batch, token,
                                              self._quality.hold))

    def _sink_call(self, call: Callable[[], T]) -> T:
        """A sink read or write, ridden through an outage up to the sink deadline."""
        return on_sink(call, deadline_s=self.settings.sink_retry_deadline_s)

    def _leased(
        self, manifest: JobManifest, sink: Sink, batch: str, heartbeat: asyncio.Task[None],
        attempt: int,
    ) -> Outcome:
        """The batch's work under its lease: counted from the sink if a copy wrote it already,
        else generated from its checkpoint on and written."""
        job = manifest.name
        if self._sink_call(lambda: sink.exists(keys.sink_result(job, batch))):
            # Written, but its worker died before recording it: count it from the sink.
            counts = written_counts(self._sink_call(lambda: list(batch_records(sink, job, batch))))
            self.ledger.batches.finish(job, batch, counts, self.engine.worker, [])
            return Outcome(status="already-done", batch=batch, attempt=attempt)
        return self._generate_and_write(manifest, sink, batch, heartbeat, attempt)

    def _generate_and_write(
        self, manifest: JobManifest, sink: Sink, batch: str, heartbeat: asyncio.Task[None],
        attempt: int,
    ) -> Outcome:
        """Read the input, send what the checkpoint lacks (or fail it past the attempts'
        limit), write the batch's objects and record it."""
        job = manifest.name
        raw = self._sink_call(lambda: sink.get(keys.sink_input(job, batch)))
        if raw is None:
            # Enqueue makes a job runnable only once every input is stored, so this input was
            # removed since: stop the job where an operator sees it, spend nothing.
            where = sink.describe(keys.sink_input(job, batch))
            self.ledger.jobs.set_state(job, STATE_PAUSED, f"input of batch {batch} is missing "
                                  f"({where}); re-run the job's enqueue command to restore it")
            raise JobError(f"{where} is missing")
        prompts = [Prompt(**orjson.loads(line)) for line in raw.splitlines() if line]
        finished = self.ledger.batches.checkpoint(job, batch)
        origin = Origin(self.engine.server_url, self.engine.worker, attempt)
        todo = [p for p in prompts if p.key not in finished]
        if todo and attempt > self.settings.batch_max_attempts:
            attempt = self._settled_attempts(job, batch, attempt)
            origin = Origin(self.engine.server_url, self.engine.worker, attempt)
        if todo and attempt > self.settings.batch_max_attempts:
            new = self.engine.run(self._give_up(manifest, batch, todo, origin))
            finished.update(new)
            todo = []
        self.engine.backlog.add(loading=-1, unsent=len(todo))
        self._loading.value = False
        if todo:
            log.info("batch %s/%s: %d prompts (%d resumed), attempt %d",
                     job, batch, len(todo), len(prompts) - len(todo), attempt)
            try:
                new = self.engine.run(self._generate(manifest, batch, todo, heartbeat, origin))
            except ModelChoiceError as exc:
                # Every prompt would fail the same way: stop the job where an operator sees it.
                self.ledger.jobs.set_state(job, STATE_PAUSED, f"model: {exc}")
                raise
            finished.update(new)
        self._write(manifest, sink, batch, prompts, finished)
        failed = sum(1 for r in finished.values() if is_failure(r))
        return Outcome("done", batch, len(prompts) - failed, failed, len(prompts) - len(todo), attempt)

    def _settled_attempts(self, job: str, batch: str, attempt: int) -> int:
        """The batch's spent attempts once late refunds have landed (this one included).

        A live worker that lost its lease in a Redis outage gives its attempt back only when
        Redis is back, which can be after the reconciler re-dispatched the batch and this copy
        counted it. Before failing prompts on the limit, wait one lease period for them.
        """
        deadline = time.monotonic() + self.settings.lease_ttl_s
        while attempt > self.settings.batch_max_attempts and time.monotonic() < deadline:
            time.sleep(min(1.0, self.settings.lease_renew_s))
            attempt = on_redis(f"batch {job}/{batch}: attempts",
                               lambda: self.ledger.leases.attempts(job, batch))
        return attempt

    async def _give_up(
        self, manifest: JobManifest, batch: str, todo: list[Prompt], origin: Origin
    ) -> dict[str, OutputRecord]:
        """Fail a poison batch's unsent prompts, saying exactly why; checkpointed (and so
        counted) like any other outcome."""
        job = manifest.name
        cause = await asyncio.to_thread(self.ledger.leases.last_cause, job, batch)
        reason = (f"not sent: batch {batch} was started {origin.attempt - 1} times and never "
                  f"finished (each time its worker died, lost its lease or failed; limit "
                  f"FLEETGEN_BATCH_MAX_ATTEMPTS={self.settings.batch_max_attempts})"
                  + (f"; last cause: {cause}" if cause else ""))
        log.error("batch %s/%s: %s; failing %d prompts", job, batch, reason, len(todo))
        records: dict[str, OutputRecord] = {}
        for p in todo:
            records[p.key] = error_record(p.id, p.line, reason, None, origin, 0,
                                          code=UNSENT_ATTEMPTS_EXHAUSTED, sample=p.sample)
            await self._checkpoint(manifest, batch, p, records[p.key])
        return records

    def _write(
        self, manifest: JobManifest, sink: Sink, batch: str, prompts: list[Prompt],
        finished: dict[str, OutputRecord],
    ) -> None:
        job = manifest.name
        ordered = [finished[p.key] for p in prompts]
        good = [r for r in ordered if not is_failure(r)]
        bad = [r for r in ordered if is_failure(r)]
        size = 0
        if bad:
            data = b"".join(orjson.dumps(r) + b"\n" for r in bad)
            self._sink_call(lambda: sink.put_new(keys.sink_errors(job, batch), data))
            size += len(data)
        data = b"".join(orjson.dumps(r) + b"\n" for r in good)
        wrote = self._sink_call(lambda: sink.put_new(keys.sink_result(job, batch), data))
        size += len(data) if wrote else 0
        # The result object is written last, so when it exists the errors object is complete;
        # if another copy wrote it first, count what the sink holds, not what this copy made.
        counts = written_counts(ordered if wrote else self._sink_call(
            lambda: list(batch_records(sink, job, batch))))
        reasons = [orjson.dumps({"batch": batch, **r["error"], "id": r["custom_id"]}) for r in bad]
        on_redis(f"batch {job}/{batch}: finish", lambda: self.ledger.batches.finish(
            job, batch, counts, self.engine.worker, reasons if wrote else [], size))

    async def _generate(
        self, manifest: JobManifest, batch: str, todo: list[Prompt], heartbeat: asyncio.Task[None],
        origin: Origin,
    ) -> dict[str, OutputRecord]:
        try:
            async with asyncio.TaskGroup() as group:
                # A lost lease or a cancelled job (the heartbeat ends with it) stops the batch.
                watch = group.create_task(follow(heartbeat))
                asks = [group.create_task(self._ask(manifest, batch, ask, origin))
                        for ask in _asks(todo)]
                # The asks are todo's answers cut in order: their outcomes line up with it.
                records = [r for outcomes in await asyncio.gather(*asks) for r in outcomes]
                await cancel(watch)
        except BaseExceptionGroup as group_error:
            # One cause is enough: a lost lease or a dead server stops the whole batch.
            raise group_error.exceptions[0] from None
        results = {p.key: r for p, r in zip(todo, records, strict=True) if isinstance(r, dict)}
        held = {r.why for r in records if isinstance(r, _Held)}
        unsent = len(todo) - len(results)
        if _Held.STOPPING in held:
            raise WorkerStoppingError(f"worker {self.engine.worker} is stopping; batch "
                                      f"{manifest.name}/{batch} handed back with {unsent} prompts unsent")
        if _Held.OUT in held:
            raise ServerSickError(
                f"{self.engine.server_url} went out of rotation "
                f"({self.engine.watch.rotation.reason or 'since back'}); batch "
                f"{manifest.name}/{batch} handed back with {unsent} prompts unsent")
        if unsent:
            # Paused mid-batch: requests already sent finished and are checkpointed; the rest
            # were not sent. The batch is released unwritten and resumed by `resume`.
            raise JobNotRunningError(
                f"job {manifest.name} paused; batch {batch} stopped with {unsent} prompts unsent")
        return results

    async def _ask(
        self, manifest: JobManifest, batch: str, ask: list[Prompt], origin: Origin,
    ) -> list[OutputRecord | _Held]:
        """The checkpointed records of one prompt's answers (`_asks`), or why each was not
        sent: one request with `n` where the server takes it, else one request each."""
        if len(ask) > 1 and await self._takes_n():
            try:
                return await self._prompt(manifest, batch, ask, origin)
            except _Split:
                pass  # learned just now: one request each, below
        if len(ask) == 1:
            return await self._prompt(manifest, batch, ask, origin)
        singles = await asyncio.gather(*(self._prompt(manifest, batch, [p], origin) for p in ask))
        return [r for outcomes in singles for r in outcomes]

    async def _takes_n(self) -> bool:
        """Whether the server takes `n`, once it is found; a server not found within the
        down-wait is sent one request per answer (always right; each request then waits for
        the server on its own)."""
        with contextlib.suppress(ServerDownError):
            return (await self.engine.connected(self.settings.server_down_wait_s)).takes_n
        return False

    async def _prompt(
        self, manifest: JobManifest, batch: str, ask: list[Prompt], origin: Origin,
    ) -> list[OutputRecord | _Held]:
        """The checkpointed records of the answers of one request, or why it was not sent
        (`_Held`, for each); `_Split` when the server refused `n`."""
        delivery = _Delivery(self.engine.backlog, len(ask))
        try:
            records = await self._generate_one(manifest, ask, origin, delivery)
        except _Held as held:
            return [held] * len(ask)
        except _Split:
            delivery.hand_on()
            raise
        finally:
            delivery.ends()
        for prompt, record in zip(ask, records, strict=True):
            _observe(manifest.name, record, delivery.queue_wait_s, origin)
            await self._checkpoint(manifest, batch, prompt, record)
        return list(records)

    async def _generate_one(
        self, manifest: JobManifest, ask: list[Prompt], origin: Origin, delivery: _Delivery
    ) -> list[OutputRecord]:
        """The final records (answers or failures) of one request's answers, in `ask`'s order.

        A server-caused failure (5xx, reset, timeout) is tried again under the one backoff
        policy (fleetgen/retry.py) and the server's resend budget; a 4xx fails the request's
        answers at once; a full or down server spends no attempt. A request whose tries all
        failed fails its answers only if the server is shown to work (it answered others
        meanwhile, or a probe); otherwise the server goes out of rotation and the answers back
        unsent (`_Held`).
        """
        settings = self.settings
        watch = self.engine.watch
        tries = 0
        answers = watch.rotation.answers

        async def one_try() -> tuple[ChatCompletion, float]:
            nonlocal tries
            tries += 1
            if tries == 1:
                watch.budget.first_try()
            else:
                await watch.budget.resend()
            return await self._send(manifest, ask, origin, delivery)

        try:
            response, latency = await with_attempts(
                f"prompt {_name(ask)}", one_try, settings.prompt_max_attempts,
                settings.retry_backoff_s, settings.retry_backoff_max_s)
        except BadRequestError as exc:
            return [error_record(p.id, p.line, exc.message, exc.status, origin, tries,
                                 sample=p.sample) for p in ask]
        except RetryableError as exc:
            if not await self._prompt_at_fault(exc, answers, tries):
                raise _Held(_Held.OUT) from None
            return [error_record(p.id, p.line, exc.message, exc.status, origin, tries,
                                 sample=p.sample) for p in ask]
        replies = split_choices(response) if len(ask) > 1 else [response]
        return [result_record(p.id, p.line, reply, latency, origin, p.sample)
                for p, reply in zip(ask, replies, strict=True)]

    async def _prompt_at_fault(self, exc: RetryableError, answers: int, tries: int) -> bool:
        """Whether a prompt whose every try failed for a server-side reason failed for its own:
        the server answered other requests since its first try, or answers a probe now. If not,
        the server is taken out of rotation."""
        engine = self.engine
        if not engine.in_rotation:
            return False
        if engine.watch.rotation.answers > answers:
            return True
        try:
            await engine.probe()
        except (BadRequestError, OverloadedError):
            return True
        except GenerationError as probe_error:
            engine.eject(f"a prompt's {tries} tries failed ({exc.message[:120]}) and so did a "
                         f"probe ({probe_error.message[:120]})")
            return False
        return True

    async def _send(
        self, manifest: JobManifest, ask: list[Prompt], origin: Origin, delivery: _Delivery,
    ) -> tuple[ChatCompletion, float]:
        """One try: a slot per answer, the request (`n` of them when `ask` holds several, with
        the first one's body and seed), its answer and latency.

        What spends nothing is handled here: a server found down is waited for
        (ServerDownError past FLEETGEN_SERVER_DOWN_WAIT_S); a full one (429, 503) is sent
        again after its Retry-After or a backoff, under a cut ceiling; a refusal of what
        fleetgen added on its own (a field, the model name) is learned and the request sent
        again at once. A server-caused failure is counted toward taking the server out of
        rotation, and raised for the prompt's attempts."""
        job = manifest.name
        prompt = ask[0]
        thinking = manifest.params.thinking_of(prompt.body)
        engine = self.engine
        while True:
            try:
                server = await engine.connected(self.settings.server_down_wait_s)
                if len(ask) > 1 and not server.takes_n:
                    raise _Split
                body = server.prepare(prompt.body, thinking=thinking, n=len(ask))
                waited = time.monotonic()
                async with engine.limiter.slots(len(ask)):
                    self._may_send(job)
                    delivery.leaves()
                    delivery.queue_wait_s += time.monotonic() - waited
                    start, response = await self._exchange(job, _name(ask), body, origin)
                latency = time.monotonic() - start
                for _ in ask:
                    engine.answered()
                return response, latency
            except OverloadedError:
                # Refused, and /health fails too: a server starting or draining, not a full one.
                delivery.server_lost()
                engine.server_failed()
                await engine.wait_ready(self.settings.server_down_wait_s)
            except BadRequestError as exc:
                engine.refused(exc)
                learned = server.learn(exc.status, exc.message, body, prompt.body)
                if learned is not None:
                    log.warning("worker %s: %s %s (it answered %s)", engine.worker,
                                engine.server_url, learned, exc.message[:200])
                elif len(ask) > 1 and not server.takes_n:
                    raise _Split from None  # another request learned it meanwhile
                elif not server.resend(body, prompt.body, thinking=thinking):
                    raise
            except RetryableError as exc:
                if engine.request_failed(exc):
                    raise _Held(_Held.OUT) from None  # the prompt goes back unsent
                raise
            except ServerDownError as exc:
                # Not the prompt's fault: wait for the server, spend no attempt.
                engine.server_failed()
                delivery.server_lost()
                waited = time.monotonic()
                await engine.wait_ready(self.settings.server_down_wait_s)
                if time.monotonic() - waited < UP_AT_ONCE_S:
                    # /health answered at once: the server is up and dropped this request (a
                    # reset): its failure, counted and resent within the budget like a 5xx.
                    if engine.request_failed(exc):
                        raise _Held(_Held.OUT) from None
                    await engine.watch.budget.resend()

    def _may_send(self, job: str) -> None:
        """Raise `_Held` when the prompt must not be sent now, with why."""
        engine = self.engine
        if engine.draining:
            raise _Held(_Held.STOPPING)
        if job in self._quality.held:
            raise _Held(_Held.PAUSED)
        if not engine.in_rotation:
            raise _Held(_Held.OUT)

    async def _exchange(self, job: str, name: str, body: RequestBody,
                        origin: Origin) -> tuple[float, ChatCompletion]:
        """The request and its answer, holding a slot: when and what it was answered. A
        refusal for a full server is waited out here, the slot kept, so that it frees no slot
        for the next request to be refused in turn; the wait is the server's Retry-After or the
        backoff, then a resend token. A refusal while /health fails too is raised (down)."""
        engine = self.engine
        refusals = 0
        while True:
            start = time.monotonic()
            metrics.request_started(job, origin.worker, origin.server)
            try:
                return start, await engine.client.chat(body)
            except OverloadedError as exc:
                if engine.health_failures:
                    raise
                refusals += 1
                wait_s = engine.overloaded(exc, refusals)
                log.debug("prompt %s: %s; sending again in %.1fs", name, exc.message, wait_s)
            finally:
                metrics.request_ended(job, origin.worker, origin.server)
            await asyncio.sleep(wait_s)
            await engine.watch.budget.resend()
            self._may_send(job)

    async def _checkpoint(
        self, manifest: JobManifest, batch: str, prompt: Prompt, record: OutputRecord
    ) -> None:
        thinking = manifest.params.thinking_of(prompt.body)
        await self._checkpoints.add(Entry(
            job=manifest.name, batch=batch, prompt_id=prompt.key, record=orjson.dumps(record),
            counters=counters(record, thinking=thinking),
            fact=self._quality.fact(manifest.name, record, thinking),
            outcome=breaker.outcome(record),
        ))


def _asks(todo: list[Prompt]) -> list[list[Prompt]]:
    """`todo` cut, in order, into what one request each may carry: the answers of one prompt
    that sit together (a batch input lists a prompt's answers in index order), an answer of a
    one-answer job alone."""
    asks: list[list[Prompt]] = []
    for prompt in todo:
        last = asks[-1][-1] if asks else None
        if (last is not None and prompt.sample is not None and last.sample is not None
                and last.id == prompt.id):
            asks[-1].append(prompt)
        else:
            asks.append([prompt])
    return asks


def _name(ask: list[Prompt]) -> str:
    """A request's name in the log: its answer's key, or its prompt's id and answers."""
    if len(ask) == 1:
        return ask[0].key
    return f"{ask[0].id} (answers {', '.join(str(p.sample) for p in ask)})"


def _observe(job: str, record: OutputRecord, queue_wait_s: float, origin: Origin) -> None:
    if is_failure(record):
        metrics.prompt_finished(
            job, origin.worker, origin.server, ok=False, finish_reason=None,
            error_code=record["error"]["code"], input_tokens=0, output_tokens=0,
            reasoning_tokens=0, latency_s=0.0, queue_wait_s=queue_wait_s)
        return
    usage = record["usage"]
    metrics.prompt_finished(
        job, origin.worker, origin.server, ok=True, finish_reason=record["finish_reason"],
        error_code=None, input_tokens=usage["prompt_tokens"],
        output_tokens=usage["completion_tokens"], reasoning_tokens=usage["reasoning_tokens"],
        latency_s=record["latency_s"], queue_wait_s=queue_wait_s,
    )
