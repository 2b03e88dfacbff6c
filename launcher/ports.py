"""TCP ports on this machine, for every part of the launcher: the loopback address its servers
listen on by default, a port nothing listens on, whether a server could bind a port.

Shared like launcher/child.py and launcher/errors.py: node supervision checks its servers' ports
with it without loading the embedded services (launcher.services), which load the settings.
"""

from __future__ import annotations

import socket

HOST = "127.0.0.1"


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
