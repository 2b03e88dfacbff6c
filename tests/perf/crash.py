"""Figure 6: what a worker SIGKILL costs, in prompts sent to a server twice.

Two simulated GPUs, one worker each. In the middle of the job, with worker 0 holding a full
server, its in-flight count is read (its own `fleetgen_requests_in_flight` gauge, and the
server's running + waiting count), then its process group is SIGKILLed and a new worker 0 is
started, as a supervisor would. Re-sent = prompts a server received after the kill that some
server had received before it. Ideal: only the prompts in flight at the kill go again (ratio
<= 1); finished prompts are in the checkpoint and must not.

The workers use tests/stack.py's fast lease settings (4 s lease, 1 s reconcile) so the dead
worker's batches come back within seconds; the figure does not depend on them.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from fleetgen.ledger import Ledger
from tests.perf.analysis import Requests
from tests.perf.fleet import Fleet, dump_stacks, stuck_batches, wait_for, wait_job
from tests.perf.sampler import SIM_FAMILIES, WORKER_FAMILIES, parse
from tests.perf.workload import Workload
from tests.stack import FAST_WORKER_ENV

JOB = "perf-crash"
FAST_LEASES = {k: v for k, v in FAST_WORKER_ENV.items() if k != "FLEETGEN_METRICS_PORT"}


@dataclass
class Crash:
    prompts: int
    in_flight_worker: int  # the killed worker's gauge right before the kill
    in_flight_server: int  # its server's running + waiting right before the kill
    resent: int
    answered_before_kill: int
    recovery_s: float | None  # kill -> first re-sent request
    output_ids: int
    duplicate_ids: int
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.resent / max(1, self.in_flight_worker)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "ratio": self.ratio}


def run_crash(folder: Path, redis_url: str, prompts: int = 800) -> Crash:
    """Kill worker 0 mid-job, restart it, and count what the servers received twice."""
    wl = Workload(prompts=prompts, servers=2)
    source = wl.write_prompts(folder / "prompts.jsonl")
    ledger = Ledger.from_url(redis_url)
    names = ["gpu0", "gpu1"]
    with Fleet(folder, redis_url) as fleet:
        sims = [fleet.sim(name, wl.sim_flags()) for name in names]
        workers = [fleet.worker(i, sim.url, env=FAST_LEASES) for i, sim in enumerate(sims)]
        fleet.producer("enqueue", str(source), "--job", JOB, "--output", str(folder / "out"),
                       "--max-tokens", str(wl.max_tokens))
        wait_for(lambda: _busy(sims[0].url, workers[0].metrics_url, prompts // 6),
                 timeout_s=120, what="worker 0 busy a while")
        in_worker = int(_scrape(workers[0].metrics_url, WORKER_FAMILIES)
                        ["fleetgen_requests_in_flight"])
        server = _scrape(f"{sims[0].url}/metrics", SIM_FAMILIES)
        killed_at = time.monotonic()
        workers[0].proc.kill()
        restarted = fleet.worker(0, sims[0].url, env=FAST_LEASES)
        finished = wait_job(ledger, JOB, timeout_s=180)
        notes = []
        if finished is None:
            dump_stacks(restarted.proc.pid, folder / "stuck-worker0-stacks.txt")
            notes.append(f"job did not finish: {', '.join(stuck_batches(ledger, JOB))} hung")
    reqs = Requests.load({n: s.record for n, s in zip(names, sims, strict=False)
                          if s.record is not None})
    resent = reqs.resent_after(killed_at)
    again = [t for t, pid, _ in reqs.received if t >= killed_at and pid in resent]
    ids = Counter(orjson.loads(line)["id"] for f in (folder / "out" / JOB / "results").glob("*")
                  for line in f.read_bytes().splitlines())
    return Crash(
        prompts=prompts, in_flight_worker=in_worker,
        in_flight_server=int(server["sglang:num_running_reqs"] + server["sglang:num_queue_reqs"]),
        resent=len(resent),
        answered_before_kill=sum(1 for t, *_ in reqs.answered if t < killed_at),
        recovery_s=(min(again) - killed_at) if again else None,
        output_ids=len(ids), duplicate_ids=sum(n - 1 for n in ids.values()), notes=notes)


def _busy(sim_url: str, metrics_url: str, answered: int) -> bool:
    sim = _scrape(f"{sim_url}/metrics", SIM_FAMILIES)
    worker = _scrape(metrics_url, WORKER_FAMILIES)
    full = worker["fleetgen_requests_in_flight"] >= worker["fleetgen_worker_max_in_flight_requests"]
    return sim["sglang:num_requests_total"] >= answered and full


def _scrape(url: str, families: tuple[str, ...]) -> dict[str, float]:
    return parse(httpx.get(url, timeout=5).text, families)
