"""The router in front of simulators (launcher/sim/router.py): one endpoint that is a server
of servers, spreading requests by what it has in flight, failing a dead backend's requests
until its health check says so, and showing nothing of its backends' capacity."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetgen.ports import free_port
from launcher.child import ChildProcess
from launcher.sim.router import RouterConfig, main, serve_in_thread
from tests.sim_helpers import (
    REPO,
    WAIT_S,
    SimProcess,
    chat_body,
    metric,
    running_sim,
    wait_until,
)

CHAT = "/v1/chat/completions"
# 20 tokens/s: a request of LONG tokens stays in flight for the whole test; one of SHORT is
# answered at once.
SLOW = ("--decode-tps", "20")
LONG: dict[str, Any] = {"max_tokens": 400, "ignore_eos": True}
SHORT: dict[str, Any] = {"max_tokens": 1}


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., SimProcess]]:
    procs: list[SimProcess] = []

    def start(*flags: str) -> SimProcess:
        procs.append(SimProcess(tmp_path, *flags))
        return procs[-1]

    yield start
    for proc in procs:
        proc.close()


def router(*backends: str, **settings: Any) -> contextlib.AbstractContextManager[str]:
    """An in-thread router on a free port in front of `backends`."""
    return serve_in_thread(RouterConfig(backends=backends, port=0, **settings))


async def until(check: Callable[[], Awaitable[Any]], what: str) -> Any:
    """The first truthy value of `check`, polled; fail after WAIT_S seconds."""
    deadline = time.monotonic() + WAIT_S
    while not (value := await check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return value


async def backends(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    """/router/stats' line per backend."""
    stats: list[dict[str, Any]] = (await client.get("/router/stats")).json()["backends"]
    return stats


def settled(url: str) -> dict[str, Any]:
    """/router/stats once nothing is in flight: a client may read its answer before the
    router has counted it."""
    def idle() -> dict[str, Any] | None:
        stats: dict[str, Any] = httpx.get(url + "/router/stats").json()
        return stats if not any(column(stats["backends"], "in_flight")) else None

    return wait_until(idle, what="nothing in flight")


def column(stats: list[dict[str, Any]], name: str) -> list[Any]:
    return [backend[name] for backend in stats]


def test_concurrent_requests_are_split_by_requests_in_flight_not_by_backend_capacity() -> None:
    async def scenario(url: str, small: str, big: str) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
            requests = [asyncio.create_task(client.post(CHAT, json=chat_body(**LONG)))
                        for _ in range(12)]

            async def all_in_flight() -> list[dict[str, Any]] | None:
                stats = await backends(client)
                return stats if sum(column(stats, "in_flight")) == 12 else None

            held = await until(all_in_flight, "12 requests in flight")

            async def small_admitted() -> str | None:
                text = (await client.get(small + "/metrics")).text
                return text if metric(text, "sglang:num_running_reqs") == 2 else None

            small_metrics = await until(small_admitted, "the small backend's 2 running")
            for request in requests:
                request.cancel()
            await asyncio.gather(*requests, return_exceptions=True)

            async def all_cancelled() -> list[dict[str, Any]] | None:
                stats = await backends(client)
                return stats if sum(column(stats, "cancelled")) == 12 else None

            left = await until(all_cancelled, "the router to see its clients leave")

            await until(lambda: _running(client, small, 0), "the small backend to drop them")
            await until(lambda: _running(client, big, 0), "the big backend to drop them")
        return {"held": held, "small": small_metrics, "left": left}

    with running_sim(*SLOW, "--max-running-requests", "2") as small, \
            running_sim(*SLOW, "--max-running-requests", "8") as big, \
            router(small, big) as url:
        seen = asyncio.run(scenario(url, small, big))
    # six each, though one backend runs two at a time and queues the rest
    assert column(seen["held"], "in_flight") == [6, 6]
    assert column(seen["held"], "sent") == [6, 6]
    assert metric(seen["small"], "sglang:num_queue_reqs") == 4
    assert column(seen["left"], "peak_in_flight") == [6, 6]
    assert column(seen["left"], "cancelled") == [6, 6]
    assert column(seen["left"], "in_flight") == [0, 0]
    assert column(seen["left"], "answered") == [0, 0]


def test_one_request_at_a_time_goes_to_the_first_backend_and_round_robin_alternates() -> None:
    with running_sim("--instant") as first, running_sim("--instant") as second:
        with router(first, second) as url:
            for _ in range(4):
                assert httpx.post(url + CHAT, json=chat_body(**SHORT)).status_code == 200
            generated = httpx.post(url + "/generate", json={"text": "hi"})
            least = settled(url)
        with router(first, second, policy="round-robin") as url:
            for _ in range(4):
                assert httpx.post(url + CHAT, json=chat_body(**SHORT)).status_code == 200
            turns = settled(url)
    assert generated.status_code == 200 and "text" in generated.json()
    assert (least["policy"], column(least["backends"], "sent")) == ("least-in-flight", [5, 0])
    assert column(least["backends"], "answered") == [5, 0]
    assert (turns["policy"], column(turns["backends"], "sent")) == ("round-robin", [2, 2])


def test_a_backend_that_refuses_connections_fails_its_requests_with_502() -> None:
    with running_sim("--instant") as alive, contextlib.ExitStack() as doomed_sim:
        doomed = doomed_sim.enter_context(running_sim("--instant"))
        with router(doomed, alive, health_interval=3600) as url:
            served = httpx.post(url + CHAT, json=chat_body(**SHORT))
            doomed_sim.close()
            # no health round runs again: the router still counts the backend alive
            refused = httpx.post(url + CHAT, json=chat_body(**SHORT))
            stats = settled(url)["backends"]
    assert served.status_code == 200
    assert refused.status_code == 502
    assert refused.headers["content-type"] == "application/json"
    error = refused.json()["error"]
    assert error["type"] == "bad_gateway"
    assert error["message"].startswith(f"backend {doomed} unreachable: ")
    assert column(stats, "alive") == [True, True]
    assert (column(stats, "answered"), column(stats, "failed")) == ([1, 0], [1, 0])


@pytest.mark.e2e  # kills simulator processes
def test_a_killed_backend_fails_its_requests_until_marked_dead_then_503_when_none_is_left(
        spawn: Callable[..., SimProcess]) -> None:
    async def scenario(url: str, first: SimProcess, second: SimProcess) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
            long = [asyncio.create_task(client.post(CHAT, json=chat_body(**LONG)))
                    for _ in range(4)]
            await until(lambda: _in_flight(client, [2, 2]), "two requests on each")
            second.close()  # SIGKILL
            await until(lambda: _done(long, 2), "the killed backend's requests answered")
            broken = [task.result() for task in long if task.done()]
            survivors = [task for task in long if not task.done()]
            dead = await until(lambda: _stats_if(client, lambda s: not s[1]["alive"]),
                               "the health checker to mark the killed backend dead")
            after = [await client.post(CHAT, json=chat_body(**SHORT)) for _ in range(3)]
            moved = await until(lambda: _stats_if(client, lambda s: s[0]["in_flight"] == 2),
                                "the short requests counted")
            first.close()
            orphans = await asyncio.gather(*survivors)
            await until(lambda: _status(client, "/health", 503), "/health 503")
            last = await client.post(CHAT, json=chat_body(**SHORT))
            models = await client.get("/v1/models")
            health = await client.get("/health")
        return {"broken": broken, "dead": dead, "after": after, "moved": moved,
                "orphans": orphans, "last": last, "models": models, "health": health}

    first, second = spawn(*SLOW), spawn(*SLOW)
    first.wait_healthy()
    second.wait_healthy()
    with router(first.url, second.url) as url:
        seen = asyncio.run(scenario(url, first, second))
    for reply in (*seen["broken"], *seen["orphans"]):
        assert reply.status_code == 502
        assert reply.json()["error"]["type"] == "bad_gateway"
    assert all(f"backend {second.url} unreachable" in r.json()["error"]["message"]
               for r in seen["broken"])
    # marked dead, it gets nothing new: the three short requests all went to the live one
    assert [r.status_code for r in seen["after"]] == [200, 200, 200]
    assert column(seen["moved"], "sent")[1] == column(seen["dead"], "sent")[1]
    assert column(seen["moved"], "sent")[0] == column(seen["dead"], "sent")[0] + 3
    assert column(seen["moved"], "answered")[0] == 3
    assert column(seen["moved"], "failed")[1] == 2
    for reply in (seen["last"], seen["models"], seen["health"]):
        assert (reply.status_code, reply.text) == (503, "no healthy upstream")
    assert seen["last"].headers["content-type"] == "text/plain"


def test_a_backend_down_at_start_is_dead_until_its_health_answers() -> None:
    port = free_port()
    down = f"http://127.0.0.1:{port}"
    with router(down, health_interval=0.1) as url:
        refused = httpx.post(url + CHAT, json=chat_body(**SHORT))
        health = httpx.get(url + "/health")
        stats = httpx.get(url + "/router/stats").json()["backends"]
        with running_sim("--instant", "--port", str(port)):
            wait_until(lambda: httpx.get(url + "/health").status_code == 200,
                       what="the router to see its backend alive")
            answered = httpx.post(url + CHAT, json=chat_body(**SHORT))
    assert (refused.status_code, refused.text) == (503, "no healthy upstream")
    assert (health.status_code, health.text) == (503, "no healthy upstream")
    assert column(stats, "alive") == [False]
    assert answered.status_code == 200


def test_a_plain_router_shows_nothing_of_its_backends_an_sglang_router_their_number() -> None:
    with running_sim("--instant") as first, running_sim("--instant") as second:
        models = httpx.get(first + "/v1/models").json()
        with router(first, second) as url:
            plain = {path: httpx.get(url + path) for path in
                     ("/metrics", "/server_info", "/get_server_info", "/v1/models")}
        with router(first, second, flavor="sglang-router") as url:
            sglang = {path: httpx.get(url + path) for path in
                      ("/metrics", "/server_info", "/get_server_info")}
    assert [plain[path].status_code for path in ("/metrics", "/server_info",
                                                 "/get_server_info")] == [404, 404, 404]
    assert [m["id"] for m in plain["/v1/models"].json()["data"]] == [m["id"] for m in models["data"]]
    assert sglang["/metrics"].status_code == 404
    for path in ("/server_info", "/get_server_info"):
        assert sglang[path].status_code == 200
        assert sglang[path].json() == {"router_manager": True, "routers_count": 1,
                                       "workers_count": 2, "default_router": "http-regular"}


def test_a_backends_refusals_and_rate_limit_headers_pass_through_unchanged() -> None:
    async def refused(url: str, sim: str) -> tuple[httpx.Response, list[dict[str, Any]]]:
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
            busy = asyncio.create_task(client.post(CHAT, json=chat_body(**LONG)))
            await until(lambda: _in_flight(client, [1]), "the one slot taken")
            reply = await client.post(CHAT, json=chat_body(**SHORT))
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
            await until(lambda: _running(client, sim, 0), "the backend to drop the request")
            return reply, await until(lambda: _stats_if(client, lambda s: not s[0]["in_flight"]),
                                      "nothing in flight")

    with running_sim(*SLOW, "--max-running-requests", "1", "--overload", "429",
                     "--retry-after", "3") as full, router(full) as url:
        reply, stats = asyncio.run(refused(url, full))
    assert reply.status_code == 429
    assert reply.headers["retry-after"] == "3"
    assert reply.headers["content-type"] == "application/json"
    assert column(stats, "failed") == [1]

    with running_sim("--instant", "--rpm", "100") as budgeted:
        direct = httpx.post(budgeted + CHAT, json=chat_body(**SHORT))
        with router(budgeted) as url:
            routed = httpx.post(url + CHAT, json=chat_body(**SHORT))
    limits = {name for name in direct.headers if name.startswith("x-ratelimit-")}
    assert limits and limits <= set(routed.headers)
    assert routed.headers["x-ratelimit-limit-requests"] == "100"
    assert routed.headers["server"] == direct.headers["server"]  # the backend's, not the router's


def test_a_streamed_answer_is_relayed_as_it_comes() -> None:
    with running_sim("--instant") as sim, router(sim) as url, \
            httpx.stream("POST", url + CHAT, json=chat_body(stream=True, max_tokens=3)) as reply:
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
        media = reply.headers["content-type"]
    assert media.startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_bad_flags_exit_2_with_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["--backend", "http://127.0.0.1:1", "--policy", "random"]) == 2
    assert main(["--backend", "127.0.0.1:1"]) == 2
    assert "usage: python -m launcher.sim.router" in capsys.readouterr().err


@pytest.mark.e2e  # starts the router as a process
def test_the_router_process_announces_its_port_and_stops_cleanly_on_sigterm(
        tmp_path: Path) -> None:
    with running_sim("--instant") as sim:
        log_path = tmp_path / "router.log"
        child = ChildProcess([sys.executable, "-m", "launcher.sim.router", "--port", "0",
                              "--backend", sim], log_path, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                             cwd=REPO)
        try:
            line = wait_until(lambda: re.search(r"Uvicorn running on (http://\S+)",
                                                log_path.read_text()), what="the ready line")
            url = line.group(1)
            health = httpx.get(url + "/health")
            answer = httpx.post(url + CHAT, json=chat_body(**SHORT))
            child.terminate()
            code = child.popen.wait(timeout=WAIT_S)
        finally:
            child.kill_group()
    log = log_path.read_text()
    assert (health.status_code, answer.status_code, code) == (200, 200, 0)
    assert f"backend {sim}: alive" in log
    assert "Traceback" not in log


async def _stats_if(client: httpx.AsyncClient,
                    check: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]] | None:
    stats = await backends(client)
    return stats if check(stats) else None


async def _in_flight(client: httpx.AsyncClient, expected: list[int]) -> bool:
    return column(await backends(client), "in_flight") == expected


async def _done(tasks: list[asyncio.Task[httpx.Response]], count: int) -> bool:
    return sum(task.done() for task in tasks) == count


async def _running(client: httpx.AsyncClient, sim: str, count: int) -> bool:
    """Whether the simulator at `sim` runs `count` requests and queues none."""
    text = (await client.get(sim + "/metrics")).text
    return (metric(text, "sglang:num_running_reqs"), metric(text, "sglang:num_queue_reqs")) \
        == (count, 0)


async def _status(client: httpx.AsyncClient, path: str, status: int) -> bool:
    return (await client.get(path)).status_code == status
