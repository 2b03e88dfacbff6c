"""A benchmark fleet on this machine: recording simulators, Celery workers and the producer.

Processes are started the way users start them (tests/stack.py's `Proc`), each logging to a
file in the run's folder. Workers run with the production settings (fleetgen/settings.py
defaults), except where a benchmark says otherwise (the crash run shortens the lease).

    with Fleet(tmp, redis_url) as fleet:
        sims = [fleet.sim(f"gpu{i}", wl.sim_flags(), record=True) for i in range(4)]
        workers = [fleet.worker(i, sim.url) for i, sim in enumerate(sims)]
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from fleetgen import keys
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from fleetgen.ports import free_port
from fleetgen.settings import Settings
from tests.stack import CELERY, FAST_WORKER_ENV, PYTHON, ROOT, Proc, python_stacks

_DEFAULTS = Settings()
# tests/stack.py's fast-failure values, put back to what a production worker uses.
PRODUCTION_WORKER_ENV = {
    name: str(getattr(_DEFAULTS, name.removeprefix("FLEETGEN_").lower()))
    for name in FAST_WORKER_ENV if name != "FLEETGEN_METRICS_PORT"
}
READY_TIMEOUT_S = 90.0


@dataclass
class Sim:
    """A running simulator: its process, base URL and request log (if recording)."""

    proc: Proc
    url: str
    record: Path | None


@dataclass
class Worker:
    """A running Celery GPU worker and its own /metrics URL."""

    proc: Proc
    metrics_url: str


@dataclass
class Fleet:
    """Owns every process it starts; `close()` stops them, newest first."""

    tmp: Path
    redis_url: str
    extra_env: Mapping[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)

    def __enter__(self) -> Self:
        self.tmp.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {**os.environ, "REDIS_URL": self.redis_url, "PYTHONUNBUFFERED": "1",
               **self.extra_env}
        env.update(extra or {})
        return env

    def sim(self, name: str, flags: list[str], record: bool = True) -> Sim:
        """Start a simulator (recording its chat requests unless `record` is False)."""
        port = free_port()
        log_path = self.tmp / f"{name}.requests"
        if record:
            argv = [PYTHON, "-m", "tests.perf.recsim", "--record", str(log_path)]
        else:
            argv = [PYTHON, "-m", "launcher", "sim"]
        argv += ["--port", str(port), *flags]
        proc = Proc(name, argv, self.env(), self.tmp / f"{name}.log").start()
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(url) or not proc.alive(), READY_TIMEOUT_S, what=f"{name} up")
        if not proc.alive():
            raise RuntimeError(f"simulator {name} exited:\n{proc.log()}")
        return Sim(proc, url, log_path if record else None)

    def worker(self, gpu: int, server_url: str, env: Mapping[str, str] | None = None) -> Worker:
        """Start `celery -A workers worker -Q gpuN` for `server_url`; wait until it is ready."""
        name = f"worker{gpu}"
        metrics_port = free_port()
        argv = [CELERY, "-A", "workers", "worker", "-Q", f"gpu{gpu}", "-n", f"gpu{gpu}@perf",
                "--without-mingle", "--without-gossip", "--loglevel", "INFO"]
        worker_env = self.env({**PRODUCTION_WORKER_ENV, "FLEETGEN_SERVER_URL": server_url,
                               "FLEETGEN_METRICS_PORT": str(metrics_port), **(env or {})})
        proc = Proc(name, argv, worker_env, self.tmp / f"{name}.log").start()
        self.procs.append(proc)
        wait_until(lambda: "ready." in proc.log() or not proc.alive(), READY_TIMEOUT_S,
                   what=f"{name} ready")
        if not proc.alive():
            raise RuntimeError(f"worker {name} exited:\n{proc.log()}")
        return Worker(proc, f"http://127.0.0.1:{metrics_port}/metrics")

    def producer(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run `python -m producer ARGS`; raise with its output if it fails."""
        result = subprocess.run([PYTHON, "-m", "producer", *args], env=self.env(), cwd=ROOT,
                                capture_output=True, text=True, timeout=600, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"producer {args} exited {result.returncode}:\n"
                               f"{result.stdout}\n{result.stderr}")
        return result

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(grace=15)
        self.procs.clear()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_job(ledger: Ledger, job: str, timeout_s: float,
             on_tick: Callable[[], None] | None = None) -> float | None:
    """When every batch of `job` was marked done (monotonic), or None after `timeout_s`."""
    batches = ledger.jobs.load(job).batches
    done = keys.job_part(job, "done")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if on_tick is not None:
            on_tick()
        if ledger.r.scard(done) >= batches:
            return time.monotonic()
        time.sleep(0.05)
    return None


def stuck_batches(ledger: Ledger, job: str) -> list[str]:
    """Batches of `job` still leased (running) right now."""
    members = ledger.r.zrange(keys.job_part(job, "running"), 0, -1)
    return sorted(b.decode() if isinstance(b, bytes) else str(b) for b in members)


def dump_stacks(pid: int, out: Path) -> None:
    """Write every thread's Python stack of `pid` to `out`, to explain a hang."""
    out.write_text(python_stacks(pid))


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str,
             interval_s: float = 0.05) -> float:
    """Poll `predicate()` until true; return the monotonic time it was first seen true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(interval_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")


__all__ = ["PRODUCTION_WORKER_ENV", "Fleet", "Sim", "Worker", "wait_for"]
