"""What a server says right now (fleetgen/readings.py): its /metrics gauges and its server info."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from fleetgen.readings import ServerReading, parse_metrics, read_server

METRICS_TWO_RANKS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="m"} 30.0
sglang:num_running_reqs{dp_rank="1",model_name="m"} 18.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="m"} 2.0
sglang:num_queue_reqs{dp_rank="1",model_name="m"} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",model_name="m"} 0.42
sglang:token_usage{dp_rank="1",model_name="m"} 0.81
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{dp_rank="0",model_name="m"} 1500.5
sglang:gen_throughput{dp_rank="1",model_name="m"} 1200.0
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{dp_rank="0",model_name="m"} 3.0
sglang:spec_accept_length{dp_rank="1",model_name="m"} 3.5
# TYPE sglang:generation_tokens counter
sglang:generation_tokens_total{model_name="m"} 12345.0
"""

SERVER_INFO = {"max_running_requests": 128, "dp_size": 1, "version": "0.5.9",
               "internal_states": [{"effective_max_running_requests_per_dp": 16,
                                    "avg_spec_accept_length": 2.71}]}



def test_metrics_of_several_schedulers_add_up_running_and_throughput_and_keep_the_worst_usage() -> None:
    assert parse_metrics(METRICS_TWO_RANKS) == {
        "running": 48.0, "queue": 2.0, "token_usage": 0.81, "gen_throughput": 2700.5,
        "accept_length": 3.25}


def read_with(handler: Any, api_key: str | None = None) -> ServerReading:
    async def go() -> ServerReading:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await read_server(client, "http://gpu0:30000", api_key)

    return asyncio.run(go())


def test_a_server_without_metrics_still_shows_its_capacity_from_server_info() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json=SERVER_INFO)

    reading = read_with(handler)
    assert (reading.state, reading.running, reading.effective_max, reading.requested_max) == (
        "up", None, 16, 128)
    assert (reading.accept_length, reading.version) == (2.71, "0.5.9")


def test_a_garbled_metrics_page_is_ignored_and_the_key_is_sent_for_server_info() -> None:
    keys_sent: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text="<html>proxy error</html>")
        keys_sent.append(request.headers.get("authorization"))
        return httpx.Response(200, json=SERVER_INFO)

    reading = read_with(handler, api_key="s3cret")
    assert (reading.state, reading.running, reading.effective_max) == ("up", None, 16)
    assert keys_sent == ["Bearer s3cret"]


def test_a_server_that_refuses_both_requests_is_down() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    assert read_with(handler) == ServerReading("down", error="connection refused")
