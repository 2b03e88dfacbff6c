"""The capacity model: §7's effective max_running_requests, slots and throughput (simulated clock)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from fleetgen.servers import parse_server_info
from launcher.logs import PrefillBatch, parse_line
from launcher.sim import info as sim_info
from launcher.sim.capacity import plan_capacity
from launcher.sim.scheduler import Scheduler, SimRequest
from launcher.sim.simulator import Simulator
from tests.sim_helpers import SimProcess, VirtualClockLoop, chat_body, config, running_sim


def effective(*flags: str) -> int:
    return plan_capacity(config(*flags)).effective_running


def test_dense_cap_is_the_request_when_the_kv_pool_allows_it() -> None:
    assert effective("--max-running-requests", "40") == 40


def test_dense_cap_defaults_to_the_4096_style_estimate() -> None:
    assert effective() == 4096


def test_speculative_decoding_defaults_the_request_to_48() -> None:
    assert effective("--speculative-algorithm", "EAGLE") == 48


def test_a_small_kv_pool_caps_running_at_half_its_tokens() -> None:
    cap = plan_capacity(config("--max-total-tokens", "50", "--max-running-requests", "40"))
    assert cap.effective_running == 25 and cap.max_total_num_tokens == 50
    assert "reduced from the requested 40 to 25 (per dp worker)" in cap.warnings[0]


# The reference run's start: a hybrid model, speculative decoding on, 128 requested.
REFERENCE_START = ("--model-arch", "mamba-hybrid", "--max-running-requests", "128",
                   "--speculative-algorithm", "NEXTN")


def test_hybrid_extra_buffer_turns_128_into_16_with_the_r_warning() -> None:
    cap = plan_capacity(config(*REFERENCE_START))
    assert (cap.mamba_cache_size, cap.mamba_ratio, cap.effective_running) == (80, 5, 16)
    assert cap.warnings == (("max_running_requests is capped to 16 by the mamba state cache "
                             "(max_mamba_cache_size=80, 5 state slots per request). To raise "
                             "it: increase --mamba-full-memory-ratio or --max-mamba-cache-size, "
                             "or halve the state size with --mamba-ssm-dtype bfloat16."),)


def test_the_reference_fix_runs_40_where_the_start_ran_16() -> None:
    fixed = plan_capacity(config(*REFERENCE_START, "--max-mamba-cache-size", "200",
                                 "--mamba-full-memory-ratio", "0.6",
                                 "--mem-fraction-static", "0.93", "--max-running-requests", "64"))
    assert fixed.fatal is None
    assert (fixed.mamba_cache_size, fixed.effective_running) == (200, 40)
    assert fixed.max_total_num_tokens // 2 > 40  # the KV pool does not bind


def test_speculative_buffers_are_sized_by_the_requests_the_pool_runs_not_by_its_slots() -> None:
    def buffers(requested: int) -> float:
        return plan_capacity(config(*REFERENCE_START, "--max-mamba-cache-size", "200",
                                    "--max-running-requests", str(requested))).spec_state_gb
    # 200 slots serve 40 requests (ratio 5): asking 128 reserves what asking 40 does
    assert buffers(128) == buffers(40)
    assert buffers(8) == pytest.approx(buffers(40) * (8 + 1) / (40 + 1))


def test_speculative_buffers_take_their_share_of_the_auto_fit() -> None:
    plain = plan_capacity(config("--model-arch", "mamba-hybrid", "--max-running-requests", "128"))
    assert plain.mamba_cache_size is not None and plain.mamba_cache_size > 80


@pytest.mark.parametrize(("flags", "expected"), [
    (("--mamba-radix-cache-strategy", "no_buffer"), 62 // 3),
    (("--mamba-radix-cache-strategy", "extra_buffer_lazy"), 72 // 4),
    (("--disable-radix-cache", "--max-running-requests", "32"), 32),
    (("--mamba-ssm-dtype", "bfloat16"), 163 // 5),
    (("--max-mamba-cache-size", "40"), 8),
])
def test_hybrid_cap_follows_the_strategy_ratio_and_slots(flags: tuple[str, ...],
                                                         expected: int) -> None:
    assert effective(*REFERENCE_START, *flags) == expected


def test_start_up_failures_carry_sglangs_messages() -> None:
    tiny = plan_capacity(config("--model-arch", "mamba-hybrid", "--max-mamba-cache-size", "3"))
    assert tiny.fatal is not None and tiny.fatal.startswith(
        "RuntimeError: Hybrid (mamba/linear-attention) state cache is too small to serve any "
        "requests. max_mamba_cache_size=3, mamba_ratio=5, resulting max_num_reqs=0.")
    starved = plan_capacity(config("--mem-fraction-static", "0.5"))
    assert starved.fatal == ("RuntimeError: Not enough memory. Please try to increase "
                             "--mem-fraction-static. Current value: mem_fraction_static=0.5")


def test_hybrid_cap_shows_in_server_info_and_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="launcher.sim")
    with running_sim("--instant", *REFERENCE_START) as url:
        info = httpx.get(url + "/server_info").json()
    state = info["internal_states"][0]
    assert info["max_running_requests"] == 128
    assert state["effective_max_running_requests_per_dp"] == 16
    assert state["max_mamba_cache_size"] == 80
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("max_running_requests is capped to 16") for m in messages)
    assert any("max_running_requests=16, context_len=40960" in m for m in messages)
    assert any(m.startswith("Mamba Cache is allocated. max_mamba_cache_size: 80,")
               for m in messages)


# Servers over several GPUs: tensor parallel memory, one set of pools per DP rank.

def test_tensor_parallel_splits_the_weights_and_gives_the_kv_pool_every_gpus_memory() -> None:
    one, two = plan_capacity(config()), plan_capacity(config("--tp-size", "2"))
    assert two.weights_gb == pytest.approx(one.weights_gb / 2)
    # Each GPU keeps what its half of the weights leaves, so the pool more than doubles.
    assert two.kv_gb > one.kv_gb and two.max_total_num_tokens > 2 * one.max_total_num_tokens
    assert plan_capacity(config("--tp-size", "4")).max_total_num_tokens > \
        2 * two.max_total_num_tokens


def test_each_data_parallel_rank_has_its_own_pools_and_the_server_runs_their_sum() -> None:
    sim = Simulator(config("--dp-size", "2", "--max-running-requests", "24"))
    info = parse_server_info(sim_info.server_info(sim))
    assert info.per_rank == (24, 24) and info.concurrency == 48
    assert info.max_total_num_tokens == plan_capacity(config()).max_total_num_tokens
    assert sim.scheduler.cap == 48


def test_dp_attention_ranks_share_the_gpus_and_split_the_ask() -> None:
    flags = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")
    cap = plan_capacity(config(*flags, "--max-running-requests", "64"))
    assert cap.effective_running == 32 and cap.requested_running == 64
    # Each rank's pool lives on one of the two GPUs: half of what TP 2 alone pools.
    tp2 = plan_capacity(config("--tp-size", "2")).max_total_num_tokens
    assert abs(2 * cap.max_total_num_tokens - tp2) <= 1


async def _flood(url: str, n: int) -> None:
    """Send n chat requests at once over warm connections; each answer is 400 tokens."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        await asyncio.gather(*(client.get("/v1/models") for _ in range(n)))  # open connections

        async def one(i: int) -> None:
            reply = await client.post("/v1/chat/completions",
                                      json=chat_body(f"question {i}", max_tokens=10_000))
            assert reply.json()["usage"]["completion_tokens"] == 400

        await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.e2e
def test_a_flood_runs_exactly_the_cap_and_queues_the_rest(tmp_path: Path) -> None:
    # 12 answers of 400 tokens on 6 slots at 86 x 4 tok/s: each round takes 1.16 s, far longer
    # than the flood takes to arrive, so the 7th request finds every slot busy.
    slots, n = 6, 12
    sim = SimProcess(tmp_path, "--max-running-requests", str(slots), "--decode-tps", "86",
                     "--speed", "4", "--mean-output-tokens", "400", "--output-sigma", "0",
                     "--prefill-tps", "1e9")
    try:
        sim.wait_healthy(timeout=60)
        warm_up = len(sim.log())  # the start-up's own one-request Prefill line is not ours
        asyncio.run(_flood(sim.url, n))
        log = sim.log()[warm_up:]
    finally:
        sim.close()
    # Every admission logs a Prefill line with the batch before it (#running-req), the new
    # requests (#new-seq) and those left waiting (#queue-req): events, not samples.
    admissions = [e for e in map(parse_line, log.splitlines()) if isinstance(e, PrefillBatch)]
    assert sum(e.new_seq or 0 for e in admissions) == n
    assert max((e.running or 0) + (e.new_seq or 0) for e in admissions) == slots
    assert max(e.queue or 0 for e in admissions) > 0


class _Stalls:
    """A busy event loop: every 50 ms of loop time, a callback holds it for 30 ms."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        self.loop = loop
        self.count = 0
        loop.call_later(0.05, self.stall)

    def stall(self) -> None:
        self.count += 1
        self.loop.advance(0.03)
        self.loop.call_later(0.05, self.stall)


def test_throughput_is_slots_times_rate_on_the_simulated_clock_even_when_the_loop_stalls() -> None:
    slots, n, rate = 6, 60, 86 * 40  # 60 answers of exactly 400 tokens on 6 slots: 10 rounds
    cfg = config("--max-running-requests", str(slots), "--decode-tps", "86", "--speed", "40",
                 "--prefill-tps", "1e9")
    scheduler = Scheduler(cfg, plan_capacity(cfg))
    loop = VirtualClockLoop()
    try:
        scheduler.start(loop)
        stalls = _Stalls(loop)
        requests = [SimRequest(f"r{i}", 1, 400, False, loop) for i in range(n)]
        for request in requests:
            scheduler.submit(request)
        loop.run_until_complete(asyncio.gather(*(r.done for r in requests)))
    finally:
        scheduler.stop()
        loop.close()
    assert scheduler.peak_running == slots and stalls.count > 10
    # Slots freed while the loop was held start their next request at the instant they freed,
    # so a late loop never turns into idle simulated capacity (tests/perf measures the same
    # ratio on a real server over HTTP: `python -m tests.perf --only timings`).
    finished = sorted(r.finish_at for r in requests)
    steady = (n - slots) * 400 / (finished[-1] - finished[0])
    assert steady == pytest.approx(slots * rate, rel=1e-6)
