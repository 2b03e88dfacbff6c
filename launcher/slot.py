"""What the supervisor keeps per GPU: a `Slot` holding its server and worker `Child`ren."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from launcher.server import LaunchSpec, LogFollower, Reading, ServerProcess, redacted

State = Literal["starting", "ready", "running", "restarting", "crashed", "stopped"]


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
    proc: ServerProcess | None = None

    def to_json(self) -> dict[str, Any]:
        """The state file entry."""
        return {"name": self.spec.name, "pid": self.pid, "state": self.state,
                "since": self.since, "restarts": max(self.starts - 1, 0),
                "last_reason": self.last_reason, "log": str(self.spec.log_path),
                "argv": redacted(self.spec.argv)}


@dataclass
class Slot:
    """One GPU: its server, its optional worker, and a pending restart order."""

    gpu: int
    server: Child
    worker: Child | None = None
    reading: Reading | None = None
    ready_s: float | None = None
    follower: LogFollower | None = None
    order: LaunchSpec | None = None  # a restart order not yet taken
    order_done: asyncio.Future[str | None] | None = None
    pending: asyncio.Future[str | None] | None = None  # the order being started
    ever_ready: bool = False

    def to_json(self) -> dict[str, Any]:
        """The state file entry of this GPU."""
        return {"gpu": self.gpu, "port": self.server.spec.port, "url": self.server.spec.url,
                **self.server.to_json(), "ready_s": self.ready_s,
                "capacity": dataclasses.asdict(self.reading) if self.reading else None,
                "worker": self.worker.to_json() if self.worker else None}
