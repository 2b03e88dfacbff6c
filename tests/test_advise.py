"""`launcher advise`: what binds each GPU's server, and the flags to try, with a prediction.

The verdicts are computed from a GPU's node.json entry and the means of its /metrics samples;
tests/test_node_e2e.py runs the command against a live simulated node.
"""

from __future__ import annotations

from typing import Any

import pytest

from launcher.node import Observed, advise, relative_throughput, render_status


def entry(binding: str, effective: int, requested: int | None, *, slots: int | None = None,
          argv: tuple[str, ...] = (), graph_bs: int | None = 256) -> dict[str, Any]:
    return {"gpu": 0, "state": "ready", "argv": ["sglang", "serve", *argv],
            "capacity": {"effective": effective, "requested": requested, "binding": binding,
                         "mamba_slots": slots, "max_total_num_tokens": 500_000,
                         "cuda_graph_max_bs": graph_bs, "reason": "..."}}


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
        "gpu0: bound by 80 Mamba slots at 16 running, KV 7% used, Mamba 100% used, 112 queued: "
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


def test_the_prediction_follows_the_step_cost_of_memory_bound_decode() -> None:
    assert relative_throughput(40, 16) == pytest.approx(3473 / 2325, rel=0.01)
    assert relative_throughput(16, 16) == 1.0


def test_status_shows_one_line_of_advice_per_bound_gpu() -> None:
    state = {"supervisor_pid": 1, "supervisor_alive": True, "updated_at": 0.0,
             "gpus": [{**entry("mamba", 16, 128, slots=80), "port": 30000, "pid": 5,
                       "since": 0.0, "restarts": 0, "pid_alive": True}]}
    text = render_status(state, now=1.0)
    assert ("advice gpu0: bound by 80 Mamba slots at 16 running: `--max-mamba-cache-size 200 "
            "--mem-fraction-static 0.93` → ~40 running (+49% tokens/s) (check: launcher advise)"
            ) in text


def test_advice_offers_no_flag_the_servers_release_lacks() -> None:
    old = entry("mamba", 16, 128, slots=80)
    old["capacity"]["version"] = "0.5.1"  # before --max-mamba-cache-size existed
    advice = advise(old, Observed(samples=2, running=16, queue=9, kv_usage=0.1))
    assert advice.flags == ()
    assert "--max-mamba-cache-size does not exist in sglang 0.5.1" in advice.why
    new = entry("request", 64, 64, graph_bs=32)
    new["capacity"]["version"] = "0.5.10"
    assert advise(new, Observed(samples=2, running=64, queue=5)).flags == (
        "--cuda-graph-max-bs", "64")
