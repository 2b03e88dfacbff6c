"""Whether the worker's server is one it can use (workers/discovery.py), against real servers
on real sockets: nothing listening, a plain web server, an OpenAI-compatible server lacking the
model asked; and how often the worker says why it waits."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from fleetgen.settings import Settings
from tests.sim_helpers import running_sim
from workers.client import ServerClient
from workers.discovery import TELL_AGAIN_S, Discovery, UnusableServerError, Waiting
from workers.flow import ServerWatch
from workers.limits import InFlight


@contextlib.contextmanager
def serving(handler: Callable[..., http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """An HTTP server of `handler` in a thread, on a free loopback port; yields its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Not on the test's stderr."""


class NoSuchModel(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint without /v1/models that knows one model, not `default`:
    /health is 200, a chat completion naming another model is a JSON 404."""

    def do_GET(self) -> None:
        self._answer(200 if self.path == "/health" else 404, b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer(404, orjson.dumps({"error": {
            "message": "The model `default` does not exist.", "type": "NotFoundError"}}))

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Not on the test's stderr."""


async def refreshed(url: str) -> Discovery:
    """A worker's discovery of `url` after one refresh (its error raised)."""
    settings = Settings()
    client = ServerClient(url, request_timeout_s=5, connect_timeout_s=2)
    in_flight = InFlight(settings, "gpu0@test", url, ServerWatch(settings.hang_after_s))
    discovery = Discovery(settings, "gpu0@test", url, client, in_flight, lambda: None)
    try:
        await discovery.refresh()
        return discovery
    finally:
        await client.aclose()


def test_a_plain_web_server_is_not_taken_for_an_openai_compatible_one(tmp_path: Path) -> None:
    with (serving(functools.partial(Quiet, directory=str(tmp_path))) as url,
          pytest.raises(UnusableServerError) as raised):
        asyncio.run(refreshed(url))
    assert str(raised.value) == (f"{url}: /v1/chat/completions answered 501: not an "
                                 "OpenAI-compatible server")


def test_nothing_listening_is_named_with_what_to_do() -> None:
    with socket.socket() as bound:  # a port of the test's own, bound and refusing connections
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        with pytest.raises(UnusableServerError) as raised:
            asyncio.run(refreshed(url))
    assert str(raised.value) == (f"nothing listens at {url}: start the server or set "
                                 "FLEETGEN_SERVER_URL")


def test_a_server_lacking_the_model_asked_is_still_an_openai_compatible_server() -> None:
    with serving(NoSuchModel) as url:
        discovery = asyncio.run(refreshed(url))
    assert discovery.usable and discovery.server is not None
    assert discovery.server.kind.name == "openai" and discovery.waiting_for is None


def test_a_real_server_is_found_as_before() -> None:
    with running_sim("--instant") as url:
        discovery = asyncio.run(refreshed(url))
    assert discovery.usable and discovery.server is not None
    assert discovery.server.kind.name == "sglang"


def test_a_cause_is_told_when_it_appears_or_changes_then_once_a_minute() -> None:
    waiting = Waiting()
    told = [(t, waiting.seen("nothing listens", t)) for t in range(130)]
    assert [(t, lasted) for t, lasted in told if lasted is not None] == [
        (0, 0.0), (int(TELL_AGAIN_S), TELL_AGAIN_S), (int(2 * TELL_AGAIN_S), 2 * TELL_AGAIN_S)]
    assert waiting.seen("not an OpenAI-compatible server", 130.5) == 0.0
    assert waiting.seen("not an OpenAI-compatible server", 131.5) is None
    waiting.clear()
    assert waiting.why is None and waiting.seen("nothing listens", 132) == 0.0
