"""The wall between the test suite and the services of the machine it runs on.

A developer runs the tests where the walkthrough's stack may be up (`python -m launcher redis`
on 6389, `launcher s3` on 8333, simulated servers from 30000) and where the shell may name a
real fleet (REDIS_URL, AWS_*, FLEETGEN_*). No test may reach any of them: the suite starts its
own Valkey and SeaweedFS on free ports (tests/conftest.py), and two walls keep it there.

- The environment (`isolate_environment`, before the tests are collected): every variable
  fleetgen's settings read is dropped; REDIS_URL names the guard's stand-in, a port this
  process holds without listening, so that a connection there is refused at once, in a
  subprocess too; boto3 finds no identity and no endpoint (no keys, no profile files, no
  instance metadata). A test that needs Redis or S3 asks for it (`redis_url`, `cli_env`,
  `ledger`, `s3_env`, `stack`).
- Connections (`Guard`): in the test process, a TCP connection to a watched port on this
  machine (the stand-in, the default ports of the services a developer runs, the local ones
  the shell named) is refused, and the test that made it fails, unless a process of this
  session serves it (`session_serves`: a test that starts its own Redis on 6389, as the
  walkthrough's does).

    guard = Guard(default_ports() | shell_ports(os.environ))
    isolate_environment(monkeypatch, guard.stand_in)
    guard.install(monkeypatch)
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from fleetgen.ports import HOST
from fleetgen.redisconn import endpoints
from fleetgen.settings import (
    EMBEDDED_REDIS_PORT_FILE,
    OLDER_NAMES,
    PROJECT_DIR,
    SERVER_BASE_PORT,
    Settings,
)
from launcher.demo import DemoPorts

# A Redis installed from the distribution listens here.
STOCK_REDIS_PORT = 6379
# A GPU node's servers: SERVER_BASE_PORT + GPU index, eight GPUs.
NODE_GPUS = 8
# The variables that name where fleetgen's processes connect, beside the FLEETGEN_* settings.
SETTINGS_VARIABLES = ("REDIS_URL", "FLEETGEN_REDIS_PASSWORD_FILE",
                      *(name for names in OLDER_NAMES.values() for name in names))
# Kept from the AWS_* variables: the machine's CA bundle names no service.
AWS_KEPT = ("AWS_CA_BUNDLE",)
# /proc/net/tcp's state of a listening socket.
TCP_LISTEN = "0A"


def default_ports() -> set[int]:
    """The ports of the services a developer runs on this machine by default: the demo's and
    the walkthrough's stack (Redis, S3, two servers, Flower, the workers' metrics), a GPU
    node's servers and a stock Redis."""
    return {*DemoPorts().all(), *range(SERVER_BASE_PORT, SERVER_BASE_PORT + NODE_GPUS),
            STOCK_REDIS_PORT}


def shell_ports(env: Mapping[str, str]) -> set[int]:
    """The ports on this machine that the developer's environment names: its Redis, S3 and
    server URLs, and the port the clone's embedded Redis serves (`launcher redis --port`)."""
    ports: set[int] = set()
    if env.get("REDIS_URL"):
        with suppress(ValueError):  # not a Redis URL: it names no port
            ports |= {port for host, port in endpoints(env["REDIS_URL"]) if is_local(host)}
    for name in ("AWS_ENDPOINT_URL", "FLEETGEN_SERVER_URL", "SGLANG_URL"):
        try:
            parts = urlsplit(env.get(name, ""))
            if parts.hostname and parts.port and is_local(parts.hostname):
                ports.add(parts.port)
        except ValueError:
            continue
    for port_file in (EMBEDDED_REDIS_PORT_FILE, PROJECT_DIR / EMBEDDED_REDIS_PORT_FILE):
        try:
            ports.add(int(port_file.read_text()))
        except (OSError, ValueError):
            continue
    return ports


def isolate_environment(monkeypatch: pytest.MonkeyPatch, stand_in: str) -> None:
    """Drop every variable that names a service, and point REDIS_URL at `stand_in`."""
    names = {*SETTINGS_VARIABLES, *(f"FLEETGEN_{f.name.upper()}" for f in fields(Settings))}
    for name in list(os.environ):
        if name in names or (name.startswith("AWS_") and name not in AWS_KEPT):
            monkeypatch.delenv(name)
    monkeypatch.setenv("REDIS_URL", stand_in)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def is_local(host: str) -> bool:
    """Whether `host` is this machine by a loopback or wildcard address."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def session_serves(port: int) -> bool:
    """Whether a process of this session (this one, or one it started at any depth) listens on
    TCP `port`, or names it in its command line: a server the test started, still starting."""
    sockets = _listening_sockets(port)
    named = re.compile(rf"(?<![0-9]){port}(?![0-9])")
    for pid in _session_pids():
        if pid != os.getpid() and named.search(_command_line(pid)):
            return True
        if sockets and sockets & _open_sockets(pid):
            return True
    return False


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def _open_sockets(pid: int) -> set[str]:
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        with suppress(OSError):
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return found


def _listening_sockets(port: int) -> set[str]:
    """The listening TCP sockets on `port`, as /proc/PID/fd links name them."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == TCP_LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                found.add(f"socket:[{cols[9]}]")
    return found


def _session_pids() -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


@dataclass(frozen=True)
class Reach:
    """A connection the guard refused: where to, and from which test (None between tests)."""

    host: str
    port: int
    test: str | None
    stand_in: bool

    def describe(self) -> str:
        if self.stand_in:
            return (f"reached for Redis at REDIS_URL ({self.host}:{self.port}), which names "
                    "nothing in the tests: ask for the test Redis (the `redis_url`, `cli_env` "
                    "or `ledger` fixture) or hand it a Settings or Ledger built on it")
        return (f"reached for {self.host}:{self.port}, a port of the services a developer runs "
                "on this machine, which this test session did not start: use the test's own "
                "(the `redis_url`, `s3_env` or `stack` fixture, a server on a free port)")


class Guard:
    """Refuses the test process's TCP connections to the `watched` ports of this machine that
    no process of this session listens on, and keeps each one refused (`reaches`)."""

    def __init__(self, watched: Iterable[int]) -> None:
        # Bound and never listening: the port stays this session's, and refuses connections.
        self._held = socket.socket()
        self._held.bind((HOST, 0))
        self.stand_in_port: int = self._held.getsockname()[1]
        self.watched = {*watched, self.stand_in_port}
        self.reaches: list[Reach] = []
        self.test: str | None = None

    @property
    def stand_in(self) -> str:
        """The REDIS_URL of the tests: a port that refuses every connection."""
        return f"redis://{HOST}:{self.stand_in_port}/0"

    def refuses(self, host: str, port: int) -> bool:
        return port in self.watched and is_local(host) and not session_serves(port)

    def check(self, sock: socket.socket, address: Any) -> None:
        """Raise ConnectionRefusedError (what a port nobody listens on answers) and keep the
        reach, if `sock` may not connect to `address`."""
        if sock.family not in (socket.AF_INET, socket.AF_INET6) \
                or sock.type != socket.SOCK_STREAM:
            return
        host, port = str(address[0]), int(address[1])
        if self.refuses(host, port):
            reach = Reach(host, port, self.test, port == self.stand_in_port)
            self.reaches.append(reach)
            raise ConnectionRefusedError(errno.ECONNREFUSED,
                                         f"tests/isolation.py: this test {reach.describe()}")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Check every connection of this process's sockets from now on."""
        connect, connect_ex = socket.socket.connect, socket.socket.connect_ex
        guard = self

        def checked_connect(sock: socket.socket, address: Any) -> None:
            guard.check(sock, address)
            connect(sock, address)

        def checked_connect_ex(sock: socket.socket, address: Any) -> int:
            try:
                guard.check(sock, address)
            except ConnectionRefusedError:
                return errno.ECONNREFUSED
            return connect_ex(sock, address)

        monkeypatch.setattr(socket.socket, "connect", checked_connect)
        monkeypatch.setattr(socket.socket, "connect_ex", checked_connect_ex)

    @contextmanager
    def watching(self, test: str) -> Iterator[list[Reach]]:
        """Attribute the reaches made meanwhile to `test`; the list holds them once it ends."""
        before = len(self.reaches)
        self.test = test
        found: list[Reach] = []
        try:
            yield found
        finally:
            self.test = None
            found += self.reaches[before:]

    def close(self) -> None:
        self._held.close()
