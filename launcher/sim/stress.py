"""A server under stress: the refusals real servers and the proxies before them send, and what
the simulator saw, for the tests of the worker's flow control (docs/development/simulator.md).

- `--overload 429|503`: a request that finds the running slots and the waiting queue full is
  refused at once (TGI, routers and hosted endpoints answer 429 with `Retry-After`; SGLang
  with `--max-queued-requests` 503), instead of waiting in an unbounded queue.
- `--fail-status`: the status `--fail-rate` answers (a 502 or 504 is a proxy's).
- `--error-window START:SECONDS:STATUS[:chat|all]`: every request of the window's scope is
  answered STATUS at once: `chat` the generation routes only (a proxy whose backend restarts,
  a full queue: `/health` stays 200), `all` every route.
- `POST /sim/misbehave` starts a window now or changes the failure rate of a running server;
  `GET /sim/stats` says what the server received and how it answered. Neither is an SGLang
  route, neither needs the API key, and neither is counted.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from launcher.sim.errors import SimError
from launcher.sim.protocol import RequestError, error_body, flavor_error

if TYPE_CHECKING:
    from launcher.sim.simulator import Simulator

SCOPES = ("chat", "all")
GENERATION = frozenset({("POST", "/v1/chat/completions"), ("POST", "/generate"),
                        ("PUT", "/generate")})
OWN_ROUTES = ("/sim/misbehave", "/sim/stats")
PROXY_REASONS = {502: "Bad Gateway", 504: "Gateway Time-out"}
JSON = "application/json"


class WindowError(SimError, ValueError):
    """An --error-window or /sim/misbehave value the simulator cannot use."""


@dataclass(frozen=True)
class Window:
    """Requests of `scope` are answered `status` from `start_s` for `seconds` (seconds after
    the server started; wall clock, not scaled by --speed)."""

    start_s: float
    seconds: float
    status: int
    scope: str = "chat"

    @classmethod
    def parse(cls, text: str) -> Window:
        parts = text.split(":")
        if len(parts) not in (3, 4):
            raise WindowError(f"--error-window {text!r}: expected START:SECONDS:STATUS[:chat|all]")
        try:
            window = cls(float(parts[0]), float(parts[1]), int(parts[2]),
                         parts[3] if len(parts) == 4 else "chat")
        except ValueError:
            raise WindowError(f"--error-window {text!r}: START and SECONDS are numbers, STATUS "
                              "an HTTP status") from None
        window.check()
        return window

    def check(self) -> None:
        if self.start_s < 0 or self.seconds <= 0:
            raise WindowError("an error window starts at 0 s or later and lasts more than 0 s")
        if not 400 <= self.status <= 599:
            raise WindowError(f"an error window's status is 4xx or 5xx, not {self.status}")
        if self.scope not in SCOPES:
            raise WindowError(f"an error window's scope is one of {', '.join(SCOPES)}")

    def covers(self, elapsed_s: float, generation: bool) -> bool:
        return (self.start_s <= elapsed_s < self.start_s + self.seconds
                and (generation or self.scope == "all"))


def refusal(status: int, flavor: str, retry_after_s: int = 0,
            message: str = "simulated failure") -> RequestError:
    """The answer a real server (or its proxy) gives with `status`."""
    if status == 429:
        # TGI's shape; routers and hosted endpoints say much the same.
        headers = {"retry-after": str(retry_after_s)} if retry_after_s else {}
        return RequestError(429, orjson.dumps({"error": "Model is overloaded",
                                               "error_type": "overloaded"}), headers)
    if status == 503:
        return RequestError(503, error_body("The request queue is full.", "503", 503))
    if status in PROXY_REASONS:
        reason = f"{status} {PROXY_REASONS[status]}"
        return RequestError(status, (f"<html>\r\n<head><title>{reason}</title></head>\r\n<body>"
                                     f"\r\n<center><h1>{reason}</h1></center>\r\n<hr><center>"
                                     "nginx</center>\r\n</body>\r\n</html>\r\n").encode())
    if status == 500:
        if flavor == "strict":  # Starlette's plain text for an unhandled exception
            return RequestError(500, b"Internal Server Error")
        return flavor_error(flavor, 500, f"Internal server error: {message}",
                            "Internal Server Error" if flavor == "vllm" else "InternalServerError")
    return flavor_error(flavor, status, message, str(status))


class Stress:
    """The misbehaviours in force and the counts `/sim/stats` gives."""

    def __init__(self, windows: tuple[Window, ...], fail_rate: float, fail_status: int,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self.started = now()
        self.windows = list(windows)
        self.fail_rate = fail_rate
        self.fail_status = fail_status
        self.requests = 0
        self.answered = 0
        self.refused: collections.Counter[int] = collections.Counter()
        self.probes: collections.Counter[str] = collections.Counter()

    def window_status(self, generation: bool) -> int | None:
        """The status an error window answers a request with now, or None."""
        if not self.windows:
            return None
        elapsed = self._now() - self.started
        for window in self.windows:
            if window.covers(elapsed, generation):
                return window.status
        return None

    def misbehave(self, data: Any) -> None:
        """Apply a `/sim/misbehave` body (WindowError when it makes no sense)."""
        if not isinstance(data, dict):
            raise WindowError("a JSON object: {status, seconds, scope}, {fail_rate, "
                              "fail_status} or {clear: true}")
        if data.get("clear"):
            self.windows.clear()
            self.fail_rate = 0.0
        if "status" in data:
            try:
                window = Window(self._now() - self.started, float(data.get("seconds", 30)),
                                int(data["status"]), str(data.get("scope", "chat")))
            except (TypeError, ValueError):
                raise WindowError("status is an HTTP status, seconds a number") from None
            window.check()
            self.windows.append(window)
        if "fail_rate" in data:
            rate = float(data["fail_rate"])
            if not 0.0 <= rate <= 1.0:
                raise WindowError("fail_rate is within [0, 1]")
            self.fail_rate = rate
        if "fail_status" in data:
            self.fail_status = int(data["fail_status"])

    def state(self) -> dict[str, Any]:
        elapsed = self._now() - self.started
        return {"elapsed_s": round(elapsed, 1), "fail_rate": self.fail_rate,
                "fail_status": self.fail_status,
                "windows": [{"start_s": w.start_s, "seconds": w.seconds, "status": w.status,
                             "scope": w.scope, "active": w.covers(elapsed, True)}
                            for w in self.windows]}


class StressMiddleware:
    """The outermost layer of the simulator's app: error windows, the counts, the own routes."""

    def __init__(self, app: ASGIApp, sim: Simulator) -> None:
        self.app = app
        self.sim = sim
        self.stress = sim.stress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope.get("method", ""), scope.get("path", "")
        if path in OWN_ROUTES:
            await self._own(method, path, receive, send)
            return
        generation = (method, path) in GENERATION
        if generation:
            self.stress.requests += 1
        elif method == "GET":
            self.stress.probes[path] += 1
        status = self.stress.window_status(generation)
        if status is not None:
            err = refusal(status, self.sim.cfg.flavor, self.sim.cfg.retry_after,
                          "simulated failure (--error-window)")
            await _send_error(err, send, self._counted(generation, send))
            return
        await self.app(scope, receive, self._counted(generation, send) if generation else send)

    def _counted(self, generation: bool, send: Send) -> Send:
        stress = self.stress

        async def counted(message: Message) -> None:
            if generation and message["type"] == "http.response.start":
                if message["status"] == 200:
                    stress.answered += 1
                else:
                    stress.refused[message["status"]] += 1
            await send(message)

        return counted

    async def _own(self, method: str, path: str, receive: Receive, send: Send) -> None:
        if path == "/sim/stats" and method == "GET":
            await _send_json(self.stats(), 200, send)
            return
        if path == "/sim/misbehave" and method == "POST":
            body = b""
            more = True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
            try:
                self.stress.misbehave(orjson.loads(body or b"{}"))
            except (orjson.JSONDecodeError, WindowError, TypeError, ValueError) as exc:
                await _send_json({"error": str(exc)}, 400, send)
                return
            await _send_json(self.stress.state(), 200, send)
            return
        await _send_json({"detail": "Method Not Allowed"}, 405, send)

    def stats(self) -> dict[str, Any]:
        scheduler = self.sim.scheduler
        return {"requests": self.stress.requests, "answered": self.stress.answered,
                "refused": {str(k): v for k, v in sorted(self.stress.refused.items())},
                "peak_in_flight": scheduler.peak_in_flight,
                "running": len(scheduler.running), "waiting": len(scheduler.waiting),
                "running_cap": scheduler.cap, "probes": dict(sorted(self.stress.probes.items())),
                **self.stress.state()}


def media_type(body: bytes) -> str:
    """What an error body is: JSON, a proxy's HTML page or plain text."""
    if body.startswith(b"{"):
        return JSON
    return "text/html" if body.startswith(b"<") else "text/plain; charset=utf-8"


async def _send_error(err: RequestError, send: Send,
                      counted: Callable[[Message], Awaitable[None]]) -> None:
    headers = [(b"content-type", media_type(err.body).encode()),
               (b"content-length", str(len(err.body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
    await counted({"type": "http.response.start", "status": err.status, "headers": headers})
    await counted({"type": "http.response.body", "body": err.body})


async def _send_json(data: Any, status: int, send: Send) -> None:
    body = orjson.dumps(data)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", JSON.encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
