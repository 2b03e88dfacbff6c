"""A router in front of several simulators: one endpoint that is a server of servers.

It stands in for what a client meets behind a load balancer (sglang-router, Envoy, nginx): one
URL, several engines behind it, and nothing of their capacity said at the door. Tests start it
in front of simulators to see how a client sizes and treats such an endpoint.

    python -m launcher.sim.router --port 0 --backend http://127.0.0.1:30001 \\
        --backend http://127.0.0.1:30002 [--policy least-in-flight|round-robin] \\
        [--flavor plain|sglang-router] [--health-interval 1.0] [--host 127.0.0.1]

Routes:
- `POST /v1/chat/completions`, `POST|PUT /generate`: sent to one live backend (`--policy`
  least-in-flight: the fewest requests in flight through this router, ties to the first;
  round-robin: the next live one in turn). The backend's status, body and headers
  (content-type, retry-after, x-ratelimit-*, ...) come back unchanged, streamed when the
  backend streams. A backend that refuses the connection or breaks it: 502
  `{"error": {"message": "backend URL unreachable: REASON", "type": "bad_gateway"}}`, never
  retried elsewhere. No live backend: 503 `no healthy upstream` (text/plain, Envoy's words).
- `GET /v1/models`: the first live backend's answer (503 as above when there is none).
- `GET /health`: 200 (empty) while a backend is live, else 503 `no healthy upstream`.
- `GET /router/stats`: the router's own figures: per backend its url, alive, in_flight, sent,
  answered (2xx), failed (any other status, or no answer), cancelled (the client left),
  peak_in_flight.
- `--flavor plain` (default): every other path is 404; a generic router shows nothing of its
  backends (`/metrics`, `/server_info`, `/get_server_info` included).
- `--flavor sglang-router`: `GET /server_info` and `GET /get_server_info` answer the router
  manager's info of sglang-router 0.3.x, which states no capacity:
  `{"router_manager": true, "routers_count": 1, "workers_count": N, "default_router":
  "http-regular"}`; `/metrics` is 404 (the real router serves it on a port of its own).

Liveness: every --health-interval seconds each backend's `GET /health` is asked; two failures
in a row (not 2xx, or no answer within a second) make it dead, one success live again. A dead
backend gets no new request. The first round runs before the port opens, and decides alone:
a backend that does not answer it starts dead.

Process: as the simulator's (launcher/sim/server.py). It logs uvicorn's ready line,
`Uvicorn running on http://HOST:PORT (Press CTRL+C to quit)`, with the real port when --port
is 0; the tests' helpers pick a free port themselves (`fleetgen.ports.free_port`), pass it as
--port and wait until `/health` is 200. SIGTERM or SIGINT stops taking connections, lets the
requests in flight finish for up to DRAIN_S seconds, drops the rest and exits 0. A taken
--port is one line on stderr and exit 3, a bad flag argparse's usage and exit 2. In a test
process, `serve_in_thread(RouterConfig(...))` serves from a thread and yields the base URL.

A client that disconnects cancels its backend request (the backend sees its client leave).
The hot path is one shared httpx client over aiohttp's pool and no per-request logging:
about 0.35 ms of one core a request, so one router carries 2,000-2,500 requests/s of
`--instant` simulators on a 2-core machine shared with them and the client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import http.cookiejar
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import aiohttp
import httpx
import orjson
import uvicorn
from httpx_aiohttp import AiohttpTransport
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from launcher.sim.config import ConfigError
from launcher.sim.logs import configure_logging
from launcher.sim.port import PortInUseError, check_port
from launcher.sim.server import EXIT_PORT_IN_USE, SimStartupError

# Named, not __name__: run as `python -m launcher.sim.router` this module is __main__, whose
# lines would miss the launcher.sim handler.
log = logging.getLogger("launcher.sim.router")

PROG = "python -m launcher.sim.router"
POLICIES = ("least-in-flight", "round-robin")
FLAVORS = ("plain", "sglang-router")
# The routes sent to a backend chosen by --policy, and counted in /router/stats.
GENERATION_ROUTES = frozenset({("POST", "/v1/chat/completions"), ("POST", "/generate"),
                               ("PUT", "/generate")})
MODELS_ROUTE = ("GET", "/v1/models")
NO_UPSTREAM = b"no healthy upstream"
JSON = b"application/json"
# sglang-router's default --request-timeout-secs: a long generation is not cut by the router.
REQUEST_TIMEOUT_S = 1800.0
CONNECT_TIMEOUT_S = 10.0
# Idle connections to a backend are dropped before its keep-alive timeout (uvicorn's 5 s, under
# SGLang and the simulator) can close one just as a request goes out on it.
KEEPALIVE_S = 4.0
HEALTH_TIMEOUT_S = 1.0  # a /health that takes longer counts as a failure
FAILURES_TO_DEAD = 2
DRAIN_S = 5.0  # how long SIGTERM waits for the requests in flight before dropping them
READY_TIMEOUT_S = 15.0  # serve_in_thread's wait for the port, beyond the first health round
# What a backend that refuses or breaks a connection raises: httpx's errors, and the aiohttp
# ones its transport leaves unmapped.
UNREACHABLE = (httpx.TransportError, aiohttp.ClientError)
# Headers of one connection, not of the message: never passed on (RFC 9110 §7.6.1); the
# lengths are set again for the body as sent.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                        b"transfer-encoding", b"upgrade", b"content-length", b"host"})


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """What one router runs with; `RouterConfig.from_argv([...])` parses the command line.

        RouterConfig(backends=("http://127.0.0.1:30001", "http://127.0.0.1:30002"), port=0)
    """

    backends: tuple[str, ...]
    policy: str = "least-in-flight"
    flavor: str = "plain"
    host: str = "127.0.0.1"
    port: int = 30000  # sglang-router's default port
    health_interval: float = 1.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.backends:
            raise ConfigError("at least one --backend URL is needed")
        for url in self.backends:
            if not url.startswith(("http://", "https://")) or url.endswith("/"):
                raise ConfigError(f"--backend must be http(s)://HOST:PORT, got {url!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.flavor not in FLAVORS:
            raise ConfigError(f"--flavor must be one of {', '.join(FLAVORS)}, got {self.flavor!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be 0-65535, got {self.port}")
        if self.health_interval <= 0:
            raise ConfigError(f"--health-interval must be > 0 seconds, got {self.health_interval}")

    @classmethod
    def from_argv(cls, argv: list[str]) -> RouterConfig:
        """Parse the router's flags; a bad one exits 2 with argparse's usage."""
        parser = build_parser()
        ns = parser.parse_args(argv)
        try:
            return cls(backends=tuple(url.rstrip("/") for url in ns.backend), policy=ns.policy,
                       flavor=ns.flavor, host=ns.host, port=ns.port,
                       health_interval=ns.health_interval, log_level=ns.log_level)
        except ConfigError as exc:
            parser.error(str(exc))
            raise  # parser.error exits; this keeps mypy's flow analysis honest


def build_parser() -> argparse.ArgumentParser:
    """The router's command line."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="A load balancer in front of simulators (or any OpenAI servers).",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(
            "example:\n  python -m launcher sim --port 30001 --instant &\n"
            "  python -m launcher sim --port 30002 --instant &\n"
            f"  {PROG} --port 30000 --backend http://127.0.0.1:30001 "
            "--backend http://127.0.0.1:30002\n"))
    parser.add_argument("--backend", action="append", required=True, metavar="URL",
                        help="a backend's base URL; repeat for each")
    parser.add_argument("--policy", default="least-in-flight", choices=POLICIES,
                        help="least-in-flight: the backend with the fewest requests in flight "
                        "through this router, ties to the first; round-robin: each in turn")
    parser.add_argument("--flavor", default="plain", choices=FLAVORS,
                        help="plain: a generic router that shows nothing of its backends; "
                        "sglang-router: its /server_info and /get_server_info")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind host")
    parser.add_argument("--port", type=int, default=30000, help="HTTP port; 0 picks a free one")
    parser.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS",
                        help="how often each backend's /health is asked")
    parser.add_argument("--log-level", default="info", help="level of the log lines")
    return parser


@dataclasses.dataclass
class Backend:
    """One backend and what this router sent it."""

    url: str
    alive: bool = False  # until the first health round says otherwise
    failures_in_row: int = 0
    in_flight: int = 0
    sent: int = 0
    answered: int = 0
    failed: int = 0
    cancelled: int = 0
    peak_in_flight: int = 0

    urls: dict[str, httpx.URL] = dataclasses.field(default_factory=dict)

    def url_of(self, path: str, query: bytes) -> httpx.URL:
        """The backend's URL of a path; parsed once per path (httpx's parse is a tenth of the
        router's CPU a request)."""
        if query:
            return httpx.URL(f"{self.url}{path}?{query.decode('latin-1')}")
        url = self.urls.get(path)
        if url is None:
            url = self.urls[path] = httpx.URL(self.url + path)
        return url

    def stats(self) -> dict[str, Any]:
        """Its line of /router/stats."""
        return {"url": self.url, "alive": self.alive, "in_flight": self.in_flight,
                "sent": self.sent, "answered": self.answered, "failed": self.failed,
                "cancelled": self.cancelled, "peak_in_flight": self.peak_in_flight}


class Router:
    """The backends, their liveness, the choice of one, and the ASGI app that forwards to it."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.backends = [Backend(url) for url in config.backends]
        self.turn = 0  # round-robin: where the next search starts
        self.client: httpx.AsyncClient | None = None
        self.health_task: asyncio.Task[None] | None = None
        self.pages = _pages(self)

    def pick(self) -> Backend | None:
        """The live backend --policy sends the next generation request to, or None."""
        if self.config.policy == "round-robin":
            count = len(self.backends)
            for step in range(count):
                backend = self.backends[(self.turn + step) % count]
                if backend.alive:
                    self.turn = (self.turn + step + 1) % count
                    return backend
            return None
        best: Backend | None = None
        for backend in self.backends:
            if backend.alive and (best is None or backend.in_flight < best.in_flight):
                best = backend
        return best

    def first_alive(self) -> Backend | None:
        return next((backend for backend in self.backends if backend.alive), None)

    def in_flight(self) -> int:
        return sum(backend.in_flight for backend in self.backends)

    async def start(self) -> None:
        """Open the shared client, run the first health round, then keep watching."""
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, pool=None)
        self.client = httpx.AsyncClient(transport=_transport(), timeout=timeout,
                                        cookies=NoCookies())
        await self.check_health(first=True)
        self.health_task = asyncio.get_running_loop().create_task(self._watch_health())

    async def aclose(self) -> None:
        if self.health_task is not None:
            self.health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.health_task
        if self.client is not None:
            await self.client.aclose()

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await self.check_health()

    async def check_health(self, first: bool = False) -> None:
        """Ask every backend's /health at once and update their liveness."""
        await asyncio.gather(*(self._probe(backend, first) for backend in self.backends))

    async def _probe(self, backend: Backend, first: bool) -> None:
        assert self.client is not None
        try:
            response = await self.client.get(backend.url + "/health", timeout=HEALTH_TIMEOUT_S)
            problem = None if response.is_success else f"/health {response.status_code}"
        except (httpx.HTTPError, aiohttp.ClientError) as exc:
            problem = _reason(exc)
        if problem is None:
            backend.failures_in_row = 0
            if not backend.alive:
                backend.alive = True
                log.info("backend %s: alive", backend.url)
            return
        backend.failures_in_row += 1
        if first or (backend.alive and backend.failures_in_row >= FAILURES_TO_DEAD):
            backend.alive = False
            log.info("backend %s: dead (%s)", backend.url, problem)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (scope.get("method"), scope.get("path"))
        if route not in GENERATION_ROUTES and route != MODELS_ROUTE:
            await self.pages(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:  # the client left before its request was whole
            return
        if route == MODELS_ROUTE:
            await self._forward(scope, body, receive, send, self.first_alive())
        else:
            await self._generation(scope, body, receive, send)

    async def _generation(self, scope: Scope, body: bytes, receive: Receive,
                          send: Send) -> None:
        backend = self.pick()
        if backend is None:
            await _no_upstream(send)
            return
        backend.sent += 1
        backend.in_flight += 1
        backend.peak_in_flight = max(backend.peak_in_flight, backend.in_flight)
        answered: bool | None = None
        try:
            answered = await self._forward(scope, body, receive, send, backend)
        finally:
            backend.in_flight -= 1
            if answered is None:
                backend.cancelled += 1
            elif answered:
                backend.answered += 1
            else:
                backend.failed += 1

    async def _forward(self, scope: Scope, body: bytes, receive: Receive, send: Send,
                       backend: Backend | None) -> bool | None:
        """Relay one request to `backend`: True if it answered 2xx, False if not (or not at
        all), None if the client left first (its backend request is then cancelled)."""
        if backend is None:
            await _no_upstream(send)
            return False
        url = backend.url_of(scope["path"], scope["query_string"])
        headers = [(name, value) for name, value in scope["headers"] if name not in HOP_BY_HOP]
        request = httpx.Request(scope["method"], url, headers=headers, content=body)
        relay = asyncio.ensure_future(self._relay(request, backend, send))
        # Once the body is read, receive() returns only when the client disconnects.
        left = asyncio.ensure_future(receive())
        try:
            await asyncio.wait((relay, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not relay.done():
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await relay
        return None if relay.cancelled() else relay.result()

    async def _relay(self, request: httpx.Request, backend: Backend, send: Send) -> bool:
        assert self.client is not None
        try:
            response = await self.client.send(request, stream=True)
        except UNREACHABLE as exc:
            await _send(send, 502, [(b"content-type", JSON)], _bad_gateway(backend, exc))
            return False
        try:
            headers: list[tuple[bytes, bytes]] = []
            sized = False  # a Content-Length: the body is whole, not a stream
            for raw_name, value in response.headers.raw:
                name = raw_name.lower()
                if name not in HOP_BY_HOP:
                    headers.append((name, value))
                sized = sized or name == b"content-length"
            if sized:
                # A whole body: read before answering, so a broken one is still a 502.
                try:
                    body = b"".join([chunk async for chunk in response.aiter_raw()])
                except UNREACHABLE as exc:
                    await _send(send, 502, [(b"content-type", JSON)], _bad_gateway(backend, exc))
                    return False
                await _send(send, response.status_code, headers, body)
                return response.is_success
            return await _stream(response, headers, send)
        finally:
            await response.aclose()


async def _stream(response: httpx.Response, headers: list[tuple[bytes, bytes]],
                  send: Send) -> bool:
    """Relay a body of unknown length (a stream of events) as it comes."""
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": headers})
    try:
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except UNREACHABLE:
        # Too late for a 502: the answer is left unfinished, and uvicorn closes the
        # connection, as a proxy resets the stream of a backend that died mid-answer.
        return False
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return response.is_success


async def _read_body(receive: Receive) -> bytes | None:
    """The request's whole body, or None if the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]],
                body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _no_upstream(send: Send) -> None:
    await _send(send, 503, [(b"content-type", b"text/plain")], NO_UPSTREAM)


class NoCookies(http.cookiejar.CookieJar):
    """A jar that keeps nothing (as the worker's): httpx has no switch to stop parsing each
    answer for cookies, and a router keeps nothing between requests."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        return None


def _transport() -> AiohttpTransport:
    """httpx over aiohttp's pool, as the worker's client (workers/client.py says why):
    httpcore's pool rescans every connection on each request event, ~2.8 ms of router CPU a
    request at 64 in flight. limit=0: the router must not queue what its backends would run;
    no cookie jar: a router keeps nothing between requests."""
    return AiohttpTransport(client=lambda: aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
        cookie_jar=aiohttp.DummyCookieJar()))


def _reason(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def _bad_gateway(backend: Backend, exc: Exception) -> bytes:
    return orjson.dumps({"error": {
        "message": f"backend {backend.url} unreachable: {_reason(exc)}", "type": "bad_gateway"}})


def _pages(router: Router) -> Starlette:
    """The router's own routes and its flavour's; anything else is Starlette's 404."""

    async def health(request: Request) -> Response:
        if router.first_alive() is None:
            return Response(NO_UPSTREAM, 503, media_type="text/plain")
        return Response(status_code=200)

    async def stats(request: Request) -> Response:
        return Response(orjson.dumps({
            "policy": router.config.policy, "flavor": router.config.flavor,
            "backends": [backend.stats() for backend in router.backends]}),
            media_type="application/json")

    async def server_info(request: Request) -> Response:
        return Response(orjson.dumps({
            "router_manager": True, "routers_count": 1,
            "workers_count": len(router.backends), "default_router": "http-regular"}),
            media_type="application/json")

    routes = [Route("/health", health, methods=["GET"]),
              Route("/router/stats", stats, methods=["GET"])]
    if router.config.flavor == "sglang-router":
        routes += [Route("/server_info", server_info, methods=["GET"]),
                   Route("/get_server_info", server_info, methods=["GET"])]
    return Starlette(routes=routes)


class RouterServer(uvicorn.Server):
    """uvicorn serving a Router: its first health round before the port opens, a drain of the
    requests in flight on SIGTERM or SIGINT, then exit 0."""

    def __init__(self, config: uvicorn.Config, router: Router) -> None:
        super().__init__(config)
        self.router = router
        self.listening = threading.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn's handlers, without uvicorn raising the signal again once stopped: that
        # would end a clean stop with -15 (SIGTERM) or a KeyboardInterrupt traceback (SIGINT).
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self.router.start()
        await super().startup(sockets)
        if self.started:
            self.listening.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_S
        if self.router.in_flight():
            log.info("draining %d requests in flight", self.router.in_flight())
        while self.router.in_flight() and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.1)
        # What is still in flight is dropped: each handler sees its client leave and cancels
        # its backend request (uvicorn's own timeout would cancel them with a traceback).
        for connection in list(self.server_state.connections):
            connection.transport.close()
        await super().shutdown(sockets)


def _uvicorn_config(router: Router) -> uvicorn.Config:
    cfg = router.config
    # The backends' own Server and Date headers pass through: uvicorn adds none of its own.
    return uvicorn.Config(router, host=cfg.host, port=cfg.port, log_config=None,
                          access_log=False, lifespan="off", proxy_headers=False,
                          server_header=False, date_header=False, timeout_keep_alive=5,
                          backlog=4096)


async def _serve(server: RouterServer, sockets: list[socket.socket] | None) -> None:
    try:
        await server.serve(sockets)
    finally:
        await server.router.aclose()


def main(argv: list[str] | None = None) -> int:
    """Run a router until SIGTERM/SIGINT: 0 then, 2 for a bad flag, 3 for a taken --port."""
    try:
        config = RouterConfig.from_argv(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad flag (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        check_port(config.host, config.port)
    except PortInUseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_PORT_IN_USE
    configure_logging(config.log_level, None, tp_prefix=False)
    log.info("router: policy %s, flavor %s, backends %s", config.policy, config.flavor,
             " ".join(config.backends))
    router = Router(config)
    server = RouterServer(_uvicorn_config(router), router)
    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        runner.run(_serve(server, None))
    return 0


@contextlib.contextmanager
def serve_in_thread(config: RouterConfig) -> Iterator[str]:
    """Serve a router from a daemon thread; yields its base URL (port 0 → a free port) once
    the first health round is done and the port accepts connections.

        with serve_in_thread(RouterConfig(backends=(a, b), port=0)) as url: ...
    """
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    router = Router(config)
    server = RouterServer(_uvicorn_config(router), router)
    loop = (server.config.get_loop_factory() or asyncio.new_event_loop)()
    thread = threading.Thread(target=loop.run_until_complete, name="sim-router", daemon=True,
                              args=(_serve(server, [sock]),))
    thread.start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S + HEALTH_TIMEOUT_S
        while not server.listening.wait(timeout=0.05):
            if not thread.is_alive() or time.monotonic() > deadline:
                raise SimStartupError("the router thread stopped before it listened")
        yield f"http://{config.host}:{sock.getsockname()[1]}"
    finally:
        loop.call_soon_threadsafe(setattr, server, "should_exit", True)
        thread.join(timeout=DRAIN_S + 5)
        loop.close()
        sock.close()


if __name__ == "__main__":
    raise SystemExit(main())
