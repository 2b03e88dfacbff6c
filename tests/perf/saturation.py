"""Figures 1-3: the same prompts through fleetgen and through the hand-written script.

Each run gets four fresh recording simulators (same seed, so every prompt gets the same answer
length in both runs) and is timed from the user's command to the last durable answer:
fleetgen from `python -m producer enqueue` to the job's last batch marked done (its results
written), the script from its start to its exit (answers appended as they arrive).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetgen.ledger import Ledger
from tests.perf.analysis import Requests, RunFigures, figures
from tests.perf.fleet import Fleet, Sim, Worker, dump_stacks, stuck_batches, wait_job
from tests.perf.sampler import SIM_FAMILIES, WORKER_FAMILIES, Sampler, Tick
from tests.perf.workload import Workload
from tests.stack import PYTHON, ROOT

JOB = "perf-saturation"
SCRIPT = ROOT / "tests" / "perf" / "generate_completions.py"


@dataclass(frozen=True)
class Run:
    """One pipeline's figures plus what the plot needs."""

    figures: RunFigures
    ticks: list[Tick]
    servers: list[str]
    started: float
    in_flight_limit: int
    notes: list[str]


def sim_names(wl: Workload) -> list[str]:
    return [f"gpu{i}" for i in range(wl.servers)]


def run_fleetgen(wl: Workload, prompts: Path, folder: Path, redis_url: str,
                 worker_env: Mapping[str, str] | None = None,
                 enqueue_args: Sequence[str] = ()) -> Run:
    """Enqueue `prompts` and let one Celery worker per simulated GPU run the job.

    `worker_env` (FLEETGEN_* settings) and `enqueue_args` (e.g. --batch-size) try a change
    without editing code.
    """
    names = sim_names(wl)
    ledger = Ledger.from_url(redis_url)
    with Fleet(folder, redis_url, extra_env=dict(worker_env or {})) as fleet:
        sims = [fleet.sim(name, wl.sim_flags()) for name in names]
        workers = [fleet.worker(i, sim.url) for i, sim in enumerate(sims)]
        targets = {name: f"{sim.url}/metrics" for name, sim in zip(names, sims, strict=False)}
        targets |= {f"worker{i}": w.metrics_url for i, w in enumerate(workers)}
        with Sampler(targets, SIM_FAMILIES + WORKER_FAMILIES) as sampler:
            started = time.monotonic()
            fleet.producer("enqueue", str(prompts), "--job", JOB, "--output",
                           str(folder / "out"), "--max-tokens", str(wl.max_tokens), *enqueue_args)
            finished = wait_job(ledger, JOB, timeout_s=_timeout(wl))
            notes = [] if finished else _hung(ledger, workers, folder)
    answers = _count_lines(folder / "out" / JOB / "results")
    if finished and answers != wl.prompts:
        raise RuntimeError(f"fleetgen wrote {answers} answers for {wl.prompts} prompts")
    limit = _worker_limit(sampler.ticks, len(workers))
    return _run("fleetgen", wl, sampler.ticks, names, sims_logs(sims, names), started,
                finished, limit, notes)


def run_script(wl: Workload, prompts: Path, folder: Path, redis_url: str, concurrency: int
               ) -> Run:
    """Send `prompts` with generate_completions.py at `concurrency` in flight per server."""
    names = sim_names(wl)
    with Fleet(folder, redis_url) as fleet:
        sims = [fleet.sim(name, wl.sim_flags()) for name in names]
        targets = {name: f"{sim.url}/metrics" for name, sim in zip(names, sims, strict=False)}
        with Sampler(targets, SIM_FAMILIES) as sampler:
            servers = [arg for sim in sims for arg in ("--server", sim.url)]
            started = time.monotonic()
            subprocess.run([PYTHON, str(SCRIPT), "--input", str(prompts), "--output",
                            str(folder / "answers.jsonl"), "--concurrency", str(concurrency),
                            "--max-tokens", str(wl.max_tokens), *servers],
                           check=True, cwd=ROOT, capture_output=True, timeout=_timeout(wl))
            finished = time.monotonic()
    answers = _count_lines(folder, "answers.jsonl")
    if answers != wl.prompts:
        raise RuntimeError(f"the script wrote {answers} answers for {wl.prompts} prompts")
    return _run("script", wl, sampler.ticks, names, sims_logs(sims, names), started, finished,
                concurrency, [])


def sims_logs(sims: list[Sim], names: list[str]) -> dict[str, Path]:
    """Server name -> its request log."""
    return {name: sim.record for name, sim in zip(names, sims, strict=False)
            if sim.record is not None}


def _run(name: str, wl: Workload, ticks: list[Tick], names: list[str], logs: dict[str, Path],
         started: float, finished: float | None, limit: int, notes: list[str]) -> Run:
    reqs = Requests.load(logs)
    wall = finished - started if finished is not None else None
    figs = figures(name, wl, ticks, reqs, names, wall_s=wall)
    return Run(figs, ticks, names, started, limit, notes)


def _hung(ledger: Ledger, workers: list[Worker], folder: Path) -> list[str]:
    """Name the batches that never finished and keep the workers' stacks."""
    for i, worker in enumerate(workers):
        dump_stacks(worker.proc.pid, folder / f"stuck-worker{i}-stacks.txt")
    return [f"job did not finish: batches {', '.join(stuck_batches(ledger, JOB))} hung"]


def _worker_limit(ticks: list[Tick], workers: int) -> int:
    """The in-flight cap the workers derived from /server_info (their own gauge)."""
    limits = [t.values.get(f"worker{i}", {}).get("fleetgen_worker_max_in_flight_requests", 0.0)
              for t in ticks[-20:] for i in range(workers)]
    return int(max(limits, default=0))


def _count_lines(folder: Path, pattern: str = "*.jsonl") -> int:
    return sum(f.read_bytes().count(b"\n") for f in folder.glob(pattern))


def _timeout(wl: Workload) -> float:
    # Five times the ideal makespan, plus start-up: a stuck run fails instead of hanging.
    return 5 * wl.prompts * wl.mean_output_tokens / wl.ideal_rate + 120
