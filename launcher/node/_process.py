"""A server or worker child process: its launch spec, spawning it, and stopping it.

The child runs in its own session and process group with stdout and stderr merged into one
log file (docs/reference/sglang.md#process: SGLang logs to both).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from launcher.embedded import die_with_parent, port_is_free
from launcher.node._args import HOST, redacted
from launcher.node._clock import Clock
from launcher.node._errors import PortBusyError

MARKER = "[launcher]"  # starts the line spawn() writes before each start


class ServerProcess(Protocol):
    """What the supervisor needs of a child process (a Popen, or a scripted fake)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill_group(self) -> None: ...


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to (re)start one child: server (with a port) or worker (without)."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_path: Path
    port: int | None = None
    host: str = HOST

    @property
    def url(self) -> str:
        """Base URL of the server's HTTP API."""
        host = HOST if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


class PopenProcess:
    """A real child in its own session; SIGTERM goes to the leader, SIGKILL to the group."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def terminate(self) -> None:
        # The leader only: SGLang's main process drains and then stops its schedulers itself,
        # and a Celery worker's warm shutdown needs its pool children alive
        # (docs/development/delivery.md#redelivery).
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def kill_group(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is already gone
        if self.popen.returncode is None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass  # a process in uninterruptible sleep; poll() reaps it later


def spawn(spec: LaunchSpec) -> PopenProcess:
    """Start `spec` with its output appended to its log after a launcher marker line.

    Raises PortBusyError when its port is taken: SGLang would find out only after loading
    the whole model (docs/reference/sglang.md#process).
    """
    if spec.port is not None and not port_is_free(spec.port):
        raise PortBusyError(f"port {spec.port} is in use by another process")
    # Server logs may hold what the server prints of its own secrets: new dirs are private.
    spec.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(spec.log_path, "ab") as out:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        argv = " ".join(redacted(spec.argv))
        out.write(f"{MARKER} {stamp} starting {spec.name}: {argv}\n".encode())
        out.flush()
        popen = subprocess.Popen(
            list(spec.argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=dict(spec.env), start_new_session=True,
            # A SIGKILLed launcher leaves its servers SIGTERMed (they drain), not orphaned.
            preexec_fn=die_with_parent,  # noqa: PLW1509 (two syscalls, no Python locks)
        )
    return PopenProcess(popen)


async def stop_process(proc: ServerProcess, clock: Clock, timeout_s: float,
                       poll_s: float = 0.1) -> tuple[int | None, bool]:
    """SIGTERM the leader, wait up to `timeout_s`, then SIGKILL the group.

    The group is swept even after a clean exit: a child the leader left behind must not keep
    the GPU. Returns (exit code, whether SIGKILL was needed).
    """
    if proc.poll() is None:
        proc.terminate()
        deadline = clock.now() + timeout_s
        while proc.poll() is None and clock.now() < deadline:
            await clock.sleep(poll_s)
    killed = proc.poll() is None
    proc.kill_group()
    return proc.poll(), killed
