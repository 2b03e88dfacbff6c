"""`launcher advise`: per GPU, what binds its server and which flags to try, with a prediction.

A server runs at most its effective cap (docs/reference/sglang.md#max-running-requests). When
work waits in its queue, the limit that binds is one of: the Mamba state slots, the KV pool,
the request itself (`--max-running-requests`, or the speculative default 48), or, above the
largest CUDA-graph batch, eager decode. With an empty queue nothing binds and no flag helps.
Advice comes only from load seen: a server that never ran requests, or whose running peak never
reached its cap (or the largest CUDA graph), gets none, since no limit was met.

The prediction uses memory-bound decode: one step costs `a + b x running` and yields the same
tokens per request, so tokens/s in all scale as `n / (a + b n)`; a and b are the reference
GPU's (docs/development/simulator.md#decode-cost), and the measured tokens/s are scaled by
that ratio. The flags are a first candidate, not a proof: `launcher tune` tries them on one GPU
and keeps them only if they win.

A server the launcher did not start has no node.json entry: `entry_for_url` reads its
`/server_info` (fleetgen/servers/_server_info.py) as `launcher up` reads a ready server's, into the same
entry, so the advice is the same.

    advice = advise(gpu_entry_from_node_json, observed)
    advice.line()  # "gpu0: bound by 80 Mamba slots at 16 running, KV 7% used: ..."
    entry = await entry_for_url("http://10.0.0.5:30000")  # any SGLang server
    advise(entry, await observe(entry.url, 30.0, 2.0)).line()  # "http://10.0.0.5:30000: ..."
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from fleetgen.readings import describe_error, parse_metrics
from fleetgen.servers import SERVER_INFO_PATHS, ServerInfo, as_float, fetch_server_info
from launcher.logs import fold
from launcher.node._args import adapt_flags, flag_value
from launcher.node._errors import NodeError
from launcher.node._flags import check_args
from launcher.node._rundir import ProcessEntry, ServerEntry
from launcher.node._watch import limits_reading

# The reference GPU's decode step (docs/development/simulator.md#decode-cost).
STEP_MS, STEP_MS_PER_REQUEST = 11.0, 0.56
# How far one change may move the cap: beyond ~2.5x a guess about memory is a guess.
MAX_GROWTH = 2.5
KV_HEADROOM = 0.8  # keep the predicted KV use under 80%
TARGET_MEM_FRACTION = 0.93
QUEUE_EMPTY = 0.5  # mean requests waiting below which the queue counts as empty


@dataclass(frozen=True)
class Observed:
    """Means over a window of a server's /metrics samples."""

    samples: int
    running: float | None = None
    peak_running: float | None = None  # the most seen running at once (the log's, or a sample's)
    queue: float | None = None
    kv_usage: float | None = None
    mamba_usage: float | None = None
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class Advice:
    """One server's verdict: what binds, how full the pools are, and the flags to try."""

    gpu: int | None  # None for a server given by URL (`advise --url`)
    binding: str  # mamba, kv, request, spec-default, cuda-graph, idle, unknown
    cap: int | None
    requested: int | None
    running: float | None
    queue: float | None
    kv_usage: float | None
    mamba_usage: float | None
    mamba_slots: int | None
    mamba_num: int | None  # slots held: Mamba usage x slots (the decode log's `mamba num`)
    tokens_per_s: float | None
    flags: tuple[str, ...] = ()
    predicted_running: int | None = None
    predicted_tokens_per_s: float | None = None
    why: str = ""
    samples: int = 0
    url: str | None = None
    server: str | None = None  # a node's server by its queue name, `gpu0` or `gpu0-1`

    @property
    def name(self) -> str:
        """`gpu0` (`gpu0-1` for a server over GPUs 0 and 1) for a node's server, else its
        URL."""
        if self.server:
            return self.server
        return f"gpu{self.gpu}" if self.gpu is not None else str(self.url)

    @property
    def gain(self) -> float | None:
        """Predicted tokens/s over the measured or modelled ones, minus one."""
        if self.cap and self.predicted_running:
            return relative_throughput(self.predicted_running, self.cap) - 1.0
        return None

    def line(self) -> str:
        """`gpu0: bound by ...: FLAGS → ~N running, ~T tokens/s (+G%)` (the URL for `gpu0`
        when advising by URL)."""
        text = f"{self.name}: {self.why}"
        if not self.flags:
            return text
        text += f": `{shlex.join(self.flags)}`"
        if self.predicted_running is not None:
            text += f" → ~{self.predicted_running} running"
            if self.predicted_tokens_per_s is not None:
                text += f", ~{self.predicted_tokens_per_s:,.0f} tokens/s"
            if self.gain is not None:
                text += f" ({self.gain:+.0%} tokens/s)"
        return text

    def _json(self) -> dict[str, Any]:
        return {**asdict(self), "flags": list(self.flags), "gain": self.gain,
                "line": self.line()}


def advice_json(advice: Sequence[Advice]) -> str:
    """`advise --json`: one object per server, in a list."""
    return json.dumps([a._json() for a in advice], indent=1)


def relative_throughput(n: int, m: int) -> float:
    """Tokens/s in all at `n` running over those at `m`, under the step cost model."""
    def total(k: int) -> float:
        return k / (STEP_MS + STEP_MS_PER_REQUEST * k)
    return total(n) / total(m) if m > 0 else math.inf


def advise(entry: ServerEntry, observed: Observed | None = None) -> Advice:
    """The advice for one GPU from its node.json entry (or `entry_for_url`'s) and, when sampled,
    its live figures."""
    cap = entry.capacity
    argv = entry.server.argv
    n = cap.effective if cap else None
    requested = cap.requested if cap else None
    binding = (cap.binding if cap else None) or "unknown"
    slots = cap.mamba_slots if cap else None
    tokens = cap.max_total_num_tokens if cap else None
    graph_bs = cap.cuda_graph_max_bs if cap else None
    version = cap.version if cap else None
    obs = observed or Observed(samples=0)
    held = round(obs.mamba_usage * slots) if obs.mamba_usage is not None and slots else None

    def verdict(binding: str, why: str, flags: Sequence[str] = (), target: int | None = None,
                predicted: float | None = None) -> Advice:
        return Advice(
            gpu=entry.gpu, binding=binding, cap=n, requested=requested,
            running=obs.running, queue=obs.queue, kv_usage=obs.kv_usage,
            mamba_usage=obs.mamba_usage, mamba_slots=slots, mamba_num=held,
            tokens_per_s=obs.tokens_per_s, flags=tuple(flags), predicted_running=target,
            predicted_tokens_per_s=predicted, why=why, samples=obs.samples,
            url=entry.url or None, server=entry.server.name or None)

    if n is None or n <= 0:
        return verdict("unknown", "the effective cap is not known yet")
    peak = obs.peak_running if obs.peak_running is not None else obs.running
    if peak is None:
        return verdict(binding, f"cap {n}: no load seen yet, so nothing to advise")
    running_text = f"{obs.running:.0f}" if obs.running is not None else f"a peak of {peak:.0f}"
    pools = _pools_text(obs, slots, held)
    if obs.queue is not None and obs.queue < QUEUE_EMPTY:
        return verdict("idle", f"nothing binds: the queue is empty ({running_text} running of "
                       f"{n}{pools}); more concurrency needs more work")
    mfs = _float(flag_value(argv, "--mem-fraction-static"))
    flags: list[str] = []
    # Only a batch that really ran above the graphs' size paid for it, and only a cap that was
    # reached bound anything. The step model does not say how much graphs save, so that advice
    # names no gain.
    if graph_bs is not None and n > graph_bs and peak > graph_bs:
        binding, target = "cuda-graph", n
        flags = ["--cuda-graph-max-bs-decode", str(n)]
        if version is not None:  # spelled as that release takes it
            flags = adapt_flags(flags, version)[0]
        why = f"batches above {graph_bs} run without CUDA graphs ({running_text} running{pools})"
    elif peak < n:
        return verdict(binding, f"cap {n} never reached (at most {peak:.0f} running): "
                       "nothing to advise")
    elif binding == "mamba" and slots:
        ratio = max(1, slots // n)
        target = _grow(n, requested, obs.kv_usage)
        flags = ["--max-mamba-cache-size", str(target * ratio)]
        if mfs is None or mfs < TARGET_MEM_FRACTION:
            flags += ["--mem-fraction-static", str(TARGET_MEM_FRACTION)]
        why = f"bound by {slots} Mamba slots at {running_text} running{pools}"
    elif binding == "kv":
        new_mfs = min(TARGET_MEM_FRACTION, (mfs or 0.84) + 0.05)
        target = _grow(n, requested, None)
        flags = ["--mem-fraction-static", f"{new_mfs:.2f}"]
        why = f"bound by the KV pool ({tokens} tokens) at {running_text} running{pools}"
    elif binding in ("request", "spec-default", "auto"):
        target = _grow(n, None, obs.kv_usage)
        flags = ["--max-running-requests", str(target)]
        what = "the speculative default of 48" if binding == "spec-default" else \
            f"--max-running-requests {requested or n}"
        why = f"bound by {what} at {running_text} running{pools}"
    else:
        return verdict(binding, f"cap {n}: {(cap.reason if cap else '') or 'no advice'}")
    rejected = check_args(flags, version) if version is not None else []
    if rejected:  # an older release lacks the flag: say so rather than advise a failing start
        return verdict(binding, f"{why}; no flag to offer: {rejected[0]}")
    if binding == "cuda-graph":
        return verdict(binding, why, flags)
    predicted = None
    if obs.tokens_per_s is not None:
        predicted = obs.tokens_per_s * relative_throughput(target, n)
    return verdict(binding, why, flags, target, predicted)


def _grow(n: int, ceiling: int | None, kv_usage: float | None) -> int:
    """The next cap to try: up to MAX_GROWTH x, within the request and the KV headroom."""
    target = math.floor(n * MAX_GROWTH)
    if kv_usage is not None and kv_usage > 0:
        target = min(target, math.floor(n * KV_HEADROOM / kv_usage))
    if ceiling is not None and ceiling > n:
        target = min(target, ceiling)
    return max(target, n + 1)


def _pools_text(obs: Observed, slots: int | None, held: int | None) -> str:
    parts = []
    if obs.kv_usage is not None:
        parts.append(f"KV {obs.kv_usage:.0%} used")
    if obs.mamba_usage is not None:
        # The slots held say whether the running requests fill the pool that caps them.
        count = f" ({held} of {slots} slots)" if held is not None else ""
        parts.append(f"Mamba {obs.mamba_usage:.0%} used{count}")
    if obs.queue is not None:
        parts.append(f"{obs.queue:.0f} queued")
    return ", " + ", ".join(parts) if parts else ""


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


# A server given by URL, and sampling a server over a window.

async def entry_for_url(url: str, api_key: str | None = None,
                        timeout_s: float = 10.0) -> ServerEntry:
    """A server the launcher did not start, as a node.json entry: its `/server_info` (or
    `/get_server_info`) read by fleetgen/servers/_server_info.py and combined as `launcher up` combines
    a ready server's (`limits_reading`, here with no log).

    Raises NodeError when the server cannot be read, or is not SGLang: then the one line says
    what advise reads and what the server answered instead.
    """
    answers: list[httpx.Response] = []

    async def note(response: httpx.Response) -> None:
        answers.append(response)

    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False, headers=_auth(api_key),
                                     event_hooks={"response": [note]}) as client:
            info = await fetch_server_info(client, url)
    except httpx.HTTPStatusError as exc:
        status = exc.response.status_code
        key = " (a wrong or missing --api-key?)" if status in (401, 403) else ""
        raise NodeError(f"{url}: {exc.request.url.path} answered {status}{key}") from exc
    except httpx.HTTPError as exc:
        raise NodeError(f"{url}: cannot read {SERVER_INFO_PATHS[0]}: "
                        f"{describe_error(exc)}") from exc
    if info is None:
        raise NodeError(f"{url} is not an SGLang server: advise reads SGLang's "
                        f"{' or '.join(SERVER_INFO_PATHS)}, and {_answered(answers)}")
    return entry_from_server_info(url, info)


def entry_from_server_info(url: str, info: ServerInfo) -> ServerEntry:
    """The node.json entry `advise` reads, for a server known only by its `/server_info`."""
    # The memory fraction the server resolved (its default included), as if passed.
    mfs = as_float(info.args.get("mem_fraction_static"))
    argv = ("--mem-fraction-static", str(mfs)) if mfs is not None else ()
    return ServerEntry(gpu=None, server=ProcessEntry(state="ready", argv=argv), url=url,
                       capacity=limits_reading(info, fold((), url)))


def _answered(answers: Sequence[httpx.Response]) -> str:
    """What a server that is not SGLang answered to the server-info paths, in a few words."""
    if not answers:
        return "it answered nothing"
    said = []
    for r in answers:
        kind = r.headers.get("content-type", "").partition(";")[0]
        said.append(f"{r.request.url.path} with {r.status_code}"
                    + (f" {kind}" if kind and r.status_code == 200 else ""))
    server = answers[-1].headers.get("server")
    return "it answered " + " and ".join(said) + (f" (server: {server})" if server else "")


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _sample(text: str) -> dict[str, float]:
    """One `/metrics` page (fleetgen.readings.parse_metrics) in advise's terms; `kv_usage` is the
    KV pool alone where the server exports it, else its fullest pool."""
    gauges = parse_metrics(text)
    kv = gauges.get("full_token_usage", gauges.get("token_usage"))
    named = {"running": gauges.get("running"), "queue": gauges.get("queue"), "kv_usage": kv,
             "mamba_usage": gauges.get("mamba_usage"), "tokens_per_s": gauges.get("gen_throughput")}
    return {k: v for k, v in named.items() if v is not None}


async def observe(url: str, window_s: float, interval_s: float,
                  api_key: str | None = None) -> Observed:
    """Sample `/metrics` every `interval_s` for `window_s`; means of what answered."""
    rows: list[Mapping[str, float]] = []
    async with httpx.AsyncClient(timeout=10.0, trust_env=False, headers=_auth(api_key)) as client:
        loop = asyncio.get_running_loop()
        end = loop.time() + window_s
        while True:
            try:
                response = await client.get(f"{url}/metrics")
                if response.status_code == 200:
                    rows.append(_sample(response.text))
            except httpx.HTTPError:
                pass  # a sample missed; the means are of what answered
            if loop.time() + interval_s > end:
                break
            await asyncio.sleep(interval_s)
    running = [row["running"] for row in rows if "running" in row]
    return Observed(samples=len(rows), peak_running=max(running, default=None),
                    **{k: _mean(rows, k) for k in (
                        "running", "queue", "kv_usage", "mamba_usage", "tokens_per_s")})


def _mean(rows: Sequence[Mapping[str, float]], key: str) -> float | None:
    values = [row[key] for row in rows if key in row]
    return sum(values) / len(values) if values else None
