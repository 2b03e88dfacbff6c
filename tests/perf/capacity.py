"""The worker's concurrency comes from the server, not from a hand-set number.

A Mamba-hybrid server asked for 128 running requests can run only 16 (the state cache caps
it; its /server_info says so). The worker must read that and keep at most 16 + margin in
flight, so the server runs exactly 16 and queues only the margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fleetgen.ledger import Ledger
from tests.perf.fleet import Fleet, wait_job
from tests.perf.sampler import SIM_FAMILIES, WORKER_FAMILIES, Sampler
from tests.perf.workload import Workload

JOB = "perf-capacity"
REQUESTED = 128


@dataclass
class CapacityFollow:
    requested: int
    effective: int  # what the server's /server_info reports
    worker_limit: int  # the worker's fleetgen_worker_max_in_flight_requests
    worker_peak_in_flight: int
    server_peak_running: int
    server_peak_waiting: int
    finished: bool

    @property
    def follows(self) -> bool:
        return (self.server_peak_running == self.effective
                and self.worker_peak_in_flight <= self.worker_limit
                and self.worker_limit < REQUESTED)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "follows": self.follows}


def run_capacity(folder: Path, redis_url: str, prompts: int = 240) -> CapacityFollow:
    """Run a short job on a hybrid server that caps 128 to 16; record both sides' peaks."""
    wl = Workload(prompts=prompts, servers=1, speed=30.0)
    flags = [f for pair in zip(wl.sim_flags()[2::2], wl.sim_flags()[3::2], strict=False)
             for f in pair]
    # started like the reference run: speculative decoding on, 80 Mamba slots
    flags += ["--model-arch", "mamba-hybrid", "--max-running-requests", str(REQUESTED),
              "--speculative-algorithm", "NEXTN"]
    source = wl.write_prompts(folder / "prompts.jsonl")
    ledger = Ledger.from_url(redis_url)
    with Fleet(folder, redis_url) as fleet:
        sim = fleet.sim("gpu0", flags, record=False)
        info = httpx.get(f"{sim.url}/server_info", timeout=5).json()
        worker = fleet.worker(0, sim.url)
        targets = {"sim": f"{sim.url}/metrics", "worker": worker.metrics_url}
        with Sampler(targets, SIM_FAMILIES + WORKER_FAMILIES) as sampler:
            fleet.producer("enqueue", str(source), "--job", JOB, "--output", str(folder / "out"))
            finished = wait_job(ledger, JOB, timeout_s=120)
    sims = [t.values["sim"] for t in sampler.ticks if t.values.get("sim")]
    workers = [t.values["worker"] for t in sampler.ticks if t.values.get("worker")]
    return CapacityFollow(
        requested=int(info["max_running_requests"]),
        effective=int(info["internal_states"][0]["effective_max_running_requests_per_dp"]),
        worker_limit=int(max(w["fleetgen_worker_max_in_flight_requests"] for w in workers)),
        worker_peak_in_flight=int(max(w["fleetgen_requests_in_flight"] for w in workers)),
        server_peak_running=int(max(s["sglang:num_running_reqs"] for s in sims)),
        server_peak_waiting=int(max(s["sglang:num_queue_reqs"] for s in sims)),
        finished=finished is not None)
