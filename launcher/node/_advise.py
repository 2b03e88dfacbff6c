"""`launcher advise`: per GPU, what binds its server and which flags to try, with a prediction.

A server runs at most its effective cap (docs/reference/sglang.md#max-running-requests). When
work waits in its queue, the limit that binds is one of: the Mamba state slots, the KV pool,
the request itself (`--max-running-requests`, or the speculative default 48), or, above the
largest CUDA-graph batch, eager decode. With an empty queue nothing binds and no flag helps.

The prediction uses memory-bound decode: one step costs `a + b x running` and yields the same
tokens per request, so tokens/s in all scale as `n / (a + b n)`; a and b are the reference
GPU's (docs/development/simulator.md#decode-cost), and the measured tokens/s are scaled by
that ratio. The flags are a first candidate, not a proof: `launcher tune` tries them on one GPU
and keeps them only if they win.

    advice = advise(gpu_entry_from_node_json, observed)
    advice.line()  # "gpu0: bound by 80 Mamba slots at 16 running, KV 7% used: ..."
"""

from __future__ import annotations

import asyncio
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from launcher.node._args import adapt_flags, flag_value
from launcher.node._flags import check_args
from workers.readings import parse_metrics

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
    queue: float | None = None
    kv_usage: float | None = None
    mamba_usage: float | None = None
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class Advice:
    """One GPU's verdict: what binds, how full the pools are, and the flags to try."""

    gpu: int
    binding: str  # mamba, kv, request, spec-default, cuda-graph, idle, unknown
    cap: int | None
    requested: int | None
    running: float | None
    queue: float | None
    kv_usage: float | None
    mamba_usage: float | None
    mamba_slots: int | None
    tokens_per_s: float | None
    flags: tuple[str, ...] = ()
    predicted_running: int | None = None
    predicted_tokens_per_s: float | None = None
    why: str = ""
    samples: int = 0

    @property
    def gain(self) -> float | None:
        """Predicted tokens/s over the measured or modelled ones, minus one."""
        if self.cap and self.predicted_running:
            return relative_throughput(self.predicted_running, self.cap) - 1.0
        return None

    def line(self) -> str:
        """`gpu0: bound by ...: FLAGS → ~N running, ~T tokens/s (+G%)`."""
        text = f"gpu{self.gpu}: {self.why}"
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

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "flags": list(self.flags), "gain": self.gain,
                "line": self.line()}


def relative_throughput(n: int, m: int) -> float:
    """Tokens/s in all at `n` running over those at `m`, under the step cost model."""
    def total(k: int) -> float:
        return k / (STEP_MS + STEP_MS_PER_REQUEST * k)
    return total(n) / total(m) if m > 0 else math.inf


def advise(entry: Mapping[str, Any], observed: Observed | None = None) -> Advice:
    """The advice for one GPU from its node.json entry and, when sampled, its live figures."""
    cap_info: Mapping[str, Any] = entry.get("capacity") or {}
    argv = [str(a) for a in entry.get("argv") or []]
    n = _int(cap_info.get("effective"))
    requested = _int(cap_info.get("requested"))
    binding = str(cap_info.get("binding") or "unknown")
    slots = _int(cap_info.get("mamba_slots"))
    tokens = _int(cap_info.get("max_total_num_tokens"))
    graph_bs = _int(cap_info.get("cuda_graph_max_bs"))
    obs = observed or Observed(samples=0)

    def verdict(binding: str, why: str, flags: Sequence[str] = (), target: int | None = None,
                predicted: float | None = None) -> Advice:
        return Advice(
            gpu=int(entry.get("gpu", -1)), binding=binding, cap=n, requested=requested,
            running=obs.running, queue=obs.queue, kv_usage=obs.kv_usage,
            mamba_usage=obs.mamba_usage, mamba_slots=slots, tokens_per_s=obs.tokens_per_s,
            flags=tuple(flags), predicted_running=target, predicted_tokens_per_s=predicted,
            why=why, samples=obs.samples)

    if n is None or n <= 0:
        return verdict("unknown", "the effective cap is not known yet")
    running_text = f"{obs.running:.0f}" if obs.running is not None else str(n)
    pools = _pools_text(obs)
    if obs.queue is not None and obs.queue < QUEUE_EMPTY:
        return verdict("idle", f"nothing binds: the queue is empty ({running_text} running of "
                       f"{n}{pools}); more concurrency needs more work")
    mfs = _float(flag_value(argv, "--mem-fraction-static"))
    flags: list[str] = []
    if graph_bs is not None and n > graph_bs:
        binding, target = "cuda-graph", n
        flags = ["--cuda-graph-max-bs-decode", str(n)]
        if isinstance(cap_info.get("version"), str):  # spelled as that release takes it
            flags = adapt_flags(flags, str(cap_info["version"]))[0]
        why = f"batches above {graph_bs} run without CUDA graphs ({running_text} running{pools})"
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
        return verdict(binding, f"cap {n}: {cap_info.get('reason') or 'no advice'}")
    version = cap_info.get("version")
    rejected = check_args(flags, version) if isinstance(version, str) else []
    if rejected:  # an older release lacks the flag: say so rather than advise a failing start
        return verdict(binding, f"{why}; no flag to offer: {rejected[0]}")
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


def _pools_text(obs: Observed) -> str:
    parts = []
    if obs.kv_usage is not None:
        parts.append(f"KV {obs.kv_usage:.0%} used")
    if obs.mamba_usage is not None:
        parts.append(f"Mamba {obs.mamba_usage:.0%} used")
    if obs.queue is not None:
        parts.append(f"{obs.queue:.0f} queued")
    return ", " + ", ".join(parts) if parts else ""


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


# Sampling a server over a window.

def _sample(text: str) -> dict[str, float]:
    """One `/metrics` page (workers.readings.parse_metrics) in advise's terms; `kv_usage` is the
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
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=10.0, trust_env=False, headers=headers) as client:
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
    return Observed(samples=len(rows), **{k: _mean(rows, k) for k in (
        "running", "queue", "kv_usage", "mamba_usage", "tokens_per_s")})


def _mean(rows: Sequence[Mapping[str, float]], key: str) -> float | None:
    values = [row[key] for row in rows if key in row]
    return sum(values) / len(values) if values else None
