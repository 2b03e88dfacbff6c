"""The worker registry and the live per-GPU table: every registered worker and what its server
says right now.

Workers register a `WorkerEntry` every few seconds (workers/registration.py), with what
their server said at that moment, the URL they use (`local_server`) and the URL other nodes can
use (`server`, fleetgen/advertise.py). `read_fleet` reads `/metrics` and `/server_info` live, all
at once and under one short deadline: this node's servers at their local URL (one that does not
answer shows as `down` instead of stalling the view), other nodes' at their published URL. An
other node's server that cannot be read from here (a `127.0.0.1` URL there is not this node's
server; a firewall) shows the reading its worker published.

The addresses come from Redis, which anyone with write access to it can fill: so these reads
never carry FLEETGEN_SERVER_API_KEY (only a worker sends it, to the one server it was configured with).
A server that wants the key for `/server_info` still shows its live `/metrics` (SGLang serves
those without a key), with capacity and version from the reading its worker published.

    rows = read_fleet(ledger, job_workers=status.workers, elapsed_s=600.0)

`published_fleet` makes the same rows from the published readings alone, without a request
(progress.json). The producer prints the rows (producer/status.py `render_fleet`).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from urllib.parse import urlsplit

import httpx
import orjson

from fleetgen.advertise import LOCAL_HOSTS
from fleetgen.ledger import Ledger
from fleetgen.readings import ServerReading, read_server_within

# A dead server must not slow `status --watch` by more than about this much.
FETCH_DEADLINE_S = 2.0
CONNECT_TIMEOUT_S = 0.5
# The one liveness rule of the registry: a worker re-registers every beat (engine.py
# `_register`); an entry four beats old is a worker that is gone (`lost`), for the table, the
# in-flight count and everyone else who reads the registry. A killed worker is shown lost
# within ten seconds, and a worker whose loop is slow for a beat or two is not. A running
# tuning's note beats the same way (`TuningNote`).
REGISTRY_BEAT_S = 2.0
LOST_AFTER_S = 4 * REGISTRY_BEAT_S
THIS_HOST = socket.gethostname()
# A server failing at least this share of the requests it runs is named in `status`.
SICK_SHARE = 0.05
# What a reading takes from `/server_info` (or from it when /metrics lacks it).
SERVER_INFO_FIELDS = ("effective_max", "requested_max", "version", "accept_length")

async def read_servers(
    urls: Iterable[str], deadline_s: float = FETCH_DEADLINE_S
) -> dict[str, ServerReading]:
    """Read every server concurrently, without credentials; each one gets at most `deadline_s`."""
    unique = sorted(set(urls))
    if not unique:
        return {}
    timeout = httpx.Timeout(deadline_s, connect=min(CONNECT_TIMEOUT_S, deadline_s))
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        readings = await asyncio.gather(
            *(read_server_within(client, u, None, deadline_s) for u in unique))
    return dict(zip(unique, readings, strict=True))


@dataclass(frozen=True)
class WorkerError:
    """What last kept a batch from running on a worker: the error, its job, when (unix time)."""

    error: str
    job: str
    at: float


@dataclass(frozen=True)
class ServerHealth:
    """How a worker's server treated its requests over the last `window_s` seconds, and whether
    the worker sends it any (workers/flow.py). Counts are by label: `HTTP 500`, `timeout`..."""

    window_s: float
    answered: int
    # Server-caused failures (5xx, resets, aborts, timeouts), each try counted.
    failed: dict[str, int]
    # Refusals of a request (4xx): the prompt's or the job's fault, not the server's.
    refused: dict[str, int]
    # "Full, come back later" (429, 503): not failures.
    overloaded: dict[str, int]
    in_rotation: bool
    out_since: float | None
    out_reason: str | None
    ejections: int
    limit: int
    limit_reason: str | None

    @classmethod
    def quiet(cls, limit: int = 1, window_s: float = 300.0) -> ServerHealth:
        """A server in rotation that no request has reached yet."""
        return cls(window_s=window_s, answered=0, failed={}, refused={}, overloaded={},
                   in_rotation=True, out_since=None, out_reason=None, ejections=0, limit=limit,
                   limit_reason=None)

    @property
    def requests(self) -> int:
        return (self.answered + sum(self.failed.values()) + sum(self.refused.values())
                + sum(self.overloaded.values()))

    @property
    def failed_share(self) -> float:
        """Server-caused failures among requests the server ran (answered, failed or refused)."""
        ran = self.answered + sum(self.failed.values()) + sum(self.refused.values())
        return sum(self.failed.values()) / ran if ran else 0.0

    @property
    def overloads_per_min(self) -> float:
        return sum(self.overloaded.values()) * 60.0 / self.window_s

    def as_task_result(self) -> dict[str, object]:
        """Its fields, its failed share and what `status` says of it (`says`), as JSON values:
        the `server` of a worker's task result, which Flower shows (workers/tasks.py)."""
        return {**asdict(self), "failed_share": round(self.failed_share, 3),
                "says": self.summary()}

    def summary(self) -> list[str]:
        """What `status` says of it: nothing for a server that is fine."""
        lines = []
        if not self.in_rotation:
            lines.append(f"out of rotation: {self.out_reason}; probing it, batches go to the "
                         "other workers")
        failed = sum(self.failed.values())
        if failed and (self.failed_share >= SICK_SHARE or not self.in_rotation):
            top = ", ".join(f"{k}: {n:,}" for k, n in sorted(
                self.failed.items(), key=lambda kv: -kv[1]))
            lines.append(f"{self.failed_share:.0%} of requests failed in the last "
                         f"{self.window_s / 60:.0f} min ({top})")
        if self.overloaded:
            top = ", ".join(f"{k}: {n:,}" for k, n in sorted(self.overloaded.items()))
            lines.append(f"server full: {self.overloads_per_min:.1f} refusals/min ({top}); "
                         f"in flight up to {self.limit}"
                         + (f" ({self.limit_reason})" if self.limit_reason else ""))
        return lines


@dataclass(frozen=True)
class WorkerEntry:
    """A worker's registry entry: who it is, what it consumes and serves, how busy it is.

    The worker writes it every beat (workers/registration.py); `registry` reads them all.

        await live.publish_worker(entry.worker, entry.to_json())
    """

    worker: str
    host: str
    pid: int
    queues: list[str]
    last_error: WorkerError | None
    # Other nodes read `server`; `status` on this node reads `local_server`, which works even
    # when the server listens on loopback only.
    server: str
    local_server: str
    # What the server said at the beat, for `status` where it cannot be read live.
    reading: ServerReading
    # `ready`, `server-down` (its /health fails) or `out-of-rotation` (it fails what it is
    # sent) as written; `registry` turns a stale entry `lost`.
    state: str
    server_kind: str | None
    effective_max_running_requests: int | None
    requested_max_running_requests: int | None
    capacity_source: str | None
    limit: int
    in_flight: int
    updated: float
    health: ServerHealth
    # When this worker process started (unix seconds): a finished job's row is its worker's only
    # while the process is the one that did the work, not a later one under the same name.
    # 0 where a worker did not say.
    started: float = 0.0

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes) -> WorkerEntry:
        """The entry `to_json` wrote; ValueError if `raw` is not one."""
        try:
            data = orjson.loads(raw)
            error = data["last_error"]
            return cls(**{**data, "queues": list(data["queues"]),
                          "last_error": WorkerError(**error) if error is not None else None,
                          "reading": ServerReading(**data["reading"]),
                          "health": ServerHealth(**data["health"])})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a registry entry: {exc}") from None

    def age_s(self, now: float) -> float:
        return round(now - self.updated, 1)


# A finished tuning stays in `status` this long after its last step.
TUNING_SHOWN_S = 1800.0
# The states of a tuning that still runs (launcher/node `TuneRecord.state`): its tuner beats.
TUNING_LIVE_STATES = ("running", "waiting")


@dataclass(frozen=True)
class TuningNote:
    """What one node's tuning (`launcher up --tune`, `launcher tune`) does now, as its launcher
    publishes it at each step: running or done, its latest step in one line (the candidates
    being tried, on which GPU, with the gain expected) and when that step should end.

    `at` is when the latest step was; `updated` when the tuner last said it still runs: while
    the tuning runs or waits, its launcher publishes the note again every REGISTRY_BEAT_S, as a
    worker its registry entry. A running note not updated for LOST_AFTER_S has no live tuner
    behind it (its process was killed, the thread that tuned died) and is not shown; a finished
    one is shown for TUNING_SHOWN_S after its last step."""

    node: str
    at: float
    updated: float
    state: str
    line: str
    until: float | None = None

    @property
    def live(self) -> bool:
        """Whether the tuning still runs (or waits for work), so its tuner beats."""
        return self.state in TUNING_LIVE_STATES

    def shown(self, now: float) -> bool:
        """Whether `status` shows the note at `now` (see the class docstring)."""
        if self.live:
            return now - self.updated <= LOST_AFTER_S
        return now - self.at <= TUNING_SHOWN_S

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes) -> TuningNote:
        """The note `to_json` wrote; ValueError if `raw` is not one."""
        try:
            data = orjson.loads(raw)
            until = data.get("until")
            return cls(node=str(data["node"]), at=float(data["at"]),
                       updated=float(data["updated"]), state=str(data["state"]),
                       line=str(data["line"]), until=float(until) if until is not None else None)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a tuning note: {exc}") from None

    def describe(self, now: float) -> str:
        """`tuning on node1: gpu0 trying `--x 1`, expected +4.0%, ~40 s left`."""
        text = f"tuning on {self.node}: {self.state}; {self.line}"
        if self.state == "running" and self.until is not None:
            text += f", ~{max(0.0, self.until - now):.0f} s left"
        return text


def tuning(ledger: Ledger, now: float | None = None) -> list[TuningNote]:
    """Each node's tuning note that `status` shows (`TuningNote.shown`), by node."""
    now = time.time() if now is None else now
    notes = []
    for raw in ledger.registry.tuning().values():
        try:
            note = TuningNote.from_json(raw)
        except ValueError:
            continue
        if note.shown(now):
            notes.append(note)
    return sorted(notes, key=lambda n: n.node)


@dataclass(frozen=True)
class FleetRow:
    """One worker in the per-GPU table: its registry entry, its server's reading and its share
    of the job. A worker that did work for the job but is not registered any more has only
    its share (and `lost`)."""

    worker: str
    host: str | None
    server: str | None
    worker_state: str
    registry_age_s: float | None
    in_flight: int | None
    limit: int | None
    # What the server is and how the limit was found (fleetgen/servers).
    server_kind: str | None
    capacity_source: str | None
    # The server's reading (fleetgen/readings.py `ServerReading`).
    running: float | None
    queue: float | None
    token_usage: float | None
    mamba_usage: float | None
    gen_throughput: float | None
    accept_length: float | None
    effective_max: int | None
    requested_max: int | None
    version: str | None
    server_state: str
    server_error: str | None
    job_prompts_done: int
    job_prompts_failed: int
    job_output_tokens: int
    job_output_tokens_per_s: float | None
    # How the server treated the worker's requests lately (None for a lost worker).
    health: ServerHealth | None


def registry(ledger: Ledger, now: float) -> dict[str, WorkerEntry]:
    """The registered workers, a stale entry's `state` turned to `lost`; an entry that is not
    one (written by something else) is left out."""
    out: dict[str, WorkerEntry] = {}
    for name, raw in ledger.registry.entries().items():
        try:
            entry = WorkerEntry.from_json(raw)
        except ValueError:
            continue
        if now - entry.updated > LOST_AFTER_S:
            entry = replace(entry, state="lost")
        out[name] = entry
    return out


def fleet_rows(
    workers: Mapping[str, WorkerEntry],
    readings: Mapping[str, ServerReading],
    job_workers: Mapping[str, Mapping[str, float]],
    elapsed_s: float,
    now: float | None = None,
    ended_at: float | None = None,
) -> list[FleetRow]:
    """One row per worker: its registry entry, its server's reading and its share of the job.

    `readings` are by worker: read live for this node's servers, as published by their worker
    for other nodes'. Workers that did work for the job but are no longer registered are
    listed as `lost`. For a job that ended at `ended_at` (done or cancelled) they are
    `finished`, as is one whose name a process started after the end now bears: that process
    did none of the job's work, so its live figures are not shown on the job's row.
    """
    now = time.time() if now is None else now
    if ended_at is not None:
        workers = {n: e for n, e in workers.items()
                   if n not in job_workers or (e.state != "lost" and e.started <= ended_at)}
    rows = []
    # A lost worker that did nothing for this job (another job's, an earlier demo's) is not
    # this job's business.
    names = {n for n, e in workers.items() if e.state != "lost"} | set(job_workers)
    for name in sorted(names, key=lambda n: (workers[n].host if n in workers else "", n)):
        entry = workers.get(name)
        reading = readings.get(name) or ServerReading("unknown")
        mine = job_workers.get(name, {})
        tokens = float(mine.get("output_tokens", 0))
        effective_max = reading.effective_max
        if effective_max is None and entry is not None:
            effective_max = entry.effective_max_running_requests
        rows.append(FleetRow(
            worker=name,
            host=entry.host if entry else None,
            server=entry.server if entry else None,
            worker_state=entry.state if entry else "lost" if ended_at is None else "finished",
            registry_age_s=entry.age_s(now) if entry else None,
            in_flight=entry.in_flight if entry else None,
            limit=entry.limit if entry else None,
            server_kind=entry.server_kind if entry else None,
            capacity_source=entry.capacity_source if entry else None,
            running=reading.running,
            queue=reading.queue,
            token_usage=reading.token_usage,
            mamba_usage=reading.mamba_usage,
            gen_throughput=reading.gen_throughput,
            accept_length=reading.accept_length,
            effective_max=effective_max,
            requested_max=reading.requested_max,
            version=reading.version,
            server_state=reading.state,
            server_error=reading.error,
            job_prompts_done=int(mine.get("prompts_done", 0)),
            job_prompts_failed=int(mine.get("prompts_failed", 0)),
            job_output_tokens=int(tokens),
            job_output_tokens_per_s=round(tokens / elapsed_s, 1) if elapsed_s > 0 else None,
            health=entry.health if entry else None,
        ))
    return rows


def read_fleet(
    ledger: Ledger,
    job_workers: Mapping[str, Mapping[str, float]],
    elapsed_s: float,
    *,
    now: float | None = None,
    deadline_s: float = FETCH_DEADLINE_S,
    ended_at: float | None = None,
) -> list[FleetRow]:
    """Registry + live server readings + this job's per-worker counters, one row per worker."""
    now = time.time() if now is None else now
    workers = registry(ledger, now)
    urls = {name: url for name, e in workers.items() if (url := _readable_url(e))}
    live = asyncio.run(read_servers(urls.values(), deadline_s))
    # Per worker: its server read live here, with what that read could not see without the
    # key taken from its worker's own reading; an other node's server that did not answer
    # here, and one with no URL this node can use, as its worker published.
    readings: dict[str, ServerReading] = {}
    for name, entry in workers.items():
        reading = live.get(urls.get(name, ""))
        if reading is not None and (entry.host == THIS_HOST or reading.state == "up"):
            readings[name] = _filled(reading, entry.reading)
        else:
            readings[name] = entry.reading
    return fleet_rows(workers, readings, job_workers, elapsed_s, now, ended_at)


def published_fleet(
    ledger: Ledger,
    job_workers: Mapping[str, Mapping[str, float]],
    elapsed_s: float,
    *,
    now: float | None = None,
    ended_at: float | None = None,
) -> list[FleetRow]:
    """The same rows from what the ledger holds alone: each server as its worker last published
    it, no server read over the network (what progress.json carries)."""
    now = time.time() if now is None else now
    workers = registry(ledger, now)
    readings = {name: entry.reading for name, entry in workers.items()}
    return fleet_rows(workers, readings, job_workers, elapsed_s, now, ended_at)


def _readable_url(entry: WorkerEntry) -> str | None:
    """Where this node can read the entry's server: its local URL on its own node, its
    published one elsewhere unless that names the other node's loopback."""
    if entry.host == THIS_HOST:
        return entry.local_server
    if (urlsplit(entry.server).hostname or "") in LOCAL_HOSTS:
        return None
    return entry.server


def _filled(live: ServerReading, published: ServerReading) -> ServerReading:
    """`live` with the figures only `/server_info` gives, when it gave none (it wants the key
    this reader does not send), taken from the reading the server's own worker published."""
    if live.state != "up":
        return live
    known = {name: getattr(published, name) for name in SERVER_INFO_FIELDS
             if getattr(live, name) is None and getattr(published, name) is not None}
    return replace(live, **known)
