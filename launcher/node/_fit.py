"""Which candidate flags a server's memory holds, predicted from its own start-up lines.

SGLang sizes its pools from what `--mem-fraction-static` leaves once the weights are loaded
(model_runner's memory profile, mem_cache's pool configurator):

    rest   = free before loading x mem_fraction_static - weights (the draft head included)
    Mamba  = (max_mamba_cache_size + 1) x slot + speculative buffers, sized per request the
             pool runs: (min(requested, slots // per-request) + 1) x buffer
    tokens = (rest - Mamba) / KV bytes per token; at most zero: "Not enough memory. Please try
             to increase --mem-fraction-static"
    cap    = min(requested, tokens // 2, slots // per-request)

Every term is on the start-up log: `Load weight end` (free and used, target and draft), the
`Mamba Cache is allocated` line (state and speculative buffers), `KV Cache is allocated`
(tokens and GB). `Memory.from_start` reads them from one start; `Memory.fit` predicts a
candidate's pools and cap, or the refusal, before anything restarts.

    memory = Memory.from_start(read_log(entry.server.log).run, ratio=5)
    memory.fit(0.95, 234)  # Fit(tokens=..., cap=46, refused=None)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.logs import ServerStart
from launcher.node._advise import relative_throughput

NOT_ENOUGH_MEMORY = ("Not enough memory for the KV pool: try to increase "
                     "--mem-fraction-static")


@dataclass(frozen=True)
class Fit:
    """A candidate's predicted pools: KV tokens, the request cap, or why SGLang refuses it."""

    mem_fraction: float
    slots: int | None
    tokens: int
    cap: int
    refused: str | None = None

    def running(self, held: float | None) -> int:
        """Requests running at once in steady state: the cap, or fewer when each holds `held`
        KV tokens and the pool fills first."""
        if self.refused is not None:
            return 0
        if held is None or held <= 0:
            return self.cap
        return min(self.cap, math.floor(self.tokens / held))


@dataclass(frozen=True)
class Memory:
    """One start's memory as its start-up lines state it (GB per GPU)."""

    total_gb: float  # free before the weights loaded
    weights_gb: float  # the target's and the draft's
    gb_per_token: float
    slot_gb: float  # one Mamba state slot (0 for a dense model)
    spec_gb_per_request: float  # speculative buffers, per request the pool runs (+1 padding)
    ratio: int | None  # Mamba slots per running request
    requested: int | None

    @classmethod
    def from_start(cls, run: ServerStart, ratio: int | None) -> Memory | None:
        """The memory of the start `run` (None when its lines are missing)."""
        w, kv = run.weights, run.kv
        if w is None or kv is None or w.avail_gb is None or w.mem_usage_gb is None \
                or not kv.tokens or kv.kv_gb is None:
            return None
        weights = w.mem_usage_gb + (run.draft.mem_usage_gb or 0.0 if run.draft else 0.0)
        requested = run.args.get("max_running_requests")
        requested = requested if isinstance(requested, int) else None
        slot = spec = 0.0
        m = run.mamba
        if m is not None and m.max_mamba_cache_size and m.conv_gb is not None \
                and m.ssm_gb is not None:
            k = m.max_mamba_cache_size
            slot = (m.conv_gb + m.ssm_gb) / (k + 1)
            buffers = (m.intermediate_ssm_gb or 0.0) + (m.intermediate_conv_gb or 0.0)
            runs = k // ratio if ratio else k
            spec = buffers / (min(requested or runs, runs) + 1)
        return cls(total_gb=w.avail_gb + w.mem_usage_gb, weights_gb=weights,
                   gb_per_token=kv.kv_gb / kv.tokens, slot_gb=slot,
                   spec_gb_per_request=spec, ratio=ratio, requested=requested)

    def fit(self, mem_fraction: float, slots: int | None) -> Fit:
        """The pools and cap a start with these values would get, or why it is refused."""
        rest = self.total_gb * mem_fraction - self.weights_gb
        runs = (slots // self.ratio if self.ratio else slots) if slots is not None else None
        mamba = 0.0
        if slots is not None and self.slot_gb:
            served = min(self.requested or runs or 0, runs or 0)
            mamba = (slots + 1) * self.slot_gb + (served + 1) * self.spec_gb_per_request
        tokens = max(0, int((rest - mamba) / self.gb_per_token))
        if tokens <= 0:
            return Fit(mem_fraction, slots, 0, 0, NOT_ENOUGH_MEMORY)
        caps = [c for c in (self.requested, tokens // 2, runs) if c is not None]
        cap = min(caps)
        if cap <= 0:
            return Fit(mem_fraction, slots, tokens, 0, "the Mamba pool serves no request")
        return Fit(mem_fraction, slots, tokens, cap)


@dataclass(frozen=True)
class Candidate:
    """Flags to try, their predicted fit, and the tokens/s gain the step model expects."""

    flags: tuple[str, ...]
    fit: Fit
    running: int
    gain: float


def candidates(memory: Memory, held: float | None, now_running: float, max_fraction: float,
               min_fraction: float) -> list[Candidate]:
    """Every (mem fraction, Mamba slots) the memory holds between the two fractions, best
    predicted first; each slot count's best fraction only. `held`: KV tokens one running
    request holds (None: the KV pool never binds)."""
    if memory.ratio is None or not memory.slot_gb:
        return []
    # Hundredths from the ceiling down to the floor (the floor itself included).
    steps = math.floor(round((max_fraction - min_fraction) / 0.01, 6))
    fractions = [round(max_fraction - 0.01 * i, 2) for i in range(max(0, steps) + 1)]
    found: dict[int, Candidate] = {}
    for slots in range(memory.ratio, 4097, memory.ratio):
        for mfs in fractions:
            fit = memory.fit(mfs, slots)
            running = fit.running(held)
            if running <= 0:
                continue
            gain = relative_throughput(running, max(1, round(now_running))) - 1.0
            flags = ("--max-mamba-cache-size", str(slots), "--mem-fraction-static", f"{mfs:.2f}")
            best = found.get(slots)
            # The same running for less memory leaves more free beyond the pools.
            if best is None or running > best.running:
                found[slots] = Candidate(flags, fit, running, gain)
        if memory.requested is not None and slots // memory.ratio > memory.requested:
            break
    return sorted(found.values(), key=lambda c: (-c.running, c.fit.mem_fraction,
                                                 c.fit.slots or 0))
