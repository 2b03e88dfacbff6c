"""The decode cost model (`--decode-model step`) and over-committed starts that fail like SGLang.

Throughput is measured on the simulated clock (VirtualClockLoop), so the figures are exact
whatever else the machine runs.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from launcher.logs import Fatal, parse_line, read_log
from launcher.sim.capacity import plan_capacity
from launcher.sim.scheduler import Scheduler, SimRequest
from tests.sim_helpers import SimProcess, VirtualClockLoop, config

REFERENCE = ("--model-arch", "mamba-hybrid", "--speculative-algorithm", "NEXTN",
             "--speculative-accept-length", "2.9", "--decode-model", "step")


def steady_tokens_per_s(*flags: str, n: int = 0) -> tuple[int, float]:
    """(running cap, output tokens/s in all) of a full batch of equal answers, simulated time."""
    cfg = config(*flags, "--prefill-tps", "1e9")
    capacity = plan_capacity(cfg)
    slots = capacity.effective_running
    assert slots > 0, capacity.fatal
    n = n or slots * 6
    scheduler = Scheduler(cfg, capacity)
    loop = VirtualClockLoop()
    try:
        scheduler.start(loop)
        requests = [SimRequest(f"r{i}", 1, 500, False, loop) for i in range(n)]
        for request in requests:
            scheduler.submit(request)
        loop.run_until_complete(asyncio.gather(*(r.done for r in requests)))
    finally:
        scheduler.stop()
        loop.close()
    finished = sorted(r.finish_at for r in requests)
    return slots, (n - slots) * 500 / (finished[-1] - finished[slots - 1])


@pytest.mark.parametrize(("running", "expected"), [(16, 2300), (40, 3455)])
def test_a_step_costs_a_plus_b_times_running_as_on_the_reference_gpu(
    running: int, expected: float,
) -> None:
    # the reference run's flags: its start, and its fix for 40 running
    fix = ("--max-mamba-cache-size", "200", "--mamba-full-memory-ratio", "0.6",
           "--mem-fraction-static", "0.93")
    slots, total = steady_tokens_per_s(*REFERENCE, *(fix if running == 40 else ()),
                                       "--max-running-requests", "128" if running == 16 else "64")
    assert slots == running
    assert total == pytest.approx(expected, rel=0.02)


def test_more_running_requests_pay_less_than_linearly_with_the_step_model() -> None:
    _, at_8 = steady_tokens_per_s(*REFERENCE, "--max-running-requests", "8")
    _, at_16 = steady_tokens_per_s(*REFERENCE, "--max-running-requests", "16")
    assert 1.2 < at_16 / at_8 < 1.9


def test_the_fixed_model_stays_the_default_and_linear() -> None:
    _, at_4 = steady_tokens_per_s("--max-running-requests", "4", "--decode-tps", "86")
    _, at_8 = steady_tokens_per_s("--max-running-requests", "8", "--decode-tps", "86")
    assert (at_4, at_8) == (pytest.approx(4 * 86), pytest.approx(8 * 86))


def test_without_speculative_decoding_a_step_yields_one_token_per_request() -> None:
    cfg = config("--decode-model", "step", "--step-ms", "10", "--step-ms-per-request", "0")
    assert cfg.decode_rate(16) == pytest.approx(100.0)


def test_graphs_that_do_not_fit_fail_capture_with_cuda_out_of_memory() -> None:
    capacity = plan_capacity(config(*REFERENCE, "--max-running-requests", "128",
                                    "--mem-fraction-static", "0.97"))
    assert capacity.fatal is not None
    event = parse_line(capacity.fatal)
    assert isinstance(event, Fatal) and event.kind == "cuda_graph"
    fits = plan_capacity(config(*REFERENCE, "--max-running-requests", "128",
                                "--mem-fraction-static", "0.95"))
    assert fits.fatal is None


def test_a_mamba_pool_larger_than_the_budget_leaves_no_kv_cache() -> None:
    capacity = plan_capacity(config(*REFERENCE, "--max-mamba-cache-size", "400",
                                    "--mem-fraction-static", "0.93"))
    assert capacity.fatal is not None
    event = parse_line(capacity.fatal)
    assert isinstance(event, Fatal) and event.kind == "kv_no_memory"


def test_an_over_committed_server_dies_at_start_and_explain_names_the_capture(
    tmp_path: Path,
) -> None:
    sim = SimProcess(tmp_path, *REFERENCE, "--max-running-requests", "128",
                     "--mem-fraction-static", "0.97")
    try:
        assert sim.wait_exit() == -signal.SIGKILL
    finally:
        sim.close()
    report = read_log(str(sim.log_path))
    assert report.run.fatal is not None and report.run.fatal.kind == "cuda_graph"
    assert not report.run.ready


def test_slots_a_full_kv_pool_leaves_idle_add_no_throughput() -> None:
    # 16 slots, but 2,000 KV tokens hold three 501-token requests: the batch is 3 wide, and a
    # waiter starts when a finish makes room, not when its (long idle) slot fell free.
    slots, total = steady_tokens_per_s(*REFERENCE, "--max-running-requests", "16",
                                       "--max-total-tokens", "2000")
    assert slots == 16
    # (the helper's window starts at the 16th finish, mid-round for a 3-wide batch: ±5%)
    assert total == pytest.approx(3 * 2.9 / (0.011 + 0.00056 * 3), rel=0.05)
