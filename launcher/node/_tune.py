"""`launcher tune`: the advice applied while a job runs, candidates measured side by side.

    python -m launcher tune [--window 60] [--margin 0.05] [--drain 30] [--width N] [--dry-run]

1. Measure every ready GPU's tokens/s over a window (the baseline).
2. Plan up to `--width` candidates (default: half the GPUs), best predicted first: for a
   server bound by its Mamba slots, the slots and memory fraction its start-up lines say its
   memory holds (`_fit.py`) that run the most requests, the KV tokens a running request holds
   read from the window; an advised candidate the memory cannot hold is skipped with the
   reason. Otherwise the `advise` flags alone. Restart one GPU per candidate, all at once,
   each with its own flags (the node's arguments stay as they were); the other GPUs keep
   serving and are the reference.
3. A restart drains for `--drain` seconds: the worker is told first, sends nothing more and
   hands back what it has not sent; what finishes within the drain is kept, what is cut is
   handed back and generated again elsewhere, at no attempt (`wait` waits for the longest
   answer instead, up to the node's --drain-timeout).
4. A candidate that fails to start (CUDA OOM, Not enough memory) is rolled back by the
   supervisor itself; with none started, more static memory (when SGLang asks for it) or a
   smaller step toward it is tried next. Those that start are measured, once their batches
   are full again, over the window against the reference (each one's tokens/s over the
   reference GPUs' mean, so a load change hits both sides) or, alone, against the baseline.
   The best wins by `--margin`, or all go back to their previous values.
5. A win is rolled out to every other GPU at once (it started on this node already); then
   the next candidates are planned on the new state, until none is expected to win by the
   margin, nothing binds, no candidate is left or `--rounds` is reached.

Every step is printed and kept in `{run_dir}/tune.json`, which the supervisor copies into
node.json (`tune`). `--dry-run` prints the plan from one window of samples and changes nothing.

`launcher up --tune` runs the same tuning by itself (`auto_tune`, in a thread of the
supervisor): once every server is ready it samples them until work waits in a queue, then tunes
where a limit binds, once; it starts no restart while a GPU is out.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from fleetgen.commandline import CommandParser
from fleetgen.poll import poll
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
    REQUEST_FILE,
    TUNE_FILE,
    NodeState,
    RestartRequest,
    ServerEntry,
    TuneRecord,
    TuneStep,
    pid_alive,
    read_state,
    write_atomic,
)

if TYPE_CHECKING:
    from fleetgen.fleet import TuningNote
    from fleetgen.ledger import Ledger

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
    """How `tune` measures and decides (seconds unless named otherwise)."""

    window_s: float = 60.0
    interval_s: float = 2.0
    # After a restart the batch refills before the window starts.
    warmup_s: float = 10.0
    # Then, optionally, its answers turn over: a restarted server's running answers are all
    # young, so its KV pool binds only once the long ones have built up again. The memory
    # model, fed by a steady answer mix, keeps a candidate clear of that; the window only has
    # to confirm a win by the margin.
    settle_s: float = 0.0
    # A share of the node's tokens/s moves well under 1% between windows of one job (peers see
    # the same load), so a 3% win is real; the first advice gains far more.
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
    def for_window(cls, window_s: float, drain_s: float | None = None) -> TuneSettings:
        """Settings scaled to one window: 30 samples in it, a sixth of it to refill, half of
        it to drain unless `drain_s` says otherwise."""
        return cls(window_s=window_s, interval_s=min(2.0, window_s / 30),
                   warmup_s=window_s / 6,
                   drain_s=window_s / 2 if drain_s is None else drain_s)


@dataclass
class TuneLog:
    """The tuning's record, written to tune.json after each step."""

    path: Path
    record: TuneRecord = field(default_factory=TuneRecord)
    stop: threading.Event | None = None  # set when the node stops: signal the supervisor no more
    notes: TuningNotes = field(default_factory=lambda: NODE_NOTES)

    def add(self, kind: str, gpu: int | Sequence[int] | None, *,
            flags: Sequence[str] | None = None, tokens_per_s: float | None = None,
            share: float | None = None, share_before: float | None = None,
            expected: float | None = None, until: float | None = None,
            note: str | None = None) -> None:
        """Record one step, print it and save the record."""
        step = TuneStep(at=time.time(), kind=kind,
                        gpu=gpu if gpu is None or isinstance(gpu, int) else tuple(gpu),
                        flags=tuple(flags) if flags is not None else None,
                        tokens_per_s=tokens_per_s, share=share, share_before=share_before,
                        expected=expected, until=until, note=note)
        self.record.steps.append(step)
        print(step.describe(), flush=True)
        self.save()

    def save(self) -> None:
        write_atomic(self.path, self.record.to_json())
        self.notes.publish(self.record)
        # SIGHUP without a restart request makes the supervisor republish node.json with it.
        state = read_state(self.path.parent)
        pid = state.supervisor_pid if state else None
        if pid is not None and pid_alive(pid) and not self.stopped \
                and not (self.path.parent / REQUEST_FILE).exists():
            os.kill(pid, signal.SIGHUP)

    @property
    def stopped(self) -> bool:
        """Whether the node is stopping (`up --tune`): no more restarts or signals."""
        return self.stop is not None and self.stop.is_set()


class TuningNotes:
    """Publishes what the tuning does to the Redis of the node's workers (fg:tuning), where
    `producer status` shows it, and beats while it runs: the note of a running or waiting
    tuning is published again every REGISTRY_BEAT_S for as long as the thread that published
    it (the tuner) is alive, so the note of a tuning that died leaves `status` as a dead
    worker's entry does (fleetgen/fleet.py `TuningNote`). A Redis out of reach costs a note,
    never the tuning: it is tried again after RETRY_S, and each try waits TIMEOUT_S at most.

    `ledger`: where to publish (default: the Redis of REDIS_URL, connected at the first note);
    `beat_s`: the beat (default REGISTRY_BEAT_S). `close()` stops the beats, and so does the
    end of the tuner's thread. A node runs one tuning at a time: a process's share NODE_NOTES."""

    RETRY_S, TIMEOUT_S = 30.0, 2.0

    def __init__(self, ledger: Ledger | None = None, beat_s: float | None = None) -> None:
        self._ledger = ledger
        self._beat_s = beat_s
        self.failed_at: float | None = None
        # Held while a note is sent, so that a beat never lands after the note that ended it.
        self._lock = threading.Lock()
        self._note: TuningNote | None = None
        self._tuner: threading.Thread | None = None
        self._beating = False
        self._closed = threading.Event()

    @property
    def beating(self) -> bool:
        """Whether the latest note is published again every beat."""
        with self._lock:
            return self._beating

    def publish(self, record: TuneRecord) -> None:
        if not record.steps:
            return
        from fleetgen.fleet import THIS_HOST, TuningNote

        steps = record.steps
        line = "; ".join(dataclasses.replace(s, until=None).describe().removeprefix("tune: ")
                         for s in record.current)
        if record.chosen:
            line += f" (chosen `{' '.join(record.chosen)}`)"
        note = TuningNote(THIS_HOST, steps[-1].at, time.time(), record.state, line,
                          steps[-1].until)
        with self._lock:
            self._note, self._tuner = note, threading.current_thread()
            self._send(note)
            start = note.live and not self._beating and not self._closed.is_set()
            self._beating = self._beating or start
        if start:
            threading.Thread(target=self._beat, name="tuning-note", daemon=True).start()

    def close(self) -> None:
        """Publish no more beats (what was published expires on its own)."""
        self._closed.set()

    def _beat(self) -> None:
        from fleetgen.fleet import REGISTRY_BEAT_S

        beat_s = REGISTRY_BEAT_S if self._beat_s is None else self._beat_s
        while not self._closed.wait(beat_s):
            with self._lock:
                note, tuner = self._note, self._tuner
                if note is None or not note.live or tuner is None or not tuner.is_alive():
                    break
                self._send(dataclasses.replace(note, updated=time.time()))
        with self._lock:
            self._beating = False

    def _send(self, note: TuningNote) -> None:
        if self.failed_at is not None and time.monotonic() - self.failed_at < self.RETRY_S:
            return
        from fleetgen import redisconn
        from fleetgen.errors import FleetgenError
        from fleetgen.fleet import TUNING_SHOWN_S
        from fleetgen.ledger import Ledger
        from fleetgen.settings import Settings

        try:
            if self._ledger is None:
                settings = Settings.from_env()
                self._ledger = Ledger(redisconn.client(
                    settings.redis_url, settings.redis_master_name,
                    socket_timeout=self.TIMEOUT_S, socket_connect_timeout=self.TIMEOUT_S))
            why = self._ledger.registry.publish_tuning(note.node, note.to_json(), TUNING_SHOWN_S)
        except FleetgenError as exc:
            why = str(exc)
        self.failed_at = None if why is None else time.monotonic()
        if why is not None:
            log.info("tune: the note for `producer status` not published: %s", why)


# The one note of this process's tunings: `up --tune`'s wait for work and the tuning after it
# are two logs of one tuner, and one beat.
NODE_NOTES: TuningNotes = TuningNotes()


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


def _next(entry: ServerEntry, seen: Observed, advice: Advice,
          resolved: Mapping[str, object], log: TuneLog, width: int,
          held: float | None) -> Plan:
    """`plan_next` for the experiment GPUs, its skipped candidates recorded."""
    plan = plan_next(entry, seen, advice.flags, advice.gain, MAX_MEM_FRACTION, resolved, width,
                     held)
    for flags, why in plan.skipped:
        log.add(kind="skipped", gpu=entry.gpu, flags=flags, note=why)
    return plan


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _ready(run_dir: Path) -> list[ServerEntry]:
    return (read_state(run_dir) or NodeState()).ready


def all_ready(run_dir: Path) -> bool:
    """Whether every GPU of the node is ready (none is out: crashed, restarting, starting)."""
    return (read_state(run_dir) or NodeState()).all_ready


def wait_full(run_dir: Path, gpus: Sequence[int], warmup_s: float, interval_s: float,
              log: TuneLog, window_s: float) -> None:
    """Wait `warmup_s`, then until each of `gpus` is full, within two windows (FULL_WAIT_S at
    most): it runs its cap or queues work, or its running count stopped growing for half a
    window (its KV pool binds first, and its worker keeps no queue). A worker learns a
    restarted server's cap once it sees it back, then takes batches until its server is full;
    a window measured before that measures the refill."""
    settle_s = max(warmup_s, window_s / 2)
    time.sleep(warmup_s)
    history: dict[int | None, list[tuple[float, float]]] = {}

    def full_or_stopped() -> bool | None:
        if log.stopped:
            return True
        entries = _ready(run_dir)
        seen = asyncio.run(_measure(entries, 0.0, interval_s))
        now = time.monotonic()
        for g in entries:
            if seen[g.gpu].running is not None:
                history.setdefault(g.gpu, []).append((now, seen[g.gpu].running or 0.0))
        full = {g.gpu: _full(g, seen[g.gpu]) or settled(history.get(g.gpu, []), settle_s)
                for g in entries}
        peers = [full[g] for g in full if g not in gpus]
        # Full, or no peer is either: the work is running out.
        return True if all(full.get(g, True) for g in gpus) or (peers and not any(peers)) \
            else None

    poll(full_or_stopped, min(FULL_WAIT_S, 2 * window_s), interval_s)


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


def restart(run_dir: Path, log: TuneLog, timeout_s: float, drain_s: float, *,
            args: Sequence[str] | None = None, gpus: Sequence[int] = (),
            gpu_args: Mapping[int, Sequence[str]] | None = None,
            rolling: bool = True) -> RestartOutcome:
    """One restart request, started only while no GPU is out: `args` for `gpus` (the node's
    arguments from then on: a winner), or `gpu_args`, each GPU its own (an experiment or a
    rollback, the node's arguments untouched). Rolling (one at a time), or all at once for
    candidates measured side by side and for a winner that started on this node already.
    `drain_s` bounds each server's drain (infinite: the node's --drain-timeout)."""
    poll(lambda: True if log.stopped or all_ready(run_dir) else None, timeout_s, 0.5)
    if log.stopped:
        return RestartOutcome("failed", "the node is stopping")
    if not all_ready(run_dir):
        return RestartOutcome("failed", "another GPU stayed out; not restarting a second one")
    request = RestartRequest(
        new_request_id("t"), rolling=rolling,
        args=tuple(args) if args is not None else None,
        gpus=tuple(gpus) if gpus else None,
        gpu_args={g: tuple(a) for g, a in gpu_args.items()} if gpu_args is not None else None,
        drain_s=None if math.isinf(drain_s) else drain_s)
    send_restart(run_dir, request)
    outcome = follow_restart(run_dir, request.id, timeout_s)
    if outcome.state in ("done", "failed", "rejected"):
        return outcome
    # Not picked up is as good as turned down; still running after the timeout, failed.
    return dataclasses.replace(
        outcome, state="rejected" if outcome.state == "unacknowledged" else "failed")


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


def run_tune(run_dir: Path, gpu: int | None, window_s: float, interval_s: float,
             margin: float, rounds: int, warmup_s: float, timeout_s: float,
             dry_run: bool, stop: threading.Event | None = None, drain_s: float = math.inf,
             width: int | None = None, settle_s: float = 0.0,
             baseline: Mapping[int | None, Observed] | None = None) -> TuneLog:
    """Tune the node under `run_dir` (see the module docstring); returns the log. `stop`
    (`up --tune`) ends it between steps when the node stops. `width`: candidates measured at
    once, one per GPU (default: half the GPUs, the rest serving as reference); `settle_s`:
    how long the candidates serve, once full, before they are measured; `baseline`: a window
    just measured, taken as the baseline."""
    entries = _ready(run_dir)
    if not entries:
        raise NodeError("no ready GPU to tune (see `launcher status`)")
    gpus = [g.gpu for g in entries if g.gpu is not None]
    exp = gpu if gpu is not None else gpus[0]
    if exp not in gpus:
        raise NodeError(f"GPU {exp} is not ready (ready: {gpus})")
    # The experiment GPUs: `exp` first, then the next ones; the rest stay the reference.
    order = [exp, *(g for g in gpus if g != exp)]
    width = max(1, min(width or len(gpus) // 2, len(gpus)))
    log = TuneLog(run_dir / TUNE_FILE, stop=stop)
    seen = dict(baseline) if baseline is not None and all(g in baseline for g in gpus) \
        else asyncio.run(_measure(entries, window_s, interval_s))
    for g in gpus:
        log.add(kind="baseline", gpu=g, tokens_per_s=seen[g].tokens_per_s,
                note=f"{seen[g].running or 0:.0f} running, {seen[g].queue or 0:.0f} queued")
    entry = next(g for g in entries if g.gpu == exp)
    advice = advise(entry, seen[exp])
    plan = _next(entry, seen[exp], advice, _resolved_args(entry.url), log, width,
                 pooled_held(entries, seen))
    if dry_run:
        log.record.state = "dry-run"
        for g, (flags, expected) in zip(order, plan.tries, strict=False):
            log.add(kind="plan", gpu=g, flags=flags, expected=expected, note=advice.line())
        if plan.tries:
            tried = order[:len(plan.tries)]
            log.add(kind="plan", gpu=tried, note=f"restart GPU {tried} with these flags, "
                    f"measure {window_s:.0f} s against GPUs {order[len(tried):] or 'own baseline'}, "
                    f"keep the best if it wins by {margin:.0%}, then roll it out to the others")
        return log
    best_tps, best_share = seen[exp].tokens_per_s, _share_of(seen, exp, order[width:])
    tries = plan.tries
    restart_s = window_s  # a restart's own time, until one is timed
    for _ in range(rounds):
        if not tries:
            log.add(kind="stop", gpu=exp, note=advice.line())
            break
        if log.stopped:
            break
        resolved = _resolved_args(entry.url)
        trial: dict[int, list[str]] = {
            g: flags for g, (flags, _) in zip(order, tries, strict=False)}
        reference = [g for g in order if g not in trial]
        before = {g: previous_values(entry, flags, resolved) for g, flags in trial.items()}
        for g, (flags, expected) in zip(trial, tries, strict=False):
            log.add(kind="trying", gpu=g, flags=flags, expected=expected,
                    until=time.time() + restart_s + warmup_s + settle_s + window_s)
        began = time.time()
        done = restart(run_dir, log, timeout_s, drain_s, gpu_args=trial, rolling=False)
        restart_s = time.time() - began
        started = [g for g in trial if g in done.done]
        for g, flags in trial.items():
            if g not in started:
                log.add(kind="failed", gpu=g, flags=flags, note=done.reason[:300])
        if not started:
            first = trial[order[0]]
            retry = more_memory(first, done.reason, _current(
                entry, "--mem-fraction-static", resolved)) or smaller_step(first, before[order[0]])
            tries = [(retry, None)] if retry else []
            continue
        wait_full(run_dir, started, warmup_s, interval_s, log, window_s)
        if log.stop is not None:
            log.stop.wait(settle_s)
        else:
            time.sleep(settle_s)
        entries = _ready(run_dir)
        seen = asyncio.run(_measure(entries, window_s, interval_s))
        if all(o.queue is not None and o.queue < QUEUE_EMPTY for o in seen.values()):
            # No queue anywhere: the job is ending, no cap binds and the window says nothing
            # about the candidates; they go back like losers.
            back = restart(run_dir, log, timeout_s, drain_s,
                           gpu_args={g: before[g] for g in started}, rolling=False)
            log.add(kind="stop", gpu=started, note="the queues are empty: nothing binds; "
                    f"back on the previous values ({back.state})")
            break
        shares = {g: _share_of(seen, g, reference) for g in started}
        for g in started:
            log.add(kind="measured", gpu=g, flags=trial[g], tokens_per_s=seen[g].tokens_per_s,
                    share=shares[g], share_before=best_share)
        top = best_of(started, shares, seen, order[0], margin)
        share, tps = shares[top], seen[top].tokens_per_s
        won = (share is not None and best_share is not None
               and share > best_share * (1 + margin)) \
            or (share is None and tps is not None and best_tps is not None
                and tps > best_tps * (1 + margin))
        log.add(kind="won" if won else "lost", gpu=top, flags=trial[top], tokens_per_s=tps,
                share=share, share_before=best_share)
        if not won:
            back = restart(run_dir, log, timeout_s, drain_s,
                           gpu_args={g: before[g] for g in started}, rolling=False)
            log.add(kind="rolled-back", gpu=started, note=back.state)
            retry = smaller_step(trial[top], before[top])
            tries = [(retry, None)] if retry else []
            entries = _ready(run_dir)
            entry = next((g for g in entries if g.gpu == exp), entry)
            continue
        log.record.chosen = _merge(log.record.chosen, trial[top])
        others = [g for g in gpus if g != top]
        if others and not log.stopped:
            # A win pays on every GPU from now on: roll it out to the others at once (it
            # started on this node's GPU; each one that fails is rolled back alone), then
            # measure the next candidates against peers running it.
            log.add(kind="rolling-out", gpu=others, flags=log.record.chosen,
                    until=time.time() + restart_s + warmup_s + window_s)
            out = restart(run_dir, log, timeout_s, drain_s, args=log.record.chosen,
                          gpus=others, rolling=False)
            log.add(kind="rolled-out" if out.state == "done" else "rollout-failed", gpu=others,
                    flags=log.record.chosen, note=out.reason[:300])
        # The next experiments run where the winner did not start, against peers running it.
        exp = others[0] if others else top
        order = [exp, *(g for g in gpus if g != exp)]
        entries = _ready(run_dir)
        entry = next(g for g in entries if g.gpu == top)
        advice = advise(entry, seen[top])
        plan = _next(entry, seen[top], advice, _resolved_args(entry.url), log, width,
                     pooled_held([e for e in entries if e.gpu in started], seen))
        if plan.expected is None or plan.expected < margin:
            # The models say no candidate the memory holds beats this one by the margin, the
            # least a window can tell apart: no restart would be kept.
            log.add(kind="stop", gpu=top, flags=plan.tries[0][0] if plan.tries else None,
                    expected=plan.expected,
                    note=f"no candidate is expected to win by {margin:.0%}")
            break
        wait_full(run_dir, gpus, warmup_s, interval_s, log, window_s)
        entries = _ready(run_dir)
        seen = asyncio.run(_measure(entries, window_s, interval_s))
        best_tps, best_share = seen[exp].tokens_per_s, _share_of(seen, exp, order[width:])
        entry = next(g for g in entries if g.gpu == exp)
        tries = plan.tries
    log.record.state = "done"
    log.save()
    return log


def auto_tune(run_dir: Path, settings: TuneSettings, stop: threading.Event) -> TuneLog | None:
    """`up --tune`: once every GPU is ready, sample them a window at a time until work waits in
    a queue and the answers' mix is steady (the KV a running request holds stopped growing,
    STEADY_GROWTH, or STEADY_WINDOWS passed); then tune once where a limit binds (`run_tune`
    on that GPU, from that window), or record why not. Returns the log, or None when the node
    stopped first."""
    waiting: TuneLog | None = None
    held: list[float] = []
    while not stop.wait(settings.interval_s):
        if not all_ready(run_dir):
            continue
        entries = _ready(run_dir)
        seen = asyncio.run(_measure(entries, settings.window_s, settings.interval_s))
        if stop.is_set() or not all_ready(run_dir):
            continue
        advice = [advise(e, seen[e.gpu]) for e in entries]
        bound = [a for a in advice if a.flags]
        if bound:
            now = pooled_held(entries, seen)
            if now is not None and len(held) < STEADY_WINDOWS and (
                    not held or now > held[-1] * (1 + STEADY_GROWTH)):
                # A job's first minutes run young answers only: their KV says too little of
                # what the long ones will hold, and the memory model would overcommit.
                waiting = waiting or TuneLog(run_dir / TUNE_FILE, TuneRecord(state="waiting"),
                                             stop=stop)
                waiting.add(kind="waiting", gpu=None, note=(
                    f"answers still building up: {now:,.0f} KV tokens per running request"
                    + (f", {held[-1]:,.0f} a window before" if held else "")))
                held.append(now)
                continue
            return run_tune(run_dir, bound[0].gpu, settings.window_s, settings.interval_s,
                            settings.margin, settings.rounds, settings.warmup_s,
                            settings.timeout_s, False, stop, settings.drain_s, settings.width,
                            settings.settle_s, baseline=seen)
        if all(a.binding == "idle" for a in advice):
            if waiting is None:  # an idle node is waiting for a job: say so once, keep sampling
                waiting = TuneLog(run_dir / TUNE_FILE, TuneRecord(state="waiting"), stop=stop)
                waiting.add(kind="waiting", gpu=None, note="no queue yet: nothing binds")
            continue
        log = TuneLog(run_dir / TUNE_FILE, TuneRecord(state="done"), stop=stop)
        log.add(kind="stop", gpu=None, note="; ".join(a.line() for a in advice))
        return log
    return None


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


def cmd_tune(argv: Sequence[str]) -> int:
    """`launcher tune`: see the module docstring."""
    p = CommandParser(
        prog="python -m launcher tune",
        description="Try candidate flags side by side on half the GPUs while the job runs; "
                    "keep the best where it wins, roll them back where they fail or lose.",
        epilog="examples:\n  python -m launcher tune --dry-run\n  python -m launcher tune "
               "--gpu 3 --window 120 --margin 0.05")
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR,
                   help="the launcher's run directory (node.json)")
    p.add_argument("--gpu", help="the GPU to experiment on (default: the first ready one)")
    p.add_argument("--window", type=float, default=60.0, help="seconds of samples per measure")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds after a restart before measuring (the batch refills)")
    p.add_argument("--margin", type=float, default=0.05, help="a win must beat the baseline by "
                   "this share of tokens/s")
    p.add_argument("--rounds", type=int, default=10, help="candidates tried at most")
    p.add_argument("--timeout", type=float, default=1800.0, help="per restart, seconds")
    p.add_argument("--drain", type=drain_seconds, default=TuneSettings.drain_s,
                   help="seconds a restarted server's running answers may finish before the "
                        "rest are cut and handed back, or `wait` for the longest one (up to "
                        "the node's --drain-timeout; default: %(default)s)")
    p.add_argument("--settle", type=float, default=TuneSettings.settle_s,
                   help="seconds the candidates serve, once their batches are full, before "
                        "they are measured: their long answers build up again (default: "
                        "%(default)s)")
    p.add_argument("--width", type=int, help="candidates measured at once, one per GPU "
                   "(default: half the GPUs; the rest serve as the reference)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--json", action="store_true", help="print tune.json at the end")
    args = p.parse_args(list(argv))
    gpu = parse_gpu_spec(args.gpu)[0] if args.gpu else None
    log = run_tune(args.run_dir, gpu, args.window, args.interval, args.margin, args.rounds,
                   args.warmup, args.timeout, args.dry_run, drain_s=args.drain,
                   width=args.width, settle_s=args.settle)
    if args.json:
        print(log.record.to_json())
    return 0
