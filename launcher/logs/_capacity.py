"""Why a server runs fewer (or more) requests at once than it was asked to.

SGLang caps max_running_requests by the KV pool (tokens // 2), by the Mamba state pool
(slots // slots-per-request) or by the request itself, and it often logs nothing about it
(docs/reference/sglang.md#max-running-requests). `read_capacity` names the binding limit in one
sentence; `from_server_info` reads the same facts, and the real concurrency, from a live
`/server_info` body. Workers and the launcher must size their concurrency from
`ServerReading.concurrency`, never from the flag they passed.

    reading = read_capacity(CapacityFacts(requested=128, effective=16, max_mamba_cache_size=80))
    reading.reason  # "asked 128, got 16: 80 Mamba slots / 5 per request (extra_buffer); ..."
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

Binding = Literal["request", "kv", "mamba", "spec-default", "auto"]

# speculative_hook.py sets an unset --max-running-requests to this when drafting is on.
SPEC_DEFAULT = 48
# Mamba state slots per running request for each radix-cache strategy, with overlap scheduling
# on (the default): 3 + tracking slots (docs/reference/sglang.md#mamba-cap). extra_buffer
# without overlap takes 4.
STRATEGY_RATIO = {"no_buffer": 3, "extra_buffer": 5, "extra_buffer_lazy": 4}
_RATIO_NAME = {1: "radix cache off", 3: "no_buffer", 4: "extra_buffer_lazy or no overlap",
               5: "extra_buffer"}
_AUTO_RULE = "min(clamp(tokens / context_len * 512, 2048, 4096), tokens // 2)"


@dataclass(frozen=True)
class CapacityFacts:
    """What is known about a server's request cap; None where nothing says."""

    requested: int | None = None  # --max-running-requests as asked (None: flag unset)
    requested_known: bool = True  # False when nothing shows the ask (e.g. a partial log)
    effective: int | None = None  # the summary line, or effective_max_running_requests_per_dp
    max_total_num_tokens: int | None = None
    max_mamba_cache_size: int | None = None
    strategy: str | None = None  # --mamba-radix-cache-strategy (or the old scheduler name)
    disable_radix_cache: bool = False
    speculative: bool = False
    per_request: int | None = None  # Mamba slots per request, when the server said so ([R])
    attn_dp_size: int = 1


@dataclass(frozen=True)
class CapacityReading:
    """The effective cap, which limit binds, and one sentence saying why and what to raise."""

    requested: int | None
    effective: int | None
    binding: Binding | None
    ratio: int | None  # Mamba state slots per request (None for dense models)
    reason: str


@dataclass(frozen=True)
class ServerReading:
    """What a live server says about itself in `/server_info`.

    As in docs/reference/sglang.md#server-info."""

    version: str | None
    model_path: str | None
    served_model_name: str | None
    context_length: int | None
    max_total_num_tokens: int | None
    max_req_input_len: int | None
    chunked_prefill_size: int | None
    speculative_algorithm: str | None
    capacity: CapacityReading
    concurrency: int | None  # requests the whole server runs at once: sum over DP ranks
    last_gen_throughput: float | None
    avg_spec_accept_length: float | None
    weight_gb: float | None
    kvcache_gb: float | None


def read_capacity(facts: CapacityFacts) -> CapacityReading:
    """Decide which limit binds the effective max_running_requests, and say why in one line."""
    spec_default = (facts.speculative and facts.requested_known
                    and facts.requested in (None, SPEC_DEFAULT))
    asked = SPEC_DEFAULT if spec_default else facts.requested
    asked_text = _asked_text(asked, spec_default, facts.requested_known)
    ratio = _known_ratio(facts)
    n = facts.effective
    if n is None:
        reason = f"asked {asked_text}; the effective value is not known yet (no summary line)"
        return CapacityReading(asked, None, None, ratio, reason)
    binding, ratio, why = _bind(facts, n, asked, spec_default, ratio)
    return CapacityReading(asked, n, binding, ratio, f"asked {asked_text}, got {n}: {why}")


def _bind(
    facts: CapacityFacts, n: int, asked: int | None, spec_default: bool, ratio: int | None
) -> tuple[Binding | None, int | None, str]:
    tokens, slots, dp = facts.max_total_num_tokens, facts.max_mamba_cache_size, facts.attn_dp_size
    per_dp = asked // dp if asked is not None else None
    below_ask = per_dp is None or n < per_dp
    unknown_ask = not facts.requested_known
    kv_allows = tokens // 2 if tokens is not None else None
    guessed = ratio if ratio is not None else _inferred_ratio(slots, n)
    mamba_binds = slots is not None and guessed is not None and slots // guessed == n
    room = _room(kv_allows, slots // ratio if slots is not None and ratio else None)
    if per_dp is not None and n > per_dp:
        why = "more than asked, so the server never saw the request; check the launch command"
        return "auto", ratio, why
    # A ratio the server stated outranks tokens // 2; a guessed one only fills a silence.
    if below_ask and mamba_binds and (ratio is not None or kv_allows != n):
        why = (f"{slots} Mamba slots / {guessed} per request ({_strategy_name(facts, guessed)}); "
               "raise --max-mamba-cache-size or --mamba-full-memory-ratio")
        return "mamba", guessed, why
    if below_ask and kv_allows == n:
        why = (f"KV pool of {tokens} tokens allows {n} (tokens // 2); "
               "raise --mem-fraction-static or lower --context-length")
        return "kv", ratio, why
    if unknown_ask:
        return None, ratio, f"the log does not show what was asked{room}"
    if per_dp is not None and n == per_dp and spec_default:
        why = (f"speculative decoding defaults --max-running-requests to {SPEC_DEFAULT}{room}; "
               "set it to run more")
        return "spec-default", ratio, why
    if per_dp is not None and n == per_dp:
        split = f" per DP worker ({asked} // {dp} attention-DP ranks)" if dp > 1 else ""
        return "request", ratio, f"the request binds{split}{room}"
    if per_dp is None:
        return "auto", ratio, f"flag unset, so sized as {_AUTO_RULE}{room}"
    if per_dp > 4096 and 2048 <= n <= 4096:
        why = ("releases before 2026-06 clip the request to the auto estimate "
               "clamp(tokens / context_len * 512, 2048, 4096)")
        return "auto", ratio, why
    return None, ratio, f"not explained by the KV pool or the Mamba pool{room}"


def _strategy_name(facts: CapacityFacts, ratio: int | None) -> str:
    if facts.disable_radix_cache:
        return "radix cache off"
    if facts.strategy in STRATEGY_RATIO:
        return str(facts.strategy)
    return _RATIO_NAME.get(ratio or 0, "strategy unknown")


def _asked_text(asked: int | None, spec_default: bool, known: bool) -> str:
    if spec_default:
        return f"{asked} (speculative default)"
    if not known:
        return "unknown"
    return "auto" if asked is None else str(asked)


def _known_ratio(facts: CapacityFacts) -> int | None:
    if facts.per_request is not None:
        return facts.per_request
    if facts.disable_radix_cache and facts.max_mamba_cache_size is not None:
        return 1
    return STRATEGY_RATIO.get(facts.strategy or "")


def _inferred_ratio(slots: int | None, n: int) -> int | None:
    """Slots per request that turn `slots` into exactly `n` requests, if plausible (1-6)."""
    if slots is None or n <= 0 or not 1 <= slots // n <= 6:
        return None
    return slots // n if slots // (slots // n) == n else None


def _room(kv_allows: int | None, mamba_allows: int | None) -> str:
    parts = [f"KV pool allows {kv_allows}"] if kv_allows is not None else []
    parts += [f"Mamba pool allows {mamba_allows}"] if mamba_allows is not None else []
    return f" ({', '.join(parts)})" if parts else ""


def facts_from_args(args: Mapping[str, object]) -> CapacityFacts:
    """Facts found in resolved server args: the `server_args=` log line or `/server_info`."""
    strategy = args.get("mamba_radix_cache_strategy") or args.get("mamba_scheduler_strategy")
    dp = as_int(args.get("dp_size")) or 1
    return CapacityFacts(
        requested=as_int(args.get("max_running_requests")),
        max_mamba_cache_size=as_int(args.get("max_mamba_cache_size")),
        strategy=strategy if isinstance(strategy, str) else None,
        disable_radix_cache=args.get("disable_radix_cache") is True,
        speculative=bool(args.get("speculative_algorithm")),
        attn_dp_size=dp if args.get("enable_dp_attention") is True else 1,
    )


def from_server_info(info: Mapping[str, object]) -> ServerReading:
    """Read a `/server_info` body: top-level resolved args plus `internal_states[i]` per DP rank.

    The top-level `max_running_requests` is the ask (or 48 for speculative decoding); the real
    per-DP cap is `internal_states[i].effective_max_running_requests_per_dp` (since 2026-01).
    """
    raw_states = info.get("internal_states")
    listed = raw_states if isinstance(raw_states, list) else []
    states = [s for s in listed if isinstance(s, Mapping)]
    first: Mapping[str, object] = states[0] if states else {}
    raw_memory = first.get("memory_usage")
    memory: Mapping[str, object] = raw_memory if isinstance(raw_memory, Mapping) else {}
    per_dp = [as_int(s.get("effective_max_running_requests_per_dp")) for s in states]
    # The ask comes from the top level and argv; the scheduler's own args (internal_states)
    # carry what it computed itself, such as the auto-fitted Mamba pool and the resolved strategy.
    top, scheduler = facts_from_args(info), facts_from_args(first)
    asked = _launch_flag(info.get("launch_command"), "--max-running-requests")
    facts = replace(
        top, requested=top.requested if asked is None else asked,
        effective=per_dp[0] if per_dp else None,
        max_total_num_tokens=as_int(info.get("max_total_num_tokens"))
        or as_int(memory.get("token_capacity")),
        max_mamba_cache_size=scheduler.max_mamba_cache_size or top.max_mamba_cache_size,
        strategy=scheduler.strategy or top.strategy,
    )
    return ServerReading(
        version=_as_str(info.get("version")), model_path=_as_str(info.get("model_path")),
        served_model_name=_as_str(info.get("served_model_name")),
        context_length=as_int(info.get("context_length")),
        max_total_num_tokens=facts.max_total_num_tokens,
        max_req_input_len=as_int(info.get("max_req_input_len")),
        chunked_prefill_size=as_int(info.get("chunked_prefill_size")),
        speculative_algorithm=_as_str(info.get("speculative_algorithm")),
        capacity=read_capacity(facts),
        concurrency=sum(n for n in per_dp if n is not None) if per_dp and None not in per_dp
        else None,
        last_gen_throughput=as_float(first.get("last_gen_throughput")),
        avg_spec_accept_length=as_float(first.get("avg_spec_accept_length")),
        weight_gb=as_float(memory.get("weight")), kvcache_gb=as_float(memory.get("kvcache")),
    )


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
