"""`launcher tune`'s steps (launcher/node/_tune.py `Tuning`) replayed in virtual time.

A `FakeNode` plays the node the tuning reads and restarts: each server runs the simulator's
capacity and step-cost models (`plan_capacity`, `modelled_tokens_per_s` of test_node.py) on
the flags it was last started with, writes the simulator's start-up lines to its log (what
the memory model reads), answers a window of samples at once while the `FakeClock` moves by
the window, and starts or dies as scripted. A tuning of minutes runs in milliseconds, and each
test reads the record the tuning kept. tests/launcher/node/test_node.py runs a real one
during a job; test_tune.py and test_autotune.py test its pieces and its notes.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from fleetgen.ledger import Ledger
from fleetgen.ports import HOST
from launcher.node._advise import Observed
from launcher.node._args import split_flags
from launcher.node._commands import up_parser
from launcher.node._restart import RestartOutcome
from launcher.node._rundir import NodeState, ProcessEntry, RestartRequest, ServerEntry
from launcher.node._tune import (
    FULL_WAIT_S,
    MEM_FRACTION_STEP,
    TuneSettings,
    Tuning,
    previous_values,
    smaller_step,
    tune_parser,
)
from launcher.node._tunelog import TuneLog, TuningNotes
from launcher.node._watch import Reading
from launcher.sim import startup
from launcher.sim.capacity import plan_capacity
from launcher.sim.config import SimConfig
from launcher.sim.simulator import Simulator
from tests.launcher.node.test_node import REFERENCE_SIM, modelled_tokens_per_s

NOT_ENOUGH = "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."
CUDA_OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.15 GiB."
# A short window, as `up --tune-window 6` would measure; the steps are what is replayed.
SETTINGS = TuneSettings.for_window(6.0)


class FakeClock:
    """Virtual time: `sleep` moves it at once."""

    def __init__(self) -> None:
        self.t = 0.0
        self.start = time.time()  # a step's `~N s left` reads the real wall clock

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.start + self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


@dataclass
class FakeNode:
    """The servers of one node, their flags and how each start goes."""

    clock: FakeClock
    logs: Path
    gpus: int = 4
    queue: float = 40.0  # requests waiting on each server
    restart_s: float = 20.0
    # Per GPU, the reasons its next starts die with, one per start (a candidate that dies).
    dies: dict[int, list[str]] = field(default_factory=dict)
    # GPUs whose batch, once restarted, never fills: each sample runs a little more, never
    # its cap.
    never_full: set[int] = field(default_factory=set)
    # From this virtual time on no work waits anywhere (the job ending).
    empty_from: float = math.inf
    # Every server's tokens/s, when not the models' (e.g. all alike: every candidate loses).
    rate: Callable[[Sequence[str]], float] | None = None
    binding: str = "mamba"
    flags: dict[int, list[str]] = field(default_factory=dict)
    requests: list[RestartRequest] = field(default_factory=list)
    samples: int = 0
    on_measure: Callable[[FakeNode], None] = lambda node: None

    def __post_init__(self) -> None:
        for g in range(self.gpus):
            self.flags.setdefault(g, [])
            self._start(g)

    def cfg(self, g: int) -> SimConfig:
        return SimConfig.from_argv([*REFERENCE_SIM, *self.flags[g]])

    def entry(self, g: int) -> ServerEntry:
        cap = plan_capacity(self.cfg(g))
        reading = Reading(version=None, weights_gb=cap.weights_gb,
                          kv_tokens=cap.max_total_num_tokens, mamba_slots=cap.mamba_cache_size,
                          max_total_num_tokens=cap.max_total_num_tokens, context_length=40960,
                          chunked_prefill_size=8192, cuda_graph_max_bs=cap.cuda_graph_max_bs,
                          requested=128, effective=cap.effective_running, binding=self.binding,
                          reason="")
        return ServerEntry(gpu=g, server=ProcessEntry(name=f"gpu{g}", state="ready",
                                                      log=str(self.logs / f"gpu{g}.log"),
                                                      argv=tuple(self.flags[g])),
                           url=f"http://gpu{g}.invalid", capacity=reading)

    def state(self) -> NodeState:
        return NodeState(gpus=tuple(self.entry(g) for g in range(self.gpus)))

    def measure(self, entries: Sequence[ServerEntry], window_s: float,
                interval_s: float) -> dict[int | None, Observed]:
        self.samples += 1
        self.clock.sleep(window_s)
        self.on_measure(self)
        return {e.gpu: self.observe(e, window_s) for e in entries}

    def observe(self, entry: ServerEntry, window_s: float) -> Observed:
        g = entry.gpu
        assert g is not None
        cfg, cap = self.cfg(g), plan_capacity(self.cfg(g))
        held = cfg.mean_output_tokens * math.exp(cfg.output_sigma ** 2)
        running = float(min(cap.effective_running, int(cap.max_total_num_tokens // held)))
        queue = self.queue if self.clock.t < self.empty_from else 0.0
        if window_s == 0 and g in self.never_full:
            filling = (cap.effective_running - 1) * (1 - 1 / self.samples)
            return Observed(samples=1, running=filling, queue=0.0)
        tps = self.rate(self.flags[g]) if self.rate else modelled_tokens_per_s(
            REFERENCE_SIM, self.flags[g])
        return Observed(samples=max(1, int(window_s / SETTINGS.interval_s)), running=running,
                        peak_running=running, queue=queue,
                        kv_usage=running * held / 2 / cap.max_total_num_tokens,
                        tokens_per_s=tps)

    def resolved(self, url: str) -> Mapping[str, object]:
        g = int(url.removeprefix("http://gpu").split(".")[0])
        return {"mem_fraction_static": plan_capacity(self.cfg(g)).mem_fraction_static}

    def restart(self, request: RestartRequest, timeout_s: float) -> RestartOutcome:
        """As the supervisor: each GPU started on its new flags, or rolled back alone."""
        self.requests.append(request)
        self.clock.sleep(self.restart_s)
        wanted = {g: list(a) for g, a in (request.gpu_args or {}).items()}
        for g in request.gpus or ():
            wanted[g] = list(request.args or ())
        started, reasons = [], []
        for g, args in wanted.items():
            old = self.flags[g]
            self.flags[g] = merged(old, args)
            script = self.dies.get(g)
            why = script.pop(0) if script else plan_capacity(self.cfg(g)).fatal
            if why is None:
                self._start(g)
                started.append(g)
            else:
                self.flags[g] = old
                reasons.append(f"gpu{g}: {why}")
        return RestartOutcome("done" if not reasons else "failed", "; ".join(reasons),
                              tuple(started))

    def _start(self, g: int) -> None:
        (self.logs / f"gpu{g}.log").write_text("\n".join(start_lines(self.cfg(g))) + "\n")


def merged(old: Sequence[str], new: Sequence[str]) -> list[str]:
    """The supervisor's flag-by-flag override of a server's arguments."""
    names = {n for n, _ in split_flags(new)}
    return [t for n, tokens in split_flags(old) if n not in names for t in tokens] + list(new)


def start_lines(cfg: SimConfig) -> list[str]:
    """The start-up lines a simulated server started with `cfg` logs."""
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
        startup.announce(Simulator(cfg))
    finally:
        for lg, (level, propagate) in zip(loggers, saved, strict=True):
            lg.removeHandler(keep)
            lg.setLevel(level)
            lg.propagate = propagate
    return lines


@pytest.fixture
def notes(ledger: Ledger) -> Iterator[TuningNotes]:
    """The tuning's notes, published to the test Redis."""
    found = TuningNotes(ledger, beat_s=60.0)
    try:
        yield found
    finally:
        found.close()


@dataclass
class Replay:
    clock: FakeClock
    node: FakeNode
    tuning: Tuning


@pytest.fixture
def replay(tmp_path: Path, notes: TuningNotes) -> Callable[..., Replay]:
    """A node of FakeNode's servers and the tuning of it, on one fake clock."""
    def make(settings: TuneSettings = SETTINGS, stop: Any = None, **node: Any) -> Replay:
        clock = FakeClock()
        fake = FakeNode(clock, tmp_path, **node)
        tuning = Tuning(tmp_path, settings, probe=fake, restart=fake.restart, clock=clock,
                        stop=stop, notes=notes)
        return Replay(clock, fake, tuning)

    return make


def kinds(log: TuneLog) -> list[str]:
    return [s.kind for s in log.record.steps]


def test_a_tuning_tries_candidates_side_by_side_keeps_the_best_and_rolls_it_out(
        replay: Callable[..., Replay], tmp_path: Path) -> None:
    r = replay()
    start = modelled_tokens_per_s(REFERENCE_SIM, [])
    log = r.tuning.run()
    steps = log.record.steps
    assert kinds(log)[:6] == ["baseline"] * 4 + ["trying"] * 2
    first = r.node.requests[0]
    # Half the GPUs at once, each its own candidate, the node's arguments untouched.
    assert sorted(first.gpu_args or {}) == [0, 1] and first.args is None
    assert not first.rolling and first.drain_s == SETTINGS.drain_s
    assert [s.gpu for s in steps if s.kind == "measured"][:2] == [0, 1]
    won = next(s for s in steps if s.kind == "won")
    assert won.share is not None and won.share_before is not None
    assert won.share > won.share_before * (1 + SETTINGS.margin)
    rollout = next(q for q in r.node.requests if q.args is not None)
    assert rollout.args == tuple(log.record.chosen) and won.gpu not in (rollout.gpus or ())
    assert "rolled-out" in kinds(log) and kinds(log)[-1] == "stop"
    assert log.record.state == "done" and log.record.chosen[:1] == ["--max-mamba-cache-size"]
    # Every GPU runs the chosen flags, faster than it started.
    for g in range(4):
        assert merged(r.node.flags[g], log.record.chosen) == r.node.flags[g]
        assert modelled_tokens_per_s(REFERENCE_SIM, r.node.flags[g]) > start * 1.2
    assert '"state": "done"' in (tmp_path / "tune.json").read_text()


def test_a_candidate_that_dies_is_recorded_failed_and_the_others_are_measured(
        replay: Callable[..., Replay]) -> None:
    r = replay(dies={1: [CUDA_OOM]})
    log = r.tuning.run()
    failed = [s for s in log.record.steps if s.kind == "failed"]
    assert [s.gpu for s in failed] == [1] and "CUDA out of memory" in (failed[0].note or "")
    measured = [s.gpu for s in log.record.steps if s.kind == "measured"]
    assert measured[0] == 0 and 1 not in measured[:1]
    assert log.record.state == "done"


def test_with_no_candidate_started_the_next_has_more_memory_when_sglang_asks_for_it(
        replay: Callable[..., Replay]) -> None:
    r = replay(gpus=2, dies={0: [NOT_ENOUGH]})
    log = r.tuning.run()
    trying = [s for s in log.record.steps if s.kind == "trying"]
    assert trying[0].gpu == 0 and len(trying) >= 2
    def fraction(flags: Sequence[str] | None) -> float:
        flags = list(flags or ())
        return float(flags[flags.index("--mem-fraction-static") + 1])

    assert fraction(trying[1].flags) == pytest.approx(
        min(0.95, fraction(trying[0].flags) + MEM_FRACTION_STEP))
    assert trying[1].expected is None  # a retry, not a planned candidate


def test_with_no_candidate_started_for_another_reason_the_next_is_a_smaller_step(
        replay: Callable[..., Replay]) -> None:
    r = replay(gpus=2, dies={0: [CUDA_OOM]})
    entry, resolved = r.node.entry(0), r.node.resolved("http://gpu0.invalid")
    log = r.tuning.run()
    trying = [s for s in log.record.steps if s.kind == "trying"]
    first = list(trying[0].flags or ())
    # Halfway from the values the server ran with to the candidate that died.
    old = previous_values(entry, first, resolved)
    assert list(trying[1].flags or ()) == smaller_step(first, old) != first


def test_a_batch_that_never_fills_is_measured_once_two_windows_have_passed(
        replay: Callable[..., Replay]) -> None:
    r = replay(never_full={0, 1})
    log = r.tuning.run()
    steps = log.record.steps
    trying = next(s for s in steps if s.kind == "trying")
    measured = next(s for s in steps if s.kind == "measured")
    bound = min(FULL_WAIT_S, 2 * SETTINGS.window_s)
    waited = measured.at - trying.at - r.node.restart_s - SETTINGS.warmup_s - SETTINGS.window_s
    assert bound <= waited <= bound + SETTINGS.interval_s


def test_a_candidate_that_loses_goes_back_and_a_smaller_step_is_tried(
        replay: Callable[..., Replay]) -> None:
    r = replay(gpus=2, rate=lambda flags: 2000.0)  # no flag changes the rate: every one loses
    started = [r.node.entry(g).capacity for g in (0, 1)]
    log = r.tuning.run()
    steps = log.record.steps
    assert [s.kind for s in steps][:5] == ["baseline", "baseline", "trying", "measured", "lost"]
    assert steps[5].kind == "rolled-back" and steps[5].note == "done"
    first, second = [s.flags for s in steps if s.kind == "trying"][:2]
    rollback = r.node.requests[1].gpu_args or {}
    assert list(steps[6].flags or ()) == smaller_step(list(first or ()), list(rollback[0]))
    assert second == steps[6].flags
    assert log.record.chosen == [] and log.record.state == "done"
    # Every experiment went back: the GPUs run the pools they were started with.
    assert [r.node.entry(g).capacity for g in (0, 1)] == started and "won" not in kinds(log)


def test_candidates_measured_while_no_work_waits_go_back_and_the_tuning_stops(
        replay: Callable[..., Replay]) -> None:
    r = replay(empty_from=SETTINGS.window_s + 1)  # the job ends after the baseline
    log = r.tuning.run()
    assert kinds(log)[-1] == "stop" and "the queues are empty" in (log.record.steps[-1].note or "")
    assert "measured" not in kinds(log) and log.record.chosen == []
    back = r.node.requests[-1].gpu_args or {}
    assert sorted(back) == [0, 1]


def test_a_dry_run_records_the_plan_and_restarts_nothing(replay: Callable[..., Replay]) -> None:
    r = replay()
    log = r.tuning.run(dry_run=True)
    assert r.node.requests == [] and log.record.state == "dry-run"
    plans = [s for s in log.record.steps if s.kind == "plan"]
    assert [s.gpu for s in plans] == [0, 1, (0, 1)]
    assert "keep the best if it wins by 3%" in (plans[-1].note or "")


def test_redis_out_of_reach_costs_the_notes_never_the_tuning(
        replay: Callable[..., Replay], tmp_path: Path) -> None:
    with socket.socket() as held:  # bound, never listening: every connection is refused
        held.bind((HOST, 0))
        client = redis.Redis(host=HOST, port=held.getsockname()[1], socket_timeout=1,
                             socket_connect_timeout=1)
        notes = TuningNotes(Ledger(client))
        clock = FakeClock()
        fake = FakeNode(clock, tmp_path)
        tuning = Tuning(tmp_path, SETTINGS, probe=fake, restart=fake.restart, clock=clock,
                        notes=notes)
        try:
            log = tuning.run()
        finally:
            notes.close()
            client.close()
    assert log.record.state == "done" and "won" in kinds(log)
    assert notes.failed_at is not None


def test_up_tune_waits_while_the_node_is_idle_and_tunes_once_work_waits(
        replay: Callable[..., Replay]) -> None:
    def work_after_three_windows(node: FakeNode) -> None:
        node.queue = 40.0 if node.samples > 3 else 0.0

    r = replay(on_measure=work_after_three_windows)
    log = r.tuning.auto()
    assert log is not None and log.record.state == "done" and "won" in kinds(log)
    waited = r.tuning._waiting
    assert waited is not None
    notes = [s.note or "" for s in waited.record.steps]
    # Idle said once; then one window to see that the answers' KV stopped growing.
    assert notes[0] == "no queue yet: nothing binds" and len(notes) == 2
    assert notes[1].startswith("answers still building up")


def test_up_tune_records_why_when_work_waits_and_nothing_binds(
        replay: Callable[..., Replay]) -> None:
    r = replay(binding="unknown", gpus=2)
    log = r.tuning.auto()
    assert log is not None and r.node.requests == []
    assert kinds(log) == ["stop"] and log.record.steps[0].gpu is None
    assert log.record.state == "done"


def test_up_tune_leaves_no_record_when_the_node_stops_while_it_waits(
        replay: Callable[..., Replay]) -> None:
    import threading

    stop = threading.Event()

    def stop_after_two_windows(node: FakeNode) -> None:
        node.queue = 0.0
        if node.samples >= 2:
            stop.set()

    r = replay(stop=stop, on_measure=stop_after_two_windows)
    assert r.tuning.auto() is None
    assert r.node.requests == []


def test_tune_and_up_show_the_same_tuning_defaults() -> None:
    tune, up = tune_parser(), up_parser()
    defaults = TuneSettings()
    assert tune.get_default("margin") == up.get_default("tune_margin") == defaults.margin
    assert tune.get_default("window") == up.get_default("tune_window") == defaults.window_s
    assert TuneSettings.for_window(defaults.window_s) == defaults
    for text in (tune.format_help(), up.format_help()):
        flat = " ".join(text.split())
        assert f"(default: {defaults.margin})" in flat
        assert f"(default: {defaults.window_s})" in flat
