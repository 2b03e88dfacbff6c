"""A hung server (launcher/sim/hang.py): generation requests taken and never answered (or
answered in part) while /health stays 200, requests under way stopped, a client that leaves
freed without a trace in the log, the answers going out once the hang ends, and a server
that still shuts down at once."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.sim_helpers import WAIT_S, SimProcess, chat_body, running_sim, wait_until

CHAT = "/v1/chat/completions"
# Answers of ~10 s: requests stay running while the test starts the hang.
SLOW = ("--decode-tps", "5", "--mean-output-tokens", "50", "--output-sigma", "0.01")


async def until_stats(client: httpx.AsyncClient, check: Callable[[dict[str, Any]], bool],
                      what: str) -> dict[str, Any]:
    """/sim/stats once `check` holds for it."""
    deadline = time.monotonic() + WAIT_S
    while True:
        stats: dict[str, Any] = (await client.get("/sim/stats")).json()
        if check(stats):
            return stats
        assert time.monotonic() < deadline, f"never {what}: {stats}"
        await asyncio.sleep(0.02)


async def misbehave(client: httpx.AsyncClient, **what: Any) -> dict[str, Any]:
    response = await client.post("/sim/misbehave", json=what)
    assert response.status_code == 200, response.text
    state: dict[str, Any] = response.json()
    return state


def test_a_chat_hang_answers_no_generation_request_while_the_probes_answer() -> None:
    async def scenario(url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
            chat = asyncio.create_task(client.post(CHAT, json=chat_body(max_tokens=8)))
            generate = asyncio.create_task(client.post("/generate", json={"text": "hi"}))
            held = await until_stats(client, lambda s: s["hanging"] == 2, "two held")
            probes = [await client.get(path) for path in
                      ("/health", "/metrics", "/v1/models", "/server_info")]
            unanswered = not chat.done() and not generate.done()
            state = (await client.get("/sim/misbehave")).json()
            cleared = await misbehave(client, hang=None)
            answers = await asyncio.gather(chat, generate)
            fresh = await client.post(CHAT, json=chat_body(max_tokens=8))
            stats = (await client.get("/sim/stats")).json()
        return {"held": held, "probes": probes, "unanswered": unanswered, "state": state,
                "cleared": cleared, "answers": answers, "fresh": fresh, "stats": stats}

    with running_sim("--instant", "--hang", "chat") as url:
        seen = asyncio.run(scenario(url))
    assert [r.status_code for r in seen["probes"]] == [200] * 4
    assert seen["unanswered"]
    assert (seen["held"]["hung"], seen["held"]["answered"], seen["held"]["refused"]) == (2, 0, {})
    assert seen["state"]["hang"] == "chat" and seen["cleared"]["hang"] is None
    # once the hang ends, the held requests are answered, late, and new ones at once
    assert [r.status_code for r in seen["answers"]] == [200, 200]
    assert seen["answers"][0].json()["object"] == "chat.completion"
    assert seen["fresh"].status_code == 200
    stats = seen["stats"]
    assert (stats["hung"], stats["hanging"], stats["answered"], stats["requests"]) == (2, 0, 3, 3)


def test_a_partial_hang_sends_the_headers_and_half_the_body_then_nothing() -> None:
    async def scenario(url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client, \
                client.stream("POST", CHAT, json=chat_body(max_tokens=8)) as response:
            length = int(response.headers["content-length"])
            got = b""
            raw = response.aiter_raw()
            while len(got) < length // 2:
                got += await anext(raw)
            held = await until_stats(client, lambda s: s["hanging"] == 1, "one held")
            half = got
            await misbehave(client, hang=None)
            async for chunk in raw:
                got += chunk
            return {"status": response.status_code, "length": length, "half": half,
                    "body": got, "held": held}

    with running_sim("--instant", "--hang", "partial") as url:
        seen = asyncio.run(scenario(url))
    assert seen["status"] == 200
    assert len(seen["half"]) == seen["length"] // 2
    assert (seen["held"]["hung"], seen["held"]["answered"]) == (1, 1)
    # the rest follows once the hang ends: the whole body, as its content-length said
    assert len(seen["body"]) == seen["length"]
    assert orjson.loads(seen["body"])["object"] == "chat.completion"


def test_requests_under_way_when_a_hang_starts_stop_until_it_ends() -> None:
    async def scenario(url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
            plain = asyncio.create_task(client.post(CHAT, json=chat_body("plain")))
            async with client.stream("POST", CHAT, json=chat_body("streamed", stream=True)) \
                    as stream:
                lines = stream.aiter_lines()
                first = await anext(lines)
                await until_stats(client, lambda s: s["running"] == 2, "two running")
                await misbehave(client, hang="chat")
                # both end now in the scheduler; neither answer may leave while it hangs
                await client.post("/abort_request", json={"abort_all": True})
                held = await until_stats(client, lambda s: s["hanging"] == 2, "two held")
                unanswered = not plain.done()
                await misbehave(client, hang=None)
                rest = [line async for line in lines]
            answer = await plain
        return {"first": first, "held": held, "unanswered": unanswered, "rest": rest,
                "answer": answer}

    with running_sim(*SLOW) as url:
        seen = asyncio.run(scenario(url))
    assert seen["first"].startswith("data: ")
    assert seen["unanswered"] and seen["held"]["hung"] == 2
    assert seen["rest"][-2:] == ["data: [DONE]", ""]
    assert seen["answer"].status_code == 200
    assert seen["answer"].json()["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize(("mode", "stream"), [("chat", False), ("chat", True),
                                              ("partial", False), ("partial", True)])
def test_a_client_that_leaves_a_held_request_frees_it_without_an_error_in_the_log(
        mode: str, stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
            async def ask() -> None:
                async with client.stream("POST", CHAT,
                                         json=chat_body(max_tokens=8, stream=stream)) as r:
                    async for _ in r.aiter_raw():
                        pass

            task = asyncio.create_task(ask())
            await until_stats(client, lambda s: s["hanging"] == 1, "one held")
            task.cancel()  # the client closes its connection
            await asyncio.gather(task, return_exceptions=True)
            freed = await until_stats(client, lambda s: s["hanging"] == 0, "none held")
            await misbehave(client, hang=None)
            after = await client.post(CHAT, json=chat_body(max_tokens=8, stream=stream))
        return {"freed": freed, "after": after}

    with running_sim("--instant", "--hang", mode) as url:
        seen = asyncio.run(scenario(url))
    assert seen["freed"]["hung"] == 1 and seen["after"].status_code == 200
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., SimProcess]]:
    procs: list[SimProcess] = []

    def start(*flags: str) -> SimProcess:
        procs.append(SimProcess(tmp_path, *flags))
        return procs[-1]

    yield start
    for proc in procs:
        proc.close()


def _ask_in_thread(url: str, stream: bool, failures: list[BaseException]) -> threading.Thread:
    def ask() -> None:
        try:
            with httpx.stream("POST", url + CHAT, json=chat_body(max_tokens=8, stream=stream),
                              timeout=WAIT_S) as response:
                response.read()
        except httpx.TransportError as exc:
            failures.append(exc)

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


@pytest.mark.e2e
def test_sigterm_during_a_hang_drops_the_held_requests_and_exits_zero_at_once(
        spawn: Callable[..., SimProcess]) -> None:
    sim = spawn("--instant", "--hang", "chat")
    sim.wait_healthy()
    failures: list[BaseException] = []
    threads = [_ask_in_thread(sim.url, stream, failures) for stream in (False, True)]
    wait_until(lambda: httpx.get(sim.url + "/sim/stats").json()["hanging"] == 2,
               what="two requests held")
    sim.proc.send_signal(signal.SIGTERM)
    # no wait for requests that cannot finish: the drain ends, the connections are dropped
    assert sim.wait_exit() == 0
    for thread in threads:
        thread.join(timeout=WAIT_S)
    assert len(failures) == 2  # each client saw its connection closed, no answer
    log = sim.log()
    for noise in ("Traceback", "Exception in ASGI application", "Cancel "):
        assert noise not in log


@pytest.mark.e2e
def test_a_stream_held_before_it_started_is_counted_out_when_its_client_leaves(
        spawn: Callable[..., SimProcess]) -> None:
    # Were it still counted in flight, SIGTERM's drain (the hang ended) would wait forever.
    sim = spawn("--instant", "--hang", "chat")
    sim.wait_healthy()

    async def leave() -> None:
        async with httpx.AsyncClient(base_url=sim.url, timeout=WAIT_S) as client:
            task = asyncio.create_task(client.post(CHAT, json=chat_body(stream=True)))
            await until_stats(client, lambda s: s["hanging"] == 1, "one held")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await until_stats(client, lambda s: s["hanging"] == 0, "none held")
            await misbehave(client, hang=None)

    asyncio.run(leave())
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.wait_exit() == 0
    assert "Traceback" not in sim.log()
