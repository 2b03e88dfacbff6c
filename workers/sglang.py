"""The HTTP client of one SGLang server (or the simulator: the worker cannot tell them apart).

httpx errors and HTTP statuses become `workers.errors` types here and nowhere else.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from workers.errors import BadRequestError, GenerationError, RetryableError, ServerDownError
from workers.http1 import Http1Transport
from workers.server_info import ServerInfo, fetch_server_info

log = logging.getLogger(__name__)


class SGLangClient:
    """One pooled async client per worker process, for the server next to its GPU."""

    def __init__(
        self,
        base_url: str,
        *,
        request_timeout_s: float,
        connect_timeout_s: float = 10.0,
        api_key: str | None = None,
        transport: str = "lean",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(connect=connect_timeout_s, read=request_timeout_s, write=60.0,
                                pool=None)
        # The worker's concurrency is bounded by its limiter (engine.py), not by a pool size.
        self._transport: httpx.AsyncBaseTransport = (
            Http1Transport(connect_timeout_s=connect_timeout_s, read_timeout_s=request_timeout_s)
            if transport == "lean" else
            httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None,
                                                         max_keepalive_connections=1024)))
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout,
                                       transport=self._transport)
        # The hot path builds its request once-parsed: the client's URL merging, cookie jar
        # and redirect/auth layers cost more per request than the lean transport itself.
        self._chat_url = httpx.URL(f"{self.base_url}/v1/chat/completions")
        self._chat_headers = {**self._http.headers, "Content-Type": "application/json"}
        self._chat_extensions = {"timeout": timeout.as_dict()}

    async def aclose(self) -> None:
        await self._http.aclose()

    async def ready(self) -> bool:
        """`/health` is 200 only once the server has warmed up.

        As in docs/reference/sglang.md#startup."""
        try:
            response = await self._http.get("/health", timeout=10.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    @property
    def http(self) -> httpx.AsyncClient:
        """The client for the server's cold endpoints (`/metrics`, `/server_info`, ...)."""
        return self._http

    @property
    def api_key(self) -> str | None:
        return self._api_key

    async def server_info(self) -> ServerInfo | None:
        """What the server says about itself (workers/server_info.py); None if not SGLang."""
        async with self._mapped("GET /server_info"):
            return await fetch_server_info(self._http, timeout_s=30.0)

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST one non-streaming chat completion and return the parsed response."""
        request = httpx.Request("POST", self._chat_url, headers=self._chat_headers,
                                content=orjson.dumps(body), extensions=self._chat_extensions)
        try:
            response = await self._transport.handle_async_request(request)
            try:
                await response.aread()
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise self._error("POST /v1/chat/completions", exc) from exc
        self._raise_for_status(response)
        data: dict[str, Any] = orjson.loads(response.content)
        return data

    @contextlib.asynccontextmanager
    async def _mapped(self, what: str) -> AsyncIterator[None]:
        try:
            yield
        except httpx.HTTPError as exc:
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: httpx.HTTPError) -> GenerationError:
        """The worker error an httpx error stands for: the one place they are mapped."""
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return ServerDownError(f"{what}: {self.base_url} unreachable ({exc!r})")
        if isinstance(exc, httpx.TimeoutException):
            return RetryableError(f"{what}: timed out ({type(exc).__name__})")
        if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
            # The connection died mid-request: usually the server crashed; the health wait
            # that follows tells a crash from a blip.
            return ServerDownError(f"{what}: connection lost ({exc!r})")
        return RetryableError(f"{what}: {exc!r}")

    @staticmethod
    def _raise_for_status(response: httpx.Response) -> None:
        status = response.status_code
        if status < 400:
            return
        message = _error_message(response)
        if status == 503:
            # Draining, starting, or a full queue (--max-queued-requests): not the prompt's fault.
            raise ServerDownError(f"HTTP 503: {message}", status=status)
        if status >= 500 or status == 429:
            raise RetryableError(f"HTTP {status}: {message}", status=status)
        raise BadRequestError(f"HTTP {status}: {message}", status=status)


def _error_message(response: httpx.Response) -> str:
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or body)[:2000]
        return str(err)[:2000]
    return str(body)[:2000]
