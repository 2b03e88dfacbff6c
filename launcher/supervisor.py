"""Keep one SGLang server (and optionally one Celery worker) per GPU running.

    supervisor = Supervisor(slots, Policy(), probe=HttpProbe(), publish=write_state)
    exit_code = await supervisor.run()      # until SIGTERM/SIGINT; SIGHUP loads a restart order

Rules (README "launcher" "Supervision"):
- A server that exits, logs a fatal line while starting, misses its ready deadline or fails
  `/health` for `unhealthy_restart_s` is restarted after an exponential backoff.
- `crash_loop_count` crashes within `crash_loop_window_s` stop that GPU with the reason; so
  does exit code 2 (SGLang's argparse rejected the arguments: retrying cannot help). A
  restart order brings a stopped GPU back.
- A restart order (`restart --rolling`) drains and restarts GPUs one at a time, each ready
  before the next; a GPU whose new arguments fail goes back to its previous ones and the
  rollout stops there.
- Stop: SIGTERM to every process, a deadline, then SIGKILL of each process group.

Clock, process factory and probe are parameters, so tests replay scripted histories.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from launcher.lifecycle import Lifecycle, Spawn
from launcher.policy import Policy
from launcher.rollout import Order, OrderError, Rollouts
from launcher.server import (
    Clock,
    LaunchSpec,
    LogFollower,
    Probe,
    SystemClock,
    describe_exit,
    read_server,
    spawn,
    wait_ready,
)
from launcher.slot import Child, Slot, State

# Re-exported: node.py and the tests import these from here.
__all__ = ["Child", "Order", "OrderError", "Policy", "Slot", "Spawn", "State", "Supervisor"]

log = logging.getLogger(__name__)


# Restart orders (rollout.py) and per-process steps (lifecycle.py) are mixins sharing this
# object's state; this class holds the loops that keep each GPU's server and worker up.
class Supervisor(Rollouts, Lifecycle):
    """Runs the slots until stopped; publishes a snapshot on every change."""

    def __init__(
        self, slots: Sequence[Slot], policy: Policy, *, probe: Probe,
        spawn: Spawn = spawn, clock: Clock | None = None,
        publish: Callable[[dict[str, Any]], None] = lambda snapshot: None,
        load_order: Callable[[], Order | None] = lambda: None,
    ) -> None:
        self.slots = {slot.gpu: slot for slot in slots}
        self.policy, self.probe, self.spawn = policy, probe, spawn
        self.clock = clock or SystemClock()
        self.publish, self.load_order = publish, load_order
        self.stop = asyncio.Event()
        self.rollout: dict[str, Any] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def snapshot(self) -> dict[str, Any]:
        """Node state: supervisor pid, each GPU, the latest rollout."""
        return {"supervisor_pid": os.getpid(), "updated_at": self.clock.wall(),
                "gpus": [slot.to_json() for slot in self.slots.values()],
                "rollout": self.rollout}

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
                if self._crashed(child, reason):
                    await self._idle(lambda: slot.order is not None,
                                     self.policy.backoff(len(child.crashes)))
        finally:
            await self._stop_child(child)

    def _take_order(self, slot: Slot) -> LaunchSpec:
        """Switch the slot to its ordered spec, if any; returns the spec to fall back to."""
        previous = slot.server.spec
        if slot.order is not None:
            slot.server.spec, slot.pending = slot.order, slot.order_done
            slot.order, slot.order_done = None, None
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
            self._set(child, "restarting" if draining else child.state,
                      "draining for a restart" if draining else "launcher stopped")
            await self._stop_child(child, timeout=self.policy.drain_timeout_s if draining
                                   else self.policy.stop_timeout_s)
        return reason

    def _asked(self, slot: Slot) -> bool:
        return self.stop.is_set() or slot.order is not None

    async def _became_ready(self, slot: Slot, elapsed_s: float) -> None:
        assert slot.follower is not None
        info = await self.probe.server_info(slot.server.spec.url)
        slot.follower.poll()
        slot.reading = read_server(info, slot.follower.report)
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
            follower.poll()
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

    async def _keep_worker(self, slot: Slot) -> None:
        child = slot.worker
        assert child is not None
        try:
            await self._idle(lambda: slot.ever_ready)  # its gate would hold it anyway
            while not self.stop.is_set() and child.state != "stopped":
                reason = await self._worker_once(child)
                if reason is not None and self._crashed(child, reason):
                    await self._idle(lambda: False, self.policy.backoff(len(child.crashes)))
            await self._idle(lambda: False)
        finally:
            await self._stop_child(child)

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
