"""Jobs as the workers leave them in the ledger, for the tests of the job views and of
`producer status`: prompts finished by the workers' own Lua script with the same counters, a
registry entry as a worker publishes it, a fleet's answers second by second."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.checkpoints import RECORD_GROUP, Entry, group_arguments
from fleetgen.fleet import (
    ServerHealth,
    WorkerEntry,
)
from fleetgen.ledger import Ledger
from fleetgen.readings import ServerReading
from fleetgen.records import (
    Origin,
    OutputRecord,
    counters,
    error_record,
    record_key,
    result_record,
    written_counts,
)
from tests.stack import make_job

NOW = 1_800_000_000.0  # a whole minute, so the rate windows below are exact


MINUTE = int(NOW // 60)


# Fields `status --json` and progress.json promise to keep (others may be added): the
# JobStatus dataclass and its fleet rows carry them.
STABLE_FIELDS = {
    "job", "state", "reason", "output", "total", "prompts", "done", "failed", "checkpointed", "in_flight",
    "in_hand", "queued", "held",
    "batches", "elapsed_s", "rate", "eta_s", "tokens", "finish_reasons", "errors",
    "empty_content", "bytes_written", "workers", "canary", "quality", "fleet", "updated_at",
    "worker_errors", "stalled", "breaker", "tuning", "rollouts", "eta_reason",
}


FLEET_FIELDS = {
    "worker", "host", "server", "worker_state", "registry_age_s", "in_flight", "limit", "server_state",
    "server_error", "running", "queue", "token_usage", "mamba_usage", "gen_throughput",
    "accept_length", "effective_max", "requested_max", "version", "job_prompts_done",
    "job_prompts_failed", "job_output_tokens", "job_output_tokens_per_s", "server_kind",
    "capacity_source", "health",
}


class Worker:
    """Finishes prompts the way workers/batch.py does: the same Lua script, the same counters."""

    def __init__(self, ledger: Ledger, name: str) -> None:
        self.ledger, self.name = ledger, name
        self.origin = Origin("http://127.0.0.1:30000", name, 1)
        self._record = ledger.r.register_script(RECORD_GROUP)
        self.count = 0
        self.records: dict[str, list[OutputRecord]] = {}

    def answer(self, job: str, batch: str, minute: int, finish: str = "stop",
               tokens: tuple[int, int, int] = (10, 100, 60), content: str = "An answer.") -> None:
        self.count += 1
        response = {"choices": [{"finish_reason": finish, "message": {
            "content": content, "reasoning_content": "thinking"}}],
            "usage": {"prompt_tokens": tokens[0], "completion_tokens": tokens[1],
                      "reasoning_tokens": tokens[2]}}
        self._put(job, batch, minute, result_record(f"{batch}-{self.count}", 1, response, 0.5,
                                                    self.origin))

    def fail(self, job: str, batch: str, minute: int) -> None:
        self.count += 1
        record = error_record(f"{batch}-{self.count}", 1, "maximum context length is 40960",
                              400, self.origin, 1)
        self._put(job, batch, minute, record)

    def _put(self, job: str, batch: str, minute: int, record: OutputRecord) -> None:
        self.records.setdefault(batch, []).append(record)
        entry = Entry(job, batch, record_key(record), orjson.dumps(record),
                      counters(record, thinking=True), b"")
        script_keys, args = group_arguments(job, [entry], self.name, minute, window=0)
        self._record(keys=script_keys, args=args)

    def finish_batch(self, job: str, batch: str, minute: int, size: int = 1000) -> None:
        """Write the batch (its records so far) at the end of `minute`."""
        self.ledger.batches.finish_and_settle(
            job, batch, written_counts(self.records.pop(batch, [])), self.name, [], size,
            now=(minute + 1) * 60.0)


def half_done_job(ledger: Ledger, name: str = "half", output: str = "/tmp/out") -> None:
    """100 prompts, started 10 minutes ago: 6 batches written (58 answers, 2 failures),
    b000007 running on gpu0@a with 4 of 10 checkpointed, b000008-10 queued. 40 answers 9 minutes ago,
    24 in the last minute."""
    make_job(ledger, name, output, created_at=NOW - 600)
    a, b = Worker(ledger, "gpu0@a"), Worker(ledger, "gpu1@b")
    for i in range(1, 7):
        batch = keys.batch_id(i)
        worker = a if i <= 3 else b
        for j in range(10):
            minute = MINUTE - 9 if (i - 1) * 10 + j < 40 else MINUTE - 1
            if i == 6 and j < 2:
                worker.fail(name, batch, minute)
            else:
                worker.answer(name, batch, minute, finish="length" if i == 1 and j < 3 else "stop")
        worker.finish_batch(name, batch, minute)
    ledger.leases.acquire(name, "b000007", "gpu0@a/lease", 30)
    for _ in range(4):
        a.answer(name, "b000007", MINUTE - 1)
    ledger.batches.mark_queued_and_settle(name, ["b000008", "b000009", "b000010"])


def answer_taking(worker: Worker, job: str, batch: str, minute: int, latency_s: float) -> None:
    """An answer of 100 tokens, as Worker.answer writes it, that took `latency_s` to come."""
    worker.count += 1
    response = {"choices": [{"finish_reason": "stop", "message": {"content": "An answer."}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 100}}
    worker._put(job, batch, minute, result_record(f"{batch}-{worker.count}", 1, response,
                                                  latency_s, worker.origin))


@contextlib.contextmanager
def ledger_time(monkeypatch: pytest.MonkeyPatch, now: float) -> Iterator[None]:
    """The ledger's clock reads `now` (what set_state and activate stamp)."""

    import fleetgen.ledger._jobs

    with monkeypatch.context() as m:
        m.setattr(fleetgen.ledger._jobs, "time", SimpleNamespace(time=lambda: now))
        yield


def register(ledger: Ledger, worker: str, server: str, age_s: float = 1.0, **extra: Any) -> None:
    """A registry entry as workers/registration.py writes it: a worker of this node
    whose server published nothing readable, unless `extra` says otherwise."""
    fields = {"worker": worker, "host": socket.gethostname(), "pid": 1,
              "queues": [keys.SHARED_QUEUE], "last_error": None,
              "server": server, "local_server": server,
              "reading": asdict(ServerReading("unknown")), "state": "ready", "server_kind": None,
              "effective_max_running_requests": 7, "requested_max_running_requests": 8,
              "capacity_source": "internal_states[0].effective_max_running_requests_per_dp",
              "limit": 11, "in_flight": 0, "updated": time.time() - age_s,
              "health": asdict(ServerHealth.quiet(11)), **extra}
    entry = WorkerEntry.from_json(orjson.dumps(fields))
    ledger.r.hset(keys.WORKERS, worker, entry.to_json())


class Fleet:
    """A fleet's answers, second by second: `slots` requests at once once ramped (from one,
    doubling every `doubling_s`), each answered `answer_s` after it was sent, prompts sent in
    order. `answered[i]` is when the i-th prompt's answer came, in seconds from the start."""

    def __init__(self, prompts: int, slots: int, answer_s: float, doubling_s: float) -> None:
        self.slots, self.answer_s, self.doubling_s = slots, answer_s, doubling_s
        self.sent: list[float] = []
        t, flying = 0.0, 0
        while len(self.sent) < prompts:
            flying = sum(1 for s in self.sent if s + answer_s > t)
            room = int(min(slots, 2 ** (t / doubling_s))) - flying
            self.sent += [t] * min(max(0, room), prompts - len(self.sent))
            t += 0.5
        self.answered = [s + answer_s for s in self.sent]

    def in_flight(self, t: float) -> int:
        return sum(1 for s in self.sent if s <= t < s + self.answer_s)


def run_fleet(ledger: Ledger, job: str, fleet: Fleet, start: float, first: int, batch: int,
              since: float, until: float, worker: str = "gpu0@a") -> None:
    """Record, as `worker` does, the fleet's answers that came between `since` and `until`
    (seconds from `start`); prompt i (from `first`) is in batch i // `batch` + 1, leased by
    `worker` while it runs."""
    w = Worker(ledger, worker)
    for i, at in enumerate(fleet.answered):
        if since < at <= until:
            b = keys.batch_id((first + i) // batch + 1)
            answer_taking(w, job, b, int((start + at) // 60), latency_s=fleet.answer_s)
    for i, sent in enumerate(fleet.sent):
        b = keys.batch_id((first + i) // batch + 1)
        if sent <= until < fleet.answered[i] and b not in ledger.batches.running(job):
            ledger.leases.acquire(job, b, f"{worker}/lease", 30)
    register(ledger, worker, "http://127.0.0.1:30000", updated=start + until - 1,
             in_flight=fleet.in_flight(until))
