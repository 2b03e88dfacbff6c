"""The supervisor's per-process steps: start a child, count its crashes, wait, stop it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from launcher.policy import Policy
from launcher.server import Clock, LaunchSpec, NodeError, ServerProcess, redacted, stop_process
from launcher.slot import Child, State

# The supervisor's logger: these lines were always logged as the supervisor's, and log
# filters and readers rely on that name.
log = logging.getLogger("launcher.supervisor")

Spawn = Callable[[LaunchSpec], ServerProcess]


class Lifecycle:
    """Supervisor mixin: the steps both the server and the worker loops are built from."""

    # Set by the supervisor's __init__.
    policy: Policy
    spawn: Spawn
    clock: Clock
    stop: asyncio.Event

    def changed(self) -> None:
        """Publish the current snapshot (the supervisor defines it)."""
        raise NotImplementedError

    def _start(self, child: Child) -> ServerProcess | None:
        child.starts += 1
        try:
            child.proc = self.spawn(child.spec)
        except (OSError, NodeError) as exc:
            child.proc, child.pid = None, None
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            child.last_reason = f"cannot start {child.spec.argv[0]}: {why}"
            return None
        child.pid = child.proc.pid
        self._set(child, "starting", child.last_reason)
        log.info("%s: starting (pid %d, start %d): %s", child.spec.name, child.pid,
                 child.starts, " ".join(redacted(child.spec.argv)))
        return child.proc

    def _crashed(self, child: Child, reason: str) -> bool:
        """Record a crash; False when the child is now stopped (crash loop or bad arguments)."""
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
            delay = self.policy.backoff(n)
            self._set(child, "restarting", reason)
            log.warning("%s: %s; restart %d in %.1f s", child.spec.name, reason, n, delay)
            return True
        self._set(child, "stopped", reason)
        log.error("%s: stopped: %s", child.spec.name, reason)
        return False

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
        code, killed = await stop_process(proc, self.clock, timeout if timeout is not None
                                          else self.policy.stop_timeout_s, self.policy.poll_s)
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
