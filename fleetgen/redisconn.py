"""Every Redis client of fleetgen's own (the ledger's, a worker's asyncio one) is built here,
from REDIS_URL: one server, or the master a set of Sentinels names.

    REDIS_URL=redis://:PASSWORD@redis.internal:6379/0
    REDIS_URL='sentinel://:PASSWORD@s1:26379/0;sentinel://s2:26379;sentinel://s3:26379'
    FLEETGEN_REDIS_MASTER_NAME=fleetgen        # the Sentinels' name for the master

The Sentinel form is Celery's own (kombu's `sentinel://` broker transport reads the same URL,
with `master_name` in its transport options, workers/app.py): the password and database of the
first part are the master's; the Sentinels themselves are asked without one. A client asks the
Sentinels for the master when it connects and again after a connection error, so after a
failover it follows the promoted replica (docs/getting-started/several-nodes.md#redis-failover).
"""

from __future__ import annotations

import re
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel

from fleetgen.redact import redact

SENTINEL_SCHEME = "sentinel"
# The ports a URL that names none means: Redis's and Sentinel's own defaults.
REDIS_PORT = 6379
SENTINEL_PORT = 26379
# A unix socket's URL schemes (redis-py's): the server is on this machine.
_SOCKET_SCHEMES = ("redis+socket", "unix")
# How redis-py words a reply outside Redis's protocol: hiredis's parser, then its own.
_NOT_RESP = re.compile(r'got "(?P<byte>.)" as reply type byte|Protocol Error: (?P<line>.+)')


def is_sentinel(url: str) -> bool:
    return url.startswith(f"{SENTINEL_SCHEME}://")


def endpoints(url: str) -> list[tuple[str, int]]:
    """The (host, port) of every server a REDIS_URL names: each Sentinel of a
    `sentinel://...;sentinel://...` one (port SENTINEL_PORT where it gives none), the one
    server of a `redis://` one (REDIS_PORT); a unix socket is this machine. ValueError for a
    port that is not a number."""
    parts = [urlsplit(part.strip()) for part in url.split(";") if part.strip()]
    if not parts or parts[0].scheme in _SOCKET_SCHEMES:
        return [("127.0.0.1", REDIS_PORT)]
    return [(p.hostname or "127.0.0.1",
             p.port or (SENTINEL_PORT if p.scheme == SENTINEL_SCHEME else REDIS_PORT))
            for p in parts]


def _master_kwargs(url: str) -> dict[str, Any]:
    first = urlsplit(url.split(";", 1)[0])
    kwargs: dict[str, Any] = {"db": int(first.path.strip("/") or 0)}
    if first.password:
        kwargs["password"] = unquote(first.password)
    if first.username:
        kwargs["username"] = unquote(first.username)
    return kwargs


def auth_refused(url: str, exc: Exception) -> str:
    """What to tell the user when the Redis `url` names did not let them in (an
    AuthenticationError): it wants a password and `url` gave none, or it refused the one
    given. Never the password itself."""
    where = redact(url)
    if "password" not in _master_kwargs(url):
        return (f"Redis at {where} needs a password and none was given: put it in REDIS_URL "
                "(redis://:PASSWORD@HOST:PORT/0) or set FLEETGEN_REDIS_PASSWORD_FILE=FILE (the "
                "embedded Redis keeps its password in DATA/password of its --data-dir, "
                ".fleetgen/redis/password by default)")
    return (f"Redis at {where} refused the password that was given ({redact(exc)}); check "
            "REDIS_URL or FLEETGEN_REDIS_PASSWORD_FILE")


def not_redis(url: str, exc: Exception) -> str:
    """What to tell the user when the server `url` names answered outside Redis's protocol (an
    InvalidResponse): an HTTP server on that port, say. The answer's start is quoted."""
    return (f"REDIS_URL {redact(url)} is not a Redis server (it answered {_answer(exc)}): point "
            "REDIS_URL at your Redis")


def _answer(exc: Exception) -> str:
    # hiredis names the first byte of the reply; redis-py's own parser quotes its first line.
    found = _NOT_RESP.search(str(exc))
    if found is None:
        return f"'{redact(exc)}'"
    if found["byte"] is not None:
        return f"'{found['byte']}...'"
    line = found["line"]
    if line[:2] in ("b'", 'b"') and line[-1:] == line[1]:
        line = line[2:-1]
    return f"'{line[:40]}...'" if len(line) > 40 else f"'{line}'"


def _socket_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k.startswith("socket_")}


# redis-py's Sentinel classes carry type hints from 8.2 on, and none before: the calls below
# are untyped on older versions and typed on newer ones, and mypy passes on both.
def client(url: str, master_name: str, **kwargs: Any) -> redis.Redis:
    """A synchronous client of the server `url` names (see the module doc)."""
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    manager = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        endpoints(url), sentinel_kwargs=_socket_kwargs(kwargs))
    master = manager.master_for(  # type: ignore[no-untyped-call, unused-ignore]
        master_name, redis_class=redis.Redis, **_master_kwargs(url), **kwargs)
    return cast(redis.Redis, master)


def async_client(url: str, master_name: str, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client of the server `url` names (see the module doc)."""
    if not is_sentinel(url):
        return aioredis.Redis.from_url(url, **kwargs)
    manager = AsyncSentinel(  # type: ignore[no-untyped-call, unused-ignore]
        endpoints(url), sentinel_kwargs=_socket_kwargs(kwargs))
    master = manager.master_for(master_name, redis_class=aioredis.Redis,
                                **_master_kwargs(url), **kwargs)
    return cast(aioredis.Redis, master)
