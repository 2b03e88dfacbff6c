"""Figure 11: a server under stress. How one worker treats a server that is slow and states no
capacity, loses capacity, refuses for being full, fails for a while, or fails for good
(workers/flow.py, workers/limits.py `QueueProbe`, workers/backend.py).

Each scenario is one job through real processes: recording simulators (`tests.perf.recsim`
around launcher/sim), Celery workers with production settings and nothing else set (no
FLEETGEN_MAX_IN_FLIGHT, no --model), and `producer enqueue --no-canary`. Every answer decodes at
20 tokens/s and each prompt asks for a `max_tokens` drawn from a range of seconds, so the
answers' wall times are known without `--speed` (the worker's controllers tick in wall time:
speed would change what is measured). Each scenario returns a dataclass of figures:

1. `slow-generic`: a strict server (no capacity endpoint, no gauges) of 64 slots, answers of
   10-40 s, ~6 answers per slot. The same prompts through a direct asyncio + httpx client
   holding 66 in flight and, at the same time on a second server, through fleetgen: seconds from fleetgen's first prompt until all
   64 slots are busy, peak in flight at the server, slot use in the steady window of each (as
   figure 10: 10% to 80% of answers) and their ratio, exactly once.
2. `capacity-drop`: the same server restarted mid-job on its port with 16 slots: seconds from
   the new server's first /health 200 until the worker's limit (its /metrics) is at most
   1.5 x 16 for good, and the new server's peak in flight.
3. `overload-429`: a strict server of 16 slots that refuses beyond them with 429 and `Retry-After: 5`: refusals,
   answers, the job's end state, prompts failed, batches run again (attempt > 1).
4. `window-503` / 5. `window-502`: a 45 s window in which every chat request is answered
   503 (full) or 502 (a proxy's bad gateway) while /health stays 200: chat refusals per second
   in the window, the simulator's GET requests per path, the first answer after the window
   and slot use in the RECOVERY_S after it, the job's end, pauses, prompts failed.
6. `sick-of-two`: two servers, gpu1 failing every request with 500: the job done by gpu0,
   nothing failed, what `producer status` says of gpu1 and how long gpu1 was sent prompts.
7. `third-failing`: one server failing 31.7% of requests: `producer status`'s line and the
   prompts failed.
8. `vllm-short`: a vLLM server of 24 slots, a short job: slot use of fleetgen ÷ a direct
   client holding 26 (side by side, as in 1).

    python -m tests.perf --only flow                                  # all (~15 min)
    python -m tests.perf --only flow --flow-scenario overload-429     # one
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from fleetgen.jobview import job_status
from fleetgen.ledger import STATE_PAUSED, Ledger
from launcher.sim.config import SimConfig
from tests.perf.analysis import Requests
from tests.perf.engines import STEADY, busy_share
from tests.perf.fleet import READY_TIMEOUT_S, Fleet, Sim, Worker, wait_for
from tests.perf.real_engine import direct_client
from tests.perf.report import Row, table
from tests.perf.sampler import WORKER_FAMILIES, Sampler
from tests.perf.workload import Workload
from tests.stack import PYTHON, Proc, healthy

# Tokens/s of one running request: an answer of max_tokens takes max_tokens / 20 seconds.
DECODE_TPS = 20.0
# Natural answers far longer than any max_tokens: every answer runs to its own max_tokens.
NATURAL_TOKENS = 1_000_000
MODEL = SimConfig().served_name
# Answer lengths, in seconds of wall time.
LONG_S = (10.0, 40.0)
SHORT_S = (2.0, 6.0)
TARGET_BUSY_RATIO = 0.97
TARGET_PEAK_OVER_CAPACITY = 1.5
TARGET_FULL_S = 10.0
# The probe controller follows a capacity that falls at its next probe (one a second).
TARGET_FOLLOW_S = 10.0
# "No hot loop": chat refusals per second while a server refuses everything.
TARGET_REFUSED_PER_S = 5.0
# How long after an error window its slot use is shown: what the window costs beyond itself.
RECOVERY_S = 30.0
# A job that has not ended by then is exported as it stands and reported as not done.
JOB_TIMEOUT_S = 420.0
SCENARIOS = ("slow-generic", "capacity-drop", "overload-429", "window-503", "window-502",
             "sick-of-two", "third-failing", "vllm-short")


@dataclass(frozen=True)
class Ending:
    """How a job ended: its state, whether it was ever paused, its exactly-once check."""

    state: str
    paused: bool
    wall_s: float
    prompts: int
    exported: int
    duplicates: int
    answered: int
    failed: int
    # Batches whose records carry attempt > 1 (a worker death or lost lease spent one).
    retried_batches: int
    first_failure: str | None


@dataclass(frozen=True)
class SlowGeneric:
    """Scenario 1: a slow server that states no capacity, fleetgen beside a direct client."""

    slots: int
    prompts: int
    direct_in_flight: int
    direct_busy: float
    fleetgen_busy: float
    busy_ratio: float
    full_s: float | None  # fleetgen's first prompt -> first instant with every slot busy
    peak_in_flight: int  # at the server, running + waiting, fleetgen's run (/sim/stats)
    peak_logged: int  # the same from the request log
    peak_over_capacity: float
    direct_wall_s: float
    limit_end: int | None
    how: str | None
    limit_log: list[str]
    ending: Ending


@dataclass(frozen=True)
class CapacityDrop:
    """Scenario 2: the server restarted with a quarter of its slots."""

    slots_before: int
    slots_after: int
    limit_before: int | None  # the worker's limit just before the restart
    follow_s: float | None  # new server up -> limit <= 1.5 x slots_after for good
    first_under_s: float | None  # new server up -> limit <= 1.5 x slots_after at first
    limit_peak_after: int | None  # the highest limit after the new server was up
    limit_end: int | None
    server_peak_in_flight: int
    limit_log: list[str]
    ending: Ending


@dataclass(frozen=True)
class Overload:
    """Scenario 3: a server that refuses with 429 beyond its slots."""

    slots: int
    refused: dict[str, int]  # HTTP status -> refusals the server sent
    answered: int  # chat requests the server answered 200 (the worker's probes included)
    refused_per_answer: float  # refusals ÷ prompts answered
    busy: float
    peak_in_flight: int
    limit_log: list[str]
    ending: Ending


@dataclass(frozen=True)
class Window:
    """Scenarios 4 and 5: a window in which every chat request is refused."""

    status: int
    window_s: float
    chat_refused: int
    refused_per_s: float  # mean over the window
    refused_peak_per_s: int  # the busiest second
    probes: dict[str, int]  # path -> requests the simulator counted
    out_of_rotation: bool  # the worker took the server out at some point
    back_after_window_s: float | None  # window end -> first answer after it
    recovery_busy: float  # slot use over RECOVERY_S after the window
    log: list[str]
    ending: Ending


@dataclass(frozen=True)
class SickOfTwo:
    """Scenario 6: one server of two failing everything."""

    requests_to_sick: int
    sick_sent_s: float | None  # gpu1's first request -> gpu1 out of rotation (registry)
    sick_named: bool
    status_lines: list[str]
    answered_by: dict[str, int]
    log: list[str]
    ending: Ending


@dataclass(frozen=True)
class ThirdFailing:
    """Scenario 7: a server failing a third of its requests."""

    fail_rate: float
    requests: int
    failed_requests: int
    status_line: str | None
    out_of_rotation: bool
    log: list[str]
    ending: Ending


@dataclass(frozen=True)
class VllmShort:
    """Scenario 8: a vLLM server, fleetgen beside a direct client."""

    slots: int
    prompts: int
    direct_in_flight: int
    direct_busy: float
    fleetgen_busy: float
    busy_ratio: float
    limit_end: int | None
    how: str | None
    ending: Ending


@dataclass
class Prompts:
    """A job's input: the JSONL file and its lines (the direct client sends the same)."""

    path: Path
    lines: list[dict[str, Any]] = field(default_factory=list)


def write_prompts(path: Path, n: int, seconds: tuple[float, float], seed: int = 0) -> Prompts:
    """`n` prompts whose answers take `seconds` (uniform) at DECODE_TPS, as their max_tokens."""
    wl = Workload(prompts=n)
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        line = orjson.loads(wl.line(i))
        line["sampling"] = {"max_tokens": round(DECODE_TPS * rng.uniform(*seconds))}
        lines.append(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(x, option=orjson.OPT_APPEND_NEWLINE) for x in lines))
    return Prompts(path, lines)


def sim_flags(slots: int, flavor: str, *extra: str) -> list[str]:
    """Flags of one simulated server whose answers run to each prompt's max_tokens."""
    return ["--flavor", flavor, "--max-running-requests", str(slots), "--decode-tps",
            str(DECODE_TPS), "--mean-output-tokens", str(NATURAL_TOKENS), "--output-sigma", "0.1",
            "--log-level", "warning", *extra]


def sim_stats(sim: Sim) -> dict[str, Any]:
    """The simulator's own counts (`GET /sim/stats`)."""
    response = httpx.get(f"{sim.url}/sim/stats", timeout=5)
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def enqueue(fleet: Fleet, folder: Path, job: str, prompts: Prompts) -> None:
    """`producer enqueue`, the canary off (the simulator's text would trip it)."""
    fleet.producer("enqueue", str(prompts.path), "--job", job, "--output", str(folder / "out"),
                   "--no-canary")


def finish(fleet: Fleet, folder: Path, job: str, prompts: int, timeout_s: float = JOB_TIMEOUT_S,
           on_tick: Callable[[], None] | None = None) -> Ending:
    """Wait until the job is done (or paused for good, or the timeout), then export it."""
    ledger = Ledger.from_url(fleet.redis_url)
    started = ledger.jobs.load(job).created_at
    deadline = time.monotonic() + timeout_s
    paused = False
    state = "running"
    while time.monotonic() < deadline:
        if on_tick is not None:
            on_tick()
        state = job_status(ledger, job).state
        paused = paused or state == STATE_PAUSED
        if state == "done":
            break
        time.sleep(0.2)
    wall = time.time() - started
    exported = folder / f"{job}.jsonl"
    fleet.producer("export", job, "--to", str(exported), "--partial", "--force")
    return _checked(exported, state, paused, wall, prompts, folder / "out" / job)


def _checked(exported: Path, state: str, paused: bool, wall: float, prompts: int,
             output: Path) -> Ending:
    records = [orjson.loads(line) for line in exported.read_bytes().splitlines() if line]
    ids = [r.get("custom_id") or r.get("id") for r in records]
    failures = [r for r in records if "error" in r and "custom_id" in r]
    retried = {path.stem for path in output.rglob("*.jsonl")
               if path.parent.name in ("results", "errors")
               and any(orjson.loads(line).get("attempt", 1) > 1
                       for line in path.read_bytes().splitlines() if line)}
    return Ending(state=state, paused=paused, wall_s=round(wall, 1), prompts=prompts,
                  exported=len(set(ids)), duplicates=len(ids) - len(set(ids)),
                  answered=len(records) - len(failures), failed=len(failures),
                  retried_batches=len(retried),
                  first_failure=failures[0]["error"]["message"][:200] if failures else None)


def registered(fleet: Fleet, worker: str) -> dict[str, Any]:
    """The worker's registry entry as JSON (its limit, state, health)."""
    raw = Ledger.from_url(fleet.redis_url).registry.entries().get(worker)
    return orjson.loads(raw) if raw else {}


def status_text(fleet: Fleet, job: str) -> str:
    """What `producer status JOB` prints."""
    return fleet.producer("status", job).stdout


def worker_lines(worker: Worker, *words: str) -> list[str]:
    """The worker's log lines about its server's flow (limits, rotation, probes)."""
    text = worker.proc.log_path.read_text(errors="replace")
    # Celery's task-result lines repeat the batch's server health: not news about the server.
    return [line.strip()[:300] for line in text.splitlines()
            if any(w in line for w in words) and "Task fleetgen.run_batch" not in line]


# Words of the worker's log lines about its limit and its server's rotation.
FLOW_WORDS = ("in flight up to", "rotation", "probe", "finding it", "does not state", "cut to")


def steady_busy(record: Path, slots: int) -> tuple[float, Requests]:
    """Figure 10's busy share of one server, over 10% to 80% of its prompts' answers."""
    reqs = Requests.load({"gpu0": record})
    answers = sorted(t for t, pid, _, status, _ in reqs.answered if status == 200 and pid != "-")
    window = (answers[int(len(answers) * STEADY[0])], answers[int(len(answers) * STEADY[1])])
    return busy_share(reqs, slots, window), reqs


def at_server(reqs: Requests) -> list[tuple[float, int]]:
    """(t, requests at the server just after t), from the request log."""
    events = sorted([(t, 1) for t, _, _ in reqs.received] + [(t, -1) for t, *_ in reqs.answered])
    out, n = [], 0
    for t, step in events:
        n += step
        out.append((t, n))
    return out


def run_direct(sim: Sim, prompts: Prompts, in_flight: int) -> float:
    """The same prompts through a plain client holding `in_flight`; its wall time."""
    records, wall, cut = asyncio.run(direct_client(sim.url, MODEL, prompts.lines, in_flight,
                                                   JOB_TIMEOUT_S))
    bad = [r for r in records if r.get("status") != 200]
    if cut or bad:
        raise RuntimeError(f"direct client: {cut} cut, {len(bad)} not answered: {bad[:1]}")
    return wall


def slow_generic(folder: Path, redis_url: str, slots: int = 64, prompts: int = 400) -> SlowGeneric:
    job = "flow-slow"
    source = write_prompts(folder / "prompts.jsonl", prompts, LONG_S)
    direct_in_flight = slots + 2
    pair = side_by_side(folder, redis_url, job, source, sim_flags(slots, "strict"),
                        direct_in_flight)
    busy, reqs = steady_busy(pair.sim, slots)
    direct_busy, _ = steady_busy(pair.direct_sim, slots)
    first = min(t for t, pid, _ in reqs.received if pid != "-")
    full = next((t for t, n in at_server(reqs) if n >= slots), None)
    logged = max(n for _, n in at_server(reqs))
    peak = int(pair.stats["peak_in_flight"])
    return SlowGeneric(
        slots=slots, prompts=prompts, direct_in_flight=direct_in_flight,
        direct_busy=round(direct_busy, 4), fleetgen_busy=round(busy, 4),
        busy_ratio=round(busy / direct_busy, 4),
        full_s=None if full is None else round(full - first, 2), peak_in_flight=peak,
        peak_logged=logged, peak_over_capacity=round(peak / slots, 3),
        direct_wall_s=round(pair.direct_wall_s, 1), limit_end=pair.entry.get("limit"),
        how=pair.entry.get("capacity_source"), limit_log=pair.log[-12:], ending=pair.ending)


@dataclass(frozen=True)
class Pair:
    """The same prompts through fleetgen and a direct client, each on its own server."""

    sim: Path  # fleetgen's server's request log
    direct_sim: Path
    stats: dict[str, Any]  # fleetgen's server's /sim/stats at the end
    entry: dict[str, Any]  # the worker's registry entry at the end
    direct_wall_s: float
    log: list[str]
    ending: Ending


def side_by_side(folder: Path, redis_url: str, job: str, source: Prompts, flags: list[str],
                 direct_in_flight: int) -> Pair:
    """Run fleetgen and the direct client at once, each against its own simulator: the
    machine is idle enough (the servers sleep through their answers) that neither slows the
    other, and the figure takes half the time."""
    with Fleet(folder / "direct", redis_url) as direct_fleet, \
            Fleet(folder / "fleetgen", redis_url) as fleet:
        direct_sim = direct_fleet.sim("gpu0", flags)
        sim = fleet.sim("gpu0", flags)
        worker = fleet.worker(0, sim.url)
        with ThreadPoolExecutor(1) as pool:
            direct = pool.submit(run_direct, direct_sim, source, direct_in_flight)
            enqueue(fleet, folder, job, source)
            ending = finish(fleet, folder, job, len(source.lines))
            stats = sim_stats(sim)
            entry = registered(fleet, "gpu0@perf")
            direct_wall = direct.result(timeout=JOB_TIMEOUT_S)
        lines = worker_lines(worker, *FLOW_WORDS)
    assert sim.record is not None and direct_sim.record is not None
    return Pair(sim.record, direct_sim.record, stats, entry, direct_wall, lines, ending)


def restart_sim(fleet: Fleet, sim: Sim, name: str, flags: list[str]) -> Sim:
    """SIGKILL `sim` and start a recording simulator with `flags` on the same port."""
    port = int(sim.url.rsplit(":", 1)[1])
    sim.proc.kill()
    wait_for(lambda: not sim.proc.alive(), 10, what="old simulator gone")
    record = fleet.tmp / f"{name}.requests"
    argv = [PYTHON, "-m", "tests.perf.recsim", "--record", str(record), "--port", str(port),
            *flags]
    proc = Proc(name, argv, fleet.env(), fleet.tmp / f"{name}.log").start()
    fleet.procs.append(proc)
    wait_for(lambda: healthy(sim.url) or not proc.alive(), READY_TIMEOUT_S, what=f"{name} up")
    if not proc.alive():
        raise RuntimeError(f"simulator {name} exited:\n{proc.log()}")
    return Sim(proc, sim.url, record)


# The worker's in-flight limit on its /metrics.
LIMIT = "fleetgen_worker_max_in_flight_requests"


def capacity_drop(folder: Path, redis_url: str, before: int = 64, after: int = 16,
                  prompts: int = 500) -> CapacityDrop:
    job = "flow-drop"
    source = write_prompts(folder / "prompts.jsonl", prompts, SHORT_S)
    bound = TARGET_PEAK_OVER_CAPACITY * after
    with Fleet(folder / "fleet", redis_url) as fleet:
        sim = fleet.sim("gpu0", sim_flags(before, "strict"))
        worker = fleet.worker(0, sim.url)
        with Sampler({"w": worker.metrics_url}, WORKER_FAMILIES) as sampler:
            enqueue(fleet, folder, job, source)
            # Restart once the worker has held the first server full for a while.
            wait_for(lambda: _limit(sampler) >= before, 60, what="limit reaches the slots",
                     interval_s=0.2)
            time.sleep(10)
            limit_before = _limit(sampler)
            new = restart_sim(fleet, sim, "gpu0-after", sim_flags(after, "strict"))
            up = time.monotonic()
            ending = finish(fleet, folder, job, prompts)
            stats = sim_stats(new)
        lines = worker_lines(worker, *FLOW_WORDS)
    peak = int(stats["peak_in_flight"])
    after_up = [(t.t - up, int(t.values["w"][LIMIT])) for t in sampler.ticks
                if t.t >= up and t.values.get("w")]
    over = [s for s, limit in after_up if limit > bound]
    under = [s for s, limit in after_up if limit <= bound]
    follow = next((s for s, limit in after_up if limit <= bound and (not over or s > over[-1])),
                  None)
    return CapacityDrop(
        slots_before=before, slots_after=after, limit_before=limit_before,
        follow_s=None if follow is None else round(max(0.0, follow), 2),
        first_under_s=round(max(0.0, under[0]), 2) if under else None,
        limit_peak_after=max((limit for _, limit in after_up), default=None),
        limit_end=after_up[-1][1] if after_up else None, server_peak_in_flight=peak,
        limit_log=lines[-20:], ending=ending)


def _limit(sampler: Sampler) -> int:
    tick = sampler.latest()
    return int(tick.values["w"][LIMIT]) if tick and tick.values.get("w") else 0


def overload_429(folder: Path, redis_url: str, slots: int = 16, prompts: int = 300) -> Overload:
    job = "flow-429"
    source = write_prompts(folder / "prompts.jsonl", prompts, SHORT_S)
    # A server that states no capacity and refuses beyond it, as TGI or a router does.
    flags = sim_flags(slots, "strict", "--overload", "429", "--retry-after", "5")
    with Fleet(folder / "fleet", redis_url) as fleet:
        sim = fleet.sim("gpu0", flags)
        worker = fleet.worker(0, sim.url)
        enqueue(fleet, folder, job, source)
        ending = finish(fleet, folder, job, prompts)
        stats = sim_stats(sim)
        lines = worker_lines(worker, *FLOW_WORDS)
    assert sim.record is not None
    busy, _ = steady_busy(sim.record, slots)
    refused = {str(k): int(v) for k, v in (stats.get("refused") or {}).items()}
    answered = int(stats["answered"])
    return Overload(slots=slots, refused=refused, answered=answered,
                    refused_per_answer=round(sum(refused.values()) / max(ending.answered, 1), 3),
                    busy=round(busy, 4), peak_in_flight=int(stats["peak_in_flight"]),
                    limit_log=lines[-20:], ending=ending)


def error_window(folder: Path, redis_url: str, status: int, start_s: float = 10.0,
                 window_s: float = 45.0, slots: int = 16, prompts: int = 240) -> Window:
    job = f"flow-{status}"
    source = write_prompts(folder / "prompts.jsonl", prompts, SHORT_S)
    flags = sim_flags(slots, "sglang", "--error-window", f"{start_s:g}:{window_s:g}:{status}")
    rotation: list[bool] = []
    with Fleet(folder / "fleet", redis_url) as fleet:
        sim = fleet.sim("gpu0", flags)
        worker = fleet.worker(0, sim.url)
        enqueue(fleet, folder, job, source)

        def watch() -> None:
            rotation.append(registered(fleet, "gpu0@perf").get("state") == "out-of-rotation")

        ending = finish(fleet, folder, job, prompts, on_tick=watch)
        asked = time.monotonic()
        stats = sim_stats(sim)
        lines = worker_lines(worker, *FLOW_WORDS)
    assert sim.record is not None
    reqs = Requests.load({"gpu0": sim.record})
    # The window is timed from the simulator's start, on the same monotonic clock as its log.
    opened = asked - stats["elapsed_s"] + start_s
    closed = opened + window_s
    refusals = [t for t, _, _, code, _ in reqs.answered if code == status]
    per_second = Counter(int(t - opened) for t in refusals if opened <= t < closed)
    after = [t for t, pid, _, code, _ in reqs.answered if code == 200 and t >= closed and pid != "-"]
    # The window answers before reading a body, so its refusals have no `R` line: leave them
    # out of the count of requests at the server.
    served = Requests(reqs.received, [a for a in reqs.answered if a[3] != status])
    return Window(
        status=status, window_s=window_s, chat_refused=len(refusals),
        refused_per_s=round(sum(per_second.values()) / window_s, 2),
        refused_peak_per_s=max(per_second.values(), default=0),
        probes={str(k): int(v) for k, v in (stats.get("probes") or {}).items()},
        out_of_rotation=any(rotation),
        back_after_window_s=round(after[0] - closed, 1) if after else None,
        recovery_busy=round(busy_share(served, slots, (closed, closed + RECOVERY_S)), 3),
        log=lines[-20:], ending=ending)


def sick_of_two(folder: Path, redis_url: str, slots: int = 16, prompts: int = 200) -> SickOfTwo:
    job = "flow-sick"
    source = write_prompts(folder / "prompts.jsonl", prompts, SHORT_S)
    out_at: list[float] = []
    with Fleet(folder / "fleet", redis_url) as fleet:
        good = fleet.sim("gpu0", sim_flags(slots, "sglang"))
        sick = fleet.sim("gpu1", sim_flags(slots, "sglang", "--fail-rate", "1"))
        fleet.worker(0, good.url)
        sick_worker = fleet.worker(1, sick.url)
        enqueue(fleet, folder, job, source)

        def watch() -> None:
            if not out_at and registered(fleet, "gpu1@perf").get("state") == "out-of-rotation":
                out_at.append(time.monotonic())

        ending = finish(fleet, folder, job, prompts, on_tick=watch)
        text = status_text(fleet, job)
        lines = worker_lines(sick_worker, *FLOW_WORDS)
    assert sick.record is not None and good.record is not None
    reqs = Requests.load({"gpu0": good.record, "gpu1": sick.record})
    to_sick = [t for t, _, server in reqs.received if server == "gpu1"]
    named = [line.strip() for line in text.splitlines() if "gpu1" in line
             or "rotation" in line or "requests failed" in line]
    answered = Counter(server for _, _, server, code, _ in reqs.answered if code == 200)
    return SickOfTwo(
        requests_to_sick=len(to_sick),
        sick_sent_s=round(out_at[0] - to_sick[0], 2) if out_at and to_sick else None,
        sick_named=any("gpu1" in line for line in named)
        and any("rotation" in line or "failed" in line for line in named),
        status_lines=named, answered_by=dict(answered), log=lines[-20:], ending=ending)


def third_failing(folder: Path, redis_url: str, fail_rate: float = 0.317, slots: int = 16,
                  prompts: int = 300) -> ThirdFailing:
    job = "flow-third"
    source = write_prompts(folder / "prompts.jsonl", prompts, SHORT_S)
    rotation: list[bool] = []
    with Fleet(folder / "fleet", redis_url) as fleet:
        sim = fleet.sim("gpu0", sim_flags(slots, "sglang", "--fail-rate", str(fail_rate)))
        worker = fleet.worker(0, sim.url)
        enqueue(fleet, folder, job, source)

        def watch() -> None:
            rotation.append(registered(fleet, "gpu0@perf").get("state") == "out-of-rotation")

        status_line: list[str] = []

        def look() -> None:
            watch()
            if len(rotation) % 25 == 0:  # `status` now and then, while requests fail
                line = _failed_line(status_text(fleet, job))
                if line:
                    status_line[:] = [line]

        ending = finish(fleet, folder, job, prompts, on_tick=look)
        line = _failed_line(status_text(fleet, job)) or (status_line[0] if status_line else None)
        lines = worker_lines(worker, *FLOW_WORDS)
    assert sim.record is not None
    reqs = Requests.load({"gpu0": sim.record})
    codes = Counter(code for _, pid, _, code, _ in reqs.answered if pid != "-")
    return ThirdFailing(fail_rate=fail_rate, requests=sum(codes.values()),
                        failed_requests=codes.get(500, 0), status_line=line,
                        out_of_rotation=any(rotation), log=lines[-20:], ending=ending)


def _failed_line(text: str) -> str | None:
    return next((line.strip() for line in text.splitlines() if "% of requests failed" in line),
                None)


def vllm_short(folder: Path, redis_url: str, slots: int = 24, prompts: int = 300) -> VllmShort:
    job = "flow-vllm"
    source = write_prompts(folder / "prompts.jsonl", prompts, SHORT_S)
    direct_in_flight = slots + 2
    pair = side_by_side(folder, redis_url, job, source, sim_flags(slots, "vllm"),
                        direct_in_flight)
    busy, _ = steady_busy(pair.sim, slots)
    direct_busy, _ = steady_busy(pair.direct_sim, slots)
    return VllmShort(slots=slots, prompts=prompts, direct_in_flight=direct_in_flight,
                     direct_busy=round(direct_busy, 4), fleetgen_busy=round(busy, 4),
                     busy_ratio=round(busy / direct_busy, 4), limit_end=pair.entry.get("limit"),
                     how=pair.entry.get("capacity_source"), ending=pair.ending)


RUNS: dict[str, Callable[[Path, str], Any]] = {
    "slow-generic": slow_generic,
    "capacity-drop": capacity_drop,
    "overload-429": overload_429,
    "window-503": lambda folder, url: error_window(folder, url, 503),
    "window-502": lambda folder, url: error_window(folder, url, 502),
    "sick-of-two": sick_of_two,
    "third-failing": third_failing,
    "vllm-short": vllm_short,
}


def run_flow(folder: Path, redis_url: str, only: Iterable[str] = SCENARIOS) -> dict[str, Any]:
    """Every chosen scenario on a flushed Redis; one that fails is reported and the rest run."""
    results: dict[str, Any] = {"scenarios": {}, "errors": {}, "took_s": {}}
    ledger = Ledger.from_url(redis_url)
    for name in only:
        ledger.r.flushall()
        started = time.monotonic()
        print(f"   flow {name} ...", flush=True)
        try:
            figures = RUNS[name](folder / name, redis_url)
            results["scenarios"][name] = asdict(figures)
        except Exception as exc:  # noqa: BLE001 (one broken scenario must not hide the others)
            results["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
        results["took_s"][name] = round(time.monotonic() - started, 1)
        print(f"   flow {name} took {results['took_s'][name]:.0f}s", flush=True)
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """Figure 11's lines of the suite's table."""
    flow = results.get("flow")
    if not flow:
        return []
    runs = flow["scenarios"]
    out: list[Row] = []
    if s := runs.get("slow-generic"):
        e = s["ending"]
        out.append(Row("11.1 slow strict server, no setting: slot use fleetgen ÷ direct",
                       f"{s['busy_ratio']:.3f}  ({s['fleetgen_busy']:.3f} / {s['direct_busy']:.3f}"
                       f" at {s['direct_in_flight']} in flight; limit {s['limit_end']}: "
                       f"{s['how']})", f"≥ {TARGET_BUSY_RATIO}",
                       s["busy_ratio"] >= TARGET_BUSY_RATIO))
        out.append(Row("     first prompt → all slots busy; peak in flight ÷ slots",
                       f"{_s(s['full_s'])}; {s['peak_over_capacity']:.2f} ({s['peak_in_flight']}"
                       f" / {s['slots']})",
                       f"≤ {TARGET_FULL_S:g} s; ≤ {TARGET_PEAK_OVER_CAPACITY}",
                       s["full_s"] is not None and s["full_s"] <= TARGET_FULL_S
                       and s["peak_over_capacity"] <= TARGET_PEAK_OVER_CAPACITY))
        out.append(_once("     exported", e))
    if s := runs.get("capacity-drop"):
        out.append(Row(f"11.2 restarted with {s['slots_after']} slots (was {s['slots_before']}):"
                       " new server up → limit ≤ 1.5×", f"{_s(s['follow_s'])} (limit "
                       f"{s['limit_before']} → peak {s['limit_peak_after']}, end "
                       f"{s['limit_end']}; server peak {s['server_peak_in_flight']})",
                       f"≤ {TARGET_FOLLOW_S:g} s", s["follow_s"] is not None
                       and s["follow_s"] <= TARGET_FOLLOW_S and _clean(s["ending"])))
    if s := runs.get("overload-429"):
        e = s["ending"]
        out.append(Row("11.3 429 + Retry-After 5 beyond 16 slots: end, failed, batches rerun",
                       f"{e['state']}, {e['failed']} failed, {e['retried_batches']} rerun; "
                       f"{sum(s['refused'].values())} refusals / {e['answered']} answers "
                       f"({s['refused_per_answer']:.2f}; {s['answered']} with probes); "
                       f"slots busy {s['busy']:.3f}, peak {s['peak_in_flight']}",
                       "done, 0, 0", _clean(e) and e["retried_batches"] == 0))
    for name in ("window-503", "window-502"):
        if s := runs.get(name):
            e = s["ending"]
            probes = ", ".join(f"{k} {v}" for k, v in sorted(s["probes"].items()))
            out.append(Row(f"11.{4 if name.endswith('3') else 5} {s['window_s']:.0f} s of "
                           f"{s['status']}: chat refusals/s in it (mean, peak); end",
                           f"{s['refused_per_s']:.1f}, {s['refused_peak_per_s']}; {e['state']}"
                           f"{', paused' if e['paused'] else ''}, {e['failed']} failed; "
                           f"{'out of rotation; ' if s['out_of_rotation'] else ''}first answer "
                           f"{_s(s['back_after_window_s'])} after it, slots busy "
                           f"{s['recovery_busy']:.2f} in the {RECOVERY_S:.0f} s after; "
                           f"probes: {probes}",
                           f"≤ {TARGET_REFUSED_PER_S:g}/s; done, no pause, 0",
                           s["refused_peak_per_s"] <= TARGET_REFUSED_PER_S and _clean(e)))
    if s := runs.get("sick-of-two"):
        e = s["ending"]
        out.append(Row("11.6 gpu1 fails all (500): gpu1 sent prompts for; status names it",
                       f"{_s(s['sick_sent_s'])} ({s['requests_to_sick']} requests); "
                       f"named: {s['sick_named']}; {e['state']}, {e['failed']} failed",
                       "named; done, 0", s["sick_named"] and _clean(e)))
    if s := runs.get("third-failing"):
        e = s["ending"]
        out.append(Row(f"11.7 {s['fail_rate']:.1%} of requests fail: status; prompts failed",
                       f"{s['status_line']!r}; {e['failed']} failed of {e['prompts']}"
                       f"{'; taken out of rotation' if s['out_of_rotation'] else ''}",
                       "named", s["status_line"] is not None))
    if s := runs.get("vllm-short"):
        out.append(Row("11.8 vLLM 24 slots, short job: slot use fleetgen ÷ direct",
                       f"{s['busy_ratio']:.3f}  ({s['fleetgen_busy']:.3f} / {s['direct_busy']:.3f}"
                       f" at {s['direct_in_flight']}; limit {s['limit_end']})",
                       f"≥ {TARGET_BUSY_RATIO}", s["busy_ratio"] >= TARGET_BUSY_RATIO
                       and _clean(s["ending"])))
    for name, error in flow["errors"].items():
        out.append(Row(f"11 {name}: failed", error.splitlines()[0][:90], "-", False))
    return out


def write(out: Path, results: dict[str, Any]) -> Path:
    """`flow.md`: figure 11's table, then what each scenario's worker logged about its server
    and what `producer status` said (results.json holds every figure)."""
    flow = results["flow"]
    parts = [f"# Figure 11: a server under stress\n\n{table(rows(results))}\n"]
    for name, figures in flow["scenarios"].items():
        lines = figures.get("status_lines") or []
        if figures.get("status_line"):
            lines = [figures["status_line"]]
        logged = figures.get("log") or figures.get("limit_log") or []
        parts.append(f"## {name} ({flow['took_s'][name]:.0f} s)\n")
        if lines:
            parts.append("`producer status`:\n\n```\n" + "\n".join(lines) + "\n```\n")
        if logged:
            parts.append("The worker's log:\n\n```\n" + "\n".join(logged) + "\n```\n")
    path = out / "flow.md"
    path.write_text("\n".join(parts))
    return path


def _once(label: str, e: dict[str, Any]) -> Row:
    return Row(label, f"{e['exported']}/{e['prompts']} once, {e['duplicates']} dup, "
               f"{e['failed']} failed; {e['state']}", "exactly once, 0 failed", _clean(e))


def _clean(e: dict[str, Any]) -> bool:
    return (e["state"] == "done" and not e["paused"] and e["failed"] == 0
            and e["duplicates"] == 0 and e["exported"] == e["prompts"])


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.1f}s"


__all__ = ["SCENARIOS", "rows", "run_flow", "write"]
