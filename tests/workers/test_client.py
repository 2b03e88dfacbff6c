"""The worker's HTTP client (workers/client.py: httpx over httpx-aiohttp's transport) against
real servers on real sockets.

The simulator (uvicorn, like SGLang) for the happy path and HTTP errors, and a small raw-socket
server for what uvicorn never does on purpose: closing mid-response, never answering, answering
garbage. Each failure must become the worker error type that decides what happens to the prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest

from fleetgen.errors import BadRequestError, OverloadedError, RetryableError, ServerDownError
from fleetgen.servers import server_capacity
from tests.sim_helpers import chat_body, free_port, running_sim
from workers.client import ServerClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


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


@contextlib.asynccontextmanager
async def client_of(url: str, request_timeout_s: float = 5.0) -> AsyncIterator[ServerClient]:
    client = ServerClient(url, request_timeout_s=request_timeout_s, connect_timeout_s=2.0)
    try:
        yield client
    finally:
        await client.aclose()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def respond(status: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        status, len(body), body)


def test_a_chat_is_answered_and_the_capacity_read_from_the_simulator() -> None:
    async def run(url: str) -> None:
        async with client_of(url) as client:
            answers = await asyncio.gather(*(client.chat(chat_body(f"hi {i}", max_tokens=8))
                                             for i in range(20)))
            assert all(0 < a["usage"]["completion_tokens"] <= 8 for a in answers)
            server = await client.detect()
            assert server.kind.name == "sglang"
            assert server.info is not None
            assert server_capacity(server.info, None).effective > 0
            assert await client.ready()

    with running_sim("--instant") as url:
        asyncio.run(run(url))


def test_a_request_the_server_rejects_is_a_bad_request() -> None:
    async def run(url: str) -> None:
        async with client_of(url) as client:
            with pytest.raises(BadRequestError, match="Messages cannot be empty") as caught:
                await client.chat({"model": "m", "messages": []})
            assert caught.value.status == 400

    with running_sim("--instant") as url:
        asyncio.run(run(url))


def test_a_refused_connection_means_the_server_is_down() -> None:
    async def run() -> None:
        async with client_of(f"http://127.0.0.1:{free_port()}") as client:
            with pytest.raises(ServerDownError, match="unreachable"):
                await client.chat(chat_body())
            assert not await client.ready()

    asyncio.run(run())


@pytest.mark.parametrize(("status", "error"), [
    (b"503 Service Unavailable", OverloadedError),  # a full queue (or draining: /health says)
    (b"500 Internal Server Error", RetryableError),
    (b"502 Bad Gateway", RetryableError),
    (b"429 Too Many Requests", OverloadedError),
    (b"404 Not Found", BadRequestError),
])
def test_http_statuses_map_to_the_workers_error_types(status: bytes,
                                                      error: type[Exception]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(respond(status, orjson.dumps({"error": {"message": "said the server"}})))
        await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, _), client_of(url) as client:
            with pytest.raises(error, match="said the server"):
                await client.chat(chat_body())

    asyncio.run(run())


@pytest.mark.parametrize("finish_reason", [
    "abort",  # SGLang's and vLLM's aborted request, in the OpenAI form
    {"type": "abort", "message": "aborted by /abort_request"},  # SGLang's native form
    None,  # no end of generation at all
])
def test_an_answer_whose_generation_did_not_end_is_retryable(finish_reason: object) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(respond(b"200 OK", orjson.dumps({"choices": [
            {"message": {"content": ""}, "finish_reason": finish_reason}]})))
        await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, _), client_of(url) as client:
            with pytest.raises(RetryableError, match="aborted the generation"):
                await client.chat(chat_body())

    asyncio.run(run())


@pytest.mark.parametrize(("reply", "error"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ntoo short", ServerDownError),
    (b"this is not HTTP\r\n\r\n", ServerDownError),
    (b"", ServerDownError),  # closed without a word
    (None, RetryableError),  # never answers: the read timeout
])
def test_broken_answers_map_to_the_workers_error_types(reply: bytes | None,
                                                       error: type[Exception]) -> None:
    silent = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if reply is None:
            await silent.wait()
            return
        writer.write(reply)
        await writer.drain()

    async def run() -> None:
        # Only the silent server may meet the read timeout: a broken answer must map to its own
        # error however late a loaded machine delivers it.
        timeout = 0.3 if reply is None else 60
        async with raw_server(handler) as (url, _), client_of(url, timeout) as client:
            try:
                with pytest.raises(error):
                    await client.chat(chat_body())
            finally:
                silent.set()

    asyncio.run(run())


def test_a_cancelled_request_closes_its_connection_and_the_next_one_works() -> None:
    release = asyncio.Event()
    answer = orjson.dumps({"choices": [{"message": {"content": "fine"}, "finish_reason": "stop"}]})

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            await release.wait()  # requests hang until the slow one was cancelled
            writer.write(respond(b"200 OK", answer))
            await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, accepted), client_of(url) as client:
            slow = asyncio.create_task(client.chat(chat_body("slow")))
            while not accepted:
                await asyncio.sleep(0.01)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            release.set()
            fast = await client.chat(chat_body("fast"))
            assert fast["choices"][0]["message"]["content"] == "fine"
            # The cancelled request's connection was not reused: its late answer would have
            # been read as the next request's.
            assert len(accepted) == 2

    asyncio.run(run())


def test_requests_in_a_row_share_one_kept_alive_connection() -> None:
    answer = orjson.dumps({"choices": [{"message": {"content": "fine"}, "finish_reason": "stop"}]})

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(respond(b"200 OK", answer))
            await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, accepted), client_of(url) as client:
            for n in range(5):
                await client.chat(chat_body(f"q{n}"))
            assert len(accepted) == 1

    asyncio.run(run())


def test_a_cookie_the_server_sets_is_never_sent_back() -> None:
    # Each prompt's request stands alone: the client keeps no cookies (sglang.py's jar).
    answer = orjson.dumps({"choices": [{"message": {"content": "fine"}, "finish_reason": "stop"}]})
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                requests.append(await read_request(reader))
            except asyncio.IncompleteReadError:
                return
            reply = respond(b"200 OK", answer)
            writer.write(reply.replace(b"\r\n\r\n", b"\r\nSet-Cookie: session=abc; Path=/\r\n\r\n", 1))
            await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, _), client_of(url) as client:
            for n in range(3):
                await client.chat(chat_body(f"q{n}"))
            assert len(client.http.cookies) == 0

    asyncio.run(run())
    assert len(requests) == 3
    assert not any(b"cookie:" in r.lower() for r in requests), requests[1]


def test_a_chat_carries_the_api_key_and_its_json_body() -> None:
    answer = orjson.dumps({"choices": [{"message": {"content": "fine"}, "finish_reason": "stop"}]})
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await read_request(reader))
        writer.write(respond(b"200 OK", answer))
        await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, _):
            client = ServerClient(url, request_timeout_s=5.0, api_key="key-123")
            try:
                assert await client.chat(chat_body("q")) == orjson.loads(answer)
            finally:
                await client.aclose()

    asyncio.run(run())
    head, _, body = requests[0].partition(b"\r\n\r\n")
    lines = [line.lower() for line in head.split(b"\r\n")]
    assert lines[0] == b"post /v1/chat/completions http/1.1"
    assert b"authorization: bearer key-123" in lines
    assert b"content-type: application/json" in lines
    assert orjson.loads(body) == chat_body("q")


def test_the_client_holds_more_requests_at_once_than_a_default_pool_allows() -> None:
    # The worker's limiter sizes its concurrency from the server; the pool must not cap it
    # (aiohttp's and httpx's default pools hold 100 connections).
    wanted = 130
    arrived: list[int] = []
    everyone = asyncio.Event()
    answer = orjson.dumps({"choices": [{"message": {"content": "fine"}, "finish_reason": "stop"}]})

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        arrived.append(1)
        if len(arrived) == wanted:
            everyone.set()
        await everyone.wait()  # nobody is answered until all are at the server at once
        writer.write(respond(b"200 OK", answer))
        await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, _), client_of(url, request_timeout_s=120) as client:
            chats = [client.chat(chat_body(f"q{n}")) for n in range(wanted)]
            answers = await asyncio.wait_for(asyncio.gather(*chats), timeout=120)
            assert len(answers) == wanted

    asyncio.run(run())


@pytest.mark.parametrize(("header", "seconds"), [
    (b"Retry-After: 7\r\n", 7.0),
    (b"Retry-After: Wed, 21 Oct 2015 07:28:00 GMT\r\n", 0.0),  # a date in the past: at once
    (b"Retry-After: soon\r\n", None),
    (b"", None),
])
def test_a_429_carries_the_servers_retry_after(header: bytes, seconds: float | None) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        body = b'{"error":"Model is overloaded","error_type":"overloaded"}'
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                     + header + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, _), client_of(url) as client:
            with pytest.raises(OverloadedError, match="overloaded") as caught:
                await client.chat(chat_body())
            assert caught.value.status == 429
            assert caught.value.retry_after_s == seconds

    asyncio.run(run())


def test_an_endpoint_that_answered_404_is_not_asked_again_until_the_server_restarts() -> None:
    asked: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            asked.append(head.split(b" ")[1])
            writer.write(respond(b"404 Not Found", b'{"detail":"Not Found"}'))
            await writer.drain()

    async def run() -> None:
        async with raw_server(handler) as (url, _), client_of(url) as client:
            for _ in range(3):
                assert (await client.http.get("/server_info")).status_code == 404
            assert asked == [b"/server_info"]
            client.forget()
            assert (await client.http.get("/server_info")).status_code == 404
            assert asked == [b"/server_info", b"/server_info"]

    asyncio.run(run())
