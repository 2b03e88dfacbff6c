"""One child process the launcher (or a test) starts: an SGLang server, a worker, Valkey,
SeaweedFS, the demo's honcho.

The child runs in its own session and process group with stdout and stderr appended to one log
file (docs/reference/sglang.md#process: SGLang logs to both), so one SIGKILL of the group
sweeps every grandchild it left (a server's schedulers must not keep the GPU). By default it
also gets SIGTERM when the *thread* that started it dies (PR_SET_PDEATHSIG): a SIGKILLed
launcher or test run orphans nothing, provided long-lived children are started from a thread
that outlives them.

    child = ChildProcess(["valkey-server", "--port", "6389"], Path("valkey.log"), env={})
    child.stop(grace=10)   # SIGTERM the leader, wait, then SIGKILL the group

Stopping a child is one sequence, `_stop_steps`, for every caller: `stop_process` runs it
blocking (the embedded servers, the demo, tests), `stop_process_async` on an event loop with the
caller's clock (the node supervisor, which stops several servers at once and is tested on a
scripted clock). Each takes a `ChildLike`, so a scripted fake stops the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
# A process in uninterruptible sleep may outlive its SIGKILL this long; poll() reaps it later.
REAP_WAIT_S = 5.0
# How often a stop looks whether the leader exited after its SIGTERM.
STOP_POLL_S = 0.05


def die_with_parent() -> None:
    """In a child, before exec: SIGTERM it when the thread that started it dies (Linux)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildProcess:
    """A child in its own session and process group, its output appended to `log_path`."""

    def __init__(self, argv: Sequence[str], log_path: Path, *, env: Mapping[str, str],
                 cwd: Path | None = None, header: str | None = None,
                 with_parent: bool = True, pass_fds: Sequence[int] = ()) -> None:
        """Start `argv`. `header` is written to the log first (a line saying what starts);
        `with_parent=False` lets the child outlive the thread that started it (a test that
        starts workers from a helper thread, the stack `launcher demo --keep` leaves up);
        `pass_fds` stay open in the child (an embedded server's data dir lock)."""
        parent = os.getpid()

        def die_with_parent_or_exit() -> None:
            die_with_parent()
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)

        with open(log_path, "ab") as out:
            if header is not None:
                out.write(header.encode() + b"\n")
                out.flush()
            # die_with_parent runs between fork and exec; it makes two syscalls and takes no
            # Python-level lock, which is what makes preexec_fn safe enough with threads here.
            self.popen = subprocess.Popen(
                list(argv), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=tuple(pass_fds),
                preexec_fn=die_with_parent_or_exit if with_parent else None,  # noqa: PLW1509
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        """SIGTERM the leader only: SGLang's main process drains and then stops its schedulers
        itself, and a Celery worker's warm shutdown needs its pool children alive
        (docs/development/delivery.md#redelivery)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the leader while it runs (a worker's restart notice)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def kill_group(self) -> None:
        """SIGKILL the whole group (a crash, or the sweep after a stop), then reap the leader."""
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
            os.killpg(self.popen.pid, signal.SIGKILL)
        if self.popen.returncode is None:
            # A process in uninterruptible sleep: poll() reaps it later.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=REAP_WAIT_S)

    def stop(self, grace: float) -> int | None:
        """`stop_process` of this child, saying so when SIGKILL was needed; the exit code."""
        code, killed = stop_process(self, grace)
        if killed:
            log.warning("pid %d: no exit %.1fs after SIGTERM, sent SIGKILL", self.pid, grace)
        return code


class ChildLike(Protocol):
    """What stopping a child needs of it (a `ChildProcess`, or a scripted fake)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...

    def kill_group(self) -> None: ...


def _stop_steps(proc: ChildLike, grace: float, now: Callable[[], float],
                poll_s: float) -> Generator[float, None, tuple[int | None, bool]]:
    """The stop sequence, yielding each wait to its driver: SIGTERM the leader (none when
    `grace` is 0: a kill), wait up to `grace` s for it to exit, then SIGKILL the group, even
    after a clean exit (a grandchild must not keep a port or the GPU). Returns (exit code,
    whether SIGKILL was needed)."""
    if grace > 0 and proc.poll() is None:
        proc.terminate()
        deadline = now() + grace
        while proc.poll() is None and (left := deadline - now()) > 0:
            yield min(poll_s, left)
    killed = proc.poll() is None
    proc.kill_group()
    return proc.poll(), killed


def stop_process(proc: ChildLike, grace: float,
                 poll_s: float = STOP_POLL_S) -> tuple[int | None, bool]:
    """Stop `proc` (`_stop_steps`), blocking; (exit code, whether SIGKILL was needed)."""
    steps = _stop_steps(proc, grace, time.monotonic, poll_s)
    try:
        while True:
            time.sleep(next(steps))
    except StopIteration as done:
        outcome: tuple[int | None, bool] = done.value
        return outcome


async def stop_process_async(
    proc: ChildLike, grace: float, *, now: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] | None = None, poll_s: float = STOP_POLL_S,
) -> tuple[int | None, bool]:
    """Stop `proc` (`_stop_steps`) on an event loop, waiting with `sleep` on the clock `now`
    (asyncio's sleep and the monotonic clock by default)."""
    pause = sleep or asyncio.sleep
    steps = _stop_steps(proc, grace, now, poll_s)
    try:
        while True:
            await pause(next(steps))
    except StopIteration as done:
        outcome: tuple[int | None, bool] = done.value
        return outcome
