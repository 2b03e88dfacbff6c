"""Per-process worker state: which server this worker serves, the loop its asyncio side runs
on, its view of that server (the backend) and its batch runner.

Set up from Celery signals: `celeryd_after_setup` reads the worker's `-Q` to find its GPU
(queue `gpuN`, or `gpuN-M` for a server over GPUs N to M, -> server port 30000+N unless
FLEETGEN_SERVER_URL is set) and adds the shared queue, so
`celery -A workers worker -Q gpu0` serves GPU 0 and also takes shared work.
"""

from __future__ import annotations

import gc
import logging
import threading

from fleetgen import keys
from fleetgen.errors import FleetgenError
from fleetgen.ledger import Ledger
from fleetgen.liveledger import LiveLedger
from fleetgen.settings import Settings
from workers.backend import Backend
from workers.backlog import Backlog
from workers.batch import BatchRunner
from workers.bridge import LoopThread

log = logging.getLogger(__name__)
# Tracked allocations between two young-generation collections (Python's default is 700).
GC_GEN0_THRESHOLD = 10_000
# How long shutdown waits for the backend and the ledger's asyncio side to close.
CLOSE_WAIT_S = 10.0


class WorkerConfigError(FleetgenError):
    """The worker cannot tell which server to use."""


def server_url(settings: Settings, queues: list[str]) -> str:
    if settings.server_url:
        return settings.server_url
    gpus = [int(m.group(1)) for q in queues if (m := keys.GPU_QUEUE.match(q))]
    if len(gpus) != 1:
        raise WorkerConfigError(
            f"cannot tell this worker's server from queues {queues}: "
            "consume exactly one gpuN queue (-Q gpu0) or set FLEETGEN_SERVER_URL"
        )
    return settings.server_url_for_gpu(gpus[0])


def tune_gc() -> None:
    """Set the cyclic garbage collector for a worker's steady state, once it is ready.

    A prompt allocates a few hundred tracked objects, and httpx leaves every response in a
    reference cycle (the response and its stream), which only the collector frees. At Python's
    defaults a collection ran every ~10 prompts and the older generations kept re-scanning the
    ~90,000 objects that Celery and the imports leave behind: 3.1 s of a 20,000-prompt run,
    13% of the worker's CPU against an instant server. What exists at ready is frozen (never scanned
    again) and the young generation waits for 10,000 allocations: 1.3 s. The price is garbage
    kept a little longer: the responses of the ~150 prompts between two collections, ~20 MB
    when answers are 32k tokens.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, older, oldest)


class WorkerRuntime:
    """Lazily built on the first batch, torn down at worker shutdown."""

    def __init__(self) -> None:
        self.settings: Settings | None = None
        self.server_url: str | None = None
        self.worker = "worker"
        self._runner: BatchRunner | None = None
        self._loop: LoopThread | None = None
        self._backend: Backend | None = None
        self._live: LiveLedger | None = None
        self._lock = threading.Lock()
        self.ledger: Ledger | None = None
        # Queues this worker consumes, its own gpuN first: the gate re-adds them in this order.
        self.queues: list[str] = []

    def configure(self, settings: Settings, hostname: str, queues: list[str],
                  server: str) -> None:
        """Set up from the worker's start, after its checks passed (preflight.check_start)."""
        self.settings = settings
        self.worker = hostname
        self.server_url = server
        self.queues = [q for q in queues if q != keys.SHARED_QUEUE] + [keys.SHARED_QUEUE]
        self.ledger = Ledger.connect(settings, client_name=keys.worker_client(hostname))

    def runner(self) -> BatchRunner:
        with self._lock:
            if self._runner is None:
                if self.settings is None or self.server_url is None or self.ledger is None:
                    raise WorkerConfigError("worker runtime used before the worker was set up")
                loop = LoopThread()
                loop.start()
                self._live, self._backend = loop.run(self._open(loop, self.settings,
                                                                self.server_url))
                self._loop = loop
                self._runner = BatchRunner(self.settings, loop, self._backend, self._live,
                                           self.ledger)
            return self._runner

    async def _open(self, loop: LoopThread, settings: Settings,
                    server: str) -> tuple[LiveLedger, Backend]:
        # The ledger's asyncio side, on the loop: the registry, leases, canary, breaker.
        live = LiveLedger.connect(settings, keys.worker_client(self.worker))
        return live, await Backend.open(settings, server, self.worker, self.queues, loop, live)

    @property
    def backend(self) -> Backend | None:
        """The worker's view of its server, once the runner is built."""
        return self._backend if self._runner is not None else None

    @property
    def backlog(self) -> Backlog | None:
        """What the worker holds (gate.py), once the runner is built."""
        return self._runner.backlog if self._runner is not None else None

    def drain(self) -> None:
        """Warm shutdown began: batches in hand stop sending, finish what is at the server
        within FLEETGEN_SHUTDOWN_GRACE_S and go back to the queue, what is still at the server
        then handed back unanswered, so the worker exits in at most that, whatever its server
        does (workers/backend.py `Backend.drain`)."""
        if self._runner is not None and self._backend is not None and self.settings is not None:
            self._backend.drain(self.settings.shutdown_grace_s)

    def server_restarting(self) -> None:
        """Its supervisor is about to drain and restart the server (workers/healthcheck.py
        `restarting`). Called from a signal handler: it only schedules the change on the loop."""
        if self._runner is not None and self._loop is not None and self._backend is not None:
            self._loop.call_soon(self._backend.checks.restarting)

    def shutdown(self) -> None:
        """Close the backend, the ledger's asyncio side and the loop; running batches have been
        cancelled by then."""
        with self._lock:
            if self._runner is None or self._loop is None or self._backend is None:
                return
            self._runner = None
            loop, backend, live = self._loop, self._backend, self._live
            try:
                loop.run(_close(backend, live), timeout=CLOSE_WAIT_S)
            finally:
                loop.stop()


async def _close(backend: Backend, live: LiveLedger | None) -> None:
    await backend.close()
    if live is not None:
        await live.aclose()


runtime = WorkerRuntime()
