"""The one server-info reader: SGLang's `/server_info`, then `/get_server_info` for older
builds, then — for any other OpenAI-compatible server — FLEETGEN_MAX_IN_FLIGHT, said once in
the worker's log. The servers here are a plain OpenAI-compatible stub, real HTTP on a real port.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from fleetgen.poll import wait_until
from fleetgen.ports import free_port
from fleetgen.readings import read_server
from fleetgen.servers import fetch_server_info, server_capacity
from tests.stack import Stack, chat_rows, wait_job_done, write_jsonl

# A /get_server_info body of an SGLang from before `/server_info` (before 2025-11): no
# launch_command, two DP ranks that each state what they run.
OLD_SGLANG_INFO = {
    "version": "0.5.2", "max_running_requests": 64, "dp_size": 2,
    "internal_states": [{"effective_max_running_requests_per_dp": 24},
                        {"effective_max_running_requests_per_dp": 20}],
}


class OpenAIStub:
    """/health and /v1/chat/completions, nothing SGLang-specific unless `get_server_info`.

    Every completion but a one-token probe is held until `release()`; `active` counts those in
    flight and `peak` the most at once.
    """

    def __init__(self, get_server_info: dict[str, Any] | None = None) -> None:
        self.active = self.peak = self.served = 0
        self.paths: list[str] = []
        self._released = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        app = FastAPI()

        @app.middleware("http")
        async def seen(request: Any, call_next: Any) -> Any:
            self.paths.append(request.url.path)
            return await call_next(request)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {}

        if get_server_info is not None:
            @app.get("/get_server_info")
            async def old_info() -> dict[str, Any]:
                return get_server_info

        @app.post("/v1/chat/completions")
        async def chat(body: dict[str, Any]) -> dict[str, Any]:
            self._loop = asyncio.get_running_loop()
            if body.get("max_tokens") == 1:  # the worker's one-token probe: answered at once
                return {"id": "probe", "object": "chat.completion", "model": "stub",
                        "choices": [{"index": 0, "finish_reason": "length",
                                     "message": {"role": "assistant", "content": "a"}}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
            self.active += 1
            self.peak = max(self.peak, self.active)
            try:
                await self._released.wait()
            finally:
                self.active -= 1
            self.served += 1
            text = f"answer {self.served} to {len(body['messages'])} messages"
            return {"id": f"c{self.served}", "object": "chat.completion", "model": "stub",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}

        self.app = app

    def release(self) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._released.set)


@contextmanager
def serving(stub: OpenAIStub) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(stub.app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="openai-stub", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 30, what="stub serving")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.e2e
def test_a_worker_keeps_max_in_flight_requests_at_a_server_without_server_info(
        stack: Stack, tmp_path: Path) -> None:
    stub = OpenAIStub()
    with serving(stub) as url:
        worker = stack.worker(0, url, {"FLEETGEN_MAX_IN_FLIGHT": "6"})
        src = write_jsonl(tmp_path / "prompts.jsonl", chat_rows(40))
        stack.producer("enqueue", str(src), "--job", "plain", "--output", str(tmp_path / "out"),
                       "--no-canary")
        wait_until(lambda: stub.active == 6, 60, what="6 requests in flight")
        stub.release()
        status = wait_job_done(stack, "plain", timeout=120)
    assert status.done == 40 and status.failed == 0
    assert stub.peak == 6
    # Said once, not at each refresh of the server's capacity.
    said = [line for line in worker.log().splitlines()
            if "FLEETGEN_MAX_IN_FLIGHT=6; keeping" in line]
    assert len(said) == 1, worker.log()
    assert "keeping 6 in flight" in said[0] and " is openai;" in said[0]


def test_an_older_sglang_is_read_from_get_server_info_summed_over_its_dp_ranks() -> None:
    stub = OpenAIStub(get_server_info=OLD_SGLANG_INFO)

    async def read(url: str) -> tuple[Any, Any]:
        async with httpx.AsyncClient() as client:
            return await fetch_server_info(client, url), await read_server(client, url)

    with serving(stub) as url:
        info, reading = asyncio.run(read(url))
    assert info is not None and info.path == "/get_server_info"
    capacity = server_capacity(info, max_in_flight=6)
    assert (capacity.effective, capacity.requested, capacity.configured) == (44, 64, False)
    assert "summed over 2 DP ranks" in capacity.source
    assert (reading.effective_max, reading.version) == (44, "0.5.2")
    assert stub.paths.count("/server_info") == 2 and stub.paths.count("/get_server_info") == 2


@pytest.mark.parametrize(("max_in_flight", "effective", "says"), [
    (None, 1, "FLEETGEN_MAX_IN_FLIGHT is not set"),
    (12, 12, "FLEETGEN_MAX_IN_FLIGHT=12"),
])
def test_a_server_that_says_nothing_gets_the_configured_number_or_one_that_names_the_setting(
        max_in_flight: int | None, effective: int, says: str) -> None:
    capacity = server_capacity(None, max_in_flight)
    assert (capacity.effective, capacity.configured) == (effective, True)
    assert says in capacity.source
