"""The state of one simulated server: status, scheduler, metrics, faults, in-flight count.

The HTTP layer (app.py) and the process layer (server.py) both act on one Simulator. What
"dying" means is injected as `on_fatal`: a real process SIGKILLs itself (exit code -9), an
in-thread test server just stops serving. A generation request's refusals for a drawn
failure (`fail_if_drawn`), a poison prompt (`fail_if_poisoned`) and a full server (`submit`)
are decided here, once for every route.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable

from fastapi import Request

from launcher.sim import logs
from launcher.sim.capacity import Capacity, plan_capacity
from launcher.sim.config import SimConfig
from launcher.sim.metrics import Metrics, build_metrics
from launcher.sim.scheduler import QueueFullError, Scheduler, SimRequest
from launcher.sim.stress import Stress, refusal

log = logging.getLogger("launcher.sim.server")
sched_log = logging.getLogger(logs.SCHEDULER_LOGGER)
DISCONNECT_CHECK_SECONDS = 4.0  # SGLang's tokenizer manager checks for gone clients this often
CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.15 GiB. GPU 0 has a "
            "total capacity of 79.19 GiB of which 1.27 GiB is free. Including non-PyTorch memory, "
            "this process has 77.91 GiB memory in use.")


class Status(enum.Enum):
    """SGLang's server_status, plus the draining state after SIGTERM."""

    STARTING = "Starting"
    UP = "Up"
    DRAINING = "Draining"


class Simulator:
    """One simulated SGLang server (loop-bound parts are set up by `start`)."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.capacity: Capacity = plan_capacity(cfg)  # one DP rank's
        # One scheduler over every DP rank's pools: a request goes to whichever rank has
        # room, as SGLang's load balancer spreads them (each rank is listed in /server_info).
        whole = self.capacity.summed(cfg.dp_size)
        self.scheduler = Scheduler(cfg, whole, on_finish=self._on_finish)
        self.metrics: Metrics | None = build_metrics(cfg, whole, self.scheduler)
        self.status = Status.STARTING
        self.started_at = time.time()
        self.startup_seconds = 0.0
        self.received = 0
        # The misbehaviours in force and what /sim/stats counts (stress.py).
        self.stress = Stress(cfg.windows, cfg.fail_rate, cfg.fail_status, hang=cfg.hang,
                             wording=cfg.wording, error_request_ids=cfg.error_request_ids,
                             poison=cfg.poison, rpm=cfg.rpm)
        self.inflight = 0
        self.idle: asyncio.Event | None = None
        self.on_fatal: Callable[[], None] = self._no_fatal_handler
        self.dead = False
        self.exit_code = 0
        self.port = cfg.port
        self.launch_command: list[str] = []
        self._watched: dict[SimRequest, Request] = {}
        self._sweeper: asyncio.Task[None] | None = None
        # thread-safe start-up milestones, for serve_in_thread
        self.listening = threading.Event()
        self.ready = threading.Event()

    def _no_fatal_handler(self) -> None:
        raise RuntimeError("simulated fatal error, but no on_fatal handler was installed")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the serving loop and start the background work."""
        self.scheduler.start(loop)
        self.idle = asyncio.Event()
        self.idle.set()
        self._sweeper = loop.create_task(self._sweep_disconnected())

    async def aclose(self) -> None:
        """Stop the background work."""
        self.scheduler.stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)

    def _on_finish(self, req: SimRequest) -> None:
        if self.metrics is not None:
            self.metrics.observe(req, self.scheduler.loop.time())

    def enter(self) -> None:
        """A generation request has arrived (counted for draining and crash injection)."""
        self.inflight += 1
        if self.idle is not None:
            self.idle.clear()

    def leave(self) -> None:
        """A generation request's response is complete."""
        self.inflight -= 1
        if self.inflight == 0 and self.idle is not None:
            self.idle.set()

    def count_request(self) -> int:
        """Number this generation request; die if --crash-after-requests says so."""
        self.received += 1
        limit = self.cfg.crash_after_requests
        if limit is not None and self.received > limit:
            self.crash(f"--crash-after-requests {limit}")
        return self.received

    def draw(self, key: bytes, salt: int) -> float:
        """A deterministic uniform in [0, 1) from request content, --seed and `salt`."""
        digest = hashlib.blake2b(key + b"|%d|%d" % (self.cfg.seed, salt), digest_size=8)
        return int.from_bytes(digest.digest(), "little") / 2.0**64

    def fail_if_drawn(self, key: bytes, index: int, plain_500: bool = False) -> None:
        """--fail-rate: raise --fail-status's answer for a drawn share of requests; the request
        number is part of the draw, so a retry can succeed. A 500 is the flavour's error body,
        or Starlette's plain text with `plain_500` (what SGLang's /generate sends)."""
        rate = self.stress.fail_rate
        if rate > 0 and self.draw(key, index) < rate:
            status = self.stress.fail_status
            flavor = "strict" if plain_500 and status == 500 else self.cfg.flavor
            raise refusal(status, flavor, self.cfg.retry_after, "simulated failure (--fail-rate)")

    def fail_if_poisoned(self, texts: list[str]) -> None:
        """--poison: raise the flavour's 500 for a request with a marker in any message, every
        time (a prompt that crashes the engine whenever it runs)."""
        markers = self.stress.poison
        if markers and any(marker in text for marker in markers for text in texts):
            self.stress.poisoned += 1
            raise refusal(500, self.cfg.flavor, message="simulated failure (--poison)")

    def submit(self, req: SimRequest) -> None:
        """Queue a generation request, or refuse it as --overload says when the running slots
        and the waiting queue are full (429 with Retry-After, else SGLang's 503); a refused
        request never reaches the scheduler, so it costs no server time."""
        scheduler = self.scheduler
        try:
            scheduler.submit(req)
        except QueueFullError as exc:
            status = 429 if self.cfg.overload == "429" else 503
            raise refusal(status, self.cfg.flavor, self.cfg.retry_after) from exc
        # in flight only grows here, so its peak is seen here
        in_flight = len(scheduler.waiting) + len(scheduler.running)
        self.stress.peak_in_flight = max(self.stress.peak_in_flight, in_flight)

    def abort_point(self, key: bytes, index: int, n_tokens: int) -> int | None:
        """--abort-rate: the token count at which this request is aborted, or None.

        Drawn like --fail-rate (content, seed, request number); the point is uniform over
        the planned output, so an abort may come before the first token."""
        rate = self.cfg.abort_rate
        if not rate or self.draw(key + b"|abort", index) >= rate:
            return None
        return int(self.draw(key + b"|abort-at", index) * n_tokens)

    def fail_prompt_hit(self, rid: str | None, texts: list[str]) -> bool:
        """--fail-prompt: a marker in the rid prefix or any message makes the prompt too long."""
        for marker in self.cfg.fail_prompt:
            if (rid is not None and rid.startswith(marker)) or any(marker in t for t in texts):
                return True
        return False

    async def wait_done(self, req: SimRequest, request: Request) -> None:
        """Wait for `req` to end; abort it if the client goes away (as SGLang does)."""
        await self.wait_for(req.done, req, request)

    async def wait_for(self, fut: asyncio.Future[None], req: SimRequest,
                       request: Request) -> None:
        """Wait for `fut`; the sweeper aborts `req` if its client disconnects meanwhile."""
        if fut.done():
            return
        self._watched[req] = request
        try:
            await fut
        finally:
            self._watched.pop(req, None)

    async def _sweep_disconnected(self) -> None:
        # One periodic check for all waiting clients: a timer per request would cost more
        # than the rest of a short request at thousands of requests per second.
        while True:
            await asyncio.sleep(DISCONNECT_CHECK_SECONDS)
            for req, request in list(self._watched.items()):
                if not req.done.done() and await request.is_disconnected():
                    self.scheduler.abort_request(req)

    def crash(self, reason: str) -> None:
        """Log SGLang's scheduler-failure lines (§6.4, §1) and die with -9."""
        if self.dead:
            return
        self.dead = True
        pid = os.getpid()
        sched_log.error(logs.scheduler_exception(CUDA_OOM, "scheduler.event_loop_overlap()"))
        log.error("SIGQUIT received. signum=3, frame=None. It usually means one child failed.")
        log.info("kill_process_tree called: parent_pid=%d, include_parent=True, pid=%d "
                 "(simulated: %s)", pid, pid, reason)
        self.on_fatal()

    def startup_fatal(self, error: str) -> None:
        """A start-up failure: the scheduler's traceback, the parent's sigquit line, -9."""
        self.dead = True
        sched_log.error(logs.scheduler_exception(
            error, "scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank)"))
        log.error("Received sigquit from a child process. It usually means the child failed.")
        self.on_fatal()
