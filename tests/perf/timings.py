"""Figure 7: how soon things happen, the wall-clock promises the pytest suite does not time.

The functional tests check each of these as behaviour only (a lease longer than the wait,
answers counted around a signal, a simulated clock), because they must pass on a 2-core
machine whose other core is busy. The seconds themselves are measured here, on whatever load
the machine has (results.md shows the load average):

- a simulator's start (`launcher sim`, default flags) -> /health 200, the slowest of three:
  target <= 2 s (tests/launcher/sim/test_process.py);
- a simulator's throughput over HTTP: 60 answers of exactly 400 tokens flooded onto 6 slots;
  tokens/s from the first answer to the last ÷ slots x per-slot rate: target 1 ± 0.06
  (tests/launcher/sim/test_capacity.py checks the same model exactly on a simulated clock);
- a SIGTERMed worker, a few answers into a batch of 40 on 4 slots of 1.25 s answers (the whole
  batch takes 12.5 s): signal -> process exit, target <= 8 s (tests/workers/test_exit.py);
- a SIGKILLed worker, production settings (30 s lease, 10 s reconcile): kill -> the batch it
  held running on the other worker (or done), target <= 60 s, the README's "within a minute"
  (tests/workers/test_exit.py, tests/system/test_chaos.py).
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fleetgen import keys
from fleetgen.ledger import Ledger
from tests.perf.fleet import Fleet, wait_for
from tests.stack import chat_rows, write_jsonl

STARTS = 3
SLOTS, FLOODED, ANSWER_TOKENS, DECODE_TPS, SPEED = 6, 60, 400, 86, 40
# 1,000-token answers at 80 x 10 tok/s (1.25 s each), 4 at a time, as in test_worker_exit.
SLOW = ["--max-running-requests", "4", "--decode-tps", "80", "--mean-output-tokens", "1000",
        "--speed", "10", "--output-sigma", "0"]


@dataclass
class Timings:
    sim_start_s: list[float]
    sim_throughput_ratio: float
    sigterm_exit_s: float
    sigkill_back_s: float | None  # None: not back within the wait

    @property
    def ok(self) -> bool:
        return (max(self.sim_start_s) <= 2.0 and abs(self.sim_throughput_ratio - 1) <= 0.06
                and self.sigterm_exit_s <= 8.0
                and self.sigkill_back_s is not None and self.sigkill_back_s <= 60.0)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "ok": self.ok}


def run_timings(folder: Path, redis_url: str) -> Timings:
    """Measure the four figures, each with its own processes."""
    ledger = Ledger.from_url(redis_url)
    with Fleet(folder / "starts", redis_url) as fleet:
        starts = []
        for i in range(STARTS):
            began = time.monotonic()
            sim = fleet.sim(f"start{i}", [], record=False)
            starts.append(time.monotonic() - began)
            sim.proc.stop()
    with Fleet(folder / "throughput", redis_url) as fleet:
        sim = fleet.sim("flooded", ["--max-running-requests", str(SLOTS), "--decode-tps",
                                    str(DECODE_TPS), "--speed", str(SPEED),
                                    "--mean-output-tokens", str(ANSWER_TOKENS),
                                    "--output-sigma", "0", "--prefill-tps", "1e9"], record=False)
        finished = asyncio.run(_flood(sim.url, FLOODED))
    # From the first round's end to the last one's, every slot decodes without a gap.
    steady = (FLOODED - SLOTS) * ANSWER_TOKENS / (finished[-1] - finished[0])
    return Timings(sim_start_s=starts, sim_throughput_ratio=steady / (SLOTS * DECODE_TPS * SPEED),
                   sigterm_exit_s=_sigterm_exit(folder / "sigterm", redis_url, ledger),
                   sigkill_back_s=_sigkill_back(folder / "sigkill", redis_url, ledger))


async def _flood(url: str, n: int) -> list[float]:
    """Send n chat requests at once over warm connections; their completion times, sorted."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        await asyncio.gather(*(client.get("/v1/models") for _ in range(n)))  # open connections
        finished: list[float] = []

        async def one(i: int) -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}],
                    "max_tokens": 10_000}
            reply = await client.post("/v1/chat/completions", json=body)
            assert reply.json()["usage"]["completion_tokens"] == ANSWER_TOKENS
            finished.append(time.perf_counter())

        await asyncio.gather(*(one(i) for i in range(n)))
    return sorted(finished)


def _owners(ledger: Ledger, job: str) -> dict[str, str]:
    """batch -> worker holding its lease, for the job's running batches."""
    out = {}
    for batch in ledger.batches.running(job):
        token = ledger.leases.token(job, batch)
        if token:
            out[batch] = keys.lease_owner(token)
    return out


def _enqueue(fleet: Fleet, folder: Path, job: str, batch_size: int) -> None:
    source = write_jsonl(folder / f"{job}.jsonl", chat_rows(80))
    fleet.producer("enqueue", str(source), "--job", job, "--output", str(folder / "out"),
                   "--batch-size", str(batch_size), "--no-canary")


def _sigterm_exit(folder: Path, redis_url: str, ledger: Ledger) -> float:
    job = "perf-sigterm"
    with Fleet(folder, redis_url) as fleet:
        worker = fleet.worker(0, fleet.sim("gpu0", SLOW, record=False).url)
        _enqueue(fleet, folder, job, batch_size=40)
        wait_for(lambda: any(w == "gpu0@perf" and ledger.r.hlen(keys.checkpoint(job, b)) >= 4
                             for b, w in _owners(ledger, job).items()), 120,
                 what="worker 0 a few answers into a batch")
        popen = worker.proc.popen
        assert popen is not None
        popen.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        popen.wait(120)
        return time.monotonic() - asked


def _sigkill_back(folder: Path, redis_url: str, ledger: Ledger) -> float | None:
    job = "perf-sigkill"
    with Fleet(folder, redis_url) as fleet:
        victim = fleet.worker(0, fleet.sim("gpu0", SLOW, record=False).url)
        fleet.worker(1, fleet.sim("gpu1", SLOW, record=False).url)
        _enqueue(fleet, folder, job, batch_size=20)
        wait_for(lambda: "gpu0@perf" in _owners(ledger, job).values(), 120,
                 what="worker 0 holding a batch")
        batch = next(b for b, w in _owners(ledger, job).items() if w == "gpu0@perf")
        victim.proc.kill()
        killed = time.monotonic()
        try:
            back = wait_for(lambda: _owners(ledger, job).get(batch) == "gpu1@perf"
                            or ledger.batches.is_done(job, batch), 180, what=f"{batch} running again")
        except TimeoutError:
            return None
        return back - killed
