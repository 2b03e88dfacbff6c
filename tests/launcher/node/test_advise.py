"""`launcher advise`: what binds each GPU's server, and the flags to try, with a prediction.

The verdicts are computed from a GPU's node.json entry and the means of its /metrics samples;
tests/launcher/node/test_node.py runs the command against a live simulated node. `advise --url` reads any
SGLang server instead: here the simulator in a thread, loaded past its cap, and a plain HTTP
server that is not SGLang.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from launcher.cli import main
from launcher.node._advise import Observed, advise, relative_throughput
from launcher.node._commands import render_status
from launcher.node._rundir import NodeState, ServerEntry
from tests.sim_helpers import TLS, chat_body, gauge, running_sim, wait_until


def entry_json(binding: str, effective: int, requested: int | None, *,
               slots: int | None = None, argv: tuple[str, ...] = (),
               graph_bs: int | None = 256) -> dict[str, Any]:
    """GPU 0's node.json entry, as the file would have it."""
    return {"gpu": 0, "state": "ready", "argv": ["sglang", "serve", *argv],
            "capacity": {"effective": effective, "requested": requested, "binding": binding,
                         "mamba_slots": slots, "max_total_num_tokens": 500_000,
                         "cuda_graph_max_bs": graph_bs, "reason": "..."}}


def entry(binding: str, effective: int, requested: int | None, **more: Any) -> ServerEntry:
    return node_state([entry_json(binding, effective, requested, **more)]).gpus[0]


def node_state(gpus: list[dict[str, Any]]) -> NodeState:
    return NodeState.from_json(json.dumps({"supervisor_pid": 1, "supervisor_alive": True,
                                           "updated_at": 0.0, "gpus": gpus}))


def test_the_reference_run_is_told_to_raise_the_mamba_slots_and_memory() -> None:
    # The reference run: asked 128, ran 16 on 80 Mamba slots with the KV pool 7% used.
    advice = advise(entry("mamba", 16, 128, slots=80),
                    Observed(samples=10, running=16, queue=112, kv_usage=0.07, mamba_usage=1.0,
                             tokens_per_s=2300))
    assert advice.binding == "mamba"
    assert advice.flags == ("--max-mamba-cache-size", "200", "--mem-fraction-static", "0.93")
    assert advice.predicted_running == 40
    assert advice.predicted_tokens_per_s == pytest.approx(3435, rel=0.01)
    assert advice.gain == pytest.approx(0.49, abs=0.01)
    assert advice.line() == (
        "gpu0: bound by 80 Mamba slots at 16 running, KV 7% used, Mamba 100% used (80 of 80 "
        "slots), 112 queued: "
        "`--max-mamba-cache-size 200 --mem-fraction-static 0.93` → ~40 running, "
        "~3,436 tokens/s (+49% tokens/s)")


def test_a_full_kv_pool_limits_how_far_the_mamba_slots_are_raised() -> None:
    advice = advise(entry("mamba", 16, 128, slots=80, argv=("--mem-fraction-static", "0.95")),
                    Observed(samples=3, running=16, queue=50, kv_usage=0.5))
    assert advice.flags == ("--max-mamba-cache-size", "125")  # 25 running keeps KV under 80%
    assert advice.predicted_running == 25 and advice.predicted_tokens_per_s is None


def test_an_empty_queue_means_nothing_binds_and_no_flag_is_offered() -> None:
    advice = advise(entry("mamba", 16, 128, slots=80),
                    Observed(samples=5, running=3, queue=0, kv_usage=0.01))
    assert advice.binding == "idle" and advice.flags == ()
    assert advice.line().startswith("gpu0: nothing binds: the queue is empty (3 running of 16")


def test_a_kv_bound_server_is_told_to_raise_the_memory_fraction() -> None:
    advice = advise(entry("kv", 20, 64, argv=("--mem-fraction-static", "0.80")),
                    Observed(samples=2, running=20, queue=9))
    assert advice.flags == ("--mem-fraction-static", "0.85")


def test_a_request_bound_server_is_told_to_ask_for_more() -> None:
    advice = advise(entry("request", 16, 16), Observed(samples=2, running=16, queue=30,
                                                       kv_usage=0.2))
    assert advice.flags == ("--max-running-requests", "40")


def test_batches_above_the_largest_cuda_graph_are_named() -> None:
    advice = advise(entry("request", 64, 64, graph_bs=32),
                    Observed(samples=2, running=64, queue=5))
    assert advice.binding == "cuda-graph"
    assert advice.flags == ("--cuda-graph-max-bs-decode", "64")
    assert "%" not in advice.line()  # the step model cannot say what graphs save: no +0%


def test_graphs_smaller_than_the_cap_are_not_advised_while_fewer_run() -> None:
    # The quick start's simulator may run 4,505 at once with graphs up to 4,096; with 40
    # running no batch is ever above the graphs.
    advice = advise(entry("request", 4505, 4505, graph_bs=4096),
                    Observed(samples=2, running=40, queue=5))
    assert advice.binding != "cuda-graph" and "--cuda-graph-max-bs-decode" not in advice.flags


def test_the_prediction_follows_the_step_cost_of_memory_bound_decode() -> None:
    assert relative_throughput(40, 16) == pytest.approx(3473 / 2325, rel=0.01)
    assert relative_throughput(16, 16) == 1.0


def status_of(gpu: dict[str, Any]) -> str:
    return render_status(node_state([{**gpu, "port": 30000, "pid": 5, "since": 0.0,
                                      "restarts": 0, "pid_alive": True}]), now=1.0)


def test_status_shows_one_line_of_advice_per_bound_gpu() -> None:
    text = status_of({**entry_json("mamba", 16, 128, slots=80), "peak_running": 16})
    assert ("advice gpu0: bound by 80 Mamba slots at a peak of 16 running: "
            "`--max-mamba-cache-size 200 --mem-fraction-static 0.93` → ~40 running "
            "(+49% tokens/s) (check: launcher advise)") in text


def test_status_advises_nothing_for_a_server_that_never_ran_a_request() -> None:
    # The quick start's idle node: asked 40, and the simulator's 4096 above graphs of 256.
    assert "advice" not in status_of(entry_json("request", 40, 40))
    assert "advice" not in status_of({**entry_json("request", 4096, None, graph_bs=256),
                                      "peak_running": None})


def test_status_advises_nothing_where_the_running_peak_never_reached_the_bound() -> None:
    assert "advice" not in status_of({**entry_json("request", 40, 40), "peak_running": 12})
    assert "advice" not in status_of({**entry_json("request", 4096, None, graph_bs=256),
                                      "peak_running": 200})
    reached = status_of({**entry_json("request", 4096, None, graph_bs=256), "peak_running": 300})
    assert "advice gpu0: batches above 256 run without CUDA graphs (a peak of 300 running" \
        in reached


def test_advise_without_any_sample_of_load_offers_no_flag() -> None:
    advice = advise(entry("request", 40, 40), Observed(samples=0))
    assert advice.flags == () and "no load seen yet" in advice.why
    below = advise(entry("mamba", 16, 128, slots=80),
                   Observed(samples=3, running=4, peak_running=9, queue=0.8))
    assert below.flags == () and "cap 16 never reached (at most 9 running)" in below.why


def test_advice_offers_no_flag_the_servers_release_lacks() -> None:
    old = entry_json("mamba", 16, 128, slots=80)
    old["capacity"]["version"] = "0.5.1"  # before --max-mamba-cache-size existed
    advice = advise(node_state([old]).gpus[0], Observed(samples=2, running=16, queue=9, kv_usage=0.1))
    assert advice.flags == ()
    assert "--max-mamba-cache-size does not exist in sglang 0.5.1" in advice.why
    new = entry_json("request", 64, 64, graph_bs=32)
    new["capacity"]["version"] = "0.5.10"
    assert advise(node_state([new]).gpus[0], Observed(samples=2, running=64, queue=5)).flags == (
        "--cuda-graph-max-bs", "64")


# `advise --url`: a server the launcher did not start.

@contextmanager
def busy(url: str, clients: int) -> Iterator[None]:
    """`clients` threads that each keep one chat request in flight until the block ends."""
    stop = threading.Event()

    def one() -> None:
        with httpx.Client(timeout=60, trust_env=False, verify=TLS) as client:
            while not stop.is_set():
                try:
                    client.post(f"{url}/v1/chat/completions", json=chat_body())
                except httpx.HTTPError:
                    return

    threads = [threading.Thread(target=one, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)


def test_advise_by_url_names_mamba_slots_as_the_binding_limit(
        capsys: pytest.CaptureFixture[str]) -> None:
    # 157 Mamba slots at 5 per request cap the 128 asked at 31; 45 clients keep a queue.
    with running_sim("--model-arch", "mamba-hybrid", "--max-running-requests", "128", "--speed", "5",
                     "--mean-output-tokens", "200", "--output-sigma", "0") as url, busy(url, 45):
        wait_until(lambda: gauge(url, "sglang:num_queue_reqs") > 0, what="a queue")
        code = main(["advise", "--url", url, "--window", "1", "--interval", "0.25", "--json"])
        out, err = capsys.readouterr()
        assert main(["advise", "--url", url, "--window", "0.5", "--interval", "0.25"]) == 0
        text = capsys.readouterr().out
    assert code == 0, err
    (advice,) = json.loads(out)
    assert (advice["url"], advice["gpu"], advice["binding"]) == (url, None, "mamba")
    assert (advice["cap"], advice["requested"], advice["mamba_slots"]) == (31, 128, 157)
    assert advice["samples"] >= 2 and advice["queue"] > 0 and advice["mamba_num"] > 0
    assert advice["flags"][:1] == ["--max-mamba-cache-size"]
    assert advice["predicted_running"] > 31
    assert text.startswith(f"{url}: bound by 157 Mamba slots at ")
    assert " slots), " in text and "--max-mamba-cache-size" in text


class NotSglang(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server of another kind: /v1/models, and 404 for anything else."""

    def do_GET(self) -> None:
        found = self.path == "/v1/models"
        body = b'{"object": "list", "data": []}' if found else b"Not Found"
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json" if found else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def not_sglang() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotSglang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_advise_by_url_says_in_one_line_that_a_server_without_server_info_is_not_sglang(
        not_sglang: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["advise", "--url", not_sglang, "--window", "0"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert err.startswith(f"launcher advise: {not_sglang} is not an SGLang server: advise reads "
                          "SGLang's /server_info or /get_server_info, and it answered "
                          "/server_info with 404 and /get_server_info with 404 (server: ")


def test_advise_by_url_of_a_closed_port_says_it_cannot_read_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotSglang)
    port = server.server_address[1]
    server.server_close()  # nothing listens there now
    assert main(["advise", "--url", f"127.0.0.1:{port}", "--window", "0"]) == 2
    assert capsys.readouterr().err == (f"launcher advise: http://127.0.0.1:{port}: cannot read "
                                       "/server_info: connection refused\n")


def test_advise_by_url_sends_the_api_key_and_suspects_it_when_refused(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEETGEN_SERVER_API_KEY", raising=False)  # the flag's default
    with running_sim("--api-key", "s3cret", "--instant") as url:
        refused = main(["advise", "--url", url, "--window", "0"])
        err = capsys.readouterr().err
        keyed = main(["advise", "--url", url, "--window", "0", "--api-key", "s3cret"])
        out = capsys.readouterr().out
    assert (refused, err) == (2, f"launcher advise: {url}: /server_info answered 401 (a wrong "
                                 "or missing --api-key?)\n")
    assert keyed == 0 and out.startswith(f"{url}: nothing binds: the queue is empty")
