"""The live per-GPU table: every registered worker and what its SGLang server says right now.

Workers register in `fg:workers` every few seconds (workers/engine.py `_register`), with what
their server said at that moment, the URL they use (`local_server`) and the URL other nodes can
use (`server`, fleetgen/advertise.py). `read_fleet` reads `/metrics` and `/server_info` live, all
at once and under one short deadline: this node's servers at their local URL (one that does not
answer shows as `down` instead of stalling the view), other nodes' at their published URL. An
other node's server that cannot be read from here (a `127.0.0.1` URL there is not this node's
server; a firewall) shows the reading its worker published.

The addresses come from Redis, which anyone with write access to it can fill: so these reads
never carry SGLANG_API_KEY (only a worker sends it, to the one server it was configured with).
A server that wants the key for `/server_info` still shows its live `/metrics` (SGLang serves
those without a key), with capacity and version from the reading its worker published.

    rows = read_fleet(ledger.r, job_workers=status["workers"], elapsed_s=600.0)

The producer prints the rows (producer/status.py `render_fleet`).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import redis

from fleetgen import keys
from fleetgen.advertise import LOCAL_HOSTS
from fleetgen.readings import ServerReading, read_server_within

# A dead server must not slow `status --watch` by more than about this much.
FETCH_DEADLINE_S = 2.0
CONNECT_TIMEOUT_S = 0.5
# The one liveness rule of the registry: a worker re-registers every beat (engine.py
# `_register`); an entry six beats old is a worker that is gone (`lost`), for the table, the
# in-flight count and everyone else who reads the registry.
REGISTRY_BEAT_S = 5.0
LOST_AFTER_S = 6 * REGISTRY_BEAT_S
THIS_HOST = socket.gethostname()
# What a reading takes from `/server_info` (or from it when /metrics lacks it).
SERVER_INFO_FIELDS = ("effective_max", "requested_max", "version", "accept_length")

async def read_servers(
    urls: Iterable[str], deadline_s: float = FETCH_DEADLINE_S
) -> dict[str, ServerReading]:
    """Read every server concurrently, without credentials; each one gets at most `deadline_s`."""
    unique = sorted(set(urls))
    if not unique:
        return {}
    timeout = httpx.Timeout(deadline_s, connect=min(CONNECT_TIMEOUT_S, deadline_s))
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        readings = await asyncio.gather(
            *(read_server_within(client, u, None, deadline_s) for u in unique))
    return dict(zip(unique, readings, strict=True))


def registry(r: redis.Redis, now: float) -> dict[str, dict[str, Any]]:
    """The `fg:workers` entries, with `state` turned to `lost` once an entry is stale."""
    out: dict[str, dict[str, Any]] = {}
    entries: dict[bytes, bytes] = r.hgetall(keys.WORKERS)  # type: ignore[assignment]
    for name, raw in entries.items():
        try:
            entry = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        age = now - float(entry.get("updated") or 0)
        entry["age_s"] = round(age, 1)
        if age > LOST_AFTER_S:
            entry["state"] = "lost"
        out[name.decode()] = entry
    return out


def fleet_rows(
    workers: Mapping[str, Mapping[str, Any]],
    readings: Mapping[str, ServerReading],
    job_workers: Mapping[str, Mapping[str, float]],
    elapsed_s: float,
) -> list[dict[str, Any]]:
    """One row per worker: its registry entry, its server's reading and its share of the job.

    `readings` are by worker: read live for this node's servers, as published by their worker
    for other nodes'. Workers that did work for the job but are no longer registered are
    listed as `lost`.
    """
    rows = []
    # A lost worker that did nothing for this job (another job's, an earlier demo's) is not
    # this job's business.
    names = {n for n, e in workers.items() if e.get("state") != "lost"} | set(job_workers)
    for name in sorted(names, key=lambda n: (str(workers.get(n, {}).get("host") or ""), n)):
        entry = workers.get(name, {})
        server = entry.get("server")
        reading = readings.get(name)
        mine = job_workers.get(name, {})
        tokens = float(mine.get("output_tokens", 0))
        live = asdict(reading) if reading else asdict(ServerReading("unknown"))
        live["server_state"] = live.pop("state")
        live["server_error"] = live.pop("error")
        if live["effective_max"] is None:
            live["effective_max"] = entry.get("effective_max_running_requests")
        rows.append({
            "worker": name,
            "host": entry.get("host"),
            "server": server,
            "worker_state": entry.get("state", "lost"),
            "registry_age_s": entry.get("age_s"),
            "in_flight": entry.get("in_flight"),
            "limit": entry.get("limit"),
            # What the server is and how the limit was found (workers/servers).
            "server_kind": entry.get("server_kind"),
            "capacity_source": entry.get("capacity_source"),
            **live,
            "job_prompts_done": int(mine.get("prompts_done", 0)),
            "job_prompts_failed": int(mine.get("prompts_failed", 0)),
            "job_output_tokens": int(tokens),
            "job_output_tokens_per_s": round(tokens / elapsed_s, 1) if elapsed_s > 0 else None,
        })
    return rows


def read_fleet(
    r: redis.Redis,
    job_workers: Mapping[str, Mapping[str, float]],
    elapsed_s: float,
    *,
    now: float | None = None,
    deadline_s: float = FETCH_DEADLINE_S,
) -> list[dict[str, Any]]:
    """Registry + live server readings + this job's per-worker counters, one row per worker."""
    now = time.time() if now is None else now
    workers = registry(r, now)
    urls = {name: url for name, e in workers.items() if (url := _readable_url(e))}
    live = asyncio.run(read_servers(urls.values(), deadline_s))
    # Per worker: its server read live here, with what that read could not see without the
    # key taken from its worker's own reading; an other node's server that did not answer
    # here, and one with no URL this node can use, as its worker published.
    readings: dict[str, ServerReading] = {}
    for name, entry in workers.items():
        reading = live.get(urls.get(name, ""))
        if reading is not None and (_on_this_node(entry) or reading.state == "up"):
            readings[name] = _filled(reading, entry.get("reading"))
        else:
            readings[name] = _published(entry)
    return fleet_rows(workers, readings, job_workers, elapsed_s)


def _on_this_node(entry: Mapping[str, Any]) -> bool:
    # Entries without a host come from workers older than the field: read them live.
    return entry.get("host") in (None, THIS_HOST)


def _readable_url(entry: Mapping[str, Any]) -> str | None:
    """Where this node can read the entry's server: its local URL on its own node, its
    published one elsewhere unless that names the other node's loopback."""
    if _on_this_node(entry):
        return entry.get("local_server") or entry.get("server")
    server = entry.get("server")
    if not server or (urlsplit(server).hostname or "") in LOCAL_HOSTS:
        return None
    return str(server)


def _filled(live: ServerReading, published: object) -> ServerReading:
    """`live` with the figures only `/server_info` gives, when it gave none (it wants the key
    this reader does not send), taken from the reading the server's own worker published."""
    if live.state != "up" or not isinstance(published, dict):
        return live
    known = asdict(live)
    for name in SERVER_INFO_FIELDS:
        if known[name] is None and published.get(name) is not None:
            known[name] = published[name]
    try:
        return ServerReading(**known)
    except TypeError:
        return live


def _published(entry: Mapping[str, Any]) -> ServerReading:
    raw = entry.get("reading")
    if not isinstance(raw, dict):
        return ServerReading("unknown", error="on another node; its worker published no reading")
    known = {k: v for k, v in raw.items() if k in ServerReading.__dataclass_fields__}
    try:
        return ServerReading(**known)
    except TypeError:
        return ServerReading("unknown", error="unreadable reading")
