"""The server URL a worker publishes in the registry: one that other nodes can use.

A worker reaches its own server at whatever FLEETGEN_SERVER_URL says, usually `http://127.0.0.1:3000N`;
that address means another machine to `producer status` run elsewhere. So the registry gets
the same URL with the loopback (or wildcard) host replaced by this node's address:
`FLEETGEN_ADVERTISE_HOST` if set, else the address this node uses on its route to Redis, the
one network every node and the producer are sure to share. `FLEETGEN_ADVERTISE_URL` replaces
the whole URL (a proxy, a NAT). Finding the route sends nothing: connecting a UDP socket only
asks the kernel which source address it would use.

    advertised_url("http://127.0.0.1:30000", settings)  # -> "http://10.213.0.11:30000"
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit, urlunsplit

from fleetgen.redisconn import endpoints
from fleetgen.settings import Settings

# Hosts that name "this machine" only: meaningless, or wrong, anywhere else.
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""})


def route_address(host: str, port: int) -> str | None:
    """This node's source address for packets to `host:port`; None if there is no route."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(address)  # UDP: no packet leaves, the kernel picks the route
                return str(sock.getsockname()[0])
        except OSError:
            continue
    return None


def advertised_url(server_url: str, settings: Settings) -> str:
    """The URL of `server_url`'s server as other nodes should use it (see the module doc)."""
    if settings.advertise_url:
        return settings.advertise_url
    parts = urlsplit(server_url)
    if (parts.hostname or "") not in LOCAL_HOSTS:
        return server_url
    host = settings.advertise_host or _route_to_redis(settings)
    if host is None or host in LOCAL_HOSTS:
        return server_url
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _route_to_redis(settings: Settings) -> str | None:
    host, port = endpoints(settings.redis_url)[0]
    return route_address(host, port)
