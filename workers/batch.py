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
An embeddings (or classify) job's prompts go several to a request (`_embed_asks`): their texts
in one `input`, the vectors (or classes) split back by prompt; a request refused for its content (a text too long)
is sent again one prompt at a time, so that the refusal falls on its own prompt alone.

An embeddings job's answers are the exception to the first rule: they are not checkpointed
(a vector is kilobytes, most of Redis's cost per record, and the batch's texts are seconds of
a GPU), so the batch is their group: they wait in memory for the batch's write, a crash loses
that batch's answers and its next run asks them again, and its recording counts them once
(`Batches.finish_and_settle`, `records.answered_counts`). Its failures are checkpointed as any.

The batch's lease (workers/lease.py) is taken once and ended once; the requests go through the
worker's view of its server (workers/backend.py), the one place that knows its limit, health
and rotation; what the worker holds is counted in its backlog (workers/backlog.py) for the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from fleetgen import breaker, canary, keys
from fleetgen.causes import job_caused
from fleetgen.checkpoints import Entry
from fleetgen.endpoints import CHAT, CLASSIFY, EMBEDDINGS, Endpoint
from fleetgen.errors import (
    BadRequestError,
    EndpointError,
    JobError,
    JobNotRunningError,
    ModelChoiceError,
    RequestHeldError,
    RetryableError,
    ServerSickError,
    WorkerStoppingError,
)
from fleetgen.job import JobManifest
from fleetgen.ledger import STATE_PAUSED, STATE_RUNNING, Ledger
from fleetgen.liveledger import Checkpoints, LiveLedger
from fleetgen.records import (
    UNSENT_ATTEMPTS_EXHAUSTED,
    Origin,
    OutputRecord,
    answer_key,
    answered_counts,
    classified_record,
    counters,
    embedding_record,
    error_record,
    is_failure,
    result_record,
    split_choices,
    split_pooled,
    written_counts,
)
from fleetgen.retry import on_redis, on_sink, with_attempts
from fleetgen.rollouts import Rollout, RolloutSpec
from fleetgen.servers import ChatCompletion, RequestBody
from fleetgen.settings import Settings
from fleetgen.sink import Sink, batch_records, open_sink
from workers import metrics
from workers.backend import Backend, Request
from workers.backlog import Backlog, Delivery
from workers.bridge import LoopThread
from workers.heartbeat import cancel
from workers.lease import Lease
from workers.preflight import SinkChecks
from workers.quality import QualityWatch
from workers.rollouts import Programs

log = logging.getLogger(__name__)
T = TypeVar("T")


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


# Where each answer's record goes the moment it is final (BatchRunner._checkpoint).
Checkpoint = Callable[[JobManifest, str, Prompt, OutputRecord], Awaitable[None]]


@dataclass
class Outcome:
    """How one delivery of a batch ended here, and its counts (the task's result)."""

    status: str
    batch: str
    done: int = 0
    failed: int = 0
    resumed: int = 0
    attempt: int = 0


class BatchRunner:
    """Executes batches for one worker process; shared by its Celery pool threads."""

    def __init__(self, settings: Settings, loop: LoopThread, backend: Backend, live: LiveLedger,
                 ledger: Ledger) -> None:
        self.settings = settings
        self.loop = loop
        self.backend = backend
        self.ledger = ledger
        self.worker = backend.worker
        self._live = live
        self._sinks: dict[str, Sink] = {}
        self.sink_checks = SinkChecks(self.worker, settings.sink_recheck_s)
        # What this worker holds, for the consumer gate (gate.py).
        self.backlog = Backlog()
        # Per pool thread: whether this thread's batch still counts as loading in the backlog.
        self._loading = threading.local()
        # Per batch being answered: how many of its answers are still to be checkpointed.
        self._left: dict[tuple[str, str], int] = {}
        self._quality, self._checkpoints = loop.run(self._register())
        self._sender = _Sender(settings, backend, self.backlog, self._quality, self._checkpoint,
                               live)
        # The jobs' programs per prompt (workers/rollouts.py).
        self.programs = self._sender.programs

    async def _register(self) -> tuple[QualityWatch, Checkpoints]:
        live = self._live
        quality = QualityWatch(live)
        failures = breaker.Breaker(live, breaker.Limits.of(self.settings), quality.trip)
        writer = live.checkpoint_writer(self.worker, quality.judge, quality.window,
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
        backlog = self.backlog
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
        self.loop.run(self._watch(job, manifest))
        # Before the lease: a job whose output this worker cannot use, whose rollout it cannot
        # run as the job's, or whose kind of request its server does not serve goes back
        # unstarted.
        sink = self.sink_checks.require(job, lambda: self.sink(manifest.output))
        if manifest.rollout is not None:
            self.programs.require(manifest)
        self._require_endpoint(manifest)
        if self.ledger.batches.is_done(job, batch):
            self.ledger.batches.finish_and_settle(job, batch, {}, self.worker, [])
            return Outcome(status="already-done", batch=batch)
        lease = Lease.acquire(self.ledger, self.loop, self._live, self.settings, self.worker,
                              job, batch, self._quality.hold)
        if lease is None:
            return Outcome(status="owned-elsewhere", batch=batch)
        return self._run_leased(manifest, sink, lease)

    def _require_endpoint(self, manifest: JobManifest) -> None:
        """EndpointError when this worker's server is known to serve another kind of request
        than the job's (`Server.serves`): a pooling model (`--is-embedding`) answers embeddings
        and classify only, a generation model never does. Unknown (a server that does not say),
        the job's requests go, and a refusal is the server's to give."""
        server = self.backend.discovery.server
        if server is None or server.serves(manifest.kind) is not False:
            return
        served = "a generation model" if not manifest.kind.generates else "an embedding model"
        raise EndpointError(
            f"worker {self.worker}: its server {self.backend.server_url} serves {served}; job "
            f"{manifest.name} asks {manifest.kind.path}: its batches go to other workers")

    def _run_leased(self, manifest: JobManifest, sink: Sink, lease: Lease) -> Outcome:
        """Run the batch under its lease, then end the lease, its attempt spent or refunded as
        `ending` says for what the run returned or raised."""
        job, batch = manifest.name, lease.batch
        started = time.monotonic()
        try:
            outcome = self._leased(manifest, sink, lease)
        except BaseException as exc:
            end = lease.end(exc)
            if not end.handled:
                raise
            # Stopped without writing: finished prompts stay in the checkpoint for whoever
            # runs the batch next (an embeddings batch's failures only: its answers go).
            log.warning("batch %s/%s: %s (%s)", job, batch, end.status, exc)
            return Outcome(status=end.status, batch=batch, attempt=lease.attempt)
        else:
            lease.end(outcome.status)
            return outcome
        finally:
            if lease.ending is not None:
                metrics.batch_finished(job, self.worker, self.backend.server_url,
                                       duration_s=time.monotonic() - started,
                                       status=lease.ending.status)

    def _sink_call(self, call: Callable[[], T]) -> T:
        """A sink read or write, ridden through an outage up to the sink deadline."""
        return on_sink(call, deadline_s=self.settings.sink_retry_deadline_s)

    def _leased(self, manifest: JobManifest, sink: Sink, lease: Lease) -> Outcome:
        """The batch's work under its lease: counted from the sink if a copy wrote it already,
        else generated from its checkpoint on and written."""
        job, batch = manifest.name, lease.batch
        if self._sink_call(lambda: sink.exists(keys.sink_result(job, batch))):
            # Written, but its worker died before recording it: count it from the sink.
            records = self._sink_call(lambda: list(batch_records(sink, job, batch)))
            live = (answered_counts(records, self.ledger.batches.checkpoint(job, batch))
                    if _batch_is_group(manifest) else {})
            self.ledger.batches.finish_and_settle(
                job, batch, written_counts(records), self.worker, [], live=live)
            return Outcome(status="already-done", batch=batch, attempt=lease.attempt)
        return self._generate_and_write(manifest, sink, lease)

    def _generate_and_write(self, manifest: JobManifest, sink: Sink, lease: Lease) -> Outcome:
        """Read the input, send what the checkpoint lacks (or fail it past the attempts'
        limit), write the batch's objects and record it."""
        job, batch, attempt = manifest.name, lease.batch, lease.attempt
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
        loaded = frozenset(finished)
        todo = [p for p in prompts if p.key not in finished]
        if todo and attempt > self.settings.batch_max_attempts:
            attempt = lease.settled_attempts()
        origin = Origin(self.backend.server_url, self.worker, attempt)
        if todo and attempt > self.settings.batch_max_attempts:
            with self._answering(job, batch, len(todo)):
                new = self.loop.run(self._give_up(manifest, batch, todo, origin))
            finished.update(new)
            todo = []
        self.backlog.add(loading=-1, unsent=len(todo))
        self._loading.value = False
        if todo:
            log.info("batch %s/%s: %d prompts (%d resumed), attempt %d",
                     job, batch, len(todo), len(prompts) - len(todo), attempt)
            try:
                with self._answering(job, batch, len(todo)):
                    new = self.loop.run(
                        self._sender.generate(manifest, batch, todo, lease, origin))
            except ModelChoiceError as exc:
                # Every prompt would fail the same way: stop the job where an operator sees it.
                self.ledger.jobs.set_state(job, STATE_PAUSED, f"model: {exc}")
                raise
            finished.update(new)
        self._write(manifest, sink, batch, prompts, finished, loaded)
        failed = sum(1 for r in finished.values() if is_failure(r))
        return Outcome("done", batch, len(prompts) - failed, failed, len(prompts) - len(todo), attempt)

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
        finished: dict[str, OutputRecord], loaded: frozenset[str],
    ) -> None:
        """Write the batch's objects, each once, and record it (`loaded`: the keys its
        checkpoint held when this run began, counted already)."""
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
        records = ordered if wrote else self._sink_call(
            lambda: list(batch_records(sink, job, batch)))
        counts = written_counts(records)
        live = answered_counts(records, loaded) if _batch_is_group(manifest) else {}
        reasons = [orjson.dumps({"batch": batch, **r["error"], "id": r["custom_id"]}) for r in bad]
        on_redis(f"batch {job}/{batch}: finish", lambda: self.ledger.batches.finish_and_settle(
            job, batch, counts, self.worker, reasons if wrote else [], size, live=live))

    @contextlib.contextmanager
    def _answering(self, job: str, batch: str, answers: int) -> Iterator[None]:
        """While `answers` of the batch are being made: `_checkpoint` counts them down, and
        the last closes its checkpoint group."""
        self._left[job, batch] = answers
        try:
            yield
        finally:
            self._left.pop((job, batch), None)

    async def _checkpoint(
        self, manifest: JobManifest, batch: str, prompt: Prompt, record: OutputRecord
    ) -> None:
        # A rollout's answer holds what its program returned: reasoning there is its choice,
        # so the canary does not count it missing.
        # A thinking model reasons in chat only: a raw completion continues its prompt as is.
        # The batch's last answer closes its group: the batch waits for nothing else.
        key = (manifest.name, batch)
        left = self._left.get(key)
        closes = left == 1
        if left is not None:
            self._left[key] = left - 1
        if _batch_is_group(manifest) and not is_failure(record):
            # The batch is an embedding's group: it waits for the batch's write (and is
            # counted by its recording); the breaker's window only learns it came.
            await self._checkpoints.answered(manifest.name, 1, closes=closes)
            return
        thinking = (manifest.rollout is None and manifest.endpoint == CHAT
                    and manifest.params.thinking_of(prompt.body))
        await self._checkpoints.add(Entry(
            job=manifest.name, batch=batch, prompt_id=prompt.key, record=orjson.dumps(record),
            counters=counters(record, thinking=thinking),
            # What the canary keeps of the answer, or nothing when it is off.
            fact=(canary.sample(record, thinking).to_json()
                  if self._quality.window(manifest.name) else b""),
            outcome=breaker.outcome(record),
            closes=closes,
        ))


class _Sender:
    """Sends a batch's unanswered prompts through the server's door (workers/backend.py
    `Backend.send`): a request per prompt's answers that sit together, tried under the prompt's
    attempts, each answer's record checkpointed as it is final."""

    def __init__(self, settings: Settings, backend: Backend, backlog: Backlog,
                 quality: QualityWatch, checkpoint: Checkpoint, live: LiveLedger) -> None:
        self.settings = settings
        self._backend = backend
        self._backlog = backlog
        self._quality = quality
        self._checkpoint = checkpoint
        self.programs = Programs(settings, live, backlog, self.send, self._held)

    def _held(self, job: str) -> str | None:
        return RequestHeldError.PAUSED if job in self._quality.held else None

    async def generate(
        self, manifest: JobManifest, batch: str, todo: list[Prompt], lease: Lease, origin: Origin,
    ) -> dict[str, OutputRecord]:
        """The records of `todo`'s answers by key, each checkpointed as it came; why the batch
        stops (raised) when some were not sent: the worker stopping, the server out of
        rotation, the job paused, the lease lost."""
        try:
            async with asyncio.TaskGroup() as group:
                # A lost lease or a cancelled job (the heartbeat ends with it) stops the batch.
                watch = group.create_task(lease.held())
                spec = manifest.rollout_spec
                if spec is not None:
                    # Loaded (and checked) before the lease: here it comes from the cache.
                    rollout = self.programs.require(manifest)
                    journal = await self.programs.journal(manifest.name, batch)
                    asks = [group.create_task(self._program(
                        manifest, spec, rollout, batch, prompt, origin,
                        journal.get(prompt.key, {}))) for prompt in todo]
                elif not manifest.kind.generates:
                    size = _texts_per_request(self._backend.in_flight.limit)
                    asks = [group.create_task(self._embed(manifest, batch, ask, origin))
                            for ask in _embed_asks(todo, manifest.kind, size)]
                else:
                    asks = [group.create_task(self._ask(manifest, batch, ask, origin))
                            for ask in _asks(todo)]
                # The asks are todo's answers cut in order: their outcomes line up with it.
                records = [r for outcomes in await asyncio.gather(*asks) for r in outcomes]
                await cancel(watch)
        except BaseExceptionGroup as group_error:
            # One cause is enough: a lost lease or a dead server stops the whole batch.
            raise group_error.exceptions[0] from None
        results = {p.key: r for p, r in zip(todo, records, strict=True) if isinstance(r, dict)}
        held = {r.why for r in records if isinstance(r, RequestHeldError)}
        unsent = len(todo) - len(results)
        where = f"batch {manifest.name}/{batch} handed back with {unsent} prompts unsent"
        if RequestHeldError.STOPPING in held:
            raise WorkerStoppingError(f"worker {origin.worker} is stopping; {where}")
        if RequestHeldError.OUT in held:
            reason = next(r.message for r in records if isinstance(r, RequestHeldError)
                          and r.why == RequestHeldError.OUT)
            raise ServerSickError(f"{origin.server} {reason}; {where}")
        if unsent:
            # Paused mid-batch: requests already sent finished and are checkpointed; the rest
            # were not sent. The batch is released unwritten and resumed by `resume`.
            raise JobNotRunningError(
                f"job {manifest.name} paused; batch {batch} stopped with {unsent} prompts unsent")
        return results

    async def _program(
        self, manifest: JobManifest, spec: RolloutSpec, rollout: Rollout, batch: str,
        prompt: Prompt, origin: Origin, journaled: dict[int, bytes],
    ) -> list[OutputRecord | RequestHeldError]:
        """The checkpointed record of one prompt whose job runs a rollout, or why it was not
        finished here (workers/rollouts.py)."""
        outcome = await self.programs.run(manifest, spec, rollout, batch, prompt, origin,
                                          journaled)
        if not isinstance(outcome, RequestHeldError):
            _observe(manifest.name, outcome, 0.0, origin)
            await self._checkpoint(manifest, batch, prompt, outcome)
        return [outcome]

    async def _ask(
        self, manifest: JobManifest, batch: str, ask: list[Prompt], origin: Origin,
    ) -> list[OutputRecord | RequestHeldError]:
        """The checkpointed records of one prompt's answers (`_asks`), or why each was not
        sent: one request with `n` where the server takes it, else one request each."""
        if len(ask) > 1 and await self._backend.takes_n():
            outcomes = await self._prompt(manifest, batch, ask, origin)
            if not any(isinstance(o, RequestHeldError) and o.why == RequestHeldError.SPLIT
                       for o in outcomes):
                return outcomes
            # learned just now: one request each, below
        if len(ask) == 1:
            return await self._prompt(manifest, batch, ask, origin)
        singles = await asyncio.gather(*(self._prompt(manifest, batch, [p], origin) for p in ask))
        return [r for outcomes in singles for r in outcomes]

    async def _embed(
        self, manifest: JobManifest, batch: str, ask: list[Prompt], origin: Origin,
    ) -> list[OutputRecord | RequestHeldError]:
        """The checkpointed records of the prompts of one embeddings request (`_embed_asks`),
        or why each was not sent. Refused for its content, a request of several prompts goes
        again one prompt at a time: the text too long fails its own prompt only."""
        job, kind = manifest.name, manifest.kind
        texts: list[str] = []
        counts: list[int] = []
        weights: list[int] = []  # each prompt's characters: its share of the prompt tokens
        for prompt in ask:
            # Its texts: a string, a list of strings, or one text of token ids (sent alone).
            given = prompt.body["input"]
            mine = (given if isinstance(given, list) and given and isinstance(given[0], str)
                    else [given])
            counts.append(len(mine))
            weights.append(sum(len(t) for t in mine))
            texts.extend(str(t) for t in mine)
        first = ask[0].body
        body: RequestBody = ({**first, "encoding_format": "base64"} if kind.name == EMBEDDINGS
                             else {**first})
        if len(ask) > 1:
            body["input"] = texts
        delivery = Delivery(self._backlog, len(ask))
        request = Request(body, job, _name(ask), ask[0].key, endpoint=kind,
                          hold=lambda: self._held(job), delivery=delivery)
        try:
            response, latency, _ = await self.send(request)
        except RequestHeldError as held:
            return [held] * len(ask)
        except BadRequestError as exc:
            if len(ask) > 1 and not job_caused(exc.code or ""):
                delivery.hand_on()
                singles = await asyncio.gather(
                    *(self._embed(manifest, batch, [p], origin) for p in ask))
                return [r for outcomes in singles for r in outcomes]
            records = self._failed(ask, exc, origin)
        except RetryableError as exc:
            records = self._failed(ask, exc, origin)
        else:
            records = [_pooled_answer(kind, p, items, tokens, latency, origin)
                       for p, (items, tokens) in zip(
                           ask, split_pooled(response, counts, weights), strict=True)]
        finally:
            delivery.ends()
        await self._answered(manifest, batch, ask, records, request.queue_wait_s, origin)
        return list(records)

    async def _answered(self, manifest: JobManifest, batch: str, ask: list[Prompt],
                        records: list[OutputRecord], queue_wait_s: float,
                        origin: Origin) -> None:
        """One request's final records, `ask`'s, observed and checkpointed: together, so that
        they go in one checkpoint group."""
        for record in records:
            _observe(manifest.name, record, queue_wait_s, origin)
        await asyncio.gather(*(self._checkpoint(manifest, batch, prompt, record)
                               for prompt, record in zip(ask, records, strict=True)))

    @staticmethod
    def _failed(ask: list[Prompt], exc: BadRequestError | RetryableError,
                origin: Origin) -> list[OutputRecord]:
        return [error_record(p.id, p.line, exc.message, exc.status, origin, exc.tries,
                             code=exc.code, sample=p.sample) for p in ask]

    async def _prompt(
        self, manifest: JobManifest, batch: str, ask: list[Prompt], origin: Origin,
    ) -> list[OutputRecord | RequestHeldError]:
        """The checkpointed records of the answers of one request, or why it was not sent
        (RequestHeldError, for each; SPLIT when the server refused `n`)."""
        delivery = Delivery(self._backlog, len(ask))
        job, first = manifest.name, ask[0]
        request = Request(first.body, job, _name(ask), first.key, n=len(ask),
                          thinking=manifest.params.thinking_of(first.body),
                          endpoint=manifest.kind, hold=lambda: self._held(job),
                          delivery=delivery)
        try:
            records = await self._generate_one(request, ask, origin)
        except RequestHeldError as held:
            if held.why == RequestHeldError.SPLIT:
                delivery.hand_on()
            return [held] * len(ask)
        finally:
            delivery.ends()
        await self._answered(manifest, batch, ask, records, request.queue_wait_s, origin)
        return list(records)

    async def _generate_one(self, request: Request, ask: list[Prompt],
                            origin: Origin) -> list[OutputRecord]:
        """The final records (answers or failures) of one request's answers, in `ask`'s order
        (`send` says how a request ends)."""
        try:
            response, latency, _ = await self.send(request)
        except (BadRequestError, RetryableError) as exc:
            return [error_record(p.id, p.line, exc.message, exc.status, origin, exc.tries,
                                 code=exc.code, sample=p.sample) for p in ask]
        replies = split_choices(response) if len(ask) > 1 else [response]
        return [result_record(p.id, p.line, reply, latency, origin, p.sample)
                for p, reply in zip(ask, replies, strict=True)]

    async def send(self, request: Request) -> tuple[ChatCompletion, float, int]:
        """One request through the door under its attempts: its completion, latency and the
        tries it took, or its final failure, `tries` set on it.

        A server-caused failure (5xx, reset, timeout) is tried again under the one backoff
        policy (fleetgen/retry.py); a refusal (BadRequestError) ends it at once. A request
        whose tries all failed ends in its RetryableError only if the server is shown to work
        (it answered others meanwhile, or a probe); otherwise the server is out of rotation
        and the request goes back unsent (RequestHeldError)."""
        settings, backend = self.settings, self._backend
        tries = 0

        async def one_try() -> tuple[ChatCompletion, float]:
            nonlocal tries
            tries += 1
            request.resend = tries > 1
            return await backend.send(request)

        try:
            response, latency = await with_attempts(
                f"prompt {request.name}", one_try, settings.prompt_max_attempts,
                settings.retry_backoff_s, settings.retry_backoff_max_s)
        except BadRequestError as exc:
            exc.tries = tries
            raise
        except RetryableError as exc:
            if not await backend.settle(exc, request, tries):
                raise RequestHeldError(RequestHeldError.OUT) from None
            exc.tries = tries
            raise
        return response, latency, tries


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


# Texts sent in one embeddings request at most: the server runs each as a request of its own
# and batches them anyway, so many to a request cut the HTTP and JSON cost per text; a quarter
# of the worker's limit at most, so that several requests are in flight and one finishing frees
# slots for the next while the others run.
TEXTS_PER_REQUEST = 64


def _texts_per_request(limit: int) -> int:
    return max(1, min(TEXTS_PER_REQUEST, limit // 4))


def _embed_asks(todo: list[Prompt], kind: Endpoint, size: int) -> list[list[Prompt]]:
    """`todo` cut, in order, into embeddings requests of at most `size` texts: prompts of
    texts that ask alike (the same `dimensions`, user) go together; a prompt of token ids, or
    one of `size` texts or more, goes alone."""
    asks: list[list[Prompt]] = []
    held = 0
    for prompt in todo:
        texts = kind.inputs(prompt.body)
        last = asks[-1] if asks else None
        if (last is not None and held + texts <= size and _joinable(prompt)
                and _joinable(last[0]) and _alike(last[0], prompt)):
            last.append(prompt)
            held += texts
        else:
            asks.append([prompt])
            held = texts
    return asks


def _batch_is_group(manifest: JobManifest) -> bool:
    """Whether the job's answers skip the checkpoint, their batch being their group: an
    embeddings job's (a vector is kilobytes, most of Redis's cost per record, and a batch of
    texts is seconds of a GPU); they are counted by the batch's recording
    (`records.answered_counts`)."""
    return manifest.endpoint == EMBEDDINGS


def _pooled_answer(kind: Endpoint, prompt: Prompt, items: list[dict[str, Any]], tokens: int,
                   latency: float, origin: Origin) -> OutputRecord:
    """A prompt's record from its texts' entries of an embeddings or classify answer."""
    if kind.name == CLASSIFY:
        return classified_record(prompt.id, prompt.line, items, tokens, latency, origin)
    return embedding_record(prompt.id, prompt.line, items, tokens, latency, origin,
                            str(prompt.body.get("encoding_format") or "float"))


def _alike(a: Prompt, b: Prompt) -> bool:
    """Whether two embeddings prompts ask the same but for their texts (and the format they
    want the vectors in: every request asks base64, the record keeps what the line asked)."""
    def rest(p: Prompt) -> dict[str, object]:
        return {k: v for k, v in p.body.items() if k not in ("input", "encoding_format")}
    return rest(a) == rest(b)


def _joinable(prompt: Prompt) -> bool:
    """Whether a prompt's texts may share a request: strings, not token ids."""
    given = prompt.body.get("input")
    return isinstance(given, str) or (isinstance(given, list) and bool(given)
                                      and isinstance(given[0], str))


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
