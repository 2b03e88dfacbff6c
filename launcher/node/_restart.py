"""One restart asked of a running supervisor and followed to its end: `launcher restart` and
`launcher tune` both restart servers this way.

    request = RestartRequest(new_request_id("r"), rolling=True, args=("--x", "1"))
    send_restart(run_dir, request)     # restart.json, then SIGHUP to the supervisor
    outcome = follow_restart(run_dir, request.id, timeout_s=600, shown=print_rollout)
    outcome.state                      # done, failed, rejected, unacknowledged, timed-out

The supervisor takes the request (docs/guides/gpu-nodes.md#restart) and shows its progress in
node.json's `rollout`; a request it turns down shows there as `rejected`. One it never picks
up within ACK_TIMEOUT_S (a supervisor stopping, or busy starting) counts as unacknowledged.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fleetgen.poll import poll
from launcher.node._errors import NodeError
from launcher.node._rundir import (
    REQUEST_FILE,
    RestartRequest,
    Rollout,
    pid_alive,
    read_state,
    write_atomic,
)

# How long a supervisor may take to show a request in node.json before it counts as not
# picked up: it loads the request on SIGHUP, at once unless its loop is busy for a moment.
ACK_TIMEOUT_S = 10.0
# node.json is rewritten on every change; a fifth of a second shows each step promptly.
FOLLOW_POLL_S = 0.2

Ended = Literal["running", "done", "failed", "rejected", "unacknowledged", "timed-out"]


@dataclass(frozen=True)
class RestartOutcome:
    """How following a restart ended: `running` only when asked to stop at its acceptance."""

    state: Ended
    reason: str = ""
    done: tuple[int, ...] = ()  # the GPUs restarted with the new arguments


def new_request_id(prefix: str) -> str:
    """`r142501-3fa2`: the prefix (`r` restart, `t` tune), the time, four random hex digits."""
    return f"{prefix}{time.strftime('%H%M%S')}-{secrets.token_hex(2)}"


def send_restart(run_dir: Path, request: RestartRequest) -> None:
    """Write `request` as restart.json and SIGHUP the supervisor; NodeError when none runs."""
    state = read_state(run_dir)
    pid = state.supervisor_pid if state else None
    if pid is None or not pid_alive(pid):
        raise NodeError(f"no running supervisor for run dir {run_dir}: start `launcher up`")
    write_atomic(run_dir / REQUEST_FILE, request.to_json())
    os.kill(pid, signal.SIGHUP)


def follow_restart(run_dir: Path, request_id: str, timeout_s: float,
                   shown: Callable[[Rollout], None] = lambda rollout: None,
                   until_accepted: bool = False) -> RestartOutcome:
    """Read node.json until restart `request_id` is done, failed or rejected (or only
    accepted, with `until_accepted`); `shown` gets its rollout at each look."""
    start = time.monotonic()

    def ended() -> RestartOutcome | None:
        state = read_state(run_dir)
        rollout = state.rollout if state else None
        if rollout is not None and rollout.rejected and rollout.rejected.id == request_id:
            return RestartOutcome("rejected", rollout.rejected.reason)
        if rollout is not None and rollout.id == request_id:
            shown(rollout)
            if rollout.finished or until_accepted:
                return RestartOutcome(rollout.state or "running", rollout.reason or "",
                                      rollout.done)
        elif time.monotonic() - start > ACK_TIMEOUT_S:
            return RestartOutcome("unacknowledged", "the supervisor did not pick the request "
                                  f"up within {ACK_TIMEOUT_S:.0f} s")
        return None

    outcome = poll(ended, timeout_s, FOLLOW_POLL_S)
    return outcome or RestartOutcome("timed-out", f"still running after {timeout_s:.0f} s")
