"""Figure 9: short answers, where the pipeline's own seams show (figures 1-3 are long answers).

2 simulated servers x 16 slots, 600-token mean answers at `--speed 40` (~190 requests/s in
all), 6,000 prompts, through fleetgen and through the plain script (generate_completions.py)
holding 18 requests per server. Each is timed from its command's start to the servers' own
`sglang:num_requests_total` reaching 6,000, so both clocks stop at the same server event.

Where fleetgen's time goes is read off the same scrapes: command start to the first request
at a server (the producer's start, validation, uploads, the broker's first delivery), the
steady rate between 10% and 90% done (batch boundaries, checkpoints, the HTTP client; the
servers' mean running requests in that window beside it), and 90% to 100% (the drain).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleetgen.ledger import Ledger
from tests.perf.fleet import Fleet, wait_job
from tests.perf.sampler import SIM_FAMILIES, Sampler, Tick
from tests.perf.workload import Workload
from tests.stack import PYTHON, ROOT

JOB = "perf-short"
SCRIPT = ROOT / "tests" / "perf" / "generate_completions.py"
REQUESTS = "sglang:num_requests_total"
RUNNING = "sglang:num_running_reqs"
SCRIPT_IN_FLIGHT = 18  # per server: the slots plus a margin, as people write it


def workload() -> Workload:
    return Workload(prompts=6000, servers=2, slots=16, mean_output_tokens=600.0, speed=40.0)


@dataclass(frozen=True)
class ShortRun:
    """One pipeline's clock, split where its time goes (seconds from the command's start)."""

    pipeline: str
    wall_s: float  # to the servers' counter reaching the prompts
    first_request_s: float  # to the first request running at a server
    rate_10_90: float  # requests/s finished between 10% and 90% done
    running_10_90: float  # mean running requests over the servers' slots in that window
    drain_s: float  # 90% -> 100% done

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_pairs(folder: Path, redis_url: str, pairs: int) -> dict[str, Any]:
    """`pairs` runs of each pipeline, alternating; the ratio of each pair and of the means."""
    wl = workload()
    folder.mkdir(parents=True, exist_ok=True)
    prompts = wl.write_prompts(folder / "prompts.jsonl")
    runs: list[tuple[ShortRun, ShortRun]] = []
    for n in range(pairs):
        fg = run_fleetgen(wl, prompts, folder / f"fleetgen-{n}", redis_url)
        sc = run_script(wl, prompts, folder / f"script-{n}", redis_url)
        runs.append((fg, sc))
    ratios = [fg.wall_s / sc.wall_s for fg, sc in runs]
    return {"workload": asdict(wl), "script_in_flight": SCRIPT_IN_FLIGHT,
            "fleetgen": [fg.as_dict() for fg, _ in runs],
            "script": [sc.as_dict() for _, sc in runs], "ratios": ratios}


def run_fleetgen(wl: Workload, prompts: Path, folder: Path, redis_url: str) -> ShortRun:
    """Workers up and ready first (a node's steady state); the clock starts at `enqueue`."""
    ledger = Ledger.from_url(redis_url)
    ledger.r.flushall()
    with Fleet(folder, redis_url) as fleet:
        sims = [fleet.sim(f"gpu{i}", wl.sim_flags(), record=False) for i in range(wl.servers)]
        for i, sim in enumerate(sims):
            fleet.worker(i, sim.url)
        with Sampler({f"gpu{i}": f"{s.url}/metrics" for i, s in enumerate(sims)},
                     SIM_FAMILIES) as sampler:
            _wait_first_tick(sampler)
            started = time.monotonic()
            fleet.producer("enqueue", str(prompts), "--job", JOB, "--output",
                           str(folder / "out"), "--max-tokens", str(wl.max_tokens))
            _wait_counted(sampler, wl, _timeout(wl))
        if wait_job(ledger, JOB, timeout_s=60) is None:
            raise RuntimeError("fleetgen's job did not finish after the servers counted it")
    return _split("fleetgen", sampler.ticks, started, wl)


def run_script(wl: Workload, prompts: Path, folder: Path, redis_url: str) -> ShortRun:
    with Fleet(folder, redis_url) as fleet:
        sims = [fleet.sim(f"gpu{i}", wl.sim_flags(), record=False) for i in range(wl.servers)]
        with Sampler({f"gpu{i}": f"{s.url}/metrics" for i, s in enumerate(sims)},
                     SIM_FAMILIES) as sampler:
            _wait_first_tick(sampler)
            servers = [arg for sim in sims for arg in ("--server", sim.url)]
            started = time.monotonic()
            subprocess.run([PYTHON, str(SCRIPT), "--input", str(prompts), "--output",
                            str(folder / "answers.jsonl"), "--concurrency",
                            str(SCRIPT_IN_FLIGHT), "--max-tokens", str(wl.max_tokens),
                            *servers], check=True, cwd=ROOT, capture_output=True,
                           timeout=_timeout(wl))
            _wait_counted(sampler, wl, 10)
    return _split("script", sampler.ticks, started, wl)


def _wait_first_tick(sampler: Sampler) -> None:
    while not sampler.ticks:
        time.sleep(0.01)


def _counted(tick: Tick, key: str = REQUESTS) -> float:
    return sum(values.get(key, 0.0) for values in tick.values.values())


def _wait_counted(sampler: Sampler, wl: Workload, timeout_s: float) -> None:
    # From the first scrape on: a server may have counted requests of its own before (warm-up).
    target = _counted(sampler.ticks[0]) + wl.prompts
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        last = sampler.latest()
        if last is not None and _counted(last) >= target:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the servers did not count {wl.prompts} requests in {timeout_s:.0f}s")


def _split(pipeline: str, ticks: list[Tick], started: float, wl: Workload) -> ShortRun:
    after = [t for t in ticks if t.t >= started]
    base = _counted(ticks[0])

    def when(share: float) -> Tick:
        return next(t for t in after if _counted(t) - base >= share * wl.prompts)

    first = next(t for t in after if _counted(t, RUNNING) > 0)
    t10, t90, t100 = when(0.1), when(0.9), when(1.0)
    window = [t for t in after if t10.t <= t.t <= t90.t]
    running = sum(_counted(t, RUNNING) for t in window) / max(len(window), 1)
    return ShortRun(
        pipeline=pipeline, wall_s=t100.t - started, first_request_s=first.t - started,
        rate_10_90=(_counted(t90) - _counted(t10)) / max(t90.t - t10.t, 1e-9),
        running_10_90=running / (wl.servers * wl.slots), drain_s=t100.t - t90.t)


def _timeout(wl: Workload) -> float:
    # Five times the ideal makespan, plus start-up: a stuck run fails instead of hanging.
    return 5 * wl.prompts * wl.mean_output_tokens / wl.ideal_rate + 120
