"""The HTTP client of one generation server: SGLang, vLLM or any OpenAI-compatible engine
(what kind it is, fleetgen/servers finds out; the exchange is the same for all).

httpx's API over aiohttp's connection pool (httpx-aiohttp's transport). httpx and aiohttp errors,
HTTP statuses and answers that are not a finished generation become `fleetgen.errors` types here
and nowhere else.
"""

from __future__ import annotations

import collections
import contextlib
import http.cookiejar
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import httpx
import orjson

from fleetgen.causes import Failure, Reply, Verdict, classify, retry_after_s
from fleetgen.endpoints import CHAT, CLASSIFY, EMBEDDINGS, ENDPOINTS, Endpoint
from fleetgen.errors import (
    BadRequestError,
    GenerationError,
    OverloadedError,
    RetryableError,
    ServerDownError,
)
from fleetgen.servers import NO_SUCH_ENDPOINT, ChatCompletion, RequestBody, Server, detect

log = logging.getLogger(__name__)

JSON = {"Content-Type": "application/json"}
CHAT_PATH = ENDPOINTS[CHAT].path
# The ends of a generation that make an answer (OpenAI's values). Anything else, SGLang's and
# vLLM's `abort` above all (a request aborted on purpose, under memory pressure or at
# shutdown), is a request the server did not finish: sent again like a server error.
FINISHED = frozenset({"stop", "length", "tool_calls", "function_call", "content_filter"})
# A request budget an endpoint states on every answer (OpenAI, Azure, Together, the HF router):
# requests per window (a minute, for most).
RATE_LIMIT_HEADER = "x-ratelimit-limit-requests"
# Idle connections are dropped before the server's keep-alive timeout (5 s in uvicorn, under
# SGLang and the simulator) can close one just as a request goes out on it.
KEEPALIVE_S = 4.0
# A cold endpoint's answer is reused this long: no endpoint is asked more than once a second,
# but liveness, which must say the truth now (its own loop asks it once a second).
FRESH_S = 1.0
LIVENESS = frozenset({"/health"})


class ServerClient:
    """One pooled async client per worker process, for the server next to its GPU."""

    def __init__(
        self,
        base_url: str,
        *,
        request_timeout_s: float,
        connect_timeout_s: float = 10.0,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(connect=connect_timeout_s, read=request_timeout_s, write=60.0,
                                pool=None)
        # aiohttp's pool, not httpcore 1.0.9's: httpcore rescans every connection on each
        # request event (O(requests x connections)) and cost 2.5-3.4 ms of worker CPU per
        # prompt at the 44 requests a 40-slot server keeps in flight, aiohttp's 1.2-1.7 ms on
        # the same box (docs/development/performance.md, worker overhead). limit=0: the worker's
        # limiter (limits.py) bounds its concurrency, not the pool (aiohttp's default of 100
        # would cap a server that runs more at once).
        transport = _aiohttp_transport()
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout,
                                       transport=transport, cookies=_NoCookies())
        self._endpoints = ColdEndpoints(httpx.AsyncHTTPTransport())
        self._cold = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout,
                                       transport=self._endpoints, cookies=_NoCookies())
        # A chat request is built once per prompt from parts made here: an absolute URL parsed
        # once and fixed headers. `client.post` would re-parse and merge both (and the
        # cookies, and the timeout) for every prompt: ~10% of the worker's CPU against an
        # instant server. `send` still applies the client's timeout, auth and transport. Only our own
        # headers: httpx's defaults (Accept, Accept-Encoding, User-Agent) are what aiohttp
        # adds anyway, and each header passed down is converted twice (~3% of the worker).
        self._urls = {e.path: httpx.URL(self.base_url + e.path) for e in ENDPOINTS.values()}
        self._post_headers = httpx.Headers({**headers, **JSON})
        # Whether the endpoint states a request budget: every extra request (a timing probe)
        # then spends it. The budget, when it is a number.
        self.budgeted = False
        self.requests_per_window: int | None = None

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._cold.aclose()

    def forget(self) -> None:
        """The server restarted: what its endpoints answered before no longer holds."""
        self._endpoints.forget()

    async def ready(self) -> bool:
        """`/health` is 200 only once the server has warmed up.

        As in docs/reference/sglang.md#startup."""
        try:
            async with self._mapping("GET /health"):
                response = await self._cold.get("/health", timeout=10.0)
        except GenerationError:
            return False
        return response.status_code == 200

    @property
    def http(self) -> httpx.AsyncClient:
        """The client for the server's cold endpoints (`/metrics`, `/server_info`, ...): at most
        one request a second per endpoint, none to one that answered 404 (`ColdEndpoints`)."""
        return self._cold

    @property
    def api_key(self) -> str | None:
        return self._api_key

    async def detect(self) -> Server:
        """What the server is: its kind, models and what it says of itself (fleetgen/servers).
        Each endpoint's requests go where that kind serves it from now on (vLLM's /classify)."""
        async with self._mapping("server detection"):
            server = await detect(self._cold, timeout_s=30.0)
        self._urls = {e.path: httpx.URL(self.base_url + server.path(e))
                      for e in ENDPOINTS.values()}
        return server

    async def chat(self, body: RequestBody) -> ChatCompletion:
        """POST one non-streaming chat completion and return the parsed response (with one
        finished choice per answer its `n` asks)."""
        return await self.post(ENDPOINTS[CHAT], body)

    async def post(self, endpoint: Endpoint, body: RequestBody) -> ChatCompletion:
        """POST one request to `endpoint` and return the parsed response: a completion with
        one finished choice per answer its `n` asks, or the embeddings (or classes) of every
        text of its `input`."""
        request = httpx.Request("POST", self._urls[endpoint.path], content=orjson.dumps(body),
                                headers=self._post_headers)
        try:
            response = await self._http.send(request)
        except Exception as exc:  # noqa: BLE001 - mapped or raised again, never swallowed
            self._raise_mapped("POST " + endpoint.path, exc)
        if not self.budgeted:
            self._note_budget(response)
        self._raise_for_status(response)
        data: ChatCompletion = orjson.loads(response.content)
        if endpoint.generates:
            _raise_unless_finished(data, int(body.get("n") or 1))
        else:
            _raise_unless_pooled(data, endpoint, endpoint.inputs(body), response.content)
        return data

    @contextlib.asynccontextmanager
    async def _mapping(self, what: str) -> AsyncIterator[None]:
        """`_raise_mapped` around a block (the cold endpoints)."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - mapped or raised again, never swallowed
            self._raise_mapped(what, exc)

    def _raise_mapped(self, what: str, exc: Exception) -> NoReturn:
        """Turn httpx's and aiohttp's errors into the worker's: the one place they are mapped.

        httpx-aiohttp maps aiohttp's connection and timeout errors to httpx's (a server gone
        mid-request arrives as `ConnectTimeout`); what it leaves unmapped, e.g. a malformed
        status line (`ClientResponseError`), is a broken exchange like httpx's
        `RemoteProtocolError`. Anything else is raised as it is."""
        failure: Failure
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            failure, detail = "connect", f"{what}: {self.base_url} unreachable ({exc!r})"
        elif isinstance(exc, httpx.TimeoutException):
            failure, detail = "timeout", f"{what}: timed out ({type(exc).__name__})"
        elif isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
            # The connection died mid-request: usually the server crashed; the health wait
            # that follows tells a crash from a blip.
            failure, detail = "reset", f"{what}: connection lost ({exc!r})"
        elif isinstance(exc, httpx.HTTPError):
            failure, detail = "incomplete", f"{what}: {exc!r}"
        else:
            # Loaded with the transport by then (see _aiohttp_transport).
            import aiohttp

            if not isinstance(exc, aiohttp.ClientError):
                raise exc
            failure, detail = "reset", f"{what}: broken exchange ({exc!r})"
        raise error_of(classify(Reply(failure=failure, detail=detail)), None) from exc

    def _note_budget(self, response: httpx.Response) -> None:
        """Learn that the endpoint has a request budget: it states one (a bare 429 is a full
        server, which the overload ceiling handles)."""
        stated = response.headers.get(RATE_LIMIT_HEADER)
        if stated is None:
            return
        self.budgeted = True
        if stated.strip().isdigit():
            self.requests_per_window = int(stated)
        log.info("%s has a request budget (%s: %s): sized from its answers and refusals, no "
                 "timing probes", self.base_url, RATE_LIMIT_HEADER, stated)

    @staticmethod
    def _raise_for_status(response: httpx.Response) -> None:
        status = response.status_code
        if status < 400:
            return
        reply = Reply(status, response.content,
                      retry_after_s(response.headers.get("retry-after")))
        raise error_of(classify(reply), status)


def error_of(verdict: Verdict, status: int | None) -> GenerationError:
    """The worker's error for a reply's cause (fleetgen/causes.py): the one mapping of causes
    to exceptions."""
    message, code = verdict.message, verdict.code
    match verdict.cause:
        case "overloaded":
            return OverloadedError(message, status=status, retry_after_s=verdict.retry_after_s)
        case "down":
            return ServerDownError(message, status=status, code=code)
        case "server":
            return RetryableError(message, status=status, code=code)
        case _:
            return BadRequestError(message, status=status, code=code)


class ColdEndpoints(httpx.AsyncBaseTransport):
    """The transport of a server's cold endpoints: what each GET path answered is reused for
    `FRESH_S` (detection, the registry beat and the load watch share one request), and a path
    the server does not have (404, 405) is not asked again until `forget` (a restart: it may
    come back as another version)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner
        self._absent: set[str] = set()
        self._fresh: dict[str, tuple[float, int, list[tuple[bytes, bytes]], bytes]] = {}
        self.sent: collections.Counter[str] = collections.Counter()

    def forget(self) -> None:
        self._absent.clear()
        self._fresh.clear()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method != "GET":
            return await self._inner.handle_async_request(request)
        if path in self._absent:
            return httpx.Response(404, request=request)
        now = time.monotonic()
        kept = self._fresh.get(path)
        if kept is not None and now - kept[0] < FRESH_S and path not in LIVENESS:
            return httpx.Response(kept[1], headers=kept[2], content=kept[3], request=request)
        self.sent[path] += 1
        response = await self._inner.handle_async_request(request)
        if response.status_code in NO_SUCH_ENDPOINT:
            self._absent.add(path)
        # Raw bytes: the client decodes them by the headers kept with them.
        content = b"".join([chunk async for chunk in response.aiter_raw()])
        await response.aclose()
        self._fresh[path] = (now, response.status_code, response.headers.raw, content)
        return httpx.Response(response.status_code, headers=response.headers.raw,
                              content=content, request=request)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _NoCookies(http.cookiejar.CookieJar):
    """A jar that keeps nothing: SGLang sets no cookies, and httpx has no switch to stop
    parsing each response for them (encode/httpx#2992 suggests this jar); the parse was ~2% of
    a worker's CPU per prompt. aiohttp's session below has its own dummy jar."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        return None


def _aiohttp_transport() -> httpx.AsyncBaseTransport:
    """httpx-aiohttp's transport on a session without a connection cap or a cookie jar.

    Imported here, not at the top: the producer imports this module (through the server
    reader) and never sends a chat, and aiohttp adds ~0.2 s to every command's start."""
    import aiohttp
    from httpx_aiohttp import AiohttpTransport

    return AiohttpTransport(client=lambda: aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
        cookie_jar=aiohttp.DummyCookieJar()))


def _raise_unless_finished(data: ChatCompletion, count: int) -> None:
    """A 200 is an answer only when its generation ended: `stop`, `length` or a tool call; one
    that asked `count` answers, only when all `count` did (the request is the unit of failure:
    it is sent again whole)."""
    choices = data.get("choices")
    choices = choices if isinstance(choices, list) and choices else [{}]
    if count > 1 and len(choices) != count:
        raise error_of(classify(Reply(failure="incomplete", detail=(
            f"server answered {len(choices)} choices of the {count} asked"))), None)
    for choice in choices:
        _raise_unless_ended(choice)


# What each item of a pooling endpoint's `data` must hold: a vector, or a class's label (vLLM's
# may be null: a model without id2label) and probabilities.
POOLED_FIELDS = {EMBEDDINGS: ("embedding",), CLASSIFY: ("label", "probs")}


def _raise_unless_pooled(data: Any, endpoint: Endpoint, count: int, raw: bytes) -> None:
    """A 200 is embeddings (or classes) only when it holds a vector (a label and its
    probabilities) for each of the `count` texts sent. vLLM answers some refusals (a generation
    model asked for embeddings) with status 200 and an error object: that is read as the
    status the object names."""
    if isinstance(data, dict) and (data.get("object") == "error" or "error" in data):
        inner = data.get("error")
        code = (inner.get("code") if isinstance(inner, dict) else None) or data.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 400
        raise error_of(classify(Reply(status=status, body=raw)), status)
    items = data.get("data") if isinstance(data, dict) else None
    fields = POOLED_FIELDS[endpoint.name]
    if not isinstance(items, list) or len(items) != count or not all(
            isinstance(v, dict) and all(f in v for f in fields) for v in items):
        got = len(items) if isinstance(items, list) else "no"
        raise error_of(classify(Reply(failure="incomplete", detail=(
            f"server answered {got} {endpoint.name} items of the {count} texts sent"))), None)


def _raise_unless_ended(choice: Any) -> None:
    reason = choice.get("finish_reason") if isinstance(choice, dict) else None
    if isinstance(reason, dict):  # SGLang's native form: {"type": "abort", "message": ...}
        detail = reason.get("message")
        reason = reason.get("type")
    else:
        detail = None
    if reason in FINISHED:
        return
    raise error_of(classify(Reply(failure="aborted", detail=(
        f"server aborted the generation (finish_reason {reason!r}"
        + (f": {detail}" if detail else "") + ")"))), None)
