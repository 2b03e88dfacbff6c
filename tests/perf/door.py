"""Figure 12: the worker's door under faults. fleetgen's wall time against a plain asyncio client
that retries the way fleetgen's defaults do, each on its own fresh server with the same prompts
(workers/backend.py `Backend.send`, fleetgen/causes.py, workers/healthcheck.py).

The direct client holds the server's slots + DIRECT_MARGIN prompts at once; a request
answered 429, 503 or 529 waits its Retry-After (1 s without one) and goes again without
counting a try; any other failure counts a try, and a prompt gets PROMPT_TRIES tries with a
backoff of RETRY_BACKOFF_S doubling up to RETRY_BACKOFF_MAX_S (fleetgen's
FLEETGEN_PROMPT_MAX_ATTEMPTS, FLEETGEN_RETRY_BACKOFF_S and _MAX_S). fleetgen runs as in
figure 11: recording simulators, workers with production settings and nothing else set,
`producer enqueue --no-canary`. Both run at once, each against its own server: a fault is set
on each server through `/sim/misbehave` FAULT_AFTER_S after that server's first chat request,
so both meet it at the same point of their job.

1. `burst-500`: 20 s of HTTP 500 on chat: wall fleetgen ÷ direct, prompts failed, batch
   attempts spent, requests at the server.
2. `overloaded-529`: the same with Anthropic's 529: ratio, failed, ejections (the worker's
   "taken out of rotation").
3. `rpm-60`: a strict server allowing 60 requests a rolling minute (OpenAI's headers, 429
   beyond), 60 prompts: both walls, ratio, requests the server received against prompts.
4. `poison-60`: 300 prompts of which 60 in a row make the server answer 500 every time: both
   walls, ratio, requests per poison prompt, ejections.
5. `hung`: two servers and two workers, one server stops answering chat (its /health stays
   200): seconds from the hang until the job is done and until the worker logged "taken out of
   rotation: hung", prompts failed, batch attempts spent, what `producer status` says of it.
6. `router-unequal`: a least-in-flight router (launcher/sim/router.py) over servers of 32 and 8
   slots; fleetgen through the router against the direct client holding 40 + DIRECT_MARGIN
   through it: ratio, the worker's in-flight limit over time (its /metrics).

    python -m tests.perf --only door                                  # all (~12 min)
    python -m tests.perf --only door --door-scenario poison-60        # one
    python -m tests.perf.door --worker-tree /tmp/fg-before            # another tree's workers

`--worker-tree` (this module's own command) starts the workers from another checkout of
fleetgen (cwd and PYTHONPATH that tree), the simulators and the producer from this one: the
same faults met by the worker code of another commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from fleetgen.ledger import Ledger
from fleetgen.ports import free_port
from fleetgen.settings import Settings
from launcher.services import RedisServer
from tests.engine_model import TEMPERATURE, TOP_P
from tests.perf.analysis import Requests
from tests.perf.fleet import PRODUCTION_WORKER_ENV, READY_TIMEOUT_S, Fleet, Sim, Worker, wait_for
from tests.perf.flow import (
    JOB_TIMEOUT_S,
    LIMIT,
    MODEL,
    SHORT_S,
    Ending,
    Prompts,
    enqueue,
    finish,
    sim_flags,
    sim_stats,
    status_text,
    worker_lines,
    write_prompts,
)
from tests.perf.report import Row, table
from tests.perf.sampler import WORKER_FAMILIES, Sampler
from tests.stack import CELERY, PYTHON, ROOT, Proc, healthy

SCENARIOS = ("burst-500", "overloaded-529", "rpm-60", "poison-60", "hung", "router-unequal")
# The direct client's retry policy is fleetgen's defaults (4 tries, 2 s doubling up to 60 s).
_DEFAULTS = Settings()
PROMPT_TRIES = _DEFAULTS.prompt_max_attempts
RETRY_BACKOFF_S = _DEFAULTS.retry_backoff_s
RETRY_BACKOFF_MAX_S = _DEFAULTS.retry_backoff_max_s
# Statuses that say "busy, come back" rather than "failed": resent without spending a try.
BUSY = frozenset({429, 503, 529})
DIRECT_MARGIN = 2
# Faults start once the job is under way, timed from each server's first chat request.
FAULT_AFTER_S = 10.0
WINDOW_S = 20.0
TARGET_RATIO = 1.5
TARGET_POISON_RATIO = 2.0
TARGET_POISON_REQUESTS = 4.0
TARGET_HUNG_DONE_S = 120.0
POISON = "POISON-PILL"
EJECTED = "taken out of rotation"
# The words of the worker's log kept in the figure's notes.
DOOR_WORDS = ("in flight up to", "rotation", "probe", "hung", "suspect", "budget", "poison",
              "overload", "refus")


@dataclass(frozen=True)
class Direct:
    """The direct client's run: its wall time and what it sent."""

    wall_s: float
    requests: int
    failed: int
    statuses: dict[str, int]  # HTTP status (or "error") -> responses


@dataclass(frozen=True)
class Versus:
    """Scenarios 1-4 and 6: fleetgen beside the direct client, each on its own server."""

    slots: int
    prompts: int
    direct_in_flight: int
    fault: str
    fleetgen_wall_s: float
    direct_wall_s: float
    ratio: float
    server_requests: int  # chat requests fleetgen's server received (refused ones included)
    server_refused: dict[str, int]
    direct: Direct
    # The direct client on a third server without the fault: what the job costs undisturbed
    # (a 20 s window makes the direct client fail most prompts, so its own wall is short).
    clean_wall_s: float | None
    ejections: int  # the worker's "taken out of rotation" lines
    poison_requests: float | None  # requests per poison prompt at fleetgen's server
    direct_poison_requests: float | None
    limit_over_time: list[tuple[float, int]]  # (s since the first prompt, worker limit)
    log: list[str]
    ending: Ending
    backends: list[dict[str, Any]] = field(default_factory=list)  # a router's, per backend


@dataclass(frozen=True)
class Hung:
    """Scenario 5: one server of two stops answering."""

    slots: int
    prompts: int
    done_after_hang_s: float | None
    ejected_after_hang_s: float | None
    hung_requests: int  # requests the hung server took and never answered (/sim/stats)
    status_lines: list[str]
    log: list[str]
    ending: Ending


@dataclass(frozen=True)
class Trees:
    """Where the processes' code comes from: the workers' tree (None: this one)."""

    workers: Path | None = None


def start_worker(fleet: Fleet, gpu: int, server_url: str, trees: Trees) -> Worker:
    """`Fleet.worker`, or the same command run from another tree's checkout."""
    if trees.workers is None:
        return fleet.worker(gpu, server_url)
    name, port = f"worker{gpu}", free_port()
    argv = [CELERY, "-A", "workers", "worker", "-Q", f"gpu{gpu}", "-n", f"gpu{gpu}@perf",
            "--without-mingle", "--without-gossip", "--loglevel", "INFO"]
    # Celery imports the app with its cwd first on sys.path; the producer and simulators
    # still run from this tree.
    env = fleet.env({**PRODUCTION_WORKER_ENV, "FLEETGEN_SERVER_URL": server_url,
                     "FLEETGEN_METRICS_PORT": str(port), "PYTHONPATH": str(trees.workers)})
    proc = Proc(name, argv, env, fleet.tmp / f"{name}.log", cwd=trees.workers).start()
    fleet.procs.append(proc)
    wait_for(lambda: "ready." in proc.log() or not proc.alive(), READY_TIMEOUT_S,
             what=f"{name} ready")
    if not proc.alive():
        raise RuntimeError(f"worker {name} exited:\n{proc.log()}")
    return Worker(proc, f"http://127.0.0.1:{port}/metrics")


async def retrying_client(url: str, prompts: list[dict[str, Any]], in_flight: int,
                          cap_s: float) -> Direct:
    """A plain asyncio + httpx client: `in_flight` chat requests at the server, each prompt
    until answered, PROMPT_TRIES failures, or `cap_s`. A prompt keeps its slot while it waits
    out a backoff or a Retry-After, as a semaphore around a retried call does."""
    sem = asyncio.Semaphore(in_flight)
    statuses: Counter[str] = Counter()
    timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    ends: list[float] = []

    async def one(client: httpx.AsyncClient, p: dict[str, Any]) -> bool:
        body = {"model": MODEL, "messages": p["messages"], "temperature": TEMPERATURE,
                "top_p": TOP_P, "max_tokens": p["sampling"]["max_tokens"]}
        tries = 0
        async with sem:
            while True:
                retry_after: str | None = None
                try:
                    r = await client.post("/v1/chat/completions", json=body)
                    status: int | None = r.status_code
                    retry_after = r.headers.get("retry-after")
                except httpx.HTTPError:
                    status = None
                statuses[str(status or "error")] += 1
                ends.append(time.monotonic())
                if status == 200:
                    return True
                if status in BUSY:
                    await asyncio.sleep(_seconds(retry_after))
                    continue
                tries += 1
                if tries >= PROMPT_TRIES:
                    return False
                await asyncio.sleep(min(RETRY_BACKOFF_S * 2 ** (tries - 1), RETRY_BACKOFF_MAX_S))

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        started = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*(one(client, p) for p in prompts)), timeout=cap_s)
    return Direct(wall_s=round(max(ends, default=started) - started, 1),
                  requests=sum(statuses.values()), failed=results.count(False),
                  statuses=dict(statuses))


def _seconds(retry_after: str | None) -> float:
    try:
        return max(float(retry_after), 0.0) if retry_after else 1.0
    except ValueError:  # an HTTP date: not worth parsing for a simulator that sends seconds
        return 1.0


def fault_later(sim: Sim, body: Mapping[str, Any] | None, after_s: float = FAULT_AFTER_S) -> float:
    """Once `sim` has had its first chat request, wait `after_s` and POST `body` to
    /sim/misbehave; return when it was set (monotonic)."""
    wait_for(lambda: int(sim_stats(sim)["requests"]) > 0, JOB_TIMEOUT_S, what="first request",
             interval_s=0.1)
    time.sleep(after_s)
    if body is not None:
        httpx.post(f"{sim.url}/sim/misbehave", json=dict(body), timeout=5).raise_for_status()
    return time.monotonic()


def versus(folder: Path, redis_url: str, job: str, source: Prompts, flags: list[str],
           slots: int, fault: Mapping[str, Any] | None, trees: Trees,
           poison_ids: frozenset[str] = frozenset(), fault_name: str = "-") -> Versus:
    """fleetgen and the direct client at once, each against its own simulator with `flags`,
    `fault` set on each FAULT_AFTER_S into its job."""
    in_flight = slots + DIRECT_MARGIN
    with Fleet(folder / "direct", redis_url) as direct_fleet, \
            Fleet(folder / "clean", redis_url) as clean_fleet, \
            Fleet(folder / "fleetgen", redis_url) as fleet:
        direct_sim = direct_fleet.sim("gpu0", flags)
        clean_sim = clean_fleet.sim("gpu0", flags) if fault is not None else None
        sim = fleet.sim("gpu0", flags)
        worker = start_worker(fleet, 0, sim.url, trees)
        with ThreadPoolExecutor(4) as pool, \
                Sampler({"w": worker.metrics_url}, WORKER_FAMILIES) as sampler:
            if fault is not None:
                pool.submit(fault_later, direct_sim, fault)
                pool.submit(fault_later, sim, fault)
            direct = pool.submit(lambda: asyncio.run(retrying_client(
                direct_sim.url, source.lines, in_flight, JOB_TIMEOUT_S)))
            clean = pool.submit(lambda: asyncio.run(retrying_client(
                clean_sim.url, source.lines, in_flight, JOB_TIMEOUT_S))) if clean_sim else None
            enqueue(fleet, folder, job, source)
            ending = finish(fleet, folder, job, len(source.lines))
            stats = sim_stats(sim)
            direct_run = direct.result(timeout=JOB_TIMEOUT_S)
            clean_wall = clean.result(timeout=JOB_TIMEOUT_S).wall_s if clean else None
        lines = worker_lines(worker, *DOOR_WORDS)
    assert sim.record is not None and direct_sim.record is not None
    return Versus(
        slots=slots, prompts=len(source.lines), direct_in_flight=in_flight, fault=fault_name,
        fleetgen_wall_s=ending.wall_s, direct_wall_s=direct_run.wall_s,
        ratio=round(ending.wall_s / direct_run.wall_s, 3), server_requests=int(stats["requests"]),
        server_refused={str(k): int(v) for k, v in (stats.get("refused") or {}).items()},
        direct=direct_run, clean_wall_s=clean_wall,
        ejections=sum(EJECTED in line for line in lines), poison_requests=_per_poison(sim.record, poison_ids),
        direct_poison_requests=_per_poison(direct_sim.record, poison_ids),
        limit_over_time=_limits(sampler), log=lines[-20:], ending=ending)


def _per_poison(record: Path, ids: frozenset[str]) -> float | None:
    if not ids:
        return None
    received = Requests.load({"gpu0": record}).received
    return round(sum(pid in ids for _, pid, _ in received) / len(ids), 2)


def _limits(sampler: Sampler) -> list[tuple[float, int]]:
    """The worker's limit each time it changed, by seconds since the first sample."""
    out: list[tuple[float, int]] = []
    ticks = [t for t in sampler.ticks if t.values.get("w") and LIMIT in t.values["w"]]
    for tick in ticks:
        limit = int(tick.values["w"][LIMIT])
        if not out or out[-1][1] != limit:
            out.append((round(tick.t - ticks[0].t, 1), limit))
    return out


def window(status: int) -> Callable[[Path, str, Trees], Versus]:
    """Scenarios 1 and 2: WINDOW_S of `status` on chat, 16 slots, answers of 2-6 s."""

    def run(folder: Path, redis_url: str, trees: Trees, slots: int = 16,
            prompts: int = 200) -> Versus:
        source = write_prompts(folder / "prompts.jsonl", prompts, SHORT_S)
        fault = {"status": status, "seconds": WINDOW_S, "scope": "chat"}
        return versus(folder, redis_url, f"door-{status}", source, sim_flags(slots, "sglang"),
                      slots, fault, trees, fault_name=f"{WINDOW_S:g} s of {status}")

    return run


def rpm_60(folder: Path, redis_url: str, trees: Trees, slots: int = 8,
           prompts: int = 60) -> Versus:
    """Scenario 3: a strict server allowing 60 requests a minute, 60 short answers."""
    source = write_prompts(folder / "prompts.jsonl", prompts, SHORT_S)
    return versus(folder, redis_url, "door-rpm", source, sim_flags(slots, "strict", "--rpm", "60"),
                  slots, None, trees, fault_name="--rpm 60")


def poison_60(folder: Path, redis_url: str, trees: Trees, slots: int = 16, prompts: int = 300,
              poisoned: int = 60, first: int = 120) -> Versus:
    """Scenario 4: `poisoned` prompts in a row, from line `first`, fail with 500 every time."""
    source = write_prompts(folder / "prompts.jsonl", prompts, SHORT_S)
    for line in source.lines[first:first + poisoned]:
        line["messages"][-1]["content"] += f" {POISON}"
    source.path.write_bytes(b"".join(orjson.dumps(x, option=orjson.OPT_APPEND_NEWLINE)
                                     for x in source.lines))
    ids = frozenset(str(x["id"]) for x in source.lines[first:first + poisoned])
    return versus(folder, redis_url, "door-poison", source,
                  sim_flags(slots, "sglang", "--poison", POISON), slots, None, trees,
                  poison_ids=ids, fault_name=f"{poisoned} poison prompts")


def hung(folder: Path, redis_url: str, trees: Trees, slots: int = 16, prompts: int = 400) -> Hung:
    """Scenario 5: gpu1's server hangs FAULT_AFTER_S into the job; gpu0's stays well."""
    job = "door-hung"
    source = write_prompts(folder / "prompts.jsonl", prompts, SHORT_S)
    flags = sim_flags(slots, "sglang")
    ejected: list[float] = []
    with Fleet(folder / "fleet", redis_url) as fleet:
        good = fleet.sim("gpu0", flags)
        bad = fleet.sim("gpu1", flags)
        start_worker(fleet, 0, good.url, trees)
        bad_worker = start_worker(fleet, 1, bad.url, trees)
        with ThreadPoolExecutor(1) as pool:
            hang = pool.submit(fault_later, bad, {"hang": "chat"})
            enqueue(fleet, folder, job, source)

            def watch() -> None:
                if not ejected and f"{EJECTED}: hung" in bad_worker.proc.log():
                    ejected.append(time.monotonic())

            ending = finish(fleet, folder, job, prompts, on_tick=watch)
            done = time.monotonic()
            hung_at = hang.result(timeout=5)
        stats = sim_stats(bad)
        text = status_text(fleet, job)
        lines = worker_lines(bad_worker, *DOOR_WORDS)
    named = [line.strip() for line in text.splitlines() if "gpu1" in line or "rotation" in line
             or "hung" in line]
    return Hung(slots=slots, prompts=prompts,
                done_after_hang_s=round(done - hung_at, 1) if ending.state == "done" else None,
                ejected_after_hang_s=round(ejected[0] - hung_at, 1) if ejected else None,
                hung_requests=int(stats.get("hung", 0)), status_lines=named, log=lines[-20:],
                ending=ending)


def router_unequal(folder: Path, redis_url: str, trees: Trees, big: int = 32, small: int = 8,
                   prompts: int = 600) -> Versus:
    """Scenario 6: a plain least-in-flight router over servers of `big` and `small` slots."""
    source = write_prompts(folder / "prompts.jsonl", prompts, SHORT_S)
    in_flight = big + small + DIRECT_MARGIN
    with Fleet(folder / "direct", redis_url) as direct_fleet, \
            Fleet(folder / "fleetgen", redis_url) as fleet:
        direct_router = _router(direct_fleet, big, small)
        router = _router(fleet, big, small)
        worker = start_worker(fleet, 0, router, trees)
        with ThreadPoolExecutor(1) as pool, \
                Sampler({"w": worker.metrics_url}, WORKER_FAMILIES) as sampler:
            direct = pool.submit(lambda: asyncio.run(retrying_client(
                direct_router, source.lines, in_flight, JOB_TIMEOUT_S)))
            enqueue(fleet, folder, "door-router", source)
            ending = finish(fleet, folder, "door-router", prompts)
            stats = httpx.get(f"{router}/router/stats", timeout=5).json()
            direct_run = direct.result(timeout=JOB_TIMEOUT_S)
        lines = worker_lines(worker, *DOOR_WORDS)
    return Versus(
        slots=big + small, prompts=prompts, direct_in_flight=in_flight,
        fault=f"router over {big} + {small} slots", fleetgen_wall_s=ending.wall_s,
        direct_wall_s=direct_run.wall_s, ratio=round(ending.wall_s / direct_run.wall_s, 3),
        server_requests=sum(int(b["sent"]) for b in stats["backends"]), server_refused={},
        direct=direct_run, clean_wall_s=None, ejections=sum(EJECTED in line for line in lines),
        poison_requests=None, direct_poison_requests=None, limit_over_time=_limits(sampler),
        log=lines[-20:], ending=ending, backends=stats["backends"])


def _router(fleet: Fleet, big: int, small: int) -> str:
    """Two recording simulators and `launcher.sim.router` in front of them; its URL."""
    backends = [fleet.sim(f"gpu0-{slots}", sim_flags(slots, "sglang")).url
                for slots in (big, small)]
    port = free_port()
    argv = [PYTHON, "-m", "launcher.sim.router", "--policy", "least-in-flight", "--flavor",
            "plain", "--port", str(port)]
    for url in backends:
        argv += ["--backend", url]
    proc = Proc("router", argv, fleet.env(), fleet.tmp / "router.log").start()
    fleet.procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url) or not proc.alive(), READY_TIMEOUT_S, what="router up")
    if not proc.alive():
        raise RuntimeError(f"router exited:\n{proc.log()}")
    return url


RUNS: dict[str, Callable[[Path, str, Trees], Any]] = {
    "burst-500": window(500),
    "overloaded-529": window(529),
    "rpm-60": rpm_60,
    "poison-60": poison_60,
    "hung": hung,
    "router-unequal": router_unequal,
}


def run_door(folder: Path, redis_url: str, only: Iterable[str] = SCENARIOS,
             trees: Trees = Trees()) -> dict[str, Any]:
    """Every chosen scenario on a flushed Redis; one that fails is reported and the rest run."""
    results: dict[str, Any] = {"scenarios": {}, "errors": {}, "took_s": {},
                               "worker_tree": str(trees.workers) if trees.workers else None}
    ledger = Ledger.from_url(redis_url)
    for name in only:
        ledger.r.flushall()
        started = time.monotonic()
        print(f"   door {name} ...", flush=True)
        try:
            figures = RUNS[name](folder / name, redis_url, trees)
            results["scenarios"][name] = asdict(figures)
        except Exception as exc:  # noqa: BLE001 (one broken scenario must not hide the others)
            results["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
        results["took_s"][name] = round(time.monotonic() - started, 1)
        print(f"   door {name} took {results['took_s'][name]:.0f}s", flush=True)
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """Figure 12's lines of the suite's table."""
    door = results.get("door")
    if not door:
        return []
    runs = door["scenarios"]
    out: list[Row] = []
    for n, name in enumerate(("burst-500", "overloaded-529"), start=1):
        if s := runs.get(name):
            e = s["ending"]
            out.append(Row(f"12.{n} {s['fault']} on chat: wall fleetgen ÷ direct; failed; "
                           "batch attempts; ejections",
                           f"{s['ratio']:.2f} ({_walls(s)}; ÷ direct without the fault "
                           f"{_clean_ratio(s)}); {e['failed']} failed (direct "
                           f"{s['direct']['failed']}); {e['retried_batches']} rerun; "
                           f"{s['ejections']} ejections; {s['server_requests']} requests for "
                           f"{s['prompts']} prompts (direct {s['direct']['requests']})",
                           f"≤ {TARGET_RATIO}; 0; 0; {'0' if n == 2 else '-'}",
                           s["ratio"] <= TARGET_RATIO and _clean(e)
                           and (n == 1 or s["ejections"] == 0)))
    if s := runs.get("rpm-60"):
        e = s["ending"]
        out.append(Row("12.3 --rpm 60, 60 prompts: wall fleetgen ÷ direct; requests at server",
                       f"{s['ratio']:.2f} ({_walls(s)}); {s['server_requests']} requests for "
                       f"{s['prompts']} prompts, refused {s['server_refused']} (direct "
                       f"{s['direct']['requests']})", f"≤ {TARGET_RATIO}; = prompts",
                       s["ratio"] <= TARGET_RATIO and _clean(e)
                       and s["server_requests"] == s["prompts"]))
    if s := runs.get("poison-60"):
        e = s["ending"]
        per = s["poison_requests"]
        out.append(Row("12.4 60 poison prompts of 300: wall ratio; requests per poison prompt; "
                       "ejections", f"{s['ratio']:.2f} ({_walls(s)}); {per} (direct "
                       f"{s['direct_poison_requests']}); {s['ejections']} ejections; "
                       f"{e['failed']} failed (direct {s['direct']['failed']})",
                       f"≤ {TARGET_POISON_RATIO}; ≤ {TARGET_POISON_REQUESTS:g}; 0",
                       s["ratio"] <= TARGET_POISON_RATIO and per is not None
                       and per <= TARGET_POISON_REQUESTS and s["ejections"] == 0
                       and e["failed"] == 60 and e["state"] == "done"))
    if s := runs.get("hung"):
        e = s["ending"]
        out.append(Row("12.5 one of two servers hangs: hang → job done; → ejected; failed; "
                       "batch attempts", f"{_s(s['done_after_hang_s'])}; "
                       f"{_s(s['ejected_after_hang_s'])}; {e['failed']} failed; "
                       f"{e['retried_batches']} rerun; {s['hung_requests']} requests hung",
                       f"≤ {TARGET_HUNG_DONE_S:g} s; -; 0; 0",
                       s["done_after_hang_s"] is not None
                       and s["done_after_hang_s"] <= TARGET_HUNG_DONE_S and _clean(e)
                       and e["retried_batches"] == 0))
    if s := runs.get("router-unequal"):
        limits = ", ".join(f"{t:g}s {v}" for t, v in s["limit_over_time"][:12])
        out.append(Row("12.6 router over 32 + 8 slots: wall fleetgen ÷ direct; worker limit",
                       f"{s['ratio']:.2f} ({_walls(s)}); limit {limits}",
                       f"≤ {TARGET_RATIO}", s["ratio"] <= TARGET_RATIO and _clean(s["ending"])))
    for name, error in door["errors"].items():
        out.append(Row(f"12 {name}: failed", error.splitlines()[0][:90], "-", False))
    return out


def _clean_ratio(s: dict[str, Any]) -> str:
    clean = s.get("clean_wall_s")
    return f"{s['fleetgen_wall_s'] / clean:.2f} of {clean:.0f} s" if clean else "n/a"


def _walls(s: dict[str, Any]) -> str:
    return f"{s['fleetgen_wall_s']:.0f} s / {s['direct_wall_s']:.0f} s"


def _clean(e: dict[str, Any]) -> bool:
    return (e["state"] == "done" and not e["paused"] and e["failed"] == 0
            and e["duplicates"] == 0 and e["exported"] == e["prompts"])


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.1f}s"


def write(out: Path, results: dict[str, Any]) -> Path:
    """`door.md`: figure 12's table, then each scenario's worker log lines and status."""
    door = results["door"]
    tree = f"\n\nWorkers from {door['worker_tree']}." if door.get("worker_tree") else ""
    parts = [f"# Figure 12: the worker's door under faults{tree}\n\n{table(rows(results))}\n"]
    for name, figures in door["scenarios"].items():
        parts.append(f"## {name} ({door['took_s'][name]:.0f} s)\n")
        if figures.get("status_lines"):
            parts.append("`producer status`:\n\n```\n" + "\n".join(figures["status_lines"])
                         + "\n```\n")
        if figures.get("log"):
            parts.append("The worker's log:\n\n```\n" + "\n".join(figures["log"]) + "\n```\n")
    path = out / "door.md"
    path.write_text("\n".join(parts))
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.perf.door`: figure 12 alone, optionally with another tree's workers."""
    p = argparse.ArgumentParser(prog="python -m tests.perf.door", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", action="append", choices=SCENARIOS, help="repeatable")
    p.add_argument("--worker-tree", type=Path, help="run the workers from this checkout")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "perf" / "door")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    trees = Trees(a.worker_tree.resolve() if a.worker_tree else None)
    run = a.out / f"run-{os.getpid()}"
    with RedisServer(data_dir=run / "redis") as redis:
        results = {"door": run_door(run, redis.url, a.scenario or SCENARIOS, trees),
                   "loadavg_end": list(os.getloadavg())}
    (a.out / "door.json").write_text(json.dumps(results, indent=1))
    write(a.out, results)
    found = rows(results)
    print(table(found))
    return 0 if all(r.ok is not False for r in found) else 1


__all__ = ["SCENARIOS", "main", "rows", "run_door", "write"]

if __name__ == "__main__":
    sys.exit(main())
