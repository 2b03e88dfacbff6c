"""redis-py's byte replies decoded the way every part of the ledger reads them."""

from __future__ import annotations

from importlib import resources
from typing import Any

import redis


def script(name: str) -> str:
    """The Lua script `name` beside these modules (package data: pyproject.toml), read through
    this package (a regular one: a folder named `fleetgen` in the working directory, such as
    the clone itself seen from its parent, can stand in for `fleetgen` but not for it)."""
    return resources.files("fleetgen.ledger").joinpath(name).read_text(encoding="utf-8")


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def floats(raw: Any) -> dict[str, float]:
    """A hash of counters, field -> value."""
    return {k.decode(): float(v) for k, v in raw.items()}


def members(r: redis.Redis, key: str) -> set[str]:
    """A set's members."""
    return {m.decode() for m in r.smembers(key)}  # type: ignore[union-attr]


def scored(r: redis.Redis, key: str) -> dict[str, float]:
    """A sorted set's members -> scores, lowest score first."""
    pairs: Any = r.zrange(key, 0, -1, withscores=True)
    return {member.decode(): float(score) for member, score in pairs}
