"""A server or worker child process: its launch spec and spawning it (launcher/child.py
stops it).

The child runs in its own session and process group with stdout and stderr merged into one
log file (docs/reference/sglang.md#process: SGLang logs to both).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fleetgen.ports import HOST, port_is_free
from fleetgen.redact import redact_argv
from launcher.child import ChildProcess
from launcher.errors import PortBusyError

MARKER = "[launcher]"  # starts the line spawn() writes before each start


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


def spawn(spec: LaunchSpec) -> ChildProcess:
    """Start `spec` with its output appended to its log after a launcher marker line.

    Raises PortBusyError when its port is taken: SGLang would find out only after loading
    the whole model (docs/reference/sglang.md#process).
    """
    if spec.port is not None and not port_is_free(spec.port, spec.host):
        raise PortBusyError(f"port {spec.port} is in use by another process")
    # Server logs may hold what the server prints of its own secrets: new dirs are private.
    spec.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    header = f"{MARKER} {stamp} starting {spec.name}: {' '.join(redact_argv(spec.argv))}"
    # A SIGKILLed launcher leaves its servers SIGTERMed (they drain), not orphaned.
    return ChildProcess(spec.argv, spec.log_path, env=spec.env, header=header)
