"""Keep one SGLang server (and optionally one Celery worker) per GPU running.

    supervisor = Supervisor(slots, Policy(), probe=HttpProbe(), publish=write_state)
    exit_code = await supervisor.run()      # until SIGTERM/SIGINT; SIGHUP loads a restart order

Rules (docs/guides/gpu-nodes.md#supervision-rules):
- A server that exits, logs a fatal line while starting, misses its ready deadline or fails
  `/health` for `unhealthy_restart_s` is restarted after an exponential backoff.
- `crash_loop_count` crashes within `crash_loop_window_s` stop that GPU with the reason; so
  does exit code 2 (SGLang's argparse rejected the arguments: retrying cannot help). A
  worker follows the same rules on its own. A restart order brings a stopped GPU back, its
  server or its worker (once the server is ready again).
- A restart order (`restart --rolling`) drains and restarts GPUs one at a time, each ready
  before the next; a GPU whose new arguments fail goes back to its previous ones and the
  rollout stops there.
- Stop: SIGTERM to every process, a deadline, then SIGKILL of each process group.

Per GPU the supervisor keeps a `Slot`: its server and optional worker, each a `Child` across
its restarts. `Policy` holds the timings and limits; a restart request becomes an `Order`.
Clock, process factory, probe and the backoff's random source are parameters, so tests replay
scripted histories.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import signal
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fleetgen.keys import RESTART_SIGNAL
from fleetgen.redact import redact_argv
from fleetgen.retry import backoff_delay
from launcher.child import ChildLike, stop_process_async
from launcher.errors import LauncherError
from launcher.node._clock import Clock, SystemClock
from launcher.node._errors import NodeError
from launcher.node._process import LaunchSpec, spawn
from launcher.node._rundir import NodeState, ProcessEntry, Rejected, Rollout, ServerEntry, State
from launcher.node._watch import (
    LogFollower,
    Probe,
    Reading,
    describe_exit,
    limits_reading,
    wait_ready,
)

# Named for the supervisor, not this module: log filters and readers rely on that name.
log = logging.getLogger("launcher.supervisor")

Spawn = Callable[[LaunchSpec], ChildLike]


@dataclass(frozen=True)
class Policy:
    """Supervision timings and limits (seconds unless named otherwise)."""

    # A large model loads its weights and captures CUDA graphs in minutes; 30 min is a hang.
    ready_timeout_s: float = 1800.0
    # Each round reads the log tail and polls the process; a quarter second keeps restarts
    # quick at a negligible cost.
    poll_s: float = 0.25
    # SGLang logs the root cause a few lines after `Scheduler hit an exception`, then exits -9.
    fatal_grace_s: float = 5.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    crash_loop_count: int = 5
    crash_loop_window_s: float = 600.0
    # On shutdown, workers requeue unfinished batches, so a short deadline loses no work.
    stop_timeout_s: float = 30.0
    # A rolling restart lets in-flight requests finish: long thinking answers take minutes.
    drain_timeout_s: float = 300.0
    health_interval_s: float = 5.0
    # /health may take 20 s under load (§4.1); three minutes of failures is a hung server.
    unhealthy_restart_s: float = 180.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")
        if self.crash_loop_count < 1 or self.poll_s <= 0:
            raise ValueError("crash_loop_count must be >= 1 and poll_s > 0")

    def backoff(self, recent_crashes: int,
                uniform: Callable[[float, float], float] = random.uniform) -> float:
        """Delay before the next start: the project's one backoff (fleetgen/retry.py), a random
        wait up to the initial delay doubled per recent crash, capped; servers that died
        together do not start again in lockstep. `uniform` is the random source."""
        return backoff_delay(recent_crashes, self.backoff_initial_s, self.backoff_max_s, uniform)


@dataclass
class Child:
    """One supervised process (a server or a worker) across its restarts."""

    spec: LaunchSpec
    state: State = "starting"
    since: float = 0.0
    pid: int | None = None
    starts: int = 0
    last_reason: str | None = None
    crashes: deque[float] = field(default_factory=deque)
    proc: ChildLike | None = None

    def entry(self) -> ProcessEntry:
        """Its node.json entry (the argv with secrets masked)."""
        return ProcessEntry(name=self.spec.name, pid=self.pid, state=self.state,
                            since=self.since, restarts=max(self.starts - 1, 0),
                            last_reason=self.last_reason, log=str(self.spec.log_path),
                            argv=tuple(redact_argv(self.spec.argv)))


@dataclass
class Slot:
    """One server (on one GPU, or several: `gpus`), its optional worker, and a pending
    restart order; known by its lead GPU `gpu`."""

    gpu: int
    server: Child
    worker: Child | None = None
    reading: Reading | None = None
    ready_s: float | None = None
    follower: LogFollower | None = None
    order: LaunchSpec | None = None  # a restart order not yet taken
    order_drain_s: float | None = None  # its drain, when it sets one
    order_done: asyncio.Future[str | None] | None = None
    pending: asyncio.Future[str | None] | None = None  # the order being started
    orders: int = 0  # restart orders given so far: a stopped worker waits for the next one
    ever_ready: bool = False
    # Every GPU the server holds, `gpu` (its lead) first; empty means `gpu` alone.
    gpus: tuple[int, ...] = ()

    def entry(self) -> ServerEntry:
        """Its node.json entry."""
        return ServerEntry(gpu=self.gpu, server=self.server.entry(),
                           gpus=self.gpus or (self.gpu,), port=self.server.spec.port,
                           url=self.server.spec.url, ready_s=self.ready_s,
                           capacity=self.reading, peak_running=self.peak_running,
                           worker=self.worker.entry() if self.worker else None)

    @property
    def peak_running(self) -> int | None:
        """The most requests its log showed running at once since this start (None before any
        decode batch): the load `status` advises from."""
        return self.follower.report.run.peak_running if self.follower else None


@dataclass(frozen=True)
class Order:
    """Restart these GPUs with these specs (the same spec to just restart); from SIGHUP."""

    id: str
    specs: Mapping[int, LaunchSpec]
    rolling: bool = True
    # How long a server's running requests may finish before the rest are cut (None: the
    # policy's drain_timeout_s).
    drain_s: float | None = None


class OrderError(NodeError):
    """A restart request that cannot be carried out (e.g. its new arguments are invalid)."""

    def __init__(self, order_id: str, reason: str) -> None:
        super().__init__(reason)
        self.order_id, self.reason = order_id, reason


class Supervisor:
    """Runs the slots until stopped; publishes a snapshot on every change.

    `header` holds what node.json says of the node as started (run dir, sim, ...); each
    snapshot is it with this supervisor's pid, each GPU and the latest rollout filled in."""

    def __init__(
        self, slots: Sequence[Slot], policy: Policy, *, probe: Probe,
        spawn: Spawn = spawn, clock: Clock | None = None,
        publish: Callable[[NodeState], None] = lambda snapshot: None,
        load_order: Callable[[], Order | None] = lambda: None,
        header: NodeState | None = None,
        uniform: Callable[[float, float], float] = random.uniform,
    ) -> None:
        self.slots = {slot.gpu: slot for slot in slots}
        self.policy, self.probe, self.spawn, self.uniform = policy, probe, spawn, uniform
        self.clock = clock or SystemClock()
        self.publish, self.load_order = publish, load_order
        self.header = header or NodeState()
        self.stop = asyncio.Event()
        self.rollout: Rollout | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def snapshot(self) -> NodeState:
        """Node state: supervisor pid, each GPU, the latest rollout."""
        return dataclasses.replace(
            self.header, supervisor_pid=os.getpid(), updated_at=self.clock.wall(),
            gpus=tuple(slot.entry() for slot in self.slots.values()), rollout=self.rollout)

    def changed(self) -> None:
        """Publish the current snapshot (the state file is rewritten on every change)."""
        self.publish(self.snapshot())

    async def run(self, install_signals: bool = True) -> int:
        """Supervise until stop (SIGTERM/SIGINT) or until every GPU is stopped; 1 in that case."""
        loop = asyncio.get_running_loop()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop.set)
            loop.add_signal_handler(signal.SIGHUP, self.hangup)
        try:
            for slot in self.slots.values():
                self._tasks.append(asyncio.create_task(self._keep_server(slot)))
                if slot.worker is not None:
                    self._tasks.append(asyncio.create_task(self._keep_worker(slot)))
            self.changed()
            while not self.stop.is_set() and not self._all_stopped():
                await self.clock.sleep(self.policy.poll_s)
            if not self.stop.is_set():
                log.error("node: every GPU is stopped; nothing left to supervise")
                return 1
            return 0
        finally:
            await self.shutdown()
            if install_signals:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    loop.remove_signal_handler(sig)

    def _all_stopped(self) -> bool:
        return all(s.server.state == "stopped" and s.order is None for s in self.slots.values())

    async def shutdown(self) -> None:
        """Stop every process: SIGTERM, the stop deadline, SIGKILL of each group."""
        if not self.stop.is_set():
            self.stop.set()
        for task in self._tasks:
            task.cancel()  # each task's `finally` stops its own process
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self.changed()

    # Restart orders: accepted or rejected here; each GPU's own loop takes its new spec.

    def hangup(self) -> None:
        """SIGHUP: load a restart order (written by `launcher restart`) and start it."""
        try:
            order = self.load_order()
        except OrderError as exc:
            self._reject(exc.order_id, exc.reason)
            return
        except Exception:  # a broken request file must not take the node down
            log.exception("node: cannot load the restart request")
            return
        if order is not None:
            self.submit(order)
        else:  # no request: republish, so node.json picks up what `tune` wrote beside it
            self.changed()

    def _reject(self, order_id: str, reason: str) -> None:
        self.rollout = dataclasses.replace(self.rollout or Rollout(),
                                           rejected=Rejected(order_id, reason))
        log.warning("node: restart %s rejected: %s", order_id, reason)
        self.changed()

    def submit(self, order: Order) -> None:
        """Start a rollout, unless one is running (then the order is recorded as rejected)."""
        unknown = sorted(set(order.specs) - set(self.slots))
        if (self.rollout is not None and self.rollout.state == "running") or unknown:
            why = f"GPU {unknown} not on this node" if unknown else \
                f"restart {self.rollout.id if self.rollout else ''} is still running"
            self._reject(order.id, why)
            return
        self.rollout = Rollout(id=order.id, state="running", rolling=order.rolling,
                               gpus=tuple(sorted(order.specs)))
        self._tasks.append(asyncio.create_task(self._roll(order)))
        self.changed()

    async def _roll(self, order: Order) -> None:
        gpus = sorted(order.specs)
        log.info("node: restart %s of GPU %s (%s)", order.id, gpus,
                 "rolling" if order.rolling else "all at once")
        batches = [[g] for g in gpus] if order.rolling else [gpus]
        for n, batch in enumerate(batches):
            # Replaced, never changed in place: a rejection recorded meanwhile stays.
            assert self.rollout is not None
            self.rollout = dataclasses.replace(self.rollout,
                                               current=batch[0] if order.rolling else None)
            self.changed()
            results = await asyncio.gather(*(self._order(g, order.specs[g], order.drain_s)
                                             for g in batch))
            failed = [(g, why) for g, why in zip(batch, results, strict=True) if why is not None]
            done = self.rollout.done + tuple(g for g in batch if g not in dict(failed))
            if failed:
                rest = [g for b in batches[n + 1:] for g in b]
                untouched = f"; GPU {rest} not restarted" if rest else ""
                reason = "; ".join(f"GPU {g}: {why} (back on its previous arguments)"
                                   for g, why in failed) + untouched
                self.rollout = dataclasses.replace(self.rollout, done=done, state="failed",
                                                   current=None, reason=reason)
                log.error("node: restart %s failed: %s", order.id, reason)
                self.changed()
                return
            self.rollout = dataclasses.replace(self.rollout, done=done)
        assert self.rollout is not None
        self.rollout = dataclasses.replace(self.rollout, state="done", current=None)
        log.info("node: restart %s done", order.id)
        self.changed()

    def _order(self, gpu: int, spec: LaunchSpec,
               drain_s: float | None) -> asyncio.Future[str | None]:
        slot = self.slots[gpu]
        slot.order, slot.order_drain_s = spec, drain_s
        slot.orders += 1
        slot.order_done = asyncio.get_running_loop().create_future()
        return slot.order_done

    # The server loop: start, wait for ready, serve until it dies, hangs or is told to stop.

    async def _keep_server(self, slot: Slot) -> None:
        child = slot.server
        try:
            while not self.stop.is_set():
                if child.state == "stopped" and slot.order is None:
                    await self._idle(lambda: slot.order is not None)
                    continue
                previous = self._take_order(slot)
                reason = await self._run_once(slot)
                pending, slot.pending = slot.pending, None
                if pending is not None and not pending.done():  # the new spec never got ready
                    child.spec = previous
                    pending.set_result(reason or "interrupted")
                    self._set(child, "restarting", f"new arguments failed: {reason}")
                    continue
                if self.stop.is_set() or reason is None:
                    continue
                delay = self._crashed(child, reason)
                if delay is not None:
                    await self._idle(lambda: slot.order is not None, delay)
        finally:
            await self._stop_child(child)

    def _take_order(self, slot: Slot) -> LaunchSpec:
        """Switch the slot to its ordered spec, if any; returns the spec to fall back to."""
        previous = slot.server.spec
        if slot.order is not None:
            slot.server.spec, slot.pending = slot.order, slot.order_done
            slot.order, slot.order_done, slot.order_drain_s = None, None, None
            slot.server.crashes.clear()  # new arguments, a fresh crash history
        return previous

    async def _run_once(self, slot: Slot) -> str | None:
        """Start the server, serve until it ends; the crash reason, or None when asked to stop."""
        child = slot.server
        slot.follower = follower = LogFollower(child.spec.log_path)
        proc = self._start(child)
        if proc is None:
            return child.last_reason
        outcome = await wait_ready(
            proc, child.spec, follower, self.probe, self.clock, self.policy.ready_timeout_s,
            self.policy.poll_s, self.policy.fatal_grace_s, interrupted=lambda: self._asked(slot))
        if not outcome.ready:
            if outcome.reason != "interrupted":  # say why now; a hung process takes a while
                self._set(child, "crashed", outcome.reason)
            await self._stop_child(child, quiet=True)
            return None if outcome.reason == "interrupted" else outcome.reason
        await self._became_ready(slot, outcome.elapsed_s)
        reason = await self._serve(slot)
        if reason is None:  # asked to restart (drain) or to stop
            draining = not self.stop.is_set()
            drain_s = self.policy.drain_timeout_s if slot.order_drain_s is None \
                else slot.order_drain_s
            self._set(child, "restarting" if draining else child.state,
                      f"draining for a restart (up to {drain_s:g} s)" if draining
                      else "launcher stopped")
            if draining:
                self._announce_restart(slot)
            await self._stop_child(child, timeout=drain_s if draining
                                   else self.policy.stop_timeout_s)
        return reason

    def _announce_restart(self, slot: Slot) -> None:
        """Tell the slot's worker its server is about to drain and restart (RESTART_SIGNAL):
        it sends nothing more, hands back what it has not sent, keeps what finishes within
        the drain and hands back what is cut, at no attempt; it takes work again once the
        server is back."""
        proc = slot.worker.proc if slot.worker is not None else None
        if proc is not None:
            proc.send_signal(RESTART_SIGNAL)

    def _asked(self, slot: Slot) -> bool:
        return self.stop.is_set() or slot.order is not None

    async def _became_ready(self, slot: Slot, elapsed_s: float) -> None:
        assert slot.follower is not None
        info = await self.probe.server_info(slot.server.spec.url)
        slot.follower.poll()
        slot.reading = limits_reading(info, slot.follower.report)
        slot.ready_s, slot.ever_ready = elapsed_s, True
        if slot.pending is not None and not slot.pending.done():
            slot.pending.set_result(None)
        self._set(slot.server, "ready", slot.server.last_reason)
        log.info("%s: ready on port %s in %.1f s (pid %s): %s", slot.server.spec.name,
                 slot.server.spec.port, elapsed_s, slot.server.pid, slot.reading.summary())

    async def _serve(self, slot: Slot) -> str | None:
        """Watch a ready server; the reason it died or hung, or None when asked to stop."""
        child, follower = slot.server, slot.follower
        assert child.proc is not None and follower is not None
        bad_since: float | None = None
        next_probe = self.clock.now() + self.policy.health_interval_s
        while not self._asked(slot):
            peak = slot.peak_running
            follower.poll()
            if slot.peak_running != peak:
                self.changed()
            code = child.proc.poll()
            if code is not None:
                follower.poll(final=True)
                return describe_exit(code, follower) + " (while serving)"
            if self.policy.unhealthy_restart_s > 0 and self.clock.now() >= next_probe:
                healthy = await self.probe.healthy(child.spec.url)
                next_probe = self.clock.now() + self.policy.health_interval_s
                bad_since = None if healthy else (bad_since or self.clock.now())
                if bad_since is not None and \
                        self.clock.now() - bad_since >= self.policy.unhealthy_restart_s:
                    await self._stop_child(child, quiet=True)
                    return f"/health failed for {self.clock.now() - bad_since:.0f} s; restarted"
            await self.clock.sleep(self.policy.poll_s)
        return None

    # The worker loop: start once the server was ready; restart after a backoff; once stopped,
    # start again after the next restart order of its server.

    async def _keep_worker(self, slot: Slot) -> None:
        child = slot.worker
        assert child is not None
        try:
            await self._idle(lambda: slot.ever_ready)  # its gate would hold it anyway
            while not self.stop.is_set():
                reason = await self._worker_once(child)
                if reason is None:  # the node stops
                    continue
                delay = self._crashed(child, reason)
                if delay is not None:
                    await self._idle(lambda: False, delay)
                    continue
                # Stopped (a crash loop, bad arguments): a restart order for its GPU brings it
                # back, with a fresh crash history, once its server is ready again (not while
                # it drains: the restart's signal would find the worker not yet listening).
                await self._next_order(slot)
                child.crashes.clear()
        finally:
            await self._stop_child(child)

    async def _next_order(self, slot: Slot) -> None:
        """Wait until the slot's server is given a restart order, has taken it and is ready
        again (or the node stops)."""
        given = slot.orders
        await self._idle(lambda: slot.orders != given)
        await self._idle(lambda: slot.order is None and slot.server.state == "ready"
                         and (slot.pending is None or slot.pending.done()))

    async def _worker_once(self, child: Child) -> str | None:
        """Run the worker until it exits (the reason) or the node stops (None)."""
        follower = LogFollower(child.spec.log_path)
        proc = self._start(child)
        if proc is None:
            return child.last_reason
        self._set(child, "running", child.last_reason)
        await self._idle(lambda: proc.poll() is not None)
        code = proc.poll()
        if code is None:
            return None
        follower.poll(final=True)
        return describe_exit(code, follower)

    # Per-process steps both loops are built from.

    def _start(self, child: Child) -> ChildLike | None:
        child.starts += 1
        try:
            child.proc = self.spawn(child.spec)
        except (OSError, LauncherError) as exc:
            child.proc, child.pid = None, None
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            child.last_reason = f"cannot start {child.spec.argv[0]}: {why}"
            return None
        child.pid = child.proc.pid
        self._set(child, "starting", child.last_reason)
        log.info("%s: starting (pid %d, start %d): %s", child.spec.name, child.pid,
                 child.starts, " ".join(redact_argv(child.spec.argv)))
        return child.proc

    def _crashed(self, child: Child, reason: str) -> float | None:
        """Record a crash; the wait before its restart (the one logged), or None when the child
        is now stopped (crash loop or bad arguments)."""
        now = self.clock.now()
        child.crashes.append(now)
        while child.crashes and now - child.crashes[0] > self.policy.crash_loop_window_s:
            child.crashes.popleft()
        n, window_min = len(child.crashes), self.policy.crash_loop_window_s / 60
        if n >= self.policy.crash_loop_count:
            reason = (f"crash loop: {n} crash{'es' if n > 1 else ''} in {window_min:g} min; "
                      f"last: {reason}")
        elif "(bad arguments)" in reason:
            reason = f"{reason}; fix the arguments, then `launcher restart`"
        else:
            delay = self.policy.backoff(n, self.uniform)
            self._set(child, "restarting", reason)
            log.warning("%s: %s; restart %d in %.1f s", child.spec.name, reason, n, delay)
            return delay
        self._set(child, "stopped", reason)
        log.error("%s: stopped: %s", child.spec.name, reason)
        return None

    async def _idle(self, until: Callable[[], bool], seconds: float | None = None) -> None:
        """Wait until `until()`, stop, or `seconds` passed (forever when None)."""
        deadline = None if seconds is None else self.clock.now() + seconds
        while not (self.stop.is_set() or until()):
            left = self.policy.poll_s if deadline is None else deadline - self.clock.now()
            if left <= 0:
                return
            await self.clock.sleep(min(left, self.policy.poll_s))

    async def _stop_child(self, child: Child, timeout: float | None = None,
                          quiet: bool = False) -> None:
        proc = child.proc
        if proc is None:
            if self.stop.is_set() and child.state != "stopped":
                self._set(child, "stopped", child.last_reason)
            return
        # child.proc stays set until the process is gone: if this task is cancelled meanwhile,
        # its `finally` stops the same process again instead of forgetting it.
        code, killed = await stop_process_async(
            proc, timeout if timeout is not None else self.policy.stop_timeout_s,
            now=self.clock.now, sleep=self.clock.sleep, poll_s=self.policy.poll_s)
        child.proc = None
        if killed:
            log.warning("%s: pid %d ignored SIGTERM; killed its process group",
                        child.spec.name, proc.pid)
        elif not quiet:
            log.info("%s: pid %d exited with code %s", child.spec.name, proc.pid, code)
        if self.stop.is_set():
            self._set(child, "stopped", "launcher stopped")

    def _set(self, child: Child, state: State, reason: str | None) -> None:
        if state != child.state:
            child.since = self.clock.wall()
        child.state, child.last_reason = state, reason
        self.changed()
