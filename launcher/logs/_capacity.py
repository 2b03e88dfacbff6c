"""Why a server runs fewer (or more) requests at once than it was asked to.

SGLang caps max_running_requests by the KV pool (tokens // 2), by the Mamba state pool
(slots // slots-per-request) or by the request itself, and it often logs nothing about it
(docs/reference/sglang.md#max-running-requests). `read_capacity` names the binding limit in one
sentence; `capacity_from_server_info` does the same for a live server's `/server_info`, read by
the one reader (fleetgen/servers/_server_info.py), which also gives the real concurrency
(`ServerInfo.concurrency`): workers and the launcher size from it, never from the flag they
passed.

    reading = read_capacity(CapacityFacts(requested=128, effective=16, max_mamba_cache_size=80))
    reading.reason  # "asked 128, got 16: 80 Mamba slots / 5 per request (extra_buffer); ..."
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from fleetgen.servers import ServerInfo, as_int

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


def capacity_from_server_info(info: ServerInfo) -> CapacityReading:
    """Why the server runs what its `/server_info` says (read by fleetgen/servers/_server_info.py).

    The ask comes from the top level and argv; the scheduler's own args (`internal_states`)
    carry what it computed itself, such as the auto-fitted Mamba pool and the resolved
    strategy. The binding limit is decided per DP rank, from rank 0.
    """
    top = facts_from_args(info.args)
    scheduler = facts_from_args(info.ranks[0] if info.ranks else {})
    facts = replace(
        top, requested=info.requested,
        effective=info.per_rank[0] if info.per_rank else None,
        max_total_num_tokens=info.max_total_num_tokens,
        max_mamba_cache_size=scheduler.max_mamba_cache_size or top.max_mamba_cache_size,
        strategy=scheduler.strategy or top.strategy,
    )
    return read_capacity(facts)
