"""Which candidates a server's memory holds, predicted from its start-up lines
(launcher/node/_fit.py), checked against the simulator, whose pools follow SGLang's arithmetic,
and the tuner's plan built on it."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from launcher.logs import fold, parse_line
from launcher.node._advise import Observed
from launcher.node._fit import NOT_ENOUGH_MEMORY, Memory, candidates
from launcher.node._rundir import ProcessEntry, ServerEntry, TuneStep
from launcher.node._tune import MAX_MEM_FRACTION, held_tokens, plan_next
from launcher.node._watch import Reading
from launcher.sim import startup
from launcher.sim.capacity import plan_capacity
from launcher.sim.config import SimConfig
from launcher.sim.simulator import Simulator
from tests.launcher.node.test_node import REFERENCE_SIM, modelled_tokens_per_s, sweep_best

# The reference answers (tests/perf/replay.py): a running request holds its prompt and its
# whole answer, the length-weighted mean of a lognormal of mean 2,374 and sigma 0.8.
HELD = 2374 * math.exp(0.64) + 260


@pytest.fixture
def reference_lines() -> Iterator[list[str]]:
    """The start-up lines of a simulated server started like the reference run."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    keep = Keep()
    loggers = [logging.getLogger(n) for n in ("launcher.sim.server", "launcher.sim.scheduler")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(keep)
        lg.setLevel(logging.INFO)
        lg.propagate = False
    try:
        startup.announce(Simulator(SimConfig.from_argv(list(REFERENCE_SIM))))
        yield lines
    finally:
        for lg, (level, propagate) in zip(loggers, saved, strict=True):
            lg.removeHandler(keep)
            lg.setLevel(level)
            lg.propagate = propagate


def _memory(lines: Sequence[str]) -> Memory:
    memory = Memory.from_start(fold(parse_line(x) for x in lines).run, ratio=5)
    assert memory is not None
    return memory


def _sim(mfs: float, slots: int) -> tuple[int, int, str | None]:
    cap = plan_capacity(SimConfig.from_argv([*REFERENCE_SIM, "--mem-fraction-static", str(mfs),
                                             "--max-mamba-cache-size", str(slots)]))
    return cap.max_total_num_tokens, cap.effective_running, cap.fatal


@pytest.mark.parametrize("mfs", [0.84, 0.88, 0.93, 0.95])
@pytest.mark.parametrize("slots", [80, 160, 200, 234, 260, 300, 500])
def test_the_start_up_lines_predict_the_pools_and_the_refusals_of_other_flags(
        reference_lines: list[str], mfs: float, slots: int) -> None:
    memory = _memory(reference_lines)
    fit = memory.fit(mfs, slots)
    tokens, cap, fatal = _sim(mfs, slots)
    if fatal is not None and "Not enough memory" in fatal:
        assert fit.refused == NOT_ENOUGH_MEMORY
        return
    assert fit.refused is None
    assert fit.cap == cap
    # The lines state GB with two decimals: within 0.02 GB of KV, or 1%.
    assert abs(fit.tokens - tokens) <= max(0.01 * tokens, 0.02 / memory.gb_per_token)


def test_the_best_candidate_the_memory_holds_runs_within_one_request_of_the_sweeps_best(
        reference_lines: list[str]) -> None:
    found = candidates(_memory(reference_lines), HELD, 16, MAX_MEM_FRACTION, 0.84)
    best = found[0]
    _, sweep = sweep_best(REFERENCE_SIM)
    assert best.running >= 45 and best.gain > 0.5
    assert modelled_tokens_per_s(REFERENCE_SIM, list(best.flags), 260) >= 0.99 * \
        modelled_tokens_per_s(REFERENCE_SIM, list(sweep), 260)
    # every candidate offered is one the simulator starts
    assert all(_sim(c.fit.mem_fraction, c.fit.slots or 0)[2] is None for c in found[:20])
    assert [c.running for c in found] == sorted((c.running for c in found), reverse=True)


def _entry(log: Path, mfs: str = "0.841") -> ServerEntry:
    reading = Reading(version=None, weights_gb=50.29, kv_tokens=515971, mamba_slots=80,
                      max_total_num_tokens=515971, context_length=40960,
                      chunked_prefill_size=8192, cuda_graph_max_bs=128, requested=128,
                      effective=16, binding="mamba", reason="")
    return ServerEntry(gpu=0, server=ProcessEntry(state="ready", log=str(log),
                                                  argv=("--mem-fraction-static", mfs)),
                       capacity=reading)


def test_an_advised_candidate_the_memory_cannot_hold_is_skipped_for_the_models_best(
        reference_lines: list[str], tmp_path: Path) -> None:
    log = tmp_path / "gpu0.log"
    log.write_text("\n".join(reference_lines) + "\n")
    seen = Observed(samples=30, running=16.0, queue=40.0, kv_usage=HELD / 2 * 16 / 515971)
    too_big = ["--max-mamba-cache-size", "500", "--mem-fraction-static", "0.93"]
    plan = plan_next(_entry(log), seen, too_big, 1.5, MAX_MEM_FRACTION, {}, width=3)
    assert plan.skipped == [(too_big, f"predicted: {NOT_ENOUGH_MEMORY}")]
    assert len(plan.tries) == 3 and plan.expected == plan.tries[0][1] is not None
    for flags, _ in plan.tries:
        assert flags[:1] == ["--max-mamba-cache-size"]
        assert _sim(float(flags[3]), int(flags[1]))[2] is None
        assert float(flags[3]) <= MAX_MEM_FRACTION
    # Side by side, best predicted first: distinct slot counts, the expected gain falling.
    assert len({flags[1] for flags, _ in plan.tries}) == 3
    gains = [gain or 0.0 for _, gain in plan.tries]
    assert gains == sorted(gains, reverse=True)


def test_a_server_without_start_up_lines_keeps_the_advice(tmp_path: Path) -> None:
    advised = ["--max-mamba-cache-size", "200", "--mem-fraction-static", "0.93"]
    plan = plan_next(_entry(tmp_path / "none.log"), Observed(samples=1, running=16.0),
                     advised, 0.4, MAX_MEM_FRACTION, {})
    assert (plan.tries, plan.expected, plan.skipped) == ([(advised, 0.4)], 0.4, [])


def test_held_tokens_reads_the_pool_when_it_binds_and_twice_the_use_otherwise(
        tmp_path: Path) -> None:
    entry = _entry(tmp_path / "gpu0.log")
    bound = Observed(samples=5, running=10.0, queue=5.0, peak_running=12.0)
    assert held_tokens(entry, bound) == 515971 / 10
    # A batch still filling queues below its cap as well: it reached the cap, the pool did
    # not bind.
    filling = Observed(samples=5, running=10.0, queue=5.0, peak_running=16.0, kv_usage=0.02)
    assert held_tokens(entry, filling) == pytest.approx(2 * 0.02 * 515971 / 10)
    half = held_tokens(entry, Observed(samples=5, running=16.0, queue=5.0, kv_usage=0.05))
    assert half == pytest.approx(2 * 0.05 * 515971 / 16)
    assert held_tokens(entry, Observed(samples=0)) is None


def test_a_step_under_way_says_its_expected_gain_and_time_left() -> None:
    step = TuneStep(at=0.0, kind="trying", gpu=0, flags=("--max-mamba-cache-size", "230"),
                    expected=0.561, until=10**12)
    text = step.describe()
    assert text.startswith("tune: gpu0 trying `--max-mamba-cache-size 230`, expected +56.1%")
    assert " s left" in text
    back = TuneStep._read(step._json())
    assert (back.expected, back.until) == (0.561, 10**12)


def test_a_running_count_that_stopped_growing_is_settled() -> None:
    from launcher.node._tune import settled

    rising = [(t * 0.5, 10.0 + t) for t in range(10)]
    assert not settled(rising, 2.0)
    flat = [*rising, *((5.0 + t * 0.5, 19.0) for t in range(6))]
    assert settled(flat, 2.0)
    assert not settled(flat[:2], 2.0)  # too short a history says nothing
    assert not settled([(t * 0.5, 0.0) for t in range(10)], 2.0)  # idle is not full


def test_drain_takes_seconds_or_wait() -> None:
    import argparse
    import math

    from launcher.node._tune import TuneSettings, drain_seconds

    assert drain_seconds("12.5") == 12.5
    assert drain_seconds("wait") == math.inf
    for bad in ("-1", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            drain_seconds(bad)
    assert TuneSettings.for_window(6.0).drain_s == 3.0
    assert TuneSettings.for_window(6.0, math.inf).drain_s == math.inf


def test_a_restart_request_keeps_each_gpus_own_arguments_and_its_drain() -> None:
    from launcher.node._rundir import RestartRequest

    request = RestartRequest("t1", rolling=False, gpu_args={0: ("--a", "1"), 3: ("--b", "2")},
                             drain_s=3.0)
    back = RestartRequest.from_json(request.to_json())
    assert back.gpu_args == {0: ("--a", "1"), 3: ("--b", "2")} and back.drain_s == 3.0
    plain = RestartRequest.from_json(RestartRequest("r1").to_json())
    assert plain.gpu_args is None and plain.drain_s is None


def test_the_models_best_is_kept_unless_another_measured_better_by_the_margin() -> None:
    from launcher.node._tune import best_of

    seen = {g: Observed(samples=1, tokens_per_s=1.0) for g in (0, 1, 2)}
    # One window moves a GPU's rate by a few percent: within the margin the model decides.
    assert best_of([0, 1, 2], {0: 1.520, 1: 1.559, 2: 1.552}, seen, 0, 0.03) == 0
    assert best_of([0, 1, 2], {0: 1.300, 1: 1.559, 2: 1.552}, seen, 0, 0.03) == 1
    assert best_of([1, 2], {1: 1.559, 2: 1.552}, seen, 0, 0.03) == 1  # the model's failed
    # Alone (no reference GPUs): by tokens/s.
    alone = {0: Observed(samples=1, tokens_per_s=3000.0), 1: Observed(samples=1, tokens_per_s=3600.0)}
    assert best_of([0, 1], {0: None, 1: None}, alone, 0, 0.03) == 1


def test_the_kv_a_running_request_holds_is_pooled_over_the_node(tmp_path: Path) -> None:
    from launcher.node._tune import pooled_held

    entries = [dataclasses.replace(_entry(tmp_path / "gpu.log"), gpu=g) for g in (0, 1)]
    seen = {0: Observed(samples=5, running=16.0, queue=5.0, kv_usage=0.05),
            1: Observed(samples=5, running=48.0, queue=5.0, kv_usage=0.25)}
    one, other = 2 * 0.05 * 515971 / 16, 2 * 0.25 * 515971 / 48
    assert pooled_held(entries, seen) == pytest.approx((one * 16 + other * 48) / 64)
    assert pooled_held(entries, {}) is None


def test_launcher_status_names_every_candidate_tried_side_by_side() -> None:
    from launcher.node._rundir import TuneRecord

    record = TuneRecord(steps=[
        TuneStep(at=0.0, kind="baseline", gpu=0, tokens_per_s=2300.0),
        TuneStep(at=0.0, kind="trying", gpu=0, flags=("--max-mamba-cache-size", "230"),
                 expected=0.561),
        TuneStep(at=0.0, kind="trying", gpu=1, flags=("--max-mamba-cache-size", "225"),
                 expected=0.551)])
    assert [s.gpu for s in record.current] == [0, 1]
    assert record.describe() == (
        "tune: running; last gpu0 trying `--max-mamba-cache-size 230`, expected +56.1%; "
        "gpu1 trying `--max-mamba-cache-size 225`, expected +55.1%")
    record.steps.append(TuneStep(at=1.0, kind="won", gpu=0))
    assert [s.kind for s in record.current] == ["won"]
