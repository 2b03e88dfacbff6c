"""What a generation server says about itself: the one reader of SGLang's `/server_info`.

The worker sizes its concurrency from it, `producer status` shows it, and `launcher up` explains
it (launcher/logs). Where the answer comes from, in order:

1. `/server_info` (SGLang since 2025-11);
2. `/get_server_info` (older SGLang builds; 0.5.23 still serves it, deprecated);
3. neither (vLLM, llama.cpp, a gateway: any other OpenAI-compatible server): the worker keeps
   `FLEETGEN_MAX_IN_FLIGHT` requests in flight and says so in its log, or, with the setting
   unset, one request and a warning that names it: never a silent 1.

The DP rule (docs/reference/sglang.md#server-info): `internal_states` holds one element per
data-parallel rank (SGLang fans the internal-state request out to every rank), and each rank's
`effective_max_running_requests_per_dp` is what that rank itself runs after its memory limits.
Ranks size their pools from their own GPU's free memory, so they may differ: the server runs
their **sum** at once. A server that does not state the effective cap of every rank (builds
before 2026-01) falls back to the top-level `max_running_requests`, which is what was asked
for the whole server.

    async with httpx.AsyncClient(base_url=url) as client:
        info = await fetch_server_info(client)   # None: not SGLang
    capacity = server_capacity(info, settings.max_in_flight)
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

# Newest first: `/server_info` arrived in 2025-11, `/get_server_info` is what came before.
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
# Statuses that mean "this server has no such endpoint" (FastAPI answers 404; some proxies 405).
NO_SUCH_ENDPOINT = (404, 405)
CONFIGURED = "FLEETGEN_MAX_IN_FLIGHT"


@dataclass(frozen=True)
class ServerInfo:
    """One `/server_info` body, read once: typed figures plus the raw parts for explaining."""

    path: str  # the endpoint that answered
    args: Mapping[str, object]  # the top level: every resolved launch argument
    ranks: tuple[Mapping[str, object], ...]  # `internal_states`, one per DP rank
    version: str | None
    model: str | None  # served_model_name, else model_path
    context_length: int | None
    max_total_num_tokens: int | None  # the KV pool in tokens
    max_req_input_len: int | None
    chunked_prefill_size: int | None
    speculative_algorithm: str | None
    requested: int | None  # --max-running-requests as launched, else the top-level value
    per_rank: tuple[int | None, ...]  # effective_max_running_requests_per_dp of each rank
    memory: Mapping[str, object]  # rank 0's memory_usage (GB and tokens)
    last_gen_throughput: float | None
    avg_spec_accept_length: float | None
    # A router's info (sglang-router's router manager: `router_manager`, `workers_count`), not
    # a server's: it states nothing of what its backends run.
    router: bool = False
    # Whether it serves an embedding model (SGLang's `--is-embedding`, a launch argument its
    # info echoes): only /v1/embeddings answers there. None where the info does not say.
    embeds: bool | None = None

    @property
    def concurrency(self) -> int | None:
        """Requests the whole server runs at once: the sum over its DP ranks, when every rank
        states its effective cap; None otherwise (SGLang before 2026-01)."""
        if not self.per_rank or None in self.per_rank:
            return None
        return sum(n for n in self.per_rank if n is not None)

    @property
    def weight_gb(self) -> float | None:
        return as_float(self.memory.get("weight"))

    @property
    def kvcache_gb(self) -> float | None:
        return as_float(self.memory.get("kvcache"))


@dataclass(frozen=True)
class ServerCapacity:
    """What the worker sizes its limiter from, and where the number came from (for its log)."""

    effective: int  # requests the server runs at once
    requested: int | None
    source: str
    # True when the server said nothing: `effective` is the operator's number (or 1), kept
    # in flight as is, with no queue margin above it.
    configured: bool = False


def _as_bool(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def parse_server_info(body: Mapping[str, object], path: str = SERVER_INFO_PATHS[0]) -> ServerInfo:
    """Read a `/server_info` (or `/get_server_info`) body; missing fields read as None."""
    raw_states = body.get("internal_states")
    ranks = tuple(s for s in raw_states if isinstance(s, Mapping)) \
        if isinstance(raw_states, list) else ()
    first: Mapping[str, object] = ranks[0] if ranks else {}
    raw_memory = first.get("memory_usage")
    memory: Mapping[str, object] = raw_memory if isinstance(raw_memory, Mapping) else {}
    asked = _launch_flag(body.get("launch_command"), "--max-running-requests")
    return ServerInfo(
        path=path, args=body, ranks=ranks,
        version=_as_str(body.get("version")),
        model=_as_str(body.get("served_model_name")) or _as_str(body.get("model_path")),
        context_length=as_int(body.get("context_length")),
        max_total_num_tokens=as_int(body.get("max_total_num_tokens"))
        or as_int(memory.get("token_capacity")),
        max_req_input_len=as_int(body.get("max_req_input_len")),
        chunked_prefill_size=as_int(body.get("chunked_prefill_size")),
        speculative_algorithm=_as_str(body.get("speculative_algorithm")),
        requested=asked if asked is not None else as_int(body.get("max_running_requests")),
        per_rank=tuple(as_int(s.get("effective_max_running_requests_per_dp")) for s in ranks),
        memory=memory,
        last_gen_throughput=as_float(first.get("last_gen_throughput")),
        avg_spec_accept_length=as_float(first.get("avg_spec_accept_length")),
        router=bool(body.get("router_manager")) or "workers_count" in body,
        embeds=_as_bool(body.get("is_embedding")),
    )


async def fetch_server_info(
    client: httpx.AsyncClient, url: str = "", headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
) -> ServerInfo | None:
    """GET `/server_info`, then `/get_server_info`; None when the server has neither (or
    answers them with something that is not a JSON object).

    httpx errors, and statuses other than 200 and "no such endpoint", are raised
    (`httpx.HTTPError`): a server that is down or refuses the key is not a server without
    the endpoint.
    """
    timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
    for path in SERVER_INFO_PATHS:
        response = await client.get(f"{url}{path}", headers=headers, timeout=timeout)
        if response.status_code in NO_SUCH_ENDPOINT:
            continue
        response.raise_for_status()
        try:
            body: Any = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            return None
        return parse_server_info(body, path) if isinstance(body, dict) else None
    return None


def stated_capacity(info: ServerInfo) -> ServerCapacity | None:
    """What the server itself says it runs at once; None if its body does not say."""
    if info.concurrency is not None:
        ranks = len(info.per_rank)
        where = "effective_max_running_requests_per_dp" + (
            f", summed over {ranks} DP ranks" if ranks > 1 else "")
        return ServerCapacity(info.concurrency, info.requested, f"{info.path} {where}")
    if info.requested is not None:
        # Servers before 2026-01 do not say what they really run; the ask is the next best.
        return ServerCapacity(info.requested, info.requested,
                              f"{info.path} max_running_requests (asked; the server did not "
                              "say what it runs)")
    return None


def server_capacity(info: ServerInfo | None, max_in_flight: int | None) -> ServerCapacity:
    """The worker's capacity: the server's own word, else FLEETGEN_MAX_IN_FLIGHT, else 1 with
    a source that says how to do better (the worker logs it)."""
    stated = stated_capacity(info) if info is not None else None
    if stated is not None:
        return stated
    silent = ("the server has no /server_info or /get_server_info" if info is None
              else f"the server's {info.path} does not say what it runs")
    if max_in_flight:
        return ServerCapacity(max_in_flight, None, f"{CONFIGURED}={max_in_flight} ({silent})",
                              configured=True)
    return ServerCapacity(1, None, f"{silent}, and {CONFIGURED} is not set: set it to the "
                          "number of requests the server runs at once", configured=True)


def _launch_flag(command: object, flag: str) -> int | None:
    """The value of `flag` in the argv (list or string) the server was launched with."""
    argv = shlex.split(command) if isinstance(command, str) else command
    if not isinstance(argv, list):
        return None
    words = [str(w) for w in argv]
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return as_int(words[i + 1])
        if word.startswith(flag + "="):
            return as_int(word[len(flag) + 1:])
    return None


def as_int(value: object) -> int | None:
    """An int from a JSON/log value (int, integral float or digit string); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def as_float(value: object) -> float | None:
    """A float from a JSON/log value; None for anything else (bools included)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _as_str(value: object) -> str | None:
    return value if isinstance(value, str) else None
