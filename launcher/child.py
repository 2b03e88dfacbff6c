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
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
# A process in uninterruptible sleep may outlive its SIGKILL this long; poll() reaps it later.
REAP_WAIT_S = 5.0


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

    def kill_group(self) -> None:
        """SIGKILL the whole group (a crash, or the sweep after a stop), then reap the leader."""
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
            os.killpg(self.popen.pid, signal.SIGKILL)
        if self.popen.returncode is None:
            # A process in uninterruptible sleep: poll() reaps it later.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=REAP_WAIT_S)

    def stop(self, grace: float) -> int | None:
        """SIGTERM the leader, wait up to `grace` s, then SIGKILL whatever is left in the group
        (even after a clean exit: a grandchild must not keep a port or the GPU). Returns the
        exit code."""
        if grace > 0 and self.alive():
            self.terminate()
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("pid %d: no exit %.1fs after SIGTERM, sending SIGKILL", self.pid, grace)
        self.kill_group()
        return self.popen.poll()
