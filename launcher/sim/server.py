"""Running a simulator: as a process (`run`) or in a background thread (`serve_in_thread`).

Process lifecycle, as SGLang's: the loading lines print before the port opens; uvicorn starts;
/health answers 503 (empty) through --startup-delay and the warmup request, then 200 once
"The server is fired up and ready to roll!" is logged. SIGTERM logs the drain line, turns
/health to 503 and exits 0 once in-flight requests are done (at once with SGL_FORCE_SHUTDOWN,
or while a hang holds them: their connections are dropped).
Fatal errors log SGLang's lines and SIGKILL the process, so its exit code is -9.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import logging.config
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator

import uvicorn

from launcher.sim import logs, startup
from launcher.sim.app import asgi_app
from launcher.sim.config import SimConfig
from launcher.sim.errors import SimError
from launcher.sim.hang import HELD
from launcher.sim.port import PortInUseError, check_port
from launcher.sim.scheduler import SimRequest
from launcher.sim.simulator import Simulator, Status

log = logging.getLogger("launcher.sim.server")
DRAIN_LOG_SECONDS = 5.0  # SGLang's sigterm watchdog reports the remaining requests this often
READY_TIMEOUT = 15.0  # seconds serve_in_thread waits beyond the configured delays
EXIT_PORT_IN_USE = 3  # uvicorn's own code for a port it could not bind


class SimStartupError(SimError, RuntimeError):
    """The in-thread simulator died or hung before it was ready."""


class SimServer(uvicorn.Server):
    """uvicorn without its signal handlers (the simulator owns SIGTERM), with a start hook."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.on_started: Callable[[], None] = lambda: None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # A request held by a hang would be waited for (timeout_graceful_shutdown), then
        # cancelled with a traceback; a dying server drops its connection instead.
        for connection in list(self.server_state.connections):
            cycle = getattr(connection, "cycle", None)
            if cycle is not None and cycle.scope.get(HELD):
                connection.transport.close()
        await super().shutdown(sockets)


def _uvicorn_config(sim: Simulator) -> uvicorn.Config:
    cfg = sim.cfg
    # loop="auto" (the default): `config.get_loop_factory()` gives uvloop when it is installed,
    # as `uvicorn.run` does; the loop is uvicorn's choice, so the simulator needs nothing of
    # fleetgen's outside launcher/sim (it must be liftable on its own).
    return uvicorn.Config(asgi_app(sim), host=cfg.host, port=cfg.port, log_config=None,
                          access_log=cfg.access_log, timeout_keep_alive=5,
                          timeout_graceful_shutdown=1, backlog=4096)


async def _bring_up(sim: Simulator) -> None:
    """--startup-delay, the warmup request, then Up."""
    cfg, loop = sim.cfg, asyncio.get_running_loop()
    if cfg.startup_delay:
        await asyncio.sleep(cfg.startup_delay)
    # vLLM and transformers serve send no warmup request through their own API
    if not cfg.skip_server_warmup and cfg.flavor == "sglang":
        # SGLang's warmup: "The capital city of France is" (6 tokens), max_new_tokens 8
        warmup = SimRequest("warmup", 6, 8, False, loop)
        sim.scheduler.submit(warmup)
        await warmup.done
    if sim.dead:
        return
    sim.status = Status.UP
    sim.stress.mark_ready()
    sim.startup_seconds = time.time() - sim.started_at
    log.info("The server is fired up and ready to roll!")
    sim.ready.set()
    if cfg.crash_after_seconds is not None:
        loop.call_later(cfg.crash_after_seconds, sim.crash,
                        f"--crash-after-seconds {cfg.crash_after_seconds}")


def _on_started(sim: Simulator, server: SimServer, tasks: set[asyncio.Task[None]]) -> None:
    sockets = [s for srv in server.servers for s in (srv.sockets or ())]
    if sockets:
        sim.port = sockets[0].getsockname()[1]
    sim.listening.set()
    task = asyncio.get_running_loop().create_task(_bring_up(sim))
    tasks.add(task)
    task.add_done_callback(tasks.discard)


def _on_sigterm(sim: Simulator, server: SimServer, tasks: set[asyncio.Task[None]]) -> None:
    log.info("SIGTERM received. signum=15 frame=None. Draining requests and shutting down...")
    if sim.status is Status.DRAINING:
        return
    sim.status = Status.DRAINING
    if sim.cfg.force_shutdown:
        server.should_exit = server.force_exit = True
        return
    task = asyncio.get_running_loop().create_task(_drain(sim, server))
    tasks.add(task)


async def _drain(sim: Simulator, server: SimServer) -> None:
    assert sim.idle is not None
    # a hung server finishes nothing more: its requests are not waited for
    while sim.inflight > 0 and sim.stress.hang.mode is None:
        log.info("Gracefully exiting... Remaining number of requests %d.", sim.inflight)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sim.idle.wait(), DRAIN_LOG_SECONDS)
    server.should_exit = True


async def _serve(sim: Simulator, server: SimServer, sockets: list[socket.socket] | None,
                 own_signals: bool) -> int:
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    sim.start(loop)
    server.on_started = lambda: _on_started(sim, server, tasks)
    if own_signals:
        loop.add_signal_handler(signal.SIGTERM, _on_sigterm, sim, server, tasks)
        loop.add_signal_handler(signal.SIGINT, setattr, server, "should_exit", True)
    try:
        await server.serve(sockets)
    finally:
        await sim.aclose()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return sim.exit_code


def _kill_self() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def run(config: SimConfig, argv: list[str] | None = None) -> int:
    """Run a simulator in this process until SIGTERM/SIGINT; returns the exit code (3, one
    line on stderr, when its port is taken: before any start-up line)."""
    try:
        check_port(config.host, config.port)
    except PortInUseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_PORT_IN_USE
    logs.configure_logging(config.log_level, config.log_level_http,
                           config.tp_prefix or config.tp_size > 1)
    sim = Simulator(config)
    sim.launch_command = ["python", "-m", "sglang.launch_server", *(argv or [])]
    sim.on_fatal = _kill_self
    if not startup.announce(sim):
        return 1  # not reached: announce's fatal path SIGKILLs the process
    server = SimServer(_uvicorn_config(sim))
    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        return runner.run(_serve(sim, server, None, own_signals=True))


def _stop_from_thread(sim: Simulator, server: SimServer) -> None:
    sim.exit_code = -9
    server.should_exit = server.force_exit = True


@contextlib.contextmanager
def serve_in_thread(config: SimConfig) -> Iterator[str]:
    """Serve `config` from a daemon thread; yields the base URL (port 0 → a free port).

    Waits until /health is 200, or only until the port accepts connections when a
    --startup-delay is configured. Fatal injections stop serving instead of killing.
    """
    sim = Simulator(config)
    sim.on_fatal = lambda: None
    if not startup.announce(sim):
        raise SimStartupError("simulated start-up failure: see the log")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    server = SimServer(_uvicorn_config(sim))
    sim.on_fatal = lambda: _stop_from_thread(sim, server)
    loop = (server.config.get_loop_factory() or asyncio.new_event_loop)()
    thread = threading.Thread(target=loop.run_until_complete, name="sglang-sim", daemon=True,
                              args=(_serve(sim, server, [sock], own_signals=False),))
    thread.start()
    try:
        _wait_started(sim, thread, wait_ready=not config.startup_delay)
        yield f"http://{config.host}:{sock.getsockname()[1]}"
    finally:
        loop.call_soon_threadsafe(setattr, server, "should_exit", True)
        thread.join(timeout=10)
        loop.close()
        sock.close()


def _wait_started(sim: Simulator, thread: threading.Thread, wait_ready: bool) -> None:
    event = sim.ready if wait_ready else sim.listening
    deadline = time.monotonic() + READY_TIMEOUT + sim.cfg.startup_delay
    while not event.wait(timeout=0.05):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise SimStartupError("the simulator thread stopped before it was ready")
