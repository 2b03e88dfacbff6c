"""The simulator under stress (launcher/sim/stress.py): refusals when full, a proxy's failures,
error windows that spare /health or not, the runtime switch, and what /sim/stats counts."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from launcher.sim.cli import main
from tests.sim_helpers import chat_body, running_sim

# Answers of ~10 s: requests stay running while the test asks for more.
SLOW = ("--decode-tps", "5", "--mean-output-tokens", "50", "--output-sigma", "0.01")


def test_a_full_server_refuses_with_429_and_retry_after_only_once_every_slot_is_taken() -> None:
    async def run(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            held = [asyncio.create_task(client.post("/v1/chat/completions",
                                                    json=chat_body(f"slow {i}")))
                    for i in range(2)]
            while (await client.get("/sim/stats")).json()["running"] < 2:
                await asyncio.sleep(0.05)
            refused = await client.post("/v1/chat/completions", json=chat_body("third"))
            for task in held:
                task.cancel()
            return [refused]

    with running_sim(*SLOW, "--max-running-requests", "2", "--overload", "429") as url:
        [refused] = asyncio.run(run(url))
        stats = httpx.get(f"{url}/sim/stats").json()
    assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
    assert refused.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    assert stats["refused"] == {"429": 1} and stats["peak_in_flight"] == 2
    assert stats["running_cap"] == 2 and stats["requests"] == 3


def test_a_failing_proxy_answers_its_html_page() -> None:
    with running_sim("--instant", "--fail-rate", "1", "--fail-status", "502") as url:
        response = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
    assert response.status_code == 502
    assert response.headers["content-type"].startswith("text/html")
    assert "<title>502 Bad Gateway</title>" in response.text


def test_a_chat_window_refuses_generation_while_health_stays_fine_until_cleared() -> None:
    with running_sim("--instant", "--error-window", "0:600:503") as url:
        refused = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
        health = httpx.get(f"{url}/health")
        cleared = httpx.post(f"{url}/sim/misbehave", json={"clear": True})
        answered = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
        stats = httpx.get(f"{url}/sim/stats").json()
    assert refused.status_code == 503 and refused.json()["message"] == "The request queue is full."
    assert health.status_code == 200
    assert cleared.status_code == 200 and cleared.json()["windows"] == []
    assert answered.status_code == 200
    assert (stats["requests"], stats["answered"], stats["refused"]) == (2, 1, {"503": 1})


def test_a_window_of_every_route_started_at_runtime_fails_health_too() -> None:
    with running_sim("--instant") as url:
        started = httpx.post(f"{url}/sim/misbehave",
                             json={"status": 502, "seconds": 600, "scope": "all"})
        health = httpx.get(f"{url}/health")
        chat = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
        bad = httpx.post(f"{url}/sim/misbehave", json={"status": 200})
    assert started.json()["windows"][0]["active"] is True
    assert (health.status_code, chat.status_code) == (502, 502)
    assert bad.status_code == 400 and "4xx or 5xx" in bad.json()["error"]


def test_the_failure_rate_can_change_while_the_server_runs() -> None:
    with running_sim("--instant") as url:
        httpx.post(f"{url}/sim/misbehave", json={"fail_rate": 1, "fail_status": 504})
        failing = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
        httpx.post(f"{url}/sim/misbehave", json={"fail_rate": 0})
        fine = httpx.post(f"{url}/v1/chat/completions", json=chat_body())
    assert (failing.status_code, fine.status_code) == (504, 200)


def test_stats_count_every_other_get_by_path_404s_included() -> None:
    with running_sim("--instant", "--flavor", "strict") as url:
        for _ in range(3):
            httpx.get(f"{url}/server_info")
        httpx.get(f"{url}/health")
        stats = httpx.get(f"{url}/sim/stats").json()
    assert stats["probes"]["/server_info"] == 3 and stats["probes"]["/health"] >= 1
    assert "/sim/stats" not in stats["probes"]


@pytest.mark.parametrize("window", ["5:10", "x:10:503", "0:10:200", "0:10:503:proxy", "0:0:503"])
def test_a_bad_error_window_exits_2(window: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--error-window", window]) == 2
    assert "error window" in capsys.readouterr().err.replace("-", " ")
