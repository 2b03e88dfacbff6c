"""TCP ports on this machine: the loopback address fleetgen's servers listen on by default, a
port nothing listens on, whether a server could bind a port, and why it could not.

A port can be taken two ways. A server listens on it: `port_holder` names that process, found
as `ss -ltnp` finds it (psutil's net_connections: the listening socket, and the process that
holds it where this user may see it). Or a connection holds it as its local end (an
outgoing connection, or one in TIME-WAIT): the kernel hands those local ports out of its
ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), so a server port inside that range is
taken at random, by no process a user could stop. `busy_reason` says which.

In the domain because every process that listens needs it: the launcher for its servers and
the node's, and Flower's configuration (workers/flowerconfig.py) for its own port.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from pathlib import Path

import psutil

HOST = "127.0.0.1"
# Where Linux reads its ephemeral range from, and its default when the file cannot be read.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)
_COMMAND_CHARS = 120


def free_port(host: str = HOST) -> int:
    """Return a TCP port on `host` (127.0.0.1) that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int, host: str = HOST) -> bool:
    """True if a server could bind `port` on `host` (with SO_REUSEADDR, as servers do)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (first, last), inclusive."""
    try:
        first, last = (int(cell) for cell in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return first, last


def in_ephemeral_range(ports: Iterable[int]) -> list[int]:
    """The ones of `ports` inside the kernel's ephemeral range."""
    first, last = ephemeral_range()
    return [port for port in ports if first <= port <= last]


def ephemeral_text() -> str:
    """Why a port in the ephemeral range is a poor server port, for messages."""
    first, last = ephemeral_range()
    return (f"the kernel's ephemeral range {first}-{last} ({EPHEMERAL_RANGE_FILE}), from which "
            f"outgoing connections take their local ports at random; pick a port below {first}")


def busy_reason(port: int) -> str:
    """Why a server cannot bind `port` (which it cannot): the process listening there, or the
    connection holding it (see the module doc)."""
    holder = port_holder(port)
    if holder is not None:
        return f"in use by {holder}"
    if in_ephemeral_range([port]):
        return f"held by a connection, not a server: it lies in {ephemeral_text()}"
    return ("held by a connection, not a server (no process listens on it: one connected from "
            "it, or one closed a moment ago and in TIME-WAIT); try again shortly or pick another")


def port_holder(port: int) -> str | None:
    """`pid 4242 (COMMAND)` of the process listening on TCP `port`, `a process of another
    user` when the system does not say whose socket it is, None when nothing listens there."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:  # where only root may list sockets (macOS): say nothing
        return None
    listening = [c for c in connections
                 if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    if not listening:
        return None
    pid = next((c.pid for c in listening if c.pid), None)
    if pid is None:
        return "a process of another user"
    try:
        # One line whatever the arguments hold (`python -c` with a script of several lines).
        command = " ".join(" ".join(psutil.Process(pid).cmdline()).split())
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # it exited meanwhile, or not ours
        return f"pid {pid}"
    return f"pid {pid} ({command[:_COMMAND_CHARS]})"
