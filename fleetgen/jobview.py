"""A job's progress in one view: counts, rate, ETA, tokens, finish reasons, quality, GPUs.

`job_status` gathers the figures into one `JobStatus`; its JSON (`to_json`) is the `producer
status --json` form and what `progress.json` holds (fleetgen/progress.py; field names are
stable, new ones may be added). With `live=True` it also reads every registered server
(fleetgen/fleet.py) for the per-GPU table. Every figure comes from the ledger; the workers'
reconciler writes progress.json, the producer prints the status (producer/status.py `render`).

    status = job_status(ledger, "distill-v1", live=True)
    print(status.done, status.rate.prompts_per_s_5m, status.to_json().decode())

The clock, the rates, the ETA and a job's share of the requests in flight are spelled out in
docs/guides/status.md ("rate", "time", "In flight");
`per_second` turns per-minute tallies into rates on that clock (the report's per-GPU chart).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Final

import orjson

from fleetgen import keys
from fleetgen.breaker import accepted_causes
from fleetgen.creation import creation_holder
from fleetgen.errors import UnknownJobError
from fleetgen.fleet import FleetRow, TuningNote, WorkerEntry, read_fleet, registry, tuning
from fleetgen.job import JobManifest, ShownState, batch_sizes
from fleetgen.ledger import (
    STATE_CANCELLED,
    STATE_CREATING,
    STATE_PAUSED,
    STATE_RUNNING,
    EndVerdict,
    FailureExample,
    Ledger,
    QualityPause,
)

RATE_WINDOW_S = 300
# The recent window spans at least this many mean answer times, and so must a stretch of whole
# minutes without an answer to count as idle: a job of long answers on few slots goes whole
# minutes without one while every slot is busy.
ANSWER_TIMES = 2
STATE_DONE: Final = "done"
# Work waiting, nothing running and nothing written for this long: the job is stalled
# (a live worker takes a queued batch within a second).
STALLED_AFTER_S = 30.0
STALLED_EXPLAINED_AFTER_S = 10.0
# A worker's last error is shown for this long after it happened.
ERROR_SHOWN_FOR_S = 3600.0


@dataclass(frozen=True)
class Batches:
    total: int
    done: int
    running: int
    queued: int


@dataclass(frozen=True)
class Rate:
    """Every figure is the job's total (all its GPUs); `_5m` over the recent window
    (`window_s`), `_all` over the job's clock (`clock_start` to `clock_end`)."""

    prompts_per_s_5m: float
    prompts_per_s_all: float
    output_tokens_per_s_5m: float
    output_tokens_per_s_all: float
    window_s: float
    mean_answer_s: float
    clock_start: float
    clock_end: float


@dataclass(frozen=True)
class Tokens:
    input: int
    output: int
    reasoning: int
    avg_output: float | None
    reasoning_share: float | None


@dataclass(frozen=True)
class Rollouts:
    """A rollout job's programs: `name` (module:attribute), rollouts ended (answered or
    failed, checkpointed), running now (every prompt of a batch in hand runs at once), the
    calls they made and how many rollouts made each number of calls (the last key counts
    that many or more), calls at the servers now, and rollouts failed by the exception
    their code raised."""

    name: str
    ended: int
    running: int
    calls: int
    calls_mean: float | None
    calls_max: int | None
    by_calls: dict[str, int]
    calls_in_flight: int
    raised: dict[str, int]


@dataclass(frozen=True)
class Canary:
    """The quality canary's settings for the job and what it has seen."""

    enabled: bool
    answers_seen: int
    min_completions: int
    # A job smaller than min_completions is judged once, at its end (workers/quality.py).
    judged_at_end: bool
    end_verdict: EndVerdict | None


@dataclass(frozen=True)
class Breaker:
    """The failure breaker's trip while it holds the job (cause and one example failure),
    and the causes `resume --accept-failures` accepted."""

    cause: str | None
    example: FailureExample | None
    accepted: list[str]


@dataclass(frozen=True)
class WorkerErrorSeen:
    """A registered worker's last error (what kept a batch from running there), `age_s` ago."""

    worker: str
    host: str
    job: str
    error: str
    age_s: float


@dataclass(frozen=True)
class Stalled:
    """Why work waits and nothing moves: `no_consumer` (no live worker consumes `queue`; the
    queues they consume are `live_queues`) or `no_progress` (nothing ran or was written for
    `idle_s`, with the last error a worker met and the workers whose server is not ready)."""

    reason: str
    queue: str
    live_queues: list[str] | None
    idle_s: float | None
    last_error: WorkerErrorSeen | None
    not_ready: list[str]


@dataclass(frozen=True)
class JobStatus:
    """Every figure of one job at `updated_at`; see docs/guides/status.md for each."""

    job: str
    state: ShownState
    reason: str | None
    output: str
    # Answers the job asks for (its outcomes: done, failed and the rest count answers); as
    # many as `prompts` unless a prompt asks several (`sampling.n`, `enqueue --samples`).
    total: int
    prompts: int
    done: int
    failed: int
    checkpointed: int
    in_flight: int
    in_hand: int
    queued: int
    # Not started because the job is paused, cancelled or still being created.
    held: int
    batches: Batches
    elapsed_s: float
    rate: Rate
    eta_s: int | None
    tokens: Tokens
    finish_reasons: dict[str, int]
    errors: dict[str, int]
    empty_content: int
    bytes_written: int
    # Worker -> the job's counters it moved (fleetgen/ledger `Counters.workers`).
    workers: dict[str, dict[str, float]]
    canary: Canary
    quality: QualityPause | None
    breaker: Breaker | None
    worker_errors: list[WorkerErrorSeen]
    stalled: Stalled | None
    fleet: list[FleetRow] | None
    updated_at: float
    # Each node's tuning, running or lately finished (fleetgen/fleet.py `TuningNote`).
    tuning: list[TuningNote] = field(default_factory=list)
    # The job's programs per prompt; None for a job of one request per answer.
    rollouts: Rollouts | None = None
    # Why a running job has no ETA (`eta_s` null): its first answers, its last ones, or none lately.
    eta_reason: str | None = None

    @property
    def clock_stopped(self) -> bool:
        """A done, paused or cancelled job: its clock and its recent window end where it
        stopped (_clock_end), not now."""
        return self.state not in (STATE_RUNNING, STATE_CREATING)

    def to_json(self, option: int = 0) -> bytes:
        """The `status --json` and progress.json form (orjson `option`s, e.g. OPT_INDENT_2)."""
        return orjson.dumps(asdict(self), option=option)


def job_status(
    ledger: Ledger, job: str, now: float | None = None, *, live: bool = False,
) -> JobStatus:
    """Every figure of `job` at `now`; `live` adds `fleet` (one row per worker, ~2 s at most)."""
    now = time.time() if now is None else now
    manifest = ledger.jobs.load(job)
    stored_state, reason = ledger.jobs.state(job)
    # done/failed are what the sink holds (the figures export reconciles); prompts answered
    # in batches not written yet are `checkpointed` until their batch is written.
    written, stats, finished_batches, extra = ledger.counters.counts(job)
    done = int(written.get("prompts_done", 0))
    failed = int(written.get("prompts_failed", 0))
    answered = int(stats.get("prompts_done", 0) + stats.get("prompts_failed", 0))
    remaining = max(0, manifest.answers - done - failed)
    checkpointed = min(remaining, max(0, answered - done - failed))
    total_batches = manifest.batches + extra
    finished = finished_batches >= total_batches and stored_state == STATE_RUNNING
    state = STATE_DONE if finished else stored_state
    running = ledger.batches.running(job)
    hands = _in_hand(ledger, manifest, running)
    in_hand = min(remaining - checkpointed, sum(hands.values()))
    # One read of the registry: what the live workers have in flight and their last errors.
    entries = registry(ledger, now)
    in_flight = min(in_hand, _sent(entries, hands, _other_hands(ledger, job, hands, entries)))
    waiting = remaining - checkpointed - in_hand
    times = _times(ledger, job, manifest.created_at)
    answer_s = _mean_answer_s(stats)
    clock = _clock(ledger.counters.minutes(job), times, now, state, answer_s)
    rate = _rates(clock, answered, stats.get("output_tokens", 0.0), answer_s)
    workers = ledger.counters.workers(job)
    worker_errors = _worker_errors(entries, now)
    queued = waiting if state == STATE_RUNNING else 0
    last_taken = max(running.values(), default=None)
    eta_s, eta_reason = _eta(remaining, remaining - checkpointed, in_flight, state, clock,
                             answer_s, None if last_taken is None else now - last_taken)
    return JobStatus(
        job=job,
        state=state,
        reason=reason or _creating_reason(ledger, manifest, state),
        output=manifest.output,
        total=manifest.answers,
        prompts=manifest.prompts,
        done=done,
        failed=failed,
        checkpointed=checkpointed,
        in_flight=in_flight,
        in_hand=in_hand,
        queued=queued,
        held=waiting if state not in (STATE_RUNNING, STATE_DONE) else 0,
        batches=Batches(total=total_batches, done=finished_batches, running=len(running),
                        queued=len(ledger.batches.queued(job))),
        elapsed_s=round(clock["elapsed"], 1),
        rate=rate,
        eta_s=eta_s,
        eta_reason=eta_reason,
        tokens=_tokens(stats, int(stats.get("prompts_done", 0))),
        finish_reasons=_prefixed(stats, "finish_"),
        errors=_prefixed(written, "error_"),
        empty_content=int(stats.get("empty_content", 0)),
        bytes_written=int(stats.get("bytes_written", 0)),
        workers=workers,
        canary=_canary(ledger, job, manifest),
        quality=ledger.guards.quality_pause(job),
        breaker=_breaker(ledger, job),
        worker_errors=worker_errors,
        stalled=_stalled(manifest, entries, worker_errors, queued, len(running), times, now),
        fleet=read_fleet(ledger, workers, clock["elapsed"], now=now,
                         ended_at=_ended_at(state, clock)) if live else None,
        updated_at=now,
        tuning=tuning(ledger, now),
        rollouts=_rollouts(manifest, stats, answered, in_hand, in_flight),
    )


def _rollouts(manifest: JobManifest, stats: dict[str, float], ended: int, in_hand: int,
              in_flight: int) -> Rollouts | None:
    spec = manifest.rollout_spec
    if spec is None:
        return None
    by_calls = {int(k): v for k, v in _prefixed(stats, "rollout_calls_").items()}
    counted = sum(by_calls.values())
    calls = int(stats.get("rollout_calls", 0))
    return Rollouts(
        name=spec.name, ended=ended, running=in_hand, calls=calls,
        calls_mean=round(calls / counted, 2) if counted else None,
        calls_max=max(by_calls) if by_calls else None,
        by_calls={str(k): v for k, v in sorted(by_calls.items())},
        calls_in_flight=in_flight, raised=_prefixed(stats, "rollout_failed_"))


def _sent(
    entries: Mapping[str, WorkerEntry], hands: Mapping[str | None, int],
    other_hands: Mapping[str, int],
) -> int:
    """The job's requests at the servers right now. A worker's registry entry counts its
    requests of every job: each live worker's are shared among the jobs whose running batches
    it holds, by their prompts in hand there (it sends a batch's prompts as slots free,
    whichever job's), and are at most this job's prompts in hand there."""
    sent = 0.0
    for name, entry in entries.items():
        mine = hands.get(name, 0)
        if entry.state == "lost" or not mine:
            continue
        sent += min(mine, entry.in_flight * mine / (mine + other_hands.get(name, 0)))
    return round(sent)


def _in_hand(
    ledger: Ledger, manifest: JobManifest, running: Mapping[str, float],
) -> dict[str | None, int]:
    """Worker holding them (None: no live lease) -> the prompts of the job's running batches
    that have not reached the checkpoint yet (sent or waiting)."""
    plan = batch_sizes(manifest.answers, manifest.batch_size, taper=manifest.taper)
    hands: dict[str | None, int] = {}
    for batch, (holder, checkpointed) in ledger.batches.holds(manifest.name, running).items():
        left = max(0, _batch_len(plan, manifest.batch_size, batch) - checkpointed)
        hands[holder] = hands.get(holder, 0) + left
    return hands


def _other_hands(
    ledger: Ledger, job: str, hands: Mapping[str | None, int], entries: Mapping[str, WorkerEntry],
) -> dict[str, int]:
    """Worker -> the prompts in hand in other active jobs' running batches it holds, for the
    live workers with requests out that hold some of `job`'s (the others' requests are not
    shared with it)."""
    workers = {name for name, entry in entries.items()
               if hands.get(name) and entry.in_flight and entry.state != "lost"}
    out: dict[str, int] = {}
    if not workers:
        return out
    for other in ledger.jobs.active():
        running = ledger.batches.running(other) if other != job else {}
        if not running:
            continue
        try:
            manifest = ledger.jobs.load(other)
        except UnknownJobError:
            continue  # expired or deleted since it was listed
        for worker, n in _in_hand(ledger, manifest, running).items():
            if worker in workers:
                out[worker] = out.get(worker, 0) + n
    return out


def _batch_len(plan: list[int], size: int, batch: str) -> int:
    """Prompts in an enqueued batch `bNNNNNN`; a requeue batch (`rNN-NNNNNN`) counts as full."""
    if keys.requeue_round(batch) is not None:
        return size
    index = keys.batch_order(batch)[1]
    return plan[index - 1] if 0 < index <= len(plan) else 0


def _times(ledger: Ledger, job: str, created_at: float) -> dict[str, float]:
    """When the job started running (enqueue finished), when its last batch was written, and
    when its state last changed (`changed`: for a paused or cancelled job, when it stopped)."""
    times = ledger.jobs.times(job)
    return {"started": times.started or created_at, "last_write": times.last_write,
            "changed": times.changed}


def _creating_reason(ledger: Ledger, manifest: JobManifest, state: str) -> str | None:
    """For a job still being created: who is creating it, or that its enqueue was interrupted."""
    if state != STATE_CREATING:
        return None
    stored = ledger.jobs.inputs_stored(manifest.name)
    holder = creation_holder(ledger, manifest.name)
    progress = f"{stored:,} of {manifest.batches:,} batch inputs stored"
    if holder is not None:
        return f"enqueue running on {holder} ({progress})"
    return (f"enqueue was interrupted ({progress} at its last report); no batch runs until it "
            f"finishes: run the same enqueue command again")


def _clock(
    minutes: dict[int, dict[str, float]], times: dict[str, float], now: float, state: str,
    answer_s: float,
) -> dict[str, float]:
    """The job's clock (start, end, elapsed) and its recent window, which ends where the clock
    does (seconds, and the prompts answered and output tokens written in it): a stopped job's
    recent rate is the one it stopped at, however late it is read."""
    start = times["started"]
    end = _clock_end(times, now, state)
    since = _window_start(minutes, start, end, answer_s)
    recent = [v for m, v in minutes.items() if m >= since // 60]
    return {"start": start, "end": end, "elapsed": max(0.0, end - start),
            # At least a second: a worker's clock a little ahead must not make a huge rate.
            "window": max(1.0, end - since),
            "prompts": sum(v["prompts"] for v in recent), "tokens": sum(v["tokens"] for v in recent)}


def _clock_end(times: dict[str, float], now: float, state: str) -> float:
    """Now while the job runs; a done job's last batch write; a paused or cancelled job's
    stop (or its last write, when a batch running at the stop was written after it)."""
    if state == STATE_DONE:
        return times["last_write"] or now
    if state in (STATE_PAUSED, STATE_CANCELLED) and times["changed"]:
        return min(now, max(times["changed"], times["last_write"]))
    return now


def _window_start(
    minutes: dict[int, dict[str, float]], start: float, end: float, answer_s: float,
) -> float:
    """Where the recent window begins: RATE_WINDOW_S (or ANSWER_TIMES mean answer times, if
    longer) before the clock's `end`, in whole minutes; not before the job started, nor
    before the end of its last idle stretch (whole minutes without an answer, at least a
    minute and at least ANSWER_TIMES mean answer times: an outage, a pause), so that a job
    going again after one is measured from the minute it went on."""
    span = max(RATE_WINDOW_S, ANSWER_TIMES * answer_s)
    first = max(int((end - span) // 60), int(start // 60))
    idle_enough = max(60.0, ANSWER_TIMES * answer_s)
    answered, idle = False, 0
    for minute in range(int(end // 60), first - 1, -1):
        if minutes.get(minute, {}).get("prompts"):
            answered, idle = True, 0
        elif answered:  # a whole minute (a newer one has answers) with none
            idle += 1
            if idle * 60 >= idle_enough:
                first = minute + idle
                break
    return max(start, first * 60.0)


def _mean_answer_s(stats: dict[str, float]) -> float:
    """Seconds one answer took on average (its request to its server, the try that answered)."""
    done = stats.get("prompts_done", 0.0)
    return stats.get("latency_s", 0.0) / done if done else 0.0


def _rates(clock: dict[str, float], answered: int, output_tokens: float, answer_s: float) -> Rate:
    elapsed = clock["elapsed"]
    return Rate(
        prompts_per_s_5m=round(clock["prompts"] / clock["window"], 3),
        prompts_per_s_all=round(answered / elapsed, 3) if elapsed else 0.0,
        output_tokens_per_s_5m=round(clock["tokens"] / clock["window"], 1),
        output_tokens_per_s_all=round(output_tokens / elapsed, 1) if elapsed else 0.0,
        window_s=round(clock["window"], 1),
        mean_answer_s=round(answer_s, 2),
        clock_start=clock["start"],
        clock_end=clock["end"],
    )


def _ended_at(state: str, clock: Mapping[str, float]) -> float | None:
    """When a done or cancelled job ended (its clock's end); None for one that may go on."""
    return clock["end"] if state in (STATE_DONE, STATE_CANCELLED) else None


def ended_at(status: JobStatus) -> float | None:
    """When the job of `status` ended, done or cancelled; None for one that may go on."""
    return _ended_at(status.state, {"end": status.rate.clock_end})


def per_second(
    tallies: Mapping[int, Mapping[str, float]], start: float, end: float,
) -> dict[int, dict[str, float]]:
    """Unix minute -> each tally per second of that minute the job's clock ran (`start` to
    `end`): a whole minute counts 60 s, the job's first and last only their part. A minute
    outside the clock has no rate and is left out.

        per_second({m: {"prompts": 12.0, "tokens": 900.0}}, rate.clock_start, rate.clock_end)
    """
    out = {}
    for minute, tally in tallies.items():
        seconds = min(end, minute * 60.0 + 60.0) - max(start, minute * 60.0)
        if seconds > 0:
            out[minute] = {k: v / seconds for k, v in tally.items()}
    return out


def _eta(
    unwritten: int, unanswered: int, in_flight: int, state: str, clock: dict[str, float],
    answer_s: float, last_taken_s: float | None,
) -> tuple[int | None, str | None]:
    """Seconds until every prompt is written, or None and why: the prompts not sent yet at the
    rate the fleet answers now (a slot frees for each answer), then one mean answer time for
    the last of them; at least 1 s while a prompt is unwritten.

    Once nothing is left to send, the mean answer time stands for the last requests only
    while they are younger than it (`last_taken_s`: since the newest running batch was
    taken). Older ones are the long tail of what was sent, and answers come back shortest
    first: the mean of those back says nothing of them. A job sent whole at once (all its
    prompts in flight) is in that state from its first seconds: no ETA then, and the reason
    says so."""
    if not unwritten:
        return 0, None
    if state != STATE_RUNNING:
        return None, None
    if not unanswered:
        return 1, None  # every prompt answered: their last batches are being written
    finishing = in_flight >= unanswered
    if finishing and (last_taken_s is None or answer_s <= 0 or last_taken_s > answer_s):
        return None, (f"finishing: the last {in_flight:,} in flight, longer than the mean "
                      "answer so far")
    per_s = _rate_now(clock, in_flight, answer_s)
    if per_s <= 0:
        return None, "nothing answered lately"
    return max(1, math.ceil((unanswered - in_flight) / per_s + answer_s)), None


def _rate_now(clock: dict[str, float], in_flight: int, answer_s: float) -> float:
    """Prompts a second the fleet answers now: the recent window's rate, or what the job's
    requests in flight give (each slot answers once a mean answer time) if that is more. The window
    lags a fleet that has just started or gone on (after a pause, an outage, a rebuild) or is
    still raising its concurrency: it counts the seconds before the first answers could come
    back, and whole minutes. Nothing answered in the window: no rate, however many are in
    flight (no answer time is known of the fleet as it runs now)."""
    recent = clock["prompts"] / clock["window"]
    if recent <= 0 or answer_s <= 0:
        return recent
    return max(recent, in_flight / answer_s)


def _tokens(stats: dict[str, float], done: int) -> Tokens:
    out_tokens = stats.get("output_tokens", 0.0)
    reasoning = stats.get("reasoning_tokens", 0.0)
    return Tokens(
        input=int(stats.get("input_tokens", 0)),
        output=int(out_tokens),
        reasoning=int(reasoning),
        avg_output=round(out_tokens / done, 1) if done else None,
        reasoning_share=round(reasoning / out_tokens, 3) if out_tokens else None,
    )


def _prefixed(stats: dict[str, float], prefix: str) -> dict[str, int]:
    # A code can fall back to 0 (its prompts requeued and answered): nothing to show then.
    return {k.removeprefix(prefix): int(v) for k, v in sorted(stats.items())
            if k.startswith(prefix) and int(v)}


def _worker_errors(entries: Mapping[str, WorkerEntry], now: float) -> list[WorkerErrorSeen]:
    """Each registered worker's last error (what kept a batch from running there), newest
    first, with how long ago it happened."""
    out = [WorkerErrorSeen(worker=name, host=entry.host, job=error.job, error=error.error,
                           age_s=round(now - error.at, 1))
           for name, entry in entries.items()
           if (error := entry.last_error) is not None and now - error.at <= ERROR_SHOWN_FOR_S]
    return sorted(out, key=lambda e: e.age_s)


def _stalled(
    manifest: JobManifest, entries: Mapping[str, WorkerEntry], errors: list[WorkerErrorSeen],
    queued: int, running: int, times: dict[str, float], now: float,
) -> Stalled | None:
    """Why work waits and nothing moves, or None: no live worker consumes the job's queue
    (known at once), or no worker of its queue is busy and nothing ran or was written for
    STALLED_AFTER_S, with the last error a worker met (on this job first)."""
    if not queued or running:
        return None
    live = [e for e in entries.values() if e.state != "lost"]
    if not any(manifest.queue in e.queues for e in live):
        consumers = sorted({q for e in live for q in e.queues})
        return Stalled(reason="no_consumer", queue=manifest.queue, live_queues=consumers,
                       idle_s=None, last_error=None, not_ready=[])
    # Workers of the job's queue busy with other work: the job waits its turn, it is not stuck.
    if any(e.in_flight and manifest.queue in e.queues for e in live):
        return None
    idle = now - max(times["started"], times["last_write"])
    mine = [e for e in errors if e.job == manifest.name]
    # An error met on this job since its last write explains the wait: say so sooner.
    explained = any(now - e.age_s > max(times["started"], times["last_write"]) for e in mine)
    if idle < (STALLED_EXPLAINED_AFTER_S if explained else STALLED_AFTER_S):
        return None
    mine = mine or errors
    return Stalled(reason="no_progress", queue=manifest.queue, live_queues=None,
                   idle_s=round(idle, 1), last_error=mine[0] if mine else None,
                   # Live workers whose gate is closed (server down): they take no batch
                   # meanwhile.
                   not_ready=sorted(n for n, e in entries.items()
                                    if e.state not in ("ready", "lost")))


def _canary(ledger: Ledger, job: str, manifest: JobManifest) -> Canary:
    thresholds = manifest.canary
    progress = ledger.guards.canary_progress(job)
    return Canary(enabled=thresholds.enabled, answers_seen=progress.seen,
                  min_completions=thresholds.min_completions,
                  judged_at_end=manifest.answers < thresholds.min_completions,
                  end_verdict=progress.end)


def _breaker(ledger: Ledger, job: str) -> Breaker | None:
    """The failure breaker's trip and the causes accepted; None if it never tripped."""
    cause, example = ledger.guards.breaker_trip(job)
    accepted = ledger.guards.accepted_causes_raw(job)
    if cause is None and accepted is None:
        return None
    return Breaker(cause=cause, example=example, accepted=accepted_causes(accepted))
