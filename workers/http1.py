"""A lean HTTP/1.1 keep-alive transport for httpx, for the worker's one local server.

httpx's default transport (httpcore on anyio, h11 parsing) costs ~600 µs of CPU per
request on this machine's cores: more than the rest of a prompt's work together, on the one
loop thread a worker has (tests/perf figure 5). This transport keeps what a worker needs and
nothing else: plain or TLS TCP to one origin, keep-alive connections reused last-in first-out,
response parsing by httptools (llhttp, the parser under uvicorn), Content-Length, chunked and
read-until-close bodies. It plugs in through httpx's own transport interface, so the client
code, the exceptions (`httpx.ConnectError`, `ReadTimeout`, `RemoteProtocolError`, ...) and
their mapping in `workers/sglang.py` are unchanged.

Not supported (the worker never sends them): HEAD, `Expect: 100-continue`, upgrades, proxies.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from typing import cast

import httptools
import httpx

# Idle connections older than this are closed, not reused: a server's keep-alive timeout
# (uvicorn's default, and SGLang's, is 5 s) may be closing them just as a request goes out.
KEEPALIVE_EXPIRY_S = 4.0


class Http1Transport(httpx.AsyncBaseTransport):
    """Keep-alive connections per origin (scheme, host, port); any number of requests at once."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float | None,
                 max_idle: int = 1024, verify: ssl.SSLContext | bool = True) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_idle = max_idle
        self._verify = verify
        self._idle: dict[tuple[str, str, int | None], deque[_Connection]] = {}
        self._closed = False
        self.connections_opened = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "HEAD":
            raise httpx.UnsupportedProtocol("Http1Transport does not send HEAD", request=request)
        if self._closed:
            raise httpx.ConnectError("transport is closed", request=request)
        body = request.content if _has_content(request) else await request.aread()
        head = _request_head(request, len(body))
        timeout = _read_timeout(request, self._read_timeout_s)
        origin = (request.url.scheme, request.url.host, request.url.port)
        conn = self._take_idle(origin) or await self._connect(request)
        try:
            status, headers, content = await conn.exchange(head + body, timeout, request)
        except BaseException:
            conn.close()  # a request cut off mid-way leaves the connection unusable
            raise
        if conn.reusable:
            self._give_back(origin, conn)
        else:
            conn.close()
        return httpx.Response(status, headers=headers, content=content, request=request,
                              extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()

    def reusable_idle(self) -> int:
        """Idle connections that could serve the next request (a closed one no longer counts)."""
        return sum(conn.reusable for idle in self._idle.values() for conn in idle)

    def _take_idle(self, origin: tuple[str, str, int | None]) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reusable and now - conn.idle_since < KEEPALIVE_EXPIRY_S:
                return conn
            conn.close()
        return None

    def _give_back(self, origin: tuple[str, str, int | None], conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, deque())
        if self._closed or len(idle) >= self._max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _connect(self, request: httpx.Request) -> _Connection:
        url = request.url
        tls = url.scheme == "https"
        port = url.port or (443 if tls else 80)
        loop = asyncio.get_running_loop()
        context = self._ssl_context() if tls else None
        timeout = _connect_timeout(request, self._connect_timeout_s)
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, url.host, port, ssl=context,
                                       server_hostname=url.host if tls else None),
                timeout,
            )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connect to {url.host}:{port} timed out",
                                       request=request) from exc
        except OSError as exc:
            raise httpx.ConnectError(f"connect to {url.host}:{port}: {exc}", request=request) from exc
        self.connections_opened += 1
        return conn

    def _ssl_context(self) -> ssl.SSLContext:
        if isinstance(self._verify, ssl.SSLContext):
            return self._verify
        context = ssl.create_default_context()
        if not self._verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


class _Connection(asyncio.Protocol):
    """One TCP connection: one request at a time, the response parsed as it arrives."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._headers_done = False
        self._complete = False
        self._keep_alive = False
        self._framed = False  # Content-Length or chunked: the body's end is known
        self._lost: Exception | None = None
        self.idle_since = 0.0

    @property
    def reusable(self) -> bool:
        return (self._lost is None and self._keep_alive and self._transport is not None
                and not self._transport.is_closing())

    async def exchange(self, data: bytes, timeout: float | None,
                       request: httpx.Request) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        if self._lost is not None or self._transport is None:
            raise httpx.RemoteProtocolError("connection closed before the request", request=request)
        loop = asyncio.get_running_loop()
        self._reset()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, waiter) if timeout is not None else None
        self._transport.write(data)
        try:
            await waiter
        except _Expired as exc:
            raise httpx.ReadTimeout(f"no complete response within {timeout:g}s",
                                    request=request) from exc
        except _Broken as exc:
            raise exc.as_httpx(request) from None
        finally:
            if timer is not None:
                timer.cancel()
            self._waiter = None
        return self._status, self._headers, b"".join(self._body)

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _reset(self) -> None:
        self._status, self._headers, self._body = 0, [], []
        self._headers_done = self._complete = self._keep_alive = self._framed = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:
            # Bytes while no request is out: the connection is out of step; never reuse it.
            self._lost = _Broken("protocol", "unexpected data between responses")
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(_Broken("protocol", f"malformed response: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close our side as well

    def connection_lost(self, exc: Exception | None) -> None:
        if self._headers_done and not self._complete and not self._framed and exc is None:
            # A body delimited by the connection closing is complete now.
            self.on_message_complete()
        if self._waiter is not None and not self._waiter.done():
            if exc is not None:
                broken = _Broken("read", f"connection lost: {exc!r}")
            else:
                broken = _Broken("protocol", "server disconnected without a complete response")
            self._fail(broken)
        self._lost = exc or _Broken("protocol", "closed")

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()
        self._headers_done = True
        for name, value in self._headers:
            lower = name.lower()
            if lower == b"content-length" or (lower == b"transfer-encoding"
                                              and b"chunked" in value.lower()):
                self._framed = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._status < 200:
            # 1xx: an interim response; the real one follows on the same connection.
            self._reset()
            return
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)


class _Expired(Exception):
    """The read timeout fired."""


class _Broken(Exception):
    """The connection failed; `kind` says which httpx error it is."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def as_httpx(self, request: httpx.Request) -> httpx.TransportError:
        cls = httpx.ReadError if self.kind == "read" else httpx.RemoteProtocolError
        return cls(str(self), request=request)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(_Expired())


def _has_content(request: httpx.Request) -> bool:
    try:
        request.content  # noqa: B018 - raises RequestNotRead for a streaming body
    except httpx.RequestNotRead:
        return False
    return True


def _request_head(request: httpx.Request, length: int) -> bytes:
    lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode(), request.url.raw_path)]
    has_length = False
    for name, value in request.headers.raw:
        lower = name.lower()
        if lower == b"transfer-encoding":
            continue  # the body is sent whole, with its length
        has_length = has_length or lower == b"content-length"
        lines.append(b"%s: %s\r\n" % (name, value))
    if not has_length and (length or request.method in ("POST", "PUT", "PATCH")):
        lines.append(b"Content-Length: %d\r\n" % length)
    lines.append(b"\r\n")
    return b"".join(lines)


def _read_timeout(request: httpx.Request, default: float | None) -> float | None:
    timeout: dict[str, float | None] = request.extensions.get("timeout") or {}
    return timeout.get("read", default)


def _connect_timeout(request: httpx.Request, default: float) -> float | None:
    timeout: dict[str, float | None] = request.extensions.get("timeout") or {}
    return timeout.get("connect", default)
