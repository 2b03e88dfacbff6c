"""`launcher tune`: the advice applied while a job runs, candidates measured side by side.

    python -m launcher tune [--window 60] [--margin 0.03] [--drain 30] [--width N] [--dry-run]

A `Tuning` runs these steps, one method each (`run` strings them together):

1. `baseline`: measure every ready GPU's tokens/s over a window, then `plan` up to `--width`
   candidates (default: half the GPUs), best predicted first: for a server bound by its Mamba
   slots, the slots and memory fraction its start-up lines say its memory holds (`_fit.py`)
   that run the most requests, the KV tokens a running request holds read from the window;
   an advised candidate the memory cannot hold is skipped with the reason. Otherwise the
   `advise` flags alone.
2. `try_candidates`: restart one GPU per candidate, all at once, each with its own flags (the
   node's arguments stay as they were); the other GPUs keep serving and are the reference.
   A restart drains for `--drain` seconds: the worker is told first, sends nothing more and
   hands back what it has not sent; what finishes within the drain is kept, what is cut is
   handed back and generated again elsewhere, at no attempt (`wait` waits for the longest
   answer instead, up to the node's --drain-timeout). A candidate that fails to start (CUDA
   OOM, Not enough memory) is rolled back by the supervisor itself; with none started,
   `retry_failed` tries more static memory (when SGLang asks for it) or a smaller step.
3. `settle`: wait until the restarted batches are full again (`wait_full`), then `--settle`.
4. `choose`: measure over the window against the reference (each one's tokens/s over the
   reference GPUs' mean, so a load change hits both sides) or, alone, against the baseline.
   The best wins by `--margin`, or all go back to their previous values (`roll_back`).
5. `roll_out`: a win goes to every other GPU at once (it started on this node already); then
   `next_round` plans the next candidates on the new state, until none is expected to win by
   the margin, nothing binds, no candidate is left or `--rounds` is reached.

Every step is printed and kept in `{run_dir}/tune.json` (`_tunelog.py`), which the supervisor
copies into node.json (`tune`). `--dry-run` prints the plan from one window of samples and
changes nothing.

`launcher up --tune` runs the same tuning by itself (`Tuning.auto`, in a thread of the
supervisor): once every server is ready it samples them until work waits in a queue
(`wait_for_work`), then tunes where a limit binds, once; it starts no restart while a GPU is
out. `TuneSettings` is the one source of both commands' defaults.

Clock, node probe and restart are parameters, as the supervisor's clock and spawn are, so
tests replay scripted tuning histories in virtual time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from fleetgen.commandline import CommandParser
from launcher.logs import read_log
from launcher.node._advise import QUEUE_EMPTY, Advice, Observed, advise, observe
from launcher.node._args import flag_value, split_flags
from launcher.node._errors import NodeError
from launcher.node._fit import Memory, candidates
from launcher.node._gpus import parse_gpu_spec
from launcher.node._restart import (
    RestartOutcome,
    follow_restart,
    new_request_id,
    send_restart,
)
from launcher.node._rundir import (
    DEFAULT_RUN_DIR,
    TUNE_FILE,
    NodeState,
    RestartRequest,
    ServerEntry,
    TuneRecord,
    read_state,
)
from launcher.node._tunelog import NODE_NOTES, TuneLog, TuningNotes

log = logging.getLogger(__name__)
# SGLang's own advice when the pools do not fit: the candidate is retried with a larger
# static memory fraction before its integer flags are halved, up to this fraction (above it
# the CUDA-graph capture runs out of memory on the reference GPU).
MEM_FRACTION_STEP, MAX_MEM_FRACTION = 0.02, 0.95
MORE_MEMORY = "increase --mem-fraction-static"
# Longest wait for a restarted server's batch to fill: a worker re-reads the cap of a server
# it sees restart at once, and every 30 s otherwise (FLEETGEN_CAPACITY_REFRESH_S): twice
# that and a margin.
FULL_WAIT_S = 75.0


@dataclass(frozen=True)
class TuneSettings:
    """How a tuning measures and decides (seconds unless named otherwise): the one source of
    the defaults of `launcher tune` and of `launcher up --tune`, whose help shows them."""

    window_s: float = 60.0
    interval_s: float = 2.0
    # After a restart the batch refills before the window starts.
    warmup_s: float = 10.0
    # Then, optionally, its answers turn over: a restarted server's running answers are all
    # young, so its KV pool binds only once the long ones have built up again. The memory
    # model, fed by a steady answer mix, keeps a candidate clear of that; the window only has
    # to confirm a win by the margin.
    settle_s: float = 0.0
    # A win is judged on a share, a GPU's tokens/s over its peers' at the same time, so a
    # load change hits both sides: that share moves well under 1% between windows of one job,
    # so a 3% win is real, and a wider margin would throw away steps a window tells apart.
    # `tune` and `up --tune` share it: one job's windows are as steady to either.
    margin: float = 0.03
    rounds: int = 10
    timeout_s: float = 1800.0
    # A tuning restart lets running answers finish this long, then cuts the rest (handed back
    # and generated again elsewhere, at no attempt); infinite waits for the longest one, up
    # to the node's --drain-timeout.
    drain_s: float = 30.0
    # Candidates measured at once, one per GPU (None: half the node's GPUs).
    width: int | None = None

    @classmethod
    def for_window(cls, window_s: float, drain_s: float | None = None,
                   margin: float | None = None) -> TuneSettings:
        """Settings scaled to one window (`up --tune-window`): 30 samples in it, a sixth of it
        to refill, half of it to drain unless `drain_s` says otherwise. The defaults' window
        gives the defaults."""
        return cls(window_s=window_s, interval_s=min(2.0, window_s / 30),
                   warmup_s=window_s / 6,
                   drain_s=window_s / 2 if drain_s is None else drain_s,
                   margin=cls.margin if margin is None else margin)


class TuneClock(Protocol):
    """Time as the tuning sees it; tests pass a fake that advances on `sleep`."""

    def now(self) -> float: ...

    def wall(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemTuneClock:
    """The real clock: monotonic for waits, wall time for the record; a sleep ends early once
    `stop` is set (the node stopping, `up --tune`)."""

    def __init__(self, stop: threading.Event | None = None) -> None:
        self.stop = stop

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if self.stop is not None:
            self.stop.wait(seconds)
        else:
            time.sleep(seconds)


class NodeProbe(Protocol):
    """What the tuning reads of its node; tests pass a scripted one."""

    def state(self) -> NodeState:
        """node.json as the supervisor wrote it last."""
        ...

    def measure(self, entries: Sequence[ServerEntry], window_s: float,
                interval_s: float) -> dict[int | None, Observed]:
        """Each server's means over a window of samples (one sample for a window of 0)."""
        ...

    def resolved(self, url: str) -> Mapping[str, object]:
        """A server's resolved arguments (/server_info); empty when it does not answer."""
        ...


# Asks the supervisor for one restart and follows it to its end: (request, timeout_s).
Restart = Callable[[RestartRequest, float], RestartOutcome]


class HttpNodeProbe:
    """The node under `run_dir`: its node.json, and its servers' /metrics and /server_info."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def state(self) -> NodeState:
        return read_state(self.run_dir) or NodeState()

    def measure(self, entries: Sequence[ServerEntry], window_s: float,
                interval_s: float) -> dict[int | None, Observed]:
        return asyncio.run(_measure(entries, window_s, interval_s))

    def resolved(self, url: str) -> Mapping[str, object]:
        return _resolved_args(url)


def restart_on(run_dir: Path) -> Restart:
    """Restart requests sent to the supervisor of `run_dir` and followed in its node.json."""
    def restart(request: RestartRequest, timeout_s: float) -> RestartOutcome:
        send_restart(run_dir, request)
        return follow_restart(run_dir, request.id, timeout_s)

    return restart


async def _measure(entries: Sequence[ServerEntry], window_s: float,
                   interval_s: float) -> dict[int | None, Observed]:
    from fleetgen.settings import setting  # here: launcher.node loads no settings reader

    api_key = setting("server_api_key")
    found = await asyncio.gather(*(observe(g.url, window_s, interval_s, api_key)
                                   for g in entries))
    return {g.gpu: o for g, o in zip(entries, found, strict=True)}


def _current(entry: ServerEntry, flag: str, resolved: Mapping[str, object]) -> str | None:
    """The value `flag` has on this server now: its argv, else what the server resolved."""
    value = flag_value(entry.server.argv, flag)
    if value is not None:
        return value
    if flag == "--max-mamba-cache-size":
        slots = entry.capacity.mamba_slots if entry.capacity else None
        return str(slots) if slots is not None else None
    found = resolved.get(flag.lstrip("-").replace("-", "_"))
    return str(found) if isinstance(found, (int, float)) and not isinstance(found, bool) else None


def previous_values(entry: ServerEntry, flags: Sequence[str],
                    resolved: Mapping[str, object]) -> list[str]:
    """The flags of a candidate set back to the values the server runs with now."""
    out: list[str] = []
    for name, _ in split_flags(flags):
        if name is not None and (value := _current(entry, name, resolved)) is not None:
            out += [name, value]
    return out


def smaller_step(flags: Sequence[str], before: Sequence[str]) -> list[str] | None:
    """Halfway from `before` to a failed candidate, integer flags only; None when no step is
    left (the same values as before)."""
    old = {name: tokens[1] for name, tokens in split_flags(before) if name and len(tokens) > 1}
    out, moved = [], False
    for name, tokens in split_flags(flags):
        value = tokens[1] if len(tokens) > 1 else None
        if name and value and value.isdigit() and old.get(name, "").isdigit():
            mid = (int(value) + int(old[name])) // 2
            moved |= mid != int(old[name])
            value = str(mid)
        out += [name or "", value] if value is not None else [name or ""]
    return out if moved else None


def more_memory(flags: Sequence[str], reason: str, current: str | None) -> list[str] | None:
    """The candidate with MEM_FRACTION_STEP more static memory than it asks (or, when it does
    not say, than the server's `current` fraction) when its start failed for lack of it
    (SGLang says so), within MAX_MEM_FRACTION; None otherwise."""
    if MORE_MEMORY not in reason:
        return None
    try:
        now = float(flag_value(flags, "--mem-fraction-static") or current or "nan")
    except ValueError:
        return None
    if not now < MAX_MEM_FRACTION:  # also when no fraction is known
        return None
    raised = f"{min(MAX_MEM_FRACTION, now + MEM_FRACTION_STEP):.2f}"
    return _merge(flags, ["--mem-fraction-static", raised])


def _resolved_args(url: str) -> Mapping[str, object]:
    """The server's resolved args from /server_info (mem_fraction_static and friends)."""
    from fleetgen.settings import setting  # here: launcher.node loads no settings reader

    headers = {"Authorization": f"Bearer {k}"} if (k := setting("server_api_key")) else {}
    try:
        body = httpx.get(f"{url}/server_info", timeout=10, trust_env=False, headers=headers).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def held_tokens(entry: ServerEntry, seen: Observed) -> float | None:
    """KV tokens one running request holds while it runs: the pool over the requests running
    when the pool binds (work queued, and the cap never reached in the window: a batch still
    filling queues below its cap too); else twice what each uses on average, as a running
    answer is on average halfway (None without figures)."""
    cap = entry.capacity
    tokens = cap.max_total_num_tokens if cap else None
    if tokens is None or not seen.running:
        return None
    if cap is not None and cap.effective and seen.queue is not None and seen.queue >= 1 \
            and seen.peak_running is not None and seen.peak_running < cap.effective:
        return tokens / seen.running
    if seen.kv_usage is None:
        return None
    return 2 * seen.kv_usage * tokens / seen.running


def pooled_held(entries: Sequence[ServerEntry],
                seen: Mapping[int | None, Observed]) -> float | None:
    """`held_tokens` over every GPU of the node at once, weighted by its running requests: the
    servers run one job's answers, and a long answer on one GPU says as much as on another
    (one GPU's few running answers are a noisy sample of a long-tailed length)."""
    found = [(h, seen[e.gpu].running or 0.0) for e in entries
             if e.gpu in seen and (h := held_tokens(e, seen[e.gpu])) is not None]
    weight = sum(w for _, w in found)
    return sum(h * w for h, w in found) / weight if weight else None


# The answers' mix is steady once the KV a running request holds grows by less than this
# from one window to the next: a job's first minutes run only young answers.
STEADY_GROWTH = 0.03
STEADY_WINDOWS = 8


def start_memory(entry: ServerEntry) -> Memory | None:
    """The memory `entry`'s latest start stated on its log (None where it did not)."""
    if not entry.server.log or not Path(entry.server.log).exists():
        return None
    report = read_log(entry.server.log)
    cap = entry.capacity
    ratio = report.capacity().ratio or (
        cap.mamba_slots // cap.effective if cap and cap.mamba_slots and cap.effective else None)
    return Memory.from_start(report.run, ratio)


@dataclass(frozen=True)
class Plan:
    """What to try next, best first: each candidate's flags and the gain expected (one
    candidate per experiment GPU), and the candidates the memory cannot hold (flags, why),
    skipped without a start."""

    tries: list[tuple[list[str], float | None]]
    skipped: list[tuple[list[str], str]] = field(default_factory=list)

    @property
    def expected(self) -> float | None:
        """The best candidate's expected gain."""
        return self.tries[0][1] if self.tries else None


def plan_next(entry: ServerEntry, seen: Observed, advice_flags: Sequence[str],
              advice_gain: float | None, ceiling: float, resolved: Mapping[str, object],
              width: int = 1, held: float | None = None) -> Plan:
    """Up to `width` candidates, best predicted first: for a server bound by its Mamba slots,
    the memory and step models' best (slots and fraction) up to `ceiling`, which its start-up
    lines say fits; the advice otherwise. An advised candidate the memory cannot hold is
    skipped with the reason. `held`: the KV tokens a running request holds (default: this
    server's own figure)."""
    memory = start_memory(entry)
    advised = [(list(advice_flags), advice_gain)] if advice_flags else []
    if memory is None or not advice_flags or "--max-mamba-cache-size" not in advice_flags:
        return Plan(advised)
    skipped: list[tuple[list[str], str]] = []
    slots = flag_value(advice_flags, "--max-mamba-cache-size")
    mfs = flag_value(advice_flags, "--mem-fraction-static") or _current(
        entry, "--mem-fraction-static", resolved)
    if slots and slots.isdigit() and mfs:
        fit = memory.fit(float(mfs), int(slots))
        if fit.refused:
            skipped.append((list(advice_flags), f"predicted: {fit.refused}"))
    now = _float(_current(entry, "--mem-fraction-static", resolved)) or ceiling
    found = candidates(memory, held if held is not None else held_tokens(entry, seen),
                       seen.running or 0.0, ceiling,
                       min(now, ceiling))
    if not found:
        return Plan([] if skipped else advised, skipped)
    return Plan([(list(c.flags), c.gain) for c in found[:max(1, width)]], skipped)


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _full(entry: ServerEntry, seen: Observed) -> bool:
    cap = entry.capacity.effective if entry.capacity else None
    if seen.queue is not None and seen.queue >= 1:
        return True
    return cap is not None and seen.running is not None and seen.running >= cap


def settled(history: Sequence[tuple[float, float]], span_s: float) -> bool:
    """Whether the running count (time, running) has not grown over the last `span_s`."""
    if not history or history[-1][0] - history[0][0] < span_s:
        return False
    cut = history[-1][0] - span_s
    before = max(r for t, r in history if t <= cut)
    return 0 < max(r for t, r in history if t > cut) <= before


def _share_of(seen: Mapping[int | None, Observed], gpu: int,
              reference: Sequence[int]) -> float | None:
    """GPU `gpu`'s tokens/s over the mean of the `reference` GPUs' (its peers serving on
    the flags being improved upon); over every other GPU's when none is left as reference."""
    peers: list[int | None] = [g for g in reference if g != gpu and g in seen] \
        or [g for g in seen if g != gpu]
    mine = seen[gpu].tokens_per_s
    others = [t for g in peers if (t := seen[g].tokens_per_s)]
    if mine is None or not others:
        return None
    return mine / (sum(others) / len(others))


def best_of(started: Sequence[int], shares: Mapping[int, float | None],
            seen: Mapping[int | None, Observed], first: int, margin: float) -> int:
    """The candidate kept of those `started`: the models' best (on GPU `first`) unless
    another measured better by `margin`, the least a window tells apart (one GPU's batch
    is fed by its worker batch by batch, and its rate moves by a few percent from window to
    window); the best measured when the models' best did not start."""
    def rate(g: int) -> float:
        return shares[g] or seen[g].tokens_per_s or 0.0

    top = max(started, key=rate)
    if first not in started or rate(top) > rate(first) * (1 + margin):
        return top
    return first


@dataclass(frozen=True)
class Trial:
    """One round's candidates: each experiment GPU's flags, the values they replace, the
    reference GPUs that keep serving, the resolved arguments they were read against, and
    those that started (the supervisor rolled the others back, `reason` says why)."""

    flags: dict[int, list[str]]
    before: dict[int, list[str]]
    reference: list[int]
    resolved: Mapping[str, object]
    started: list[int]
    reason: str


class Tuning:
    """One node's tuning, a step per method (see the module docstring); `run` tunes now,
    `auto` waits for work first (`up --tune`).

        tuning = Tuning.of_node(run_dir, TuneSettings())
        log = tuning.run(gpu=None, dry_run=False)      # the record, also in tune.json

    `probe` reads the node, `restart` asks its supervisor for a restart and follows it,
    `clock` sleeps and stamps; `stop` (`up --tune`) ends the tuning between steps when the
    node stops; `notes` publishes each step for `producer status`."""

    def __init__(self, run_dir: Path, settings: TuneSettings, *, probe: NodeProbe,
                 restart: Restart, clock: TuneClock | None = None,
                 stop: threading.Event | None = None, notes: TuningNotes | None = None) -> None:
        self.path = run_dir / TUNE_FILE
        self.settings, self.probe, self.restart = settings, probe, restart
        self.clock: TuneClock = clock or SystemTuneClock(stop)
        self.stop, self.notes = stop, notes or NODE_NOTES
        self.log = self.new_log()
        # Between steps: the node's GPUs, the experiment GPUs first (`order[0]` is the one the
        # models plan for, `order[width:]` the reference), the last window, the advice and the
        # candidates planned from it, and the share or tokens/s a candidate must beat.
        self.gpus: list[int] = []
        self.order: list[int] = []
        self.width = 1
        self.seen: dict[int | None, Observed] = {}
        self.entry: ServerEntry
        self.advice: Advice
        self.tries: list[tuple[list[str], float | None]] = []
        self.best_tps: float | None = None
        self.best_share: float | None = None
        self.restart_s = settings.window_s  # a restart's own time, until one is timed
        self._waiting: TuneLog | None = None

    @classmethod
    def of_node(cls, run_dir: Path, settings: TuneSettings,
                stop: threading.Event | None = None) -> Tuning:
        """The tuning of the node that `launcher up` runs under `run_dir`."""
        return cls(run_dir, settings, probe=HttpNodeProbe(run_dir),
                   restart=restart_on(run_dir), stop=stop)

    @property
    def exp(self) -> int:
        """The GPU the models plan for, the first experiment GPU."""
        return self.order[0]

    def new_log(self, record: TuneRecord | None = None) -> TuneLog:
        """A fresh record in tune.json."""
        return TuneLog(self.path, record or TuneRecord(), stop=self.stop, notes=self.notes,
                       wall=self.clock.wall)

    def run(self, gpu: int | None = None, *, dry_run: bool = False,
            baseline: Mapping[int | None, Observed] | None = None) -> TuneLog:
        """Tune now, experimenting first on `gpu` (default: the first ready one); `baseline`:
        a window just measured, taken as the baseline. Returns the record."""
        self.log = self.new_log()
        self.measure_baseline(gpu, baseline)
        if dry_run:
            self.show_plan()
            return self.log
        for _ in range(self.settings.rounds):
            if not self.tries:
                self.log.add(kind="stop", gpu=self.exp, note=self.advice.line())
                break
            if self.log.stopped or not self.round():
                break
        self.log.record.state = "done"
        self.log.save()
        return self.log

    def round(self) -> bool:
        """One round: candidates side by side, settled, measured, the best kept and rolled out
        or all rolled back; False when the tuning ends with it."""
        trial = self.try_candidates()
        if not trial.started:
            self.tries = self.retry_failed(trial)
            return True
        self.settle(trial.started)
        self.seen = self.measure()
        if all(o.queue is not None and o.queue < QUEUE_EMPTY for o in self.seen.values()):
            # No queue anywhere: the job is ending, no cap binds and the window says nothing
            # about the candidates; they go back like losers.
            back = self.restart_gpus({g: trial.before[g] for g in trial.started})
            self.log.add(kind="stop", gpu=trial.started, note="the queues are empty: nothing "
                         f"binds; back on the previous values ({back.state})")
            return False
        top, won = self.choose(trial)
        if not won:
            self.roll_back(trial, top)
            return True
        self.roll_out(trial, top)
        return self.next_round(trial, top)

    def measure_baseline(self, gpu: int | None,
                         baseline: Mapping[int | None, Observed] | None) -> None:
        """Step 1: every ready GPU's window (or `baseline`), recorded, and the first plan."""
        entries = self.ready()
        if not entries:
            raise NodeError("no ready GPU to tune (see `launcher status`)")
        self.gpus = [g.gpu for g in entries if g.gpu is not None]
        exp = gpu if gpu is not None else self.gpus[0]
        if exp not in self.gpus:
            raise NodeError(f"GPU {exp} is not ready (ready: {self.gpus})")
        # The experiment GPUs: `exp` first, then the next ones; the rest stay the reference.
        self.order = [exp, *(g for g in self.gpus if g != exp)]
        self.width = max(1, min(self.settings.width or len(self.gpus) // 2, len(self.gpus)))
        self.seen = dict(baseline) if baseline is not None and all(
            g in baseline for g in self.gpus) else self.measure(entries)
        for g in self.gpus:
            self.log.add(kind="baseline", gpu=g, tokens_per_s=self.seen[g].tokens_per_s,
                         note=f"{self.seen[g].running or 0:.0f} running, "
                              f"{self.seen[g].queue or 0:.0f} queued")
        self.entry = next(g for g in entries if g.gpu == exp)
        self.advice = advise(self.entry, self.seen[exp])
        self.tries = self.plan(self.entry, self.seen[exp], pooled_held(entries, self.seen)).tries
        self.best_tps = self.seen[exp].tokens_per_s
        self.best_share = _share_of(self.seen, exp, self.order[self.width:])

    def plan(self, entry: ServerEntry, seen: Observed, held: float | None) -> Plan:
        """`plan_next` for the experiment GPUs from the advice, its skipped candidates
        recorded."""
        plan = plan_next(entry, seen, self.advice.flags, self.advice.gain, MAX_MEM_FRACTION,
                         self.probe.resolved(entry.url), self.width, held)
        for flags, why in plan.skipped:
            self.log.add(kind="skipped", gpu=entry.gpu, flags=flags, note=why)
        return plan

    def show_plan(self) -> None:
        """`--dry-run`: the candidates, where they would be tried and how judged."""
        self.log.record.state = "dry-run"
        for g, (flags, expected) in zip(self.order, self.tries, strict=False):
            self.log.add(kind="plan", gpu=g, flags=flags, expected=expected,
                         note=self.advice.line())
        if self.tries:
            tried = self.order[:len(self.tries)]
            self.log.add(kind="plan", gpu=tried, note=(
                f"restart GPU {tried} with these flags, measure {self.settings.window_s:.0f} s "
                f"against GPUs {self.order[len(tried):] or 'own baseline'}, keep the best if "
                f"it wins by {self.settings.margin:.0%}, then roll it out to the others"))

    def try_candidates(self) -> Trial:
        """Step 2: restart one experiment GPU per candidate, all at once."""
        s = self.settings
        resolved = self.probe.resolved(self.entry.url)
        flags = {g: f for g, (f, _) in zip(self.order, self.tries, strict=False)}
        before = {g: previous_values(self.entry, f, resolved) for g, f in flags.items()}
        until = self.clock.wall() + self.restart_s + s.warmup_s + s.settle_s + s.window_s
        for g, (f, expected) in zip(flags, self.tries, strict=False):
            self.log.add(kind="trying", gpu=g, flags=f, expected=expected, until=until)
        began = self.clock.now()
        done = self.restart_gpus(flags)
        self.restart_s = self.clock.now() - began
        started = [g for g in flags if g in done.done]
        for g, f in flags.items():
            if g not in started:
                self.log.add(kind="failed", gpu=g, flags=f, note=done.reason[:300])
        return Trial(flags, before, [g for g in self.order if g not in flags], resolved,
                     started, done.reason)

    def retry_failed(self, trial: Trial) -> list[tuple[list[str], float | None]]:
        """With no candidate started: the models' one with more static memory where SGLang
        asked for it, else a smaller step toward it; nothing when no step is left."""
        first, before = trial.flags[self.exp], trial.before[self.exp]
        current = _current(self.entry, "--mem-fraction-static", trial.resolved)
        retry = more_memory(first, trial.reason, current) or smaller_step(first, before)
        return [(retry, None)] if retry else []

    def settle(self, gpus: Sequence[int]) -> None:
        """Step 3: until the restarted batches are full again, then `settle_s` more."""
        self.wait_full(gpus)
        self.clock.sleep(self.settings.settle_s)

    def choose(self, trial: Trial) -> tuple[int, bool]:
        """Step 4: the candidates' shares recorded, the best of them, and whether it won by
        the margin over the baseline's share (alone: its tokens/s)."""
        margin = self.settings.margin
        shares = {g: _share_of(self.seen, g, trial.reference) for g in trial.started}
        for g in trial.started:
            self.log.add(kind="measured", gpu=g, flags=trial.flags[g],
                         tokens_per_s=self.seen[g].tokens_per_s, share=shares[g],
                         share_before=self.best_share)
        top = best_of(trial.started, shares, self.seen, self.exp, margin)
        share, tps = shares[top], self.seen[top].tokens_per_s
        won = (share is not None and self.best_share is not None
               and share > self.best_share * (1 + margin)) \
            or (share is None and tps is not None and self.best_tps is not None
                and tps > self.best_tps * (1 + margin))
        self.log.add(kind="won" if won else "lost", gpu=top, flags=trial.flags[top],
                     tokens_per_s=tps, share=share, share_before=self.best_share)
        return top, won

    def roll_back(self, trial: Trial, top: int) -> None:
        """Every candidate that started back on its previous values; a smaller step toward
        the best one is next."""
        back = self.restart_gpus({g: trial.before[g] for g in trial.started})
        self.log.add(kind="rolled-back", gpu=trial.started, note=back.state)
        retry = smaller_step(trial.flags[top], trial.before[top])
        self.tries = [(retry, None)] if retry else []
        self.entry = next((g for g in self.ready() if g.gpu == self.exp), self.entry)

    def roll_out(self, trial: Trial, top: int) -> None:
        """Step 5: the winner becomes the node's arguments, on every other GPU at once (it
        started on this node's GPU; each one that fails is rolled back alone); the next
        experiments run where it did not start, against peers running it."""
        s, record = self.settings, self.log.record
        record.chosen = _merge(record.chosen, trial.flags[top])
        others = [g for g in self.gpus if g != top]
        if others and not self.log.stopped:
            self.log.add(kind="rolling-out", gpu=others, flags=record.chosen,
                         until=self.clock.wall() + self.restart_s + s.warmup_s + s.window_s)
            out = self.request(args=record.chosen, gpus=others)
            self.log.add(kind="rolled-out" if out.state == "done" else "rollout-failed",
                         gpu=others, flags=record.chosen, note=out.reason[:300])
        exp = others[0] if others else top
        self.order = [exp, *(g for g in self.gpus if g != exp)]

    def next_round(self, trial: Trial, top: int) -> bool:
        """The next candidates, planned on the winner's window; once all are full again, a
        new baseline. False when none is expected to win by the margin."""
        margin = self.settings.margin
        entries = self.ready()
        entry = next(g for g in entries if g.gpu == top)
        self.advice = advise(entry, self.seen[top])
        plan = self.plan(entry, self.seen[top], pooled_held(
            [e for e in entries if e.gpu in trial.started], self.seen))
        if plan.expected is None or plan.expected < margin:
            # The models say no candidate the memory holds beats this one by the margin, the
            # least a window can tell apart: no restart would be kept.
            self.log.add(kind="stop", gpu=top, flags=plan.tries[0][0] if plan.tries else None,
                         expected=plan.expected,
                         note=f"no candidate is expected to win by {margin:.0%}")
            return False
        self.wait_full(self.gpus)
        entries = self.ready()
        self.seen = self.measure(entries)
        self.best_tps = self.seen[self.exp].tokens_per_s
        self.best_share = _share_of(self.seen, self.exp, self.order[self.width:])
        self.entry = next(g for g in entries if g.gpu == self.exp)
        self.tries = plan.tries
        return True

    def auto(self) -> TuneLog | None:
        """`up --tune`: `wait_for_work`, then `run` once on the first GPU a limit binds, from
        that window; or record why not. None when the node stopped first."""
        found = self.wait_for_work()
        if found is None:
            return None
        if isinstance(found, TuneLog):
            return found
        gpu, seen = found
        return self.run(gpu, baseline=seen)

    def wait_for_work(self) -> tuple[int | None, dict[int | None, Observed]] | TuneLog | None:
        """Once every GPU is ready, sample them a window at a time until work waits in a queue
        and the answers' mix is steady (`still_young`): the GPU to tune and the window.
        Where nothing binds though work waits, the record saying why; None once stopped."""
        held: list[float] = []
        while True:
            self.clock.sleep(self.settings.interval_s)
            if self.stopped:
                return None
            if not self.probe.state().all_ready:
                continue
            entries = self.ready()
            seen = self.measure(entries)
            if self.stopped or not self.probe.state().all_ready:
                continue
            advice = [advise(e, seen[e.gpu]) for e in entries]
            bound = [a for a in advice if a.flags]
            if bound:
                if self.still_young(entries, seen, held):
                    continue
                return bound[0].gpu, seen
            if not all(a.binding == "idle" for a in advice):
                done = self.new_log(TuneRecord(state="done"))
                done.add(kind="stop", gpu=None, note="; ".join(a.line() for a in advice))
                return done
            if self._waiting is None:  # an idle node is waiting for a job: say so once
                self.waiting("no queue yet: nothing binds")

    def still_young(self, entries: Sequence[ServerEntry], seen: Mapping[int | None, Observed],
                    held: list[float]) -> bool:
        """Whether the KV a running request holds still grows by STEADY_GROWTH a window
        (`held`: its former windows), within STEADY_WINDOWS: a job's first minutes run young
        answers only, whose KV says too little of what the long ones will hold, and the
        memory model would overcommit."""
        now = pooled_held(entries, seen)
        if now is None or len(held) >= STEADY_WINDOWS or (
                held and now <= held[-1] * (1 + STEADY_GROWTH)):
            return False
        self.waiting(f"answers still building up: {now:,.0f} KV tokens per running request"
                     + (f", {held[-1]:,.0f} a window before" if held else ""))
        held.append(now)
        return True

    def waiting(self, note: str) -> None:
        """One more `waiting` step of the record kept while waiting for work."""
        self._waiting = self._waiting or self.new_log(TuneRecord(state="waiting"))
        self._waiting.add(kind="waiting", gpu=None, note=note)

    @property
    def stopped(self) -> bool:
        """Whether the node is stopping (`up --tune`)."""
        return self.stop is not None and self.stop.is_set()

    def ready(self) -> list[ServerEntry]:
        """The node's ready servers now."""
        return self.probe.state().ready

    def measure(self, entries: Sequence[ServerEntry] | None = None,
                window_s: float | None = None) -> dict[int | None, Observed]:
        """A window of samples of `entries` (default: the ready ones)."""
        s = self.settings
        return self.probe.measure(self.ready() if entries is None else entries,
                                  s.window_s if window_s is None else window_s, s.interval_s)

    def wait_full(self, gpus: Sequence[int]) -> None:
        """Wait `warmup_s`, then until each of `gpus` is full, within two windows (FULL_WAIT_S
        at most): it runs its cap or queues work, or its running count stopped growing for
        half a window (its KV pool binds first, and its worker keeps no queue). A worker
        learns a restarted server's cap once it sees it back, then takes batches until its
        server is full; a window measured before that measures the refill."""
        s = self.settings
        span_s = max(s.warmup_s, s.window_s / 2)
        self.clock.sleep(s.warmup_s)
        history: dict[int | None, list[tuple[float, float]]] = {}

        def full_or_stopped() -> bool:
            if self.log.stopped:
                return True
            entries = self.ready()
            seen = self.measure(entries, 0.0)
            now = self.clock.now()
            for g in entries:
                if seen[g.gpu].running is not None:
                    history.setdefault(g.gpu, []).append((now, seen[g.gpu].running or 0.0))
            full = {g.gpu: _full(g, seen[g.gpu]) or settled(history.get(g.gpu, []), span_s)
                    for g in entries}
            peers = [full[g] for g in full if g not in gpus]
            # Full, or no peer is either: the work is running out.
            return all(full.get(g, True) for g in gpus) or bool(peers and not any(peers))

        self.wait(full_or_stopped, min(FULL_WAIT_S, 2 * s.window_s), s.interval_s)

    def restart_gpus(self, gpu_args: Mapping[int, Sequence[str]]) -> RestartOutcome:
        """Each of these GPUs restarted with its own arguments, the node's untouched (an
        experiment or a rollback)."""
        return self.request(gpu_args=gpu_args)

    def request(self, *, args: Sequence[str] | None = None, gpus: Sequence[int] = (),
                gpu_args: Mapping[int, Sequence[str]] | None = None) -> RestartOutcome:
        """One restart request, started only while no GPU is out: `args` for `gpus` (the
        node's arguments from then on: a winner), or `gpu_args`, each GPU its own. All at
        once: candidates are measured side by side, and a winner started on this node
        already. `drain_s` bounds each server's drain (infinite: the node's
        --drain-timeout)."""
        s = self.settings
        self.wait(lambda: self.log.stopped or self.probe.state().all_ready, s.timeout_s, 0.5)
        if self.log.stopped:
            return RestartOutcome("failed", "the node is stopping")
        if not self.probe.state().all_ready:
            return RestartOutcome("failed", "another GPU stayed out; not restarting a second one")
        request = RestartRequest(
            new_request_id("t"), rolling=False,
            args=tuple(args) if args is not None else None,
            gpus=tuple(gpus) if gpus else None,
            gpu_args={g: tuple(a) for g, a in gpu_args.items()} if gpu_args is not None else None,
            drain_s=None if math.isinf(s.drain_s) else s.drain_s)
        outcome = self.restart(request, s.timeout_s)
        if outcome.state in ("done", "failed", "rejected"):
            return outcome
        # Not picked up is as good as turned down; still running after the timeout, failed.
        return dataclasses.replace(
            outcome, state="rejected" if outcome.state == "unacknowledged" else "failed")

    def wait(self, check: Callable[[], bool], timeout_s: float, interval_s: float) -> bool:
        """`check()` at once, every `interval_s` and at the deadline, on the tuning's clock
        (fleetgen.poll's rule, in virtual time under test); whether it came true."""
        deadline = self.clock.now() + timeout_s
        while not check():
            left = deadline - self.clock.now()
            if left <= 0:
                return False
            self.clock.sleep(min(interval_s, left))
        return True


def _merge(old: Sequence[str], new: Sequence[str]) -> list[str]:
    names = {n for n, _ in split_flags(new)}
    kept = [t for n, tokens in split_flags(old) if n not in names for t in tokens]
    return kept + list(new)


def drain_seconds(text: str) -> float:
    """`--drain`'s value: seconds, or `wait` (infinite) for the longest answer."""
    if text == "wait":
        return math.inf
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seconds or `wait`, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"seconds must be >= 0, not {text}")
    return value


# `--margin` and `up --tune-margin` say the same.
MARGIN_HELP = ("a candidate must beat the baseline by this share of tokens/s, measured "
               "against its peers")


def tune_parser() -> CommandParser:
    """`launcher tune`'s flags, their defaults TuneSettings'."""
    d = TuneSettings()
    p = CommandParser(
        prog="python -m launcher tune",
        description="Try candidate flags side by side on half the GPUs while the job runs; "
                    "keep the best where it wins, roll them back where they fail or lose.",
        epilog="examples:\n  python -m launcher tune --dry-run\n  python -m launcher tune "
               "--gpu 3 --window 120 --margin 0.05")
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR,
                   help="the launcher's run directory (node.json)")
    p.add_argument("--gpu", help="the GPU to experiment on (default: the first ready one)")
    p.add_argument("--window", type=float, default=d.window_s,
                   help="seconds of samples per measure (default: %(default)s)")
    p.add_argument("--interval", type=float, default=d.interval_s,
                   help="seconds between samples (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=d.warmup_s,
                   help="seconds after a restart before measuring, while the batch refills "
                        "(default: %(default)s)")
    p.add_argument("--margin", type=float, default=d.margin,
                   help=MARGIN_HELP + " (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help="candidates tried at most (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=d.timeout_s,
                   help="per restart, seconds (default: %(default)s)")
    p.add_argument("--drain", type=drain_seconds, default=d.drain_s,
                   help="seconds a restarted server's running answers may finish before the "
                        "rest are cut and handed back, or `wait` for the longest one (up to "
                        "the node's --drain-timeout; default: %(default)s)")
    p.add_argument("--settle", type=float, default=d.settle_s,
                   help="seconds the candidates serve, once their batches are full, before "
                        "they are measured: their long answers build up again (default: "
                        "%(default)s)")
    p.add_argument("--width", type=int, help="candidates measured at once, one per GPU "
                   "(default: half the GPUs; the rest serve as the reference)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--json", action="store_true", help="print tune.json at the end")
    return p


def cmd_tune(argv: Sequence[str]) -> int:
    """`launcher tune`: see the module docstring."""
    args = tune_parser().parse_args(list(argv))
    settings = TuneSettings(window_s=args.window, interval_s=args.interval,
                            warmup_s=args.warmup, settle_s=args.settle, margin=args.margin,
                            rounds=args.rounds, timeout_s=args.timeout, drain_s=args.drain,
                            width=args.width)
    gpu = parse_gpu_spec(args.gpu)[0] if args.gpu else None
    log = Tuning.of_node(args.run_dir, settings).run(gpu, dry_run=args.dry_run)
    if args.json:
        print(log.record.to_json())
    return 0
