"""kombu's Redis transports, made to fail like a lost connection once their connection is gone.

When the broker connection drops, Celery's consumer lets kombu `collect()` the connection, which
detaches the transport from it (`transport.client = None`), and then closes it again; a batch
that finishes later acks its message on the same old channel. Either step can make the old
channel build a new Redis pool from the detached transport, and kombu then raises
`AttributeError` ("'NoneType' object has no attribute 'hostname'"), which neither Celery's
`ignore_errors` nor `ack_log_error` expects: the worker logged "Unrecoverable error" and exited
after a few Redis restarts in a row. A channel of a detached transport raises the Redis
`ConnectionError` instead, which both already handle as the broker loss it is; the message it
could not ack or restore comes back through the visibility timeout, and our leases cover the
batch either way.
"""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis


class _DetachedChannelFails:
    """Mixin for a kombu Redis channel: no new pool once the connection has been collected."""

    connection: Any

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection is None or self.connection.client is None:
            raise redis.ConnectionError("the broker connection was closed after a loss")
        params: dict[str, Any] = super()._connparams(asynchronous)  # type: ignore[misc]
        return params


class Channel(_DetachedChannelFails, kombu_redis.Channel):  # type: ignore[misc]
    """A `redis://` channel."""


class SentinelChannel(_DetachedChannelFails, kombu_redis.SentinelChannel):  # type: ignore[misc]
    """A `sentinel://` channel."""


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    """The `redis://` transport with `Channel`."""

    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):  # type: ignore[misc]
    """The `sentinel://` transport with `SentinelChannel`."""

    Channel = SentinelChannel


def install() -> None:
    """Make kombu's Redis URL schemes (`redis`, `rediss`, `redis+socket`, `sentinel`) use these.

    kombu picks a transport by the URL's scheme from its alias table; replacing the entries
    keeps its URL parsing (TLS for `rediss://`, Sentinel lists, sockets) as it is.
    """
    redis_transport = f"{__name__}:Transport"
    TRANSPORT_ALIASES.update({"redis": redis_transport, "rediss": redis_transport,
                              "sentinel": f"{__name__}:SentinelTransport"})
