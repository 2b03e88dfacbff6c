"""What one server says about itself right now: `/metrics` gauges (any kind's) and, for SGLang,
its server info.

Read by each worker for its own server (published in its registry entry, engine.py), and by
`producer status` for servers on its own node (fleetgen/fleet.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleetgen.servers import KINDS, ServerInfo, fetch_server_info, stated_capacity

# Prometheus family -> (short name, how readings of several schedulers combine), over every
# kind's gauges: the names of different engines never collide, so one page is read the same
# way whatever served it.
GAUGES: dict[str, tuple[str, str]] = {
    family: (short, how) for kind in KINDS.values() for short, (family, how) in kind.gauges.items()
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
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in GAUGES:
            found.setdefault(GAUGES[family.name][0], []).extend(s.value for s in family.samples)
    how = {short: combine for short, combine in GAUGES.values()}
    out: dict[str, float] = {}
    for short, values in found.items():
        if values:
            combine = how[short]
            value = (max(values) if combine == "max"
                     else sum(values) / (len(values) if combine == "mean" else 1))
            out[short] = round(value, 3)
    if "token_usage" not in out and "gpu_cache_usage" in out:
        out["token_usage"] = out["gpu_cache_usage"]
    return out


async def read_server(client: httpx.AsyncClient, url: str, api_key: str | None = None) -> ServerReading:
    """`/metrics` and the server's info (fleetgen/servers/_server_info.py) of one server; never raises
    for a server that is down."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    metrics, info = await asyncio.gather(
        client.get(f"{url}/metrics"), fetch_server_info(client, url, headers),
        return_exceptions=True,
    )
    if isinstance(metrics, BaseException) and isinstance(info, BaseException):
        return ServerReading("down", error=describe_error(metrics))
    gauges = _gauges(metrics)
    known = info if isinstance(info, ServerInfo) else None
    capacity = stated_capacity(known) if known else None
    accept = gauges.get("accept_length")
    if accept is None and known and known.avg_spec_accept_length:
        accept = round(known.avg_spec_accept_length, 3)
    return ServerReading(
        "up",
        running=gauges.get("running"), queue=gauges.get("queue"),
        token_usage=gauges.get("token_usage"), mamba_usage=gauges.get("mamba_usage"),
        gen_throughput=gauges.get("gen_throughput"), accept_length=accept,
        effective_max=capacity.effective if capacity else None,
        requested_max=capacity.requested if capacity else None,
        version=known.version if known else None,
    )


def _gauges(metrics: httpx.Response | BaseException) -> dict[str, float]:
    """The gauges of a 200 `/metrics` answer; nothing (not an error) for 404 or a bad page."""
    if not isinstance(metrics, httpx.Response) or metrics.status_code != 200:
        return {}
    try:
        return parse_metrics(metrics.text)
    except ValueError:
        return {}


def describe_error(exc: BaseException) -> str:
    """A few words for why a server did not answer."""
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return "no answer in time"
    if isinstance(exc, httpx.ConnectError):
        return "connection refused"
    return type(exc).__name__


async def read_server_within(client: httpx.AsyncClient, url: str, api_key: str | None,
                             deadline_s: float) -> ServerReading:
    """`read_server` under a deadline: a hung server reads as `down`."""
    try:
        return await asyncio.wait_for(read_server(client, url, api_key), deadline_s)
    except TimeoutError as exc:
        return ServerReading("down", error=describe_error(exc))
