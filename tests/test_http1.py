"""The lean HTTP/1.1 transport (workers/http1.py) against real servers on real sockets.

The simulator (uvicorn, like SGLang) for the happy paths, and a small raw-socket server for
what uvicorn never does on purpose: closing mid-response, never answering, answering garbage.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import orjson
import pytest
from sim_helpers import chat_body, running_sim

from workers.errors import BadRequestError, RetryableError, ServerDownError
from workers.http1 import Http1Transport
from workers.sglang import SGLangClient

JSON = {"Content-Type": "application/json"}
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def lean(timeout: float = 30.0) -> httpx.AsyncClient:
    transport = Http1Transport(connect_timeout_s=5.0, read_timeout_s=timeout)
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(timeout, connect=5.0))


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server on a free port; yields its URL and a list counting accepted connections."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}", accepted


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def respond(body: bytes, *extra: bytes) -> bytes:
    headers = b"".join(h + b"\r\n" for h in extra)
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), headers, body)


def test_chat_answers_match_httpx_default_transport_and_connections_are_reused() -> None:
    async def run(url: str) -> None:
        body = orjson.dumps(chat_body("same prompt", max_tokens=32, seed=7))
        async with lean() as fast, httpx.AsyncClient() as default:
            ours = await fast.post(f"{url}/v1/chat/completions", content=body, headers=JSON)
            theirs = await default.post(f"{url}/v1/chat/completions", content=body, headers=JSON)
            assert ours.status_code == theirs.status_code == 200
            a, b = orjson.loads(ours.content), orjson.loads(theirs.content)
            assert a["choices"][0]["message"] == b["choices"][0]["message"]
            transport = fast._transport
            assert isinstance(transport, Http1Transport)
            answers = await asyncio.gather(*(
                fast.post(f"{url}/v1/chat/completions", content=body, headers=JSON) for _ in range(200)))
            assert {r.status_code for r in answers} == {200}
            # 200 requests, at most 200 at once: the pool never holds more than that, and a
            # second round at the same concurrency opens no new connection.
            opened = transport.connections_opened
            assert opened <= 201
            await asyncio.gather(*(fast.post(f"{url}/v1/chat/completions", content=body, headers=JSON)
                                   for _ in range(50)))
            assert transport.connections_opened == opened

    with running_sim("--instant") as url:
        asyncio.run(run(url))


def test_a_chunked_streaming_response_is_read_whole() -> None:
    async def run(url: str) -> None:
        body = orjson.dumps(chat_body("stream me", max_tokens=20, stream=True))
        async with lean() as fast, httpx.AsyncClient() as default:
            ours = await fast.post(f"{url}/v1/chat/completions", content=body, headers=JSON)
            theirs = await default.post(f"{url}/v1/chat/completions", content=body, headers=JSON)
        assert ours.headers.get("transfer-encoding") == "chunked"
        assert ours.content.count(b"data: ") == theirs.content.count(b"data: ") > 2
        assert ours.content.rstrip().endswith(b"data: [DONE]")

    with running_sim("--instant") as url:
        asyncio.run(run(url))


def test_connection_close_and_read_until_close_bodies() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        if b"/close" in request:
            writer.write(respond(b"closed-after", b"Connection: close"))
        else:  # no length, no chunking: the body ends when the connection does
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil-eof body")
        await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, accepted), lean() as client:
            assert (await client.get(f"{url}/close")).content == b"closed-after"
            assert (await client.get(f"{url}/close")).content == b"closed-after"
            assert (await client.get(f"{url}/eof")).content == b"until-eof body"
            assert len(accepted) == 3  # nothing reused after Connection: close

    asyncio.run(run())


def test_a_keep_alive_connection_serves_requests_in_turn_and_interim_1xx_is_skipped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + respond(b"ok"))
            await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, accepted), lean() as client:
            for _ in range(5):
                response = await client.post(f"{url}/x", content=b"payload")
                assert (response.status_code, response.content) == (200, b"ok")
            assert len(accepted) == 1

    asyncio.run(run())


def test_an_idle_connection_the_server_closed_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(respond(b"once"))  # keep-alive promised, then closed (keep-alive timeout)
        await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, accepted), lean() as client:
            assert (await client.get(f"{url}/a")).content == b"once"
            transport = client._transport
            assert isinstance(transport, Http1Transport)
            while transport.reusable_idle():
                await asyncio.sleep(0.01)  # until the loop has seen the server's FIN
            assert (await client.get(f"{url}/b")).content == b"once"
            assert len(accepted) == 2

    asyncio.run(run())


@pytest.mark.parametrize(("reply", "error"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ntoo short", ServerDownError),
    (b"this is not HTTP\r\n\r\n", ServerDownError),
    (None, RetryableError),  # never answers: the read timeout
])
def test_broken_answers_map_to_the_workers_error_types(reply: bytes | None,
                                                       error: type[Exception]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if reply is None:
            await asyncio.Event().wait()  # never: until the run ends
        writer.write(reply)
        await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, _):
            # Only the silent server may meet the read timeout: a broken answer must map to its
            # own error however late a loaded machine delivers it.
            client = SGLangClient(url, request_timeout_s=0.3 if reply is None else 60)
            try:
                with pytest.raises(error):
                    await client.chat(chat_body())
            finally:
                await client.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("transport", ["lean", "httpx"])
def test_both_transports_answer_and_map_refusals_and_4xx_alike(transport: str) -> None:
    async def run(url: str) -> None:
        down = SGLangClient("http://127.0.0.1:9", request_timeout_s=5, transport=transport)
        client = SGLangClient(url, request_timeout_s=5, transport=transport)
        try:
            answer = await client.chat(chat_body("hi", max_tokens=8))
            assert 0 < answer["usage"]["completion_tokens"] <= 8
            with pytest.raises(ServerDownError):
                await down.chat(chat_body())
            with pytest.raises(BadRequestError, match="Messages cannot be empty"):
                await client.chat({"model": "m", "messages": []})
            info = await client.server_info()
            assert info is not None and (info.concurrency or 0) > 0
        finally:
            await down.aclose()
            await client.aclose()

    with running_sim("--instant") as url:
        asyncio.run(run(url))


def test_a_cancelled_request_closes_its_connection_and_the_next_one_works() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                request = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            if b"/slow" in request:
                await release.wait()
            writer.write(respond(b"fine"))
            await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, accepted), lean() as client:
            slow = asyncio.create_task(client.get(f"{url}/slow"))
            while not accepted:
                await asyncio.sleep(0.01)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            release.set()
            assert (await client.get(f"{url}/fast")).content == b"fine"
            assert len(accepted) == 2  # the cancelled one's connection was not reused

    asyncio.run(run())


def test_connections_are_kept_per_origin() -> None:
    async def answer_with_port(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = writer.get_extra_info("sockname")[1]
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(respond(str(port).encode()))
            await writer.drain()

    async def run() -> None:
        async with raw_server(answer_with_port) as (a, seen_a), \
                raw_server(answer_with_port) as (b, seen_b), lean() as client:
            for _ in range(3):
                for url in (a, b):
                    answer = await client.get(f"{url}/x")
                    assert answer.content == url.rsplit(":", 1)[1].encode()
            assert (len(seen_a), len(seen_b)) == (1, 1)

    asyncio.run(run())
