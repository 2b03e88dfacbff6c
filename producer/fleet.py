"""The live per-GPU table: every registered worker and what its SGLang server says right now.

Workers register in `fg:workers` every few seconds (workers/engine.py `_register`). `read_fleet`
fetches `/metrics` and `/server_info` of every server named there, all at once and under one
short deadline, so a server that does not answer shows as `down` instead of stalling the view.

    rows = read_fleet(ledger.r, job_workers=status["workers"], elapsed_s=600.0)
    print("\\n".join(render_fleet(rows)))
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import orjson
import redis
from prometheus_client.parser import text_string_to_metric_families

from workers import keys
from workers.errors import RetryableError
from workers.sglang import ServerCapacity

# A dead server must not slow `status --watch` by more than about this much.
FETCH_DEADLINE_S = 2.0
CONNECT_TIMEOUT_S = 0.5
# Workers re-register every 5 s (engine.REGISTRY_BEAT_S); six missed beats means gone.
LOST_AFTER_S = 30.0

# Gauge -> how readings of several schedulers (DP ranks) combine into one per server.
GAUGES: dict[str, tuple[str, str]] = {
    "running": ("sglang:num_running_reqs", "sum"),
    "queue": ("sglang:num_queue_reqs", "sum"),
    "token_usage": ("sglang:token_usage", "max"),
    "mamba_usage": ("sglang:mamba_usage", "max"),
    "gen_throughput": ("sglang:gen_throughput", "sum"),
    "accept_length": ("sglang:spec_accept_length", "mean"),
}


@dataclass(frozen=True)
class ServerReading:
    """One server's live figures; `state` is `up` or `down` (then `error` says why)."""

    state: str
    error: str | None = None
    running: float | None = None
    queue: float | None = None
    token_usage: float | None = None
    mamba_usage: float | None = None
    gen_throughput: float | None = None
    accept_length: float | None = None
    effective_max: int | None = None
    requested_max: int | None = None
    version: str | None = None


def parse_metrics(text: str) -> dict[str, float]:
    """The GAUGES found in a Prometheus text page, keyed by their short name."""
    wanted = {name: (short, how) for short, (name, how) in GAUGES.items()}
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            found.setdefault(wanted[family.name][0], []).extend(s.value for s in family.samples)
    out: dict[str, float] = {}
    for short, values in found.items():
        how = GAUGES[short][1]
        if values:
            value = max(values) if how == "max" else sum(values) / (len(values) if how == "mean" else 1)
            out[short] = round(value, 3)
    return out


async def read_server(client: httpx.AsyncClient, url: str, api_key: str | None = None) -> ServerReading:
    """`/metrics` and `/server_info` of one server; never raises for a server that is down."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    metrics, info = await asyncio.gather(
        client.get(f"{url}/metrics"), client.get(f"{url}/server_info", headers=headers),
        return_exceptions=True,
    )
    if isinstance(metrics, BaseException) and isinstance(info, BaseException):
        return ServerReading("down", error=_describe(metrics))
    gauges = _gauges(metrics)
    body = _json(info)
    capacity = _capacity(body)
    state0 = (body.get("internal_states") or [{}])[0] if body else {}
    accept = gauges.get("accept_length")
    if accept is None and isinstance(state0, dict) and state0.get("avg_spec_accept_length"):
        accept = round(float(state0["avg_spec_accept_length"]), 3)
    return ServerReading(
        "up",
        running=gauges.get("running"), queue=gauges.get("queue"),
        token_usage=gauges.get("token_usage"), mamba_usage=gauges.get("mamba_usage"),
        gen_throughput=gauges.get("gen_throughput"), accept_length=accept,
        effective_max=capacity.effective if capacity else None,
        requested_max=capacity.requested if capacity else None,
        version=body.get("version") if body else None,
    )


def _gauges(metrics: httpx.Response | BaseException) -> dict[str, float]:
    """The gauges of a 200 `/metrics` answer; nothing (not an error) for 404 or a bad page."""
    if not isinstance(metrics, httpx.Response) or metrics.status_code != 200:
        return {}
    try:
        return parse_metrics(metrics.text)
    except ValueError:
        return {}


def _json(info: httpx.Response | BaseException) -> dict[str, Any] | None:
    if not isinstance(info, httpx.Response) or info.status_code != 200:
        return None
    try:
        body = orjson.loads(info.content)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None


def _capacity(body: dict[str, Any] | None) -> ServerCapacity | None:
    if body is None:
        return None
    try:
        return ServerCapacity.from_server_info(body)
    except (RetryableError, AttributeError, TypeError, ValueError):
        return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return "no answer in time"
    if isinstance(exc, httpx.ConnectError):
        return "connection refused"
    return type(exc).__name__


async def read_servers(
    urls: Iterable[str], api_key: str | None = None, deadline_s: float = FETCH_DEADLINE_S
) -> dict[str, ServerReading]:
    """Read every server concurrently; each one gets at most `deadline_s`."""
    unique = sorted(set(urls))
    if not unique:
        return {}
    timeout = httpx.Timeout(deadline_s, connect=min(CONNECT_TIMEOUT_S, deadline_s))
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:

        async def bounded(url: str) -> ServerReading:
            try:
                return await asyncio.wait_for(read_server(client, url, api_key), deadline_s)
            except TimeoutError as exc:
                return ServerReading("down", error=_describe(exc))

        readings = await asyncio.gather(*(bounded(u) for u in unique))
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

    Workers that did work for the job but are no longer registered are listed as `lost`.
    """
    rows = []
    for name in sorted(set(workers) | set(job_workers)):
        entry = workers.get(name, {})
        server = entry.get("server")
        reading = readings.get(server) if server else None
        mine = job_workers.get(name, {})
        tokens = float(mine.get("output_tokens", 0))
        live = asdict(reading) if reading else asdict(ServerReading("unknown"))
        live["server_state"] = live.pop("state")
        live["server_error"] = live.pop("error")
        if live["effective_max"] is None:
            live["effective_max"] = entry.get("effective_max_running_requests")
        rows.append({
            "worker": name,
            "server": server,
            "worker_state": entry.get("state", "lost"),
            "registry_age_s": entry.get("age_s"),
            "in_flight": entry.get("in_flight"),
            "limit": entry.get("limit"),
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
    api_key: str | None = None,
    now: float | None = None,
    deadline_s: float = FETCH_DEADLINE_S,
) -> list[dict[str, Any]]:
    """Registry + live server readings + this job's per-worker counters, one row per worker."""
    now = time.time() if now is None else now
    workers = registry(r, now)
    urls = [e["server"] for e in workers.values() if e.get("server")]
    readings = asyncio.run(read_servers(urls, api_key, deadline_s))
    return fleet_rows(workers, readings, job_workers, elapsed_s)


def render_fleet(rows: list[dict[str, Any]]) -> list[str]:
    """The per-GPU table for people; a server that did not answer shows `down`.

    `asked` is the requested max_running_requests when the server runs fewer (e.g. Mamba slots).
    """
    lines = [f"  {'worker':<22} {'state':<12} {'server':<22} {'run/max':>9} {'asked':>5} {'queue':>5}"
             f" {'tok use':>7} {'mamba':>5} {'gen tok/s':>9} {'accept':>6} | {'job done':>8}"
             f" {'job tok/s':>9}"]
    for row in rows:
        server = (row["server"] or "-").removeprefix("http://").removeprefix("https://")
        asked = row["requested_max"] if row["requested_max"] != row["effective_max"] else None
        if row["server_state"] == "up":
            run_max = f"{_num(row['running'])}/{_num(row['effective_max'])}"
            live = (f"{run_max:>9} {_num(asked) if asked else '':>5} {_num(row['queue']):>5}"
                    f" {_pct(row['token_usage']):>7} {_pct(row['mamba_usage']):>5}"
                    f" {_num(row['gen_throughput']):>9} {_dec(row['accept_length']):>6}")
        else:
            live = f"{row['server_state']:>9} {'':>5} {'':>5} {'':>7} {'':>5} {'':>9} {'':>6}"
        lines.append(
            f"  {row['worker'][:22]:<22} {row['worker_state']:<12} {server[:22]:<22} {live} |"
            f" {row['job_prompts_done']:>8,} {_num(row['job_output_tokens_per_s']):>9}"
        )
    return lines


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _dec(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
