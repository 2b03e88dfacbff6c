"""The simulator's port, checked before anything is logged: a taken port is one line naming
the process that holds it, not forty lines of start-up and then uvicorn's `[Errno 98]`.

    check_port("127.0.0.1", 30000)   # PortInUseError: port 30000 on 127.0.0.1 is in use by
                                     # pid 4242 (python -m launcher sim --port 30000); ...

The holder is found as `ss -ltnp` finds it, without `ss`: the listening socket's inode in
/proc/net/tcp (and tcp6), then the process whose /proc/PID/fd links to that socket. Another
user's process shows only as such (its fds are not readable).
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from launcher.sim.errors import SimError

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
_COMMAND_CHARS = 120


class PortInUseError(SimError, OSError):
    """The simulator's --port is taken by another process."""


def check_port(host: str, port: int) -> None:
    """Raise PortInUseError naming the holder if a server could not listen on `host:port` now
    (with SO_REUSEADDR, as uvicorn binds). Port 0 (any free port) is never taken."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            holder = port_holder(port)
            raise PortInUseError(
                f"port {port} on {host} is in use{f' by {holder}' if holder else ''}; stop it, "
                f"or pass another --port (its worker then needs FLEETGEN_SERVER_URL=http://{host}:PORT)"
            ) from None


def port_holder(port: int) -> str | None:
    """`pid 4242 (COMMAND)` of the process listening on TCP `port`, `a process of another
    user` when /proc does not show whose socket it is, None when nothing listens there."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    links = {f"socket:[{inode}]" for inode in inodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:  # not ours to read, or it exited meanwhile
            continue
        if any(_link(fd) in links for fd in fds):
            try:
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").strip()
            except OSError:
                return f"pid {proc.name}"
            return f"pid {proc.name} ({command.decode(errors='replace')[:_COMMAND_CHARS]})"
    return "a process of another user"


def _link(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except OSError:  # closed meanwhile
        return ""


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cells = row.split()
            if len(cells) > 9 and cells[3] == _LISTEN and int(cells[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cells[9])
    return inodes
