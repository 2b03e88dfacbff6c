"""A server under stress: the refusals real servers and the proxies before them send, and what
the simulator saw, for the tests of the worker's flow control (docs/development/simulator.md).

- `--overload 429|503`: a request that finds the running slots and the waiting queue full is
  refused at once (TGI, routers and hosted endpoints answer 429 with `Retry-After`; SGLang
  with `--max-queued-requests` 503), instead of waiting in an unbounded queue
  (Simulator.submit decides it).
- `--fail-status`: the status `--fail-rate` answers (a 502 or 504 is a proxy's).
- `--error-window START:SECONDS:STATUS[:chat|all]`: every request of the window's scope is
  answered STATUS at once: `chat` the generation routes only (a proxy whose backend restarts,
  a full queue: `/health` stays 200), `all` every route. Windows run on the wall clock from
  the moment the server is ready.
- `--hang chat|partial`: generation requests are taken and never answered, or answered in
  part, while /health stays 200 (hang.py).
- `--wording`: whose words refuse a job that does not fit the context (wording.py).
- `--error-request-ids`: every JSON error message ends with a request id of its own.
- `--poison MARKER`: a chat request with MARKER in a message is answered 500, every time.
- `--rpm N`: at most N generation requests a minute, with OpenAI's headers and 429
  (ratelimit.py).
- `POST /sim/misbehave` starts a window now or switches any of these on a running server
  (`GET` reads them); `GET /sim/stats` says what the server received and how it answered.
  They are the simulator's own routes (app.py): in every flavour, behind `--api-key`, never
  refused by a window and never counted.

`refusal` builds the answer of a status whichever misbehaviour sends it (a full server, a
drawn failure, a window, a poison prompt), so a status reads the same from each; the words
for a job too long and the budget's 429 are their engines' own (wording.py, ratelimit.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from launcher.sim.errors import SimError
from launcher.sim.hang import HANGS, Gate, Hang
from launcher.sim.protocol import RequestError, error_body, flavor_error
from launcher.sim.ratelimit import Headers, RequestBudget
from launcher.sim.wording import WORDINGS

if TYPE_CHECKING:
    from launcher.sim.simulator import Simulator

SCOPES = ("chat", "all")
OWN_PREFIX = "/sim/"  # the simulator's own routes: /sim/misbehave, /sim/stats
CHAT_ROUTE = ("POST", "/v1/chat/completions")
SGLANG_GENERATE = (("POST", "/generate"), ("PUT", "/generate"))
QUEUE_FULL = "The request queue is full."  # SGLang's scheduler, --max-queued-requests
PROXY_REASONS = {502: "Bad Gateway", 504: "Gateway Time-out"}  # nginx's reason phrases
# What `/sim/misbehave` switches beyond the windows and the failure rate, each cleared by
# `{"clear": true}`.
SWITCHES = ("hang", "wording", "error_request_ids", "poison", "rpm")
MISBEHAVE_KEYS = frozenset(("status", "seconds", "scope", "fail_rate", "fail_status", "clear",
                            *SWITCHES))
MISBEHAVE_SHAPES = ('{"status": 503, "seconds": 45, "scope": "chat"}, '
                    '{"fail_rate": 0.3, "fail_status": 500}, {"hang": "chat"}, '
                    '{"wording": "tgi"}, {"error_request_ids": true}, {"poison": ["MARKER"]}, '
                    '{"rpm": 60} or {"clear": true}')
OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
JSON = "application/json"


class WindowError(SimError, ValueError):
    """An --error-window or /sim/misbehave value the simulator cannot use."""


def check_status(status: int, what: str) -> None:
    """A refusal's status is a 4xx or a 5xx."""
    if not 400 <= status <= 599:
        raise WindowError(f"{what} is a 4xx or 5xx status, not {status}")


@dataclass(frozen=True)
class Window:
    """Requests of `scope` are answered `status` from `start_s` for `seconds` (seconds after
    the server became ready; wall clock, not scaled by --speed)."""

    start_s: float
    seconds: float
    status: int
    scope: str = "chat"

    @classmethod
    def parse(cls, text: str) -> Window:
        """`START:SECONDS:STATUS[:chat|all]`, as --error-window takes it."""
        parts = text.split(":")
        if len(parts) not in (3, 4):
            raise WindowError(f"--error-window {text!r}: expected START:SECONDS:STATUS[:chat|all]")
        try:
            window = cls(float(parts[0]), float(parts[1]), int(parts[2]),
                         parts[3] if len(parts) == 4 else "chat")
        except ValueError:
            raise WindowError(f"--error-window {text!r}: START and SECONDS are numbers, STATUS "
                              "an HTTP status") from None
        try:
            window.check()
        except WindowError as exc:
            raise WindowError(f"--error-window {text!r}: {exc}") from None
        return window

    def check(self) -> None:
        """Raise WindowError unless the window can be served."""
        if self.start_s < 0 or self.seconds <= 0:
            raise WindowError("an error window starts at 0 s or later and lasts more than 0 s")
        check_status(self.status, "an error window's status")
        if self.scope not in SCOPES:
            raise WindowError(f"an error window's scope is one of {', '.join(SCOPES)}, "
                              f"not {self.scope!r}")

    def covers(self, elapsed_s: float, generation: bool) -> bool:
        """Whether a request `elapsed_s` after ready is refused (generation: of a chat or
        /generate route)."""
        return (self.start_s <= elapsed_s < self.start_s + self.seconds
                and (generation or self.scope == "all"))


def refusal(status: int, flavor: str, retry_after_s: int = 0,
            message: str = "simulated failure") -> RequestError:
    """The answer a real server (or the proxy before it) gives with `status`.

    429: TGI's overload body with `Retry-After` (none when `retry_after_s` is 0). 529:
    Anthropic's overloaded error. 503: SGLang's queue full. 502, 504: nginx's HTML page. 500:
    the engine's own error (`flavor`'s; "strict" is Starlette's plain text). Any other: the
    flavour's JSON error with `message`.
    """
    if status == 529:
        return RequestError(529, orjson.dumps(OVERLOADED))
    if status == 429:
        headers = {"retry-after": str(retry_after_s)} if retry_after_s else {}
        return RequestError(429, orjson.dumps({"error": "Model is overloaded",
                                               "error_type": "overloaded"}), headers)
    if status == 503:
        return RequestError(503, error_body(QUEUE_FULL, "503", 503))
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


def media_type(body: bytes) -> str:
    """What an error body is: JSON, a proxy's HTML page or plain text."""
    if body.startswith(b"{"):
        return JSON
    return "text/html" if body.startswith(b"<") else "text/plain; charset=utf-8"


def error_response(err: RequestError) -> Response:
    """A refusal as the engine sends it: its status, body and headers."""
    return Response(err.body, status_code=err.status, media_type=media_type(err.body),
                    headers=err.headers)


async def answered(sim: Simulator, request: Request,
                   answer: Callable[[Simulator, Request], Awaitable[bytes]]) -> Response:
    """A route's JSON answer, or the refusal it raised, the request in flight meanwhile."""
    sim.enter()
    try:
        return Response(await answer(sim, request), media_type=JSON)
    except RequestError as err:
        return error_response(err)
    finally:
        sim.leave()


def _number(data: dict[str, Any], key: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WindowError(f"{key} is a number, not {value!r}")
    return float(value)


def _status(data: dict[str, Any], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise WindowError(f"{key} is an HTTP status, not {value!r}")
    check_status(value, key)
    return value


def check_switches(hang: Any, wording: Any, error_request_ids: Any, poison: Any,
                   rpm: Any) -> None:
    """Raise WindowError unless the switches' values can be served (None: off)."""
    if hang is not None and hang not in HANGS:
        raise WindowError(f"hang is one of {', '.join(HANGS)} or null, not {hang!r}")
    if wording is not None and wording not in WORDINGS:
        raise WindowError(f"wording is one of {', '.join(WORDINGS)} or null, not {wording!r}")
    if not isinstance(error_request_ids, bool):
        raise WindowError(f"error_request_ids is true or false, not {error_request_ids!r}")
    if not isinstance(poison, list | tuple) or not all(isinstance(m, str) and m for m in poison):
        raise WindowError(f"poison is a list of markers (non-empty strings), not {poison!r}")
    if rpm is not None and (isinstance(rpm, bool) or not isinstance(rpm, int) or rpm < 1):
        raise WindowError(f"rpm is a number of requests (1 or more) or null, not {rpm!r}")


class WindowState(TypedDict):
    """One error window as /sim/misbehave shows it."""

    start_s: float
    seconds: float
    status: int
    scope: str
    active: bool


class MisbehaviourState(TypedDict):
    """The answer of /sim/misbehave: the misbehaviours in force (None: off)."""

    elapsed_s: float
    fail_rate: float
    fail_status: int
    windows: list[WindowState]
    hang: str | None
    wording: str | None  # None: the flavour's own
    error_request_ids: bool
    poison: list[str]
    rpm: int | None


class Stress:
    """The misbehaviours in force and the counts `/sim/stats` gives.

    The counts are plain attributes bumped once per request (StressMiddleware,
    Simulator.submit): the simulator serves thousands of requests a second.
    """

    def __init__(self, windows: tuple[Window, ...], fail_rate: float, fail_status: int,
                 now: Callable[[], float] = time.monotonic, *, hang: str | None = None,
                 wording: str | None = None, error_request_ids: bool = False,
                 poison: tuple[str, ...] = (), rpm: int | None = None) -> None:
        self._now = now
        self.ready_at: float | None = None  # the windows' clock starts when the server is ready
        self.windows = list(windows)
        self.fail_rate = fail_rate
        self.fail_status = fail_status
        self.hang = Hang(hang)
        self.wording = wording
        self.error_request_ids = error_request_ids
        self.poison = poison
        self.budget = RequestBudget(rpm, now)
        self.requests = 0
        self.answered = 0
        self.refused: dict[int, int] = {}
        self.probes: dict[str, int] = {}
        self.peak_in_flight = 0
        self.poisoned = 0

    def mark_ready(self) -> None:
        """The server is ready: the error windows' START counts from now."""
        self.ready_at = self._now()

    def elapsed(self) -> float:
        """Seconds since the server became ready (0 before)."""
        return 0.0 if self.ready_at is None else self._now() - self.ready_at

    def window_status(self, generation: bool) -> int | None:
        """The status an error window answers a request with now, or None."""
        if not self.windows or self.ready_at is None:
            return None
        elapsed = self._now() - self.ready_at
        for window in self.windows:
            if window.covers(elapsed, generation):
                return window.status
        return None

    def misbehave(self, data: Any) -> None:
        """Apply a `/sim/misbehave` body, all of it or (WindowError) none of it.

        `clear` ends every misbehaviour first (windows, failure rate, hang, wording, request
        ids, poison, budget); `status` with `seconds` (and `scope`, chat by default) starts a
        window now; `fail_rate` and `fail_status` replace --fail-rate's and --fail-status's
        values; each of SWITCHES replaces its flag's value (null turns it off).
        """
        if not isinstance(data, dict) or not set(data) <= MISBEHAVE_KEYS:
            raise WindowError(f"expected a JSON object like {MISBEHAVE_SHAPES}")
        window = None
        if "status" in data:
            if "seconds" not in data:
                raise WindowError("a window needs seconds as well as a status")
            window = Window(self.elapsed(), _number(data, "seconds"), _status(data, "status"),
                            data.get("scope", "chat"))
            window.check()
        elif "seconds" in data or "scope" in data:
            raise WindowError("seconds and scope describe a window: give its status too")
        rate = self.fail_rate
        if "fail_rate" in data:
            rate = _number(data, "fail_rate")
            if not 0.0 <= rate <= 1.0:
                raise WindowError(f"fail_rate is within [0, 1], not {rate}")
        fail_status = _status(data, "fail_status") if "fail_status" in data else self.fail_status
        switched = {"hang": None, "wording": None, "error_request_ids": False, "poison": [],
                    "rpm": None, **{k: data[k] for k in SWITCHES if k in data}}
        check_switches(**switched)
        if data.get("clear"):
            self.windows.clear()
            self.fail_rate = 0.0
            self._switch(dict.fromkeys(SWITCHES) | {"error_request_ids": False, "poison": []})
        if window is not None:
            self.windows.append(window)
        if "fail_rate" in data:
            self.fail_rate = rate
        self.fail_status = fail_status
        self._switch({k: data[k] for k in SWITCHES if k in data})

    def _switch(self, values: dict[str, Any]) -> None:
        if "hang" in values:
            self.hang.switch(values["hang"])
        if "rpm" in values:
            self.budget.set_limit(values["rpm"])
        if "wording" in values:
            self.wording = values["wording"]
        if "error_request_ids" in values:
            self.error_request_ids = values["error_request_ids"]
        if "poison" in values:
            self.poison = tuple(values["poison"])

    def state(self) -> MisbehaviourState:
        """The misbehaviours in force (the answer of /sim/misbehave)."""
        elapsed = self.elapsed()
        return {"elapsed_s": round(elapsed, 1), "fail_rate": self.fail_rate,
                "fail_status": self.fail_status,
                "windows": [{"start_s": round(w.start_s, 1), "seconds": w.seconds,
                             "status": w.status, "scope": w.scope,
                             "active": self.ready_at is not None and w.covers(elapsed, True)}
                            for w in self.windows],
                "hang": self.hang.mode, "wording": self.wording,
                "error_request_ids": self.error_request_ids, "poison": list(self.poison),
                "rpm": self.budget.limit}


class SimStats(MisbehaviourState):
    """`GET /sim/stats`: what the server saw since it started and its load now."""

    requests: int
    answered: int
    refused: dict[str, int]
    peak_in_flight: int
    running: int
    waiting: int
    running_cap: int
    probes: dict[str, int]
    hung: int
    hanging: int
    poisoned: int
    rpm_used: int


def stats(sim: Simulator) -> SimStats:
    """The body of `GET /sim/stats`: what the server saw since it started, its load now, and
    the misbehaviours in force (`elapsed_s` is the error windows' clock)."""
    stress, scheduler = sim.stress, sim.scheduler
    return {"requests": stress.requests, "answered": stress.answered,
            "refused": {str(k): v for k, v in sorted(stress.refused.items())},
            "peak_in_flight": stress.peak_in_flight, "running": len(scheduler.running),
            "waiting": len(scheduler.waiting), "running_cap": scheduler.cap,
            "probes": dict(sorted(stress.probes.items())), "hung": stress.hang.hung,
            "hanging": stress.hang.holding, "poisoned": stress.poisoned,
            "rpm_used": stress.budget.used() if stress.budget.limit is not None else 0,
            **stress.state()}


class StressMiddleware:
    """The outermost layer of the simulator's app: the budget, the error windows, the hang,
    the request ids and the counts.

    Outside the API key check, as a proxy before the server is: the budget and a window
    answer before the server would (a hang never holds their answers), and the counts see
    every answer, a 401 included. Each misbehaviour costs a request one attribute check
    while it is off.
    """

    def __init__(self, app: ASGIApp, sim: Simulator) -> None:
        self.app = app
        self.stress = sim.stress
        self.flavor = sim.cfg.flavor
        self.retry_after = sim.cfg.retry_after
        routes = (CHAT_ROUTE, *SGLANG_GENERATE) if self.flavor == "sglang" else (CHAT_ROUTE,)
        self.generation = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path.startswith(OWN_PREFIX):
            await self.app(scope, receive, send)
            return
        stress, method = self.stress, scope["method"]
        if stress.error_request_ids:
            send = _with_request_id(send)
        if (method, path) not in self.generation:
            if method == "GET":
                stress.probes[path] = stress.probes.get(path, 0) + 1
            status = stress.window_status(False)
            if status is None:
                await self.app(scope, receive, send)
            else:
                await _send_error(self._window_refusal(status), send)
            return
        stress.requests += 1
        headers: Headers = ()
        if stress.budget.limit is not None:
            try:
                headers = stress.budget.take()
            except RequestError as spent:
                await _send_error(spent, self._counted(send))
                return
        status = stress.window_status(True)
        if status is None:
            await self.app(scope, receive, self._answered(scope, receive, send, headers))
        else:
            await _send_error(self._window_refusal(status), self._counted(send, headers))

    def _window_refusal(self, status: int) -> RequestError:
        return refusal(status, self.flavor, self.retry_after, "simulated failure (--error-window)")

    def _counted(self, send: Send, headers: Headers = ()) -> Send:
        """Count the answer's status; add the budget's headers to it."""
        stress = self.stress

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                if status == 200:
                    stress.answered += 1
                else:
                    stress.refused[status] = stress.refused.get(status, 0) + 1
                if headers:
                    message = {**message, "headers": [*message.get("headers", ()), *headers]}
            await send(message)

        return counted

    def _answered(self, scope: Scope, receive: Receive, send: Send, headers: Headers) -> Send:
        """The server's own answer to a generation request: counted, and passed by the hang.
        A request that arrives during a hang meets it at once, one under way when a hang
        starts at its next message."""
        hang = self.stress.hang
        counted = self._counted(send, headers)
        gate: Gate | None = None
        if hang.mode is not None:
            gate = Gate(hang, scope, receive, counted)
            gate.meet()

        async def answered(message: Message) -> None:
            nonlocal gate
            if gate is None:
                if hang.mode is None:
                    await counted(message)
                    return
                gate = Gate(hang, scope, receive, counted)
            await gate(message)

        return answered


def _with_request_id(send: Send) -> Send:
    """`--error-request-ids`: the message of a JSON error answer ends with a request id of its
    own, ` (request id req_<13 hex>)`; the content-length follows."""
    held: list[Message] = []

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            if message["status"] >= 400 and _is_json(message):
                held.append(message)  # until the body is known
                return
        elif held:
            start = held.pop()
            if not message.get("more_body", False):
                body = _append_request_id(message.get("body", b""))
                length = str(len(body)).encode()
                start = {**start, "headers": [(k, length if k == b"content-length" else v)
                                              for k, v in start.get("headers", ())]}
                message = {**message, "body": body}
            await send(start)
        await send(message)

    return send_with_id


def _is_json(start: Message) -> bool:
    return any(k == b"content-type" and v.startswith(JSON.encode())
               for k, v in start.get("headers", ()))


def _append_request_id(body: bytes) -> bytes:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(data, dict):
        return body
    suffix = f" (request id req_{uuid.uuid4().hex[:13]})"
    error = data.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        error["message"] += suffix
    elif isinstance(error, str):
        data["error"] = error + suffix
    elif isinstance(data.get("message"), str):
        data["message"] += suffix
    elif isinstance(data.get("detail"), str):
        data["detail"] += suffix
    else:
        return body
    return orjson.dumps(data)


async def _send_error(err: RequestError, send: Callable[[Message], Awaitable[None]]) -> None:
    headers = [(b"content-type", media_type(err.body).encode()),
               (b"content-length", str(len(err.body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": err.body})
