"""The simulator misbehaves like a server under stress (launcher/sim/stress.py): refusals when
full, a proxy's failures, error windows that spare /health or not, the runtime switch, and
what /sim/stats counts. Checked by real HTTP against in-thread servers, beside a fast layer
for the window clock and the answers' shapes."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from launcher.sim import ConfigError, SimConfig
from launcher.sim.cli import main
from launcher.sim.protocol import RequestError
from launcher.sim.ratelimit import RequestBudget, duration
from launcher.sim.stress import Stress, Window, WindowError, refusal
from tests.sim_helpers import TLS, WAIT_S, chat_body, running_sim

# Answers of ~10 s: requests stay running while the test asks for more.
SLOW = ("--decode-tps", "5", "--mean-output-tokens", "50", "--output-sigma", "0.01")
OVERLOADED = {"error": "Model is overloaded", "error_type": "overloaded"}
QUEUE_FULL = {"object": "error", "message": "The request queue is full.", "type": "503",
              "param": None, "code": 503}


async def until_in_flight(client: httpx.AsyncClient, n: int) -> dict[str, Any]:
    """/sim/stats once `n` generation requests are running or waiting."""
    deadline = time.monotonic() + WAIT_S
    while True:
        stats: dict[str, Any] = (await client.get("/sim/stats")).json()
        if stats["running"] + stats["waiting"] == n:
            return stats
        assert time.monotonic() < deadline, f"never {n} in flight: {stats}"
        await asyncio.sleep(0.02)


async def fill_then_ask(url: str, held: int) -> dict[str, Any]:
    """Hold `held` slow requests, ask once more by chat and by /generate, free the server and
    ask again: every answer, and /sim/stats before and after."""
    async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
        holding = [asyncio.create_task(client.post("/v1/chat/completions",
                                                   json=chat_body(f"slow {i}")))
                   for i in range(held)]
        full = await until_in_flight(client, held)
        chat = await client.post("/v1/chat/completions", json=chat_body("one more"))
        generate = await client.post("/generate", json={"text": "one more"})
        after_refusals = (await client.get("/sim/stats")).json()
        await client.post("/abort_request", json={"abort_all": True})
        freed = await asyncio.gather(*holding)
        again = await client.post("/v1/chat/completions",
                                  json=chat_body("once freed", max_tokens=1))
        stats = (await client.get("/sim/stats")).json()
    return {"full": full, "chat": chat, "generate": generate, "after": after_refusals,
            "freed": freed, "again": again, "stats": stats}


@pytest.mark.parametrize(("flags", "held", "status", "retry_after"), [
    (("--overload", "429"), 2, 429, "5"),
    (("--overload", "429", "--retry-after", "0"), 2, 429, None),
    (("--overload", "429", "--max-queued-requests", "1", "--retry-after", "7"), 3, 429, "7"),
    (("--overload", "503"), 2, 503, None),
], ids=["429", "429-no-retry-after", "429-queue-of-1", "503"])
def test_a_full_server_refuses_at_once_only_while_every_slot_and_queue_place_is_taken(
        flags: tuple[str, ...], held: int, status: int, retry_after: str | None) -> None:
    with running_sim(*SLOW, "--max-running-requests", "2", *flags) as url:
        seen = asyncio.run(fill_then_ask(url, held))
    chat, generate = seen["chat"], seen["generate"]
    assert (chat.status_code, generate.status_code) == (status, status)
    assert chat.headers.get("retry-after") == retry_after
    assert chat.json() == generate.json() == (OVERLOADED if status == 429 else QUEUE_FULL)
    # the refused requests never reached the scheduler
    assert (seen["after"]["running"], seen["after"]["waiting"]) == (2, held - 2)
    assert [r.status_code for r in seen["freed"]] == [200] * held
    assert seen["again"].status_code == 200
    stats = seen["stats"]
    assert (stats["requests"], stats["answered"]) == (held + 3, held + 1)
    assert stats["refused"] == {str(status): 2}
    assert (stats["peak_in_flight"], stats["running_cap"]) == (held, 2)


def test_by_default_a_full_server_queues_the_request_as_sglang_does() -> None:
    async def ask(url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
            holding = [asyncio.create_task(client.post("/v1/chat/completions",
                                                       json=chat_body(f"slow {i}")))
                       for i in range(3)]
            stats = await until_in_flight(client, 3)
            await client.post("/abort_request", json={"abort_all": True})
            assert [r.status_code for r in await asyncio.gather(*holding)] == [200] * 3
            return stats

    with running_sim(*SLOW, "--max-running-requests", "2") as url:
        stats = asyncio.run(ask(url))
    assert (stats["running"], stats["waiting"], stats["refused"]) == (2, 1, {})
    assert stats["peak_in_flight"] == 3


@pytest.mark.parametrize("status", [502, 504])
def test_a_failing_proxy_answers_nginx_html_on_every_generation_route(status: int) -> None:
    with running_sim("--instant", "--fail-rate", "1", "--fail-status", str(status)) as url:
        chat = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), verify=TLS)
        generate = httpx.post(f"{url}/generate", json={"text": "hi"}, verify=TLS)
    for response in (chat, generate):
        assert response.status_code == status
        assert response.headers["content-type"].startswith("text/html")
        assert response.text.startswith(f"<html>\r\n<head><title>{status} ")
        assert "<center>nginx</center>" in response.text


def test_the_default_failure_is_sglangs_internal_server_error() -> None:
    with running_sim("--instant", "--fail-rate", "1") as url:
        chat = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), verify=TLS)
        generate = httpx.post(f"{url}/generate", json={"text": "hi"}, verify=TLS)
    assert chat.status_code == 500 and chat.json() == {
        "object": "error", "message": "Internal server error: simulated failure (--fail-rate)",
        "type": "InternalServerError", "param": None, "code": 500}
    assert generate.status_code == 500 and generate.text == "Internal Server Error"


def test_a_chat_window_refuses_generation_while_health_and_info_stay_fine() -> None:
    with running_sim("--instant", "--error-window", "0:600:503",
                     "--error-window", "600:10:429") as url:
        chat = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), verify=TLS)
        generate = httpx.post(f"{url}/generate", json={"text": "hi"}, verify=TLS)
        health = httpx.get(f"{url}/health", verify=TLS)
        models = httpx.get(f"{url}/v1/models", verify=TLS)
        stats = httpx.get(f"{url}/sim/stats", verify=TLS).json()
    assert (chat.status_code, generate.status_code) == (503, 503)
    assert chat.json() == generate.json() == QUEUE_FULL
    assert (health.status_code, models.status_code) == (200, 200)
    assert [w["active"] for w in stats["windows"]] == [True, False]
    assert (stats["requests"], stats["answered"], stats["refused"]) == (2, 0, {"503": 2})


@pytest.mark.parametrize(("status", "check"), [
    (429, lambda r: r.json() == OVERLOADED and r.headers["retry-after"] == "3"),
    (502, lambda r: "<title>502 Bad Gateway</title>" in r.text),
    (529, lambda r: r.json() == {"type": "error", "error": {"type": "overloaded_error",
                                                            "message": "Overloaded"}}),
    (418, lambda r: r.json() == {"object": "error", "message":
                                 "simulated failure (--error-window)", "type": "418",
                                 "param": None, "code": 418}),
])
def test_a_window_answers_each_status_in_its_senders_shape(
        status: int, check: Callable[[httpx.Response], bool]) -> None:
    with running_sim("--instant", "--retry-after", "3",
                     "--error-window", f"0:600:{status}") as url:
        chat = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), verify=TLS)
    assert chat.status_code == status and check(chat)


def test_a_window_of_every_route_fails_health_too_until_cleared() -> None:
    with running_sim("--instant", "--error-window", "0:600:502:all") as url:
        health = httpx.get(f"{url}/health", verify=TLS)
        models = httpx.get(f"{url}/v1/models", verify=TLS)
        chat = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), verify=TLS)
        stats = httpx.get(f"{url}/sim/stats", verify=TLS)
        cleared = httpx.post(f"{url}/sim/misbehave", json={"clear": True}, verify=TLS)
        health_after = httpx.get(f"{url}/health", verify=TLS)
        chat_after = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), verify=TLS)
    assert (health.status_code, models.status_code, chat.status_code) == (502, 502, 502)
    assert health.headers["content-type"].startswith("text/html")
    # the simulator's own routes are never refused: a window of every route can be ended
    assert stats.status_code == 200 and stats.json()["windows"][0]["scope"] == "all"
    assert cleared.status_code == 200 and cleared.json()["windows"] == []
    assert (health_after.status_code, chat_after.status_code) == (200, 200)


def test_misbehaviour_is_switched_on_and_off_while_the_server_runs() -> None:
    with running_sim("--instant") as url:
        def misbehave(**what: Any) -> dict[str, Any]:
            response = httpx.post(f"{url}/sim/misbehave", json=what, verify=TLS)
            assert response.status_code == 200, response.text
            state: dict[str, Any] = response.json()
            return state

        started = misbehave(status=503, seconds=45, scope="chat")
        in_window = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), verify=TLS)
        health = httpx.get(f"{url}/health", verify=TLS)
        failing = misbehave(clear=True, fail_rate=1, fail_status=502)
        failed = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), verify=TLS)
        cleared = misbehave(clear=True)
        fine = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), verify=TLS)
    [window] = started["windows"]
    assert window["status"] == 503 and window["seconds"] == 45 and window["active"]
    assert (in_window.status_code, health.status_code) == (503, 200)
    assert (failing["fail_rate"], failing["fail_status"], failing["windows"]) == (1, 502, [])
    assert failed.status_code == 502
    assert (cleared["fail_rate"], cleared["windows"]) == (0, [])
    assert fine.status_code == 200


@pytest.mark.parametrize(("body", "words"), [
    ({"status": 200, "seconds": 5}, "4xx or 5xx"),
    ({"status": 503}, "seconds"),
    ({"status": 503, "seconds": 5, "scope": "proxy"}, "scope"),
    ({"seconds": 5}, "status"),
    ({"fail_rate": 2}, "[0, 1]"),
    ({"fail_rate": 0.5, "fail_status": 200}, "4xx or 5xx"),
    ({"fail_rate": "often"}, "number"),
    ({"fail_rte": 0.5}, "JSON object"),
    ([503], "JSON object"),
    ({"hang": "forever"}, "hang"),
    ({"wording": "bard"}, "wording"),
    ({"error_request_ids": "yes"}, "true or false"),
    ({"poison": "MARKER"}, "list of markers"),
    ({"poison": [""]}, "list of markers"),
    ({"rpm": 0}, "rpm"),
    ({"rpm": True}, "rpm"),
    ({"clear": True, "rpm": 1.5}, "rpm"),
])
def test_a_misbehaviour_that_makes_no_sense_is_a_400_and_changes_nothing(
        body: Any, words: str) -> None:
    with running_sim("--instant") as url:
        before = httpx.get(f"{url}/sim/stats", verify=TLS).json()
        refused = httpx.post(f"{url}/sim/misbehave", content=orjson.dumps(body), verify=TLS)
        after = httpx.get(f"{url}/sim/stats", verify=TLS).json()
    assert refused.status_code == 400 and words in refused.json()["error"]
    assert {k: v for k, v in after.items() if k not in ("elapsed_s", "probes")} == {
        k: v for k, v in before.items() if k not in ("elapsed_s", "probes")}


@pytest.mark.parametrize("flavor", ["sglang", "vllm", "strict"])
def test_the_own_routes_exist_in_every_flavour_behind_the_api_key(flavor: str) -> None:
    key = {"Authorization": "Bearer k"}
    with running_sim("--instant", "--flavor", flavor, "--api-key", "k") as url:
        answers = [httpx.get(f"{url}/sim/stats", verify=TLS),
                   httpx.post(f"{url}/sim/misbehave", json={}, verify=TLS),
                   httpx.get(f"{url}/sim/stats", headers=key, verify=TLS),
                   httpx.post(f"{url}/sim/misbehave", json={"fail_rate": 0.5}, headers=key,
                              verify=TLS)]
    assert [r.status_code for r in answers] == [401, 401, 200, 200]
    assert answers[3].json()["fail_rate"] == 0.5


def test_stats_count_generation_answers_and_every_other_get_by_path_404s_included() -> None:
    with running_sim("--instant", "--flavor", "strict", "--fail-prompt", "TOO LONG") as url:
        fresh = httpx.get(f"{url}/sim/stats", verify=TLS).json()
        for path in ("/server_info", "/server_info", "/server_info", "/get_server_info",
                     "/metrics", "/health", "/v1/models"):
            httpx.get(url + path, verify=TLS)
        httpx.post(f"{url}/abort_request", json={"abort_all": True}, verify=TLS)
        # no `model`: a strict server refuses any name but its own
        long = httpx.post(f"{url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "TOO LONG"}]}, verify=TLS)
        fine = httpx.post(f"{url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "Hello"}]}, verify=TLS)
        stats = httpx.get(f"{url}/sim/stats", verify=TLS).json()
    assert (fresh["requests"], fresh["peak_in_flight"], fresh["probes"]) == (0, 0, {})
    assert (long.status_code, fine.status_code) == (400, 200)
    assert (stats["requests"], stats["answered"], stats["refused"]) == (2, 1, {"400": 1})
    assert stats["probes"] == {"/get_server_info": 1, "/health": 1, "/metrics": 1,
                               "/server_info": 3, "/v1/models": 1}
    assert (stats["running"], stats["waiting"], stats["peak_in_flight"]) == (0, 0, 1)
    assert stats["running_cap"] > 0


def test_the_warmup_and_routes_a_flavour_lacks_are_no_generation_requests() -> None:
    with running_sim("--instant", "--flavor", "vllm") as url:
        generate = httpx.post(f"{url}/generate", json={"text": "hi"}, verify=TLS)
        stats = httpx.get(f"{url}/sim/stats", verify=TLS).json()
    with running_sim("--instant") as url:
        warmed = httpx.get(f"{url}/sim/stats", verify=TLS).json()
    assert generate.status_code == 404
    assert (stats["requests"], stats["refused"], stats["probes"]) == (0, {}, {})
    assert (warmed["requests"], warmed["peak_in_flight"]) == (0, 0)


REQUEST_ID = re.compile(r" \(request id req_[0-9a-f]{13}\)$")


def test_every_json_error_message_ends_with_a_request_id_of_its_own() -> None:
    with running_sim("--instant", "--error-request-ids") as url:
        empty = [httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, verify=TLS)
                 for _ in range(2)]
        generate = httpx.post(f"{url}/generate", json={}, verify=TLS)
        missing = httpx.get(f"{url}/nope", verify=TLS)
        fine = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=1), verify=TLS)
        httpx.post(f"{url}/sim/misbehave", json={"status": 503, "seconds": 60}, verify=TLS)
        window = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), verify=TLS)
        httpx.post(f"{url}/sim/misbehave", json={"clear": True, "status": 502, "seconds": 60},
                   verify=TLS)
        proxy = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), verify=TLS)
        httpx.post(f"{url}/sim/misbehave", json={"clear": True}, verify=TLS)
        plain = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, verify=TLS)
    messages = [empty[0].json()["message"], empty[1].json()["message"],
                generate.json()["error"]["message"], missing.json()["detail"],
                window.json()["message"]]
    assert all(REQUEST_ID.search(m) for m in messages), messages
    assert messages[0].startswith("Messages cannot be empty. (request id req_")
    assert messages[0] != messages[1]  # a new id for each request
    for response in (*empty, generate, missing, window):
        assert int(response.headers["content-length"]) == len(response.content)
    assert fine.status_code == 200 and "request id" not in fine.text
    assert proxy.status_code == 502 and "request id" not in proxy.text  # HTML, not JSON
    assert plain.json()["message"] == "Messages cannot be empty."


def test_the_request_id_goes_where_each_flavour_puts_its_message() -> None:
    with running_sim("--instant", "--flavor", "vllm") as url:
        httpx.post(f"{url}/sim/misbehave", json={"error_request_ids": True}, verify=TLS)
        unknown = httpx.post(f"{url}/v1/chat/completions", json=chat_body(),
                             verify=TLS)  # model "m"
    message = unknown.json()["error"]["message"]
    assert unknown.status_code == 404
    assert message.startswith("The model `m` does not exist. (request id req_")
    assert REQUEST_ID.search(message)


@pytest.mark.parametrize(("flavor", "body"), [
    ("sglang", b'{"object":"error","message":"Internal server error: simulated failure '
               b'(--poison)","type":"InternalServerError","param":null,"code":500}'),
    ("vllm", b'{"error":{"message":"Internal server error: simulated failure (--poison)",'
             b'"type":"Internal Server Error","param":null,"code":500}}'),
    ("strict", b"Internal Server Error"),
])
def test_a_poison_prompt_is_answered_500_every_time_while_the_others_are_served(
        flavor: str, body: bytes) -> None:
    def ask(url: str, text: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": text}]}, verify=TLS)

    with running_sim("--instant", "--flavor", flavor, "--poison", "BAD MARKER") as url:
        poisoned = [ask(url, "some BAD MARKER here") for _ in range(3)]
        fine = ask(url, "Hello there")
        stats = httpx.get(f"{url}/sim/stats", verify=TLS).json()
        httpx.post(f"{url}/sim/misbehave", json={"poison": ["OTHER"]}, verify=TLS)
        now_fine = ask(url, "some BAD MARKER here")
        now_poisoned = ask(url, "an OTHER one")
    assert [(r.status_code, r.content) for r in poisoned] == [(500, body)] * 3
    assert fine.status_code == 200
    assert (stats["poisoned"], stats["refused"], stats["poison"]) == (3, {"500": 3},
                                                                      ["BAD MARKER"])
    assert (now_fine.status_code, now_poisoned.status_code) == (200, 500)


DURATION = re.compile(r"^(\d+m)?\d+(\.\d+)?s$|^\d+ms$")


def test_the_budget_allows_n_requests_a_minute_with_openais_headers_then_a_429() -> None:
    with running_sim("--instant", "--rpm", "2") as url:
        first = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=1), verify=TLS)
        second = httpx.post(f"{url}/generate", json={"text": "hi"}, verify=TLS)
        third = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=1), verify=TLS)
        health = httpx.get(f"{url}/health", verify=TLS)
        stats = httpx.get(f"{url}/sim/stats", verify=TLS).json()
        httpx.post(f"{url}/sim/misbehave", json={"rpm": None}, verify=TLS)
        unlimited = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=1),
                               verify=TLS)
        httpx.post(f"{url}/sim/misbehave", json={"rpm": 5}, verify=TLS)
        renewed = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=1), verify=TLS)
    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429)
    for response, remaining in ((first, "1"), (second, "0"), (third, "0"), (renewed, "4")):
        assert response.headers["x-ratelimit-limit-requests"] in ("2", "5")
        assert response.headers["x-ratelimit-remaining-requests"] == remaining
        assert DURATION.match(response.headers["x-ratelimit-reset-requests"])
    wait = third.headers["x-ratelimit-reset-requests"]
    assert 1 <= int(third.headers["retry-after"]) <= 60
    assert third.json() == {"error": {
        "message": "Rate limit reached for requests per min (RPM): Limit 2, Used 2, Requested "
                   f"1. Please try again in {wait}.",
        "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    assert "x-ratelimit-limit-requests" not in health.headers
    assert (stats["rpm"], stats["rpm_used"], stats["refused"]) == (2, 2, {"429": 1})
    assert unlimited.status_code == 200
    assert "x-ratelimit-limit-requests" not in unlimited.headers


def test_every_switch_shows_in_the_state_and_clear_turns_them_all_off() -> None:
    with running_sim("--instant", "--hang", "partial", "--wording", "tgi",
                     "--error-request-ids", "--poison", "X", "--poison", "Y",
                     "--rpm", "9") as url:
        given = httpx.get(f"{url}/sim/misbehave", verify=TLS).json()
        cleared = httpx.post(f"{url}/sim/misbehave", json={"clear": True}, verify=TLS).json()
        stats = httpx.get(f"{url}/sim/stats", verify=TLS).json()
    switches = ("hang", "wording", "error_request_ids", "poison", "rpm")
    assert [given[k] for k in switches] == ["partial", "tgi", True, ["X", "Y"], 9]
    assert [cleared[k] for k in switches] == [None, None, False, [], None]
    assert (stats["hung"], stats["hanging"], stats["poisoned"], stats["rpm_used"]) == (0, 0, 0, 0)


class Clock:
    """A hand-moved monotonic clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_windows_count_from_the_moment_the_server_is_ready() -> None:
    clock = Clock()
    stress = Stress((Window.parse("5:10:503"), Window.parse("20:5:502:all")), 0.0, 500, clock)
    clock.now += 300  # loading and warmup: no window yet, whatever their START
    assert stress.window_status(True) is None
    stress.mark_ready()
    ready = clock.now
    seen = []
    for elapsed in (4.9, 5.0, 14.9, 15.0, 20.0, 25.0):
        clock.now = ready + elapsed
        seen.append((stress.window_status(True), stress.window_status(False)))
    assert seen == [(None, None), (503, None), (503, None), (None, None), (502, 502),
                    (None, None)]


def test_a_runtime_window_starts_now_and_a_bad_body_changes_nothing() -> None:
    clock = Clock()
    stress = Stress((), 0.25, 500, clock)
    stress.mark_ready()
    clock.now += 60
    stress.misbehave({"status": 504, "seconds": 30, "scope": "all"})
    assert stress.windows == [Window(60.0, 30.0, 504, "all")]
    with pytest.raises(WindowError):
        stress.misbehave({"clear": True, "fail_status": 302})
    assert (len(stress.windows), stress.fail_rate, stress.fail_status) == (1, 0.25, 500)


def test_refusals_read_as_their_senders_write_them() -> None:
    assert refusal(429, "sglang").headers == {}
    assert refusal(529, "vllm").status == 529 and refusal(529, "sglang").headers == {}
    assert orjson.loads(refusal(529, "strict").body) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert refusal(429, "vllm", 9).headers == {"retry-after": "9"}
    assert orjson.loads(refusal(503, "strict").body) == QUEUE_FULL
    assert refusal(500, "strict").body == b"Internal Server Error"
    assert orjson.loads(refusal(500, "vllm").body)["error"]["type"] == "Internal Server Error"
    assert b"<title>504 Gateway Time-out</title>" in refusal(504, "sglang").body


def test_a_bad_switch_changes_no_other_switch_nor_clears_anything() -> None:
    stress = Stress((Window.parse("0:60:503"),), 0.5, 500, Clock(), hang="chat",
                    wording="tgi", error_request_ids=True, poison=("X",), rpm=3)
    before = stress.state()
    with pytest.raises(WindowError, match="rpm"):
        stress.misbehave({"clear": True, "hang": None, "rpm": 0})
    assert stress.state() == before
    stress.misbehave({"wording": None, "poison": ["Y", "Z"]})
    assert (stress.wording, stress.poison, stress.hang.mode) == (None, ("Y", "Z"), "chat")


def test_the_budget_frees_a_request_a_minute_after_it_was_taken() -> None:
    clock = Clock()
    budget = RequestBudget(2, clock)
    taken = [budget.take()]
    clock.now += 10
    taken.append(budget.take())
    clock.now += 5
    with pytest.raises(RequestError) as spent:
        budget.take()
    assert spent.value.status == 429
    assert spent.value.headers["retry-after"] == "45"
    assert spent.value.headers["x-ratelimit-reset-requests"] == "45s"
    assert b"Limit 2, Used 2, Requested 1. Please try again in 45s." in spent.value.body
    assert [dict(h)[b"x-ratelimit-remaining-requests"] for h in taken] == [b"1", b"0"]
    assert dict(taken[1])[b"x-ratelimit-reset-requests"] == b"50s"
    clock.now += 45  # the first request leaves the window
    assert dict(budget.take())[b"x-ratelimit-remaining-requests"] == b"0"
    assert budget.used() == 2
    budget.set_limit(1)  # a lower budget: the minute's requests still count
    with pytest.raises(RequestError, match="Limit 1, Used 2"):
        budget.take()


@pytest.mark.parametrize(("seconds", "text"), [
    (0.12, "120ms"), (0.0004, "0ms"), (1.5, "1.5s"), (59.9984, "59.998s"), (60, "1m0s"),
    (360, "6m0s"), (61.25, "1m1.25s"), (3600, "1h0m0s")])
def test_durations_read_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text


@pytest.mark.parametrize(("argv", "words"), [
    (["--error-window", "5:10"], "START:SECONDS:STATUS"),
    (["--error-window", "x:10:503"], "numbers"),
    (["--error-window", "0:10:200"], "4xx or 5xx"),
    (["--error-window", "0:10:503:proxy"], "scope"),
    (["--error-window", "0:0:503"], "more than 0 s"),
    (["--fail-status", "200"], "--fail-status"),
    (["--retry-after", "-1"], "--retry-after"),
    (["--max-queued-requests", "-1"], "--max-queued-requests"),
    (["--overload", "502"], "--overload"),
    (["--hang", "forever"], "--hang"),
    (["--wording", "bard"], "--wording"),
    (["--rpm", "0"], "--rpm"),
    (["--poison", ""], "--poison"),
])
def test_a_bad_stress_flag_exits_2_naming_it(argv: list[str], words: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_a_full_server_keeps_no_queue_unless_told_once_it_refuses() -> None:
    assert SimConfig().queued_cap is None
    assert SimConfig(overload="429").queued_cap == 0
    assert SimConfig(overload="503", max_queued_requests=4).queued_cap == 4
    with pytest.raises(ConfigError, match="--overload"):
        SimConfig(overload="sometimes")
