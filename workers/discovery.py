"""What the worker's server is: found at first contact and again every
FLEETGEN_CAPACITY_REFRESH_S, its kind, the models it serves, what it refused of what fleetgen
adds (fleetgen/servers), and with that how many requests it takes at once (workers/limits.py).

Batches wait for the first contact (`connected`). What an earlier contact learned is kept
while the server found is the same kind serving the same models. A one-token probe (`probe`)
teaches what the server refuses before any prompt is sent, and tells a server out of rotation
alive again (workers/healthcheck.py).

Until the first contact finds a server fleetgen can use, the worker is not ready and says why:
nothing listens at the URL, or what answers there is not an OpenAI-compatible server (its chat
completions route answers 405 or 501, or 404 while it lists no models and fails /health, as a
plain web server does). The cause is logged when it appears or changes and then once a minute,
though the server is tried every second, and the registry shows it (workers/registration.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from fleetgen.endpoints import CHAT, CLASSIFY, COMPLETIONS, EMBEDDINGS, ENDPOINTS, Endpoint
from fleetgen.errors import (
    BadRequestError,
    FleetgenError,
    GenerationError,
    RetryableError,
    ServerDownError,
)
from fleetgen.servers import RequestBody, Server, ServerCapacity
from fleetgen.settings import Settings
from workers.client import CHAT_PATH, ServerClient
from workers.flow import PROBE_TIMEOUT_S
from workers.limits import InFlight

log = logging.getLogger(__name__)
# The one-token request that times a server's queue and tells a server out of rotation alive.
PROBE_BODY: RequestBody = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
# The same for the other endpoints: a server that only pools (SGLang's --is-embedding, vLLM's
# pooling runner: an embedding, classifier or reward model) fails a chat request, so a worker
# probes what it last sent there.
PROBE_BODIES: dict[str, RequestBody] = {
    CHAT: PROBE_BODY,
    COMPLETIONS: {"prompt": "Hi", "max_tokens": 1},
    EMBEDDINGS: {"input": "Hi"},
    CLASSIFY: {"input": "Hi"},
}
# A server that has not answered the first probe by then is used without what it would have
# taught (the model it is pinned to is then learned from the first prompt's refusal).
FIRST_PROBE_S = 10.0
# Requests that found the server back at once refresh what is known of it once.
REFRESH_AGAIN_S = 1.0
# While the server cannot be read, it is tried again this often.
UNREAD_AGAIN_S = 1.0
# ... but why is logged only when the cause appears or changes, and then this often.
TELL_AGAIN_S = 60.0
# What an OpenAI-compatible server never answers to a chat completion: no POST taken there.
NO_CHAT_ROUTE = (405, 501)
# ... and what it answers to one naming a model it lacks, as a plain web server to any POST.
NOT_FOUND = 404


class UnusableServerError(FleetgenError):
    """Nothing listens at the worker's server URL, or what answers there is not an
    OpenAI-compatible server: the worker waits for one and takes no batch meanwhile."""


class Waiting:
    """Why the server cannot be used, and when that was last told: a cause is told when it
    appears or changes, then every `every_s` while it lasts, however often it is seen."""

    def __init__(self, every_s: float = TELL_AGAIN_S) -> None:
        self.why: str | None = None
        self._every_s = every_s
        self._since = 0.0
        self._told_at = 0.0

    def seen(self, why: str, now: float) -> float | None:
        """Note `why` at `now` (monotonic seconds); how long it has lasted when it is to be
        told now (0 for a new cause), else None."""
        if why != self.why:
            self.why, self._since, self._told_at = why, now, now
            return 0.0
        if now - self._told_at < self._every_s:
            return None
        self._told_at = now
        return now - self._since

    def clear(self) -> None:
        self.why = None


class Discovery:
    """The server as found (`server`, None until it answered once) and how it is found again."""

    def __init__(self, settings: Settings, worker: str, server_url: str, client: ServerClient,
                 in_flight: InFlight, publish: Callable[[], None]) -> None:
        self._settings = settings
        self._worker = worker
        self._server_url = server_url
        self._client = client
        self._in_flight = in_flight
        # What probes ask: the endpoint of the last request the server answered (chat before).
        self.probing: Endpoint = ENDPOINTS[CHAT]
        # Tells the registry: `status` says what the server is from the first contact on.
        self._publish = publish
        self.server: Server | None = None
        self._found = asyncio.Event()
        self._refreshed_at = -math.inf
        self._waiting = Waiting()
        # Called once the server is usable (the worker's ready line): `when_usable`.
        self._on_usable: Callable[[], None] | None = None

    @property
    def usable(self) -> bool:
        """Whether a server fleetgen can use was found (it stays so; /health says if it is up)."""
        return self._found.is_set()

    @property
    def waiting_for(self) -> str | None:
        """Why the worker still waits for a usable server, or None (`status` shows it)."""
        return None if self.usable else self._waiting.why

    async def when_usable(self, on_usable: Callable[[], None]) -> None:
        """Call `on_usable` once the server is usable: now if it is, else from the loop when
        it is found. Until then the worker has said, or says now, why it waits."""
        if self.usable:
            on_usable()
            return
        self._on_usable = on_usable
        if self._waiting.why is None:
            self._unreadable(f"{self._server_url}: no answer yet")

    async def connected(self, deadline_s: float) -> Server:
        """The server once it has been found (ServerDownError past the deadline)."""
        if not self._found.is_set():
            try:
                await asyncio.wait_for(self._found.wait(), deadline_s)
            except TimeoutError:
                why = self._waiting.why or f"{self._server_url}: not reachable to find what it is"
                raise ServerDownError(f"{why} (after {deadline_s:.0f}s)") from None
        assert self.server is not None
        return self.server

    async def refresh(self) -> ServerCapacity:
        """Find what the server is and how many requests to keep in flight there. Until a
        usable server was found, UnusableServerError says why none is there."""
        try:
            found = await self._client.detect()
        except ServerDownError as exc:
            if self.usable:
                raise
            raise UnusableServerError(f"nothing listens at {self._server_url}: start the server "
                                      "or set FLEETGEN_SERVER_URL") from exc
        first = self.server is None
        server = self._adopt(found)
        in_flight = self._in_flight
        if ((first and server.model is None and not server.kind.any_model)
                or in_flight.wants_idle_probe(server)):
            # Learn the served model from the server's own refusal of a probe, before any
            # prompt is sent (a server pinned to one model that /v1/models does not list);
            # and time an idle server, the probe controller's reference.
            try:
                idle = in_flight.active == 0
                latency = await self.probe(FIRST_PROBE_S)
                if idle:
                    in_flight.idle_probe_s = latency
            except GenerationError as exc:
                if first:
                    await self._refuse_unless_chat(server, exc)
        capacity = in_flight.found(server)
        self._waiting.clear()
        if first:
            self._found.set()
            self._publish()
            if self._on_usable is not None:
                self._on_usable()
                self._on_usable = None
        return capacity

    async def _refuse_unless_chat(self, server: Server, exc: GenerationError) -> None:
        """Raise UnusableServerError when the first probe's refusal says the server has no chat
        completions route: a 405 or 501 (no POST taken there), or a 404 from a server that lists
        no models and fails /health (an OpenAI-compatible server lacking the model asked
        answers 404 too, but answers one of those)."""
        status = exc.status
        if status not in NO_CHAT_ROUTE and not (
                status == NOT_FOUND and not server.models and not await self._client.ready()):
            return
        self.server = None
        # What this one's endpoints answered (404s are remembered) is not what the server the
        # operator starts on this port will answer.
        self._client.forget()
        raise UnusableServerError(f"{self._server_url}: {CHAT_PATH} answered {status}: not an "
                                  "OpenAI-compatible server")

    def _adopt(self, found: Server) -> Server:
        """The server found now; what an earlier contact learned is kept while it is the same
        kind serving the same models."""
        known = self.server
        if known is not None and (known.kind, known.models) == (found.kind, found.models):
            found.refused, found.pinned = known.refused, known.pinned
            found.__post_init__()
        elif known is not None:
            log.warning("worker %s: %s changed: now %s (was %s)", self._worker,
                        self._server_url, found.describe(), known.describe())
            self._in_flight.forget(restarted=False)
        self.server = found
        return found

    async def refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
                delay = self._settings.capacity_refresh_s
            except FleetgenError as exc:
                self._unreadable(self._why(exc))
                delay = UNREAD_AGAIN_S
            except Exception:  # a surprise must not end the loop batches wait on
                log.exception("worker %s: reading %s failed", self._worker, self._server_url)
                delay = self._settings.capacity_refresh_s
            await asyncio.sleep(delay)

    async def refresh_soon(self) -> None:
        """Find the server again (it is back), once however many requests were waiting for it."""
        now = time.monotonic()
        if now - self._refreshed_at < REFRESH_AGAIN_S:
            return
        self._refreshed_at = now
        try:
            await self.refresh()
        except FleetgenError as exc:
            self._unreadable(self._why(exc))

    def _why(self, exc: FleetgenError) -> str:
        """What a failed refresh says: whole for an unusable server, with the URL otherwise
        while no usable server was found."""
        if isinstance(exc, UnusableServerError) or self.usable:
            return str(exc)
        return f"{self._server_url}: {exc}"

    def _unreadable(self, why: str) -> None:
        """Log why the server cannot be read, when the cause is new or a minute old: before a
        usable server was found, as the worker's start line (and in the registry at once);
        after, as a reading missed while it restarts."""
        lasted = self._waiting.seen(why, time.monotonic())
        if lasted is None:
            return
        still = f" (still, {lasted / 60:.0f} min)" if lasted else ""
        if self.usable:
            log.info("worker %s: capacity not readable yet (%s)%s", self._worker, why, still)
            return
        log.warning("worker %s started: waiting for its server: %s%s", self._worker, why, still)
        self._publish()

    async def probe(self, timeout_s: float = PROBE_TIMEOUT_S) -> float:
        """One one-token request to the server; its latency. A refusal that teaches the worker
        something (the model it is pinned to, a field it refuses) is learned and the probe
        sent again; other errors are raised (GenerationError). Unanswered within `timeout_s`,
        it is a RetryableError ("timeout"): a probe never waits on a hung server."""
        try:
            return await asyncio.wait_for(self._probe(), timeout_s)
        except TimeoutError:
            raise RetryableError(f"probe unanswered in {timeout_s:.0f}s",
                                 code="timeout") from None

    async def _probe(self) -> float:
        server = self.server
        assert server is not None
        while True:
            endpoint = self.probing
            stored = PROBE_BODIES[endpoint.name].copy()
            if server.model is None and server.models:
                stored["model"] = server.models[0]
            body = server.prepare(stored, thinking=False, chat=endpoint.name == CHAT)
            start = time.monotonic()
            try:
                await self._client.post(endpoint, body)
            except BadRequestError as exc:
                learned = server.learn(exc.status, exc.message, body, stored)
                if learned is None:
                    raise
                log.warning("worker %s: %s %s (it answered %s)", self._worker,
                            self._server_url, learned, exc.message[:200])
                continue
            return time.monotonic() - start
