"""Figure 10: engines that are not SGLang, with no setting: how full the worker keeps them.

One recording simulator per flavour (`--flavor sglang|vllm|strict`, 24 slots; launcher/sim), one
worker with nothing but Redis and the server's URL set (no FLEETGEN_MAX_IN_FLIGHT, no --model),
one job. The server's slots are busy while it holds a request for each: from the request log,
busy(t) = min(requests at the server at t, slots) / slots, averaged over the steady part of the
job (from the first 10% of answers to the first 80%: the ramp and the drain are not the
controller's doing). The export is checked: every prompt exactly once, every one an answer.

    python -m tests.perf --only engines
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from fleetgen import keys
from fleetgen.ledger import Ledger
from tests.perf.analysis import Requests
from tests.perf.fleet import Fleet, wait_job
from tests.perf.workload import Workload

FLAVORS = ("sglang", "vllm", "strict")
SLOTS = 24
# The target: a capacity-limited server kept at least this busy with no setting.
BUSY_TARGET = 0.90
STEADY = (0.10, 0.80)


@dataclass(frozen=True)
class EngineRun:
    flavor: str
    prompts: int
    busy: float  # share of slot-time busy in the steady window
    wall_s: float
    limit: int | None  # the worker's in-flight limit at the end
    how: str | None  # how the worker found it
    kind: str | None  # what the worker took the server for
    exported: int
    duplicates: int
    failed: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def busy_share(reqs: Requests, slots: int, window: tuple[float, float]) -> float:
    """Slot-time busy ÷ slot-time available between two instants (request log sweep)."""
    start, end = window
    events = sorted([(t, 1) for t, _, _ in reqs.received] + [(t, -1) for t, *_ in reqs.answered])
    at_server, busy, last = 0, 0.0, start
    for t, step in events:
        if t > start:
            span = min(t, end) - max(last, start)
            if span > 0:
                busy += min(at_server, slots) * span
            last = t
        if t >= end:
            break
        at_server += step
    if last < end:
        busy += min(at_server, slots) * (end - max(last, start))
    return busy / (slots * (end - start))


def run_flavor(flavor: str, folder: Path, redis_url: str, prompts: int, speed: float) -> EngineRun:
    wl = Workload(prompts=prompts, servers=1, slots=SLOTS, mean_output_tokens=600.0,
                  speed=speed)
    folder.mkdir(parents=True)
    path = wl.write_prompts(folder / "prompts.jsonl")
    job = f"engines-{flavor}"
    with Fleet(folder / "fleet", redis_url) as fleet:
        sim = fleet.sim("gpu0", [*wl.sim_flags(), "--flavor", flavor])
        worker = fleet.worker(0, sim.url)
        fleet.producer("enqueue", str(path), "--job", job, "--output", str(folder / "out"),
                       "--queue", "gpu0")
        ledger = Ledger.from_url(redis_url)
        started = ledger.jobs.load(job).created_at
        done = wait_job(ledger, job, timeout_s=600)
        if done is None:
            raise RuntimeError(f"{flavor}: job not done in 600 s\n{worker.proc.log()[-3000:]}")
        entry = orjson.loads(ledger.r.hget(keys.WORKERS, "gpu0@perf") or b"{}")
        exported = folder / "export.jsonl"
        fleet.producer("export", job, "--to", str(exported))
    assert sim.record is not None
    reqs = Requests.load({"gpu0": sim.record})
    answers = sorted(t for t, *_ in reqs.answered)
    window = (answers[int(len(answers) * STEADY[0])], answers[int(len(answers) * STEADY[1])])
    ids = [orjson.loads(line) for line in exported.read_bytes().splitlines() if line]
    seen = [r.get("custom_id") or r.get("id") for r in ids]
    failed = sum(1 for r in ids if r.get("error"))
    return EngineRun(flavor, prompts, round(busy_share(reqs, SLOTS, window), 4),
                     round(time.time() - started, 1), entry.get("limit"),
                     entry.get("capacity_source"), entry.get("server_kind"), len(set(seen)),
                     len(seen) - len(set(seen)), failed)


def run_engines(folder: Path, redis_url: str, prompts: int = 1500,
                speed: float = 20.0) -> dict[str, Any]:
    runs = {}
    for flavor in FLAVORS:
        Ledger.from_url(redis_url).r.flushall()
        runs[flavor] = run_flavor(flavor, folder / flavor, redis_url, prompts, speed).as_dict()
    return {"slots": SLOTS, "target": BUSY_TARGET, "runs": runs}
