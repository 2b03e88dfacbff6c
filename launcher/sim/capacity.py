"""How big the pools are and the effective max_running_requests.

As in docs/reference/sglang.md#max-running-requests.

The simulated GPU is an 80 GB H100 serving a 27B bf16 model. Memory figures are synthetic but
follow SGLang 0.5.23's arithmetic (mem_cache/kv_cache_configurator.py, _handle_max_mamba_cache),
so the flags move them the way they move a real server. The pools below are one DP rank's,
spread over its N GPUs (`SimConfig.rank_gpus`: --tp-size x --pp-size, divided by --dp-size
with --enable-dp-attention), with the weights split over the tp x pp GPUs; a server of several
DP ranks has one such set of pools per rank (`Capacity.summed`):
  budget           = N * (avail_before_load * mem_fraction_static - weights / (tp * pp))
                     (weights: the draft head included)
  Mamba slots K    = --max-mamba-cache-size; or the request with --disable-radix-cache; or the
                     auto-fit of the r/(1+r) share (r = mamba-full-memory-ratio), solved with
                     speculative decoding's buffers counted as D/ratio of a slot each
  spec buffers     = slot * (min(requested, K // ratio) + 1) * D: sized by the request pool
  KV budget        = budget - (K + 1) * slot - spec buffers
  dense running    = min(requested, tokens // 2), or clamp(tokens/ctx*512, 2048, 4096) if unset
  hybrid running   = min(dense running, K // ratio)
The slot size is calibrated on the reference run (speculative decoding on, auto spec
parameters): the auto-fit gives 80 Mamba slots, and extra_buffer's ratio 5 turns
`--max-running-requests 128` into 16, the "asked 128, got 16" case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from launcher.sim.config import SimConfig

AVAIL_BEFORE_LOAD_GB = 78.50
WEIGHTS_GB = 50.29  # 27e9 params * 2 bytes
DRAFT_WEIGHTS_GB = 0.85  # an MTP head, counted when speculative decoding is on
AUTO_MEM_FRACTION = 0.841  # what SGLang's auto formula gives on an 80 GB GPU
DENSE_KV_BYTES_PER_TOKEN = 32 * 1024
HYBRID_KV_BYTES_PER_TOKEN = 16 * 1024  # only the full-attention layers keep KV
AUTO_MAMBA_SLOTS = 80
# Kept free beyond the graphs for activations; the pools leaving less fail graph capture.
ACTIVATION_RESERVE_GB = 2.5
DEFAULT_CUDA_GRAPH_MAX_BS = 256  # SGLang's default for a GPU with < 90 GB
SPEC_DEFAULT_RUNNING = 48
AUTO_SPEC = (3, 1, 4)  # (num_steps, eagle_topk, num_draft_tokens)
GIB = float(1 << 30)
SPEC_RESET_WARNING = ("Max running requests is reset to 48 for speculative decoding. You can "
                      "override this by explicitly setting --max-running-requests.")


@dataclass(frozen=True)
class Capacity:
    """Resolved pool sizes and caps of one DP rank, plus the lines SGLang would log while
    deciding them. Token and slot counts are the rank's; GB figures are per GPU, as SGLang
    reports them."""

    max_total_num_tokens: int
    requested_running: int | None  # server_args.max_running_requests (48 with spec if unset)
    effective_running: int
    mamba_cache_size: int | None
    mamba_ratio: int | None
    mamba_strategy: str | None
    cuda_graph_max_bs: int
    capture_bs: tuple[int, ...]
    spec_steps: int | None
    spec_topk: int | None
    spec_draft_tokens: int | None
    mem_fraction_static: float
    weights_gb: float
    kv_gb: float
    mamba_gb: float  # the state slots and the speculative buffers
    spec_state_gb: float  # speculative decoding's intermediate buffers, part of mamba_gb
    graph_gb: float
    warnings: tuple[str, ...]  # logged while the pools are sized
    fatal: str | None  # a start-up error: the server logs it and dies with -9

    def summed(self, ranks: int) -> Capacity:
        """`ranks` DP ranks of this size seen as one pool: what the whole server holds and runs
        at once (the scheduler's and /metrics' view; /server_info lists each rank)."""
        return replace(self, max_total_num_tokens=self.max_total_num_tokens * ranks,
                       effective_running=self.effective_running * ranks,
                       mamba_cache_size=None if self.mamba_cache_size is None
                       else self.mamba_cache_size * ranks)

    @property
    def avail_after_weights_gb(self) -> float:
        """Free memory once the weights are loaded."""
        return AVAIL_BEFORE_LOAD_GB - self.weights_gb

    @property
    def avail_after_pools_gb(self) -> float:
        """Free memory once the KV and Mamba pools are allocated."""
        return self.avail_after_weights_gb - self.kv_gb - self.mamba_gb


def _slot_gb(cfg: SimConfig) -> float:
    """Bytes of one request's Mamba state, so that the reference start auto-fits 80 slots.

    The reference run (auto mem fraction, r = 0.9, extra_buffer's ratio 5, speculative decoding
    with the auto 4 draft tokens) had 80 slots; SGLang's joint solve there is
    K = (share - slot * (1 + D)) / (slot * (1 + D / ratio)), so slot = share / (1 + D + K (1 +
    D / ratio)), with K = 80.5 to keep float noise from costing a slot.
    """
    draft, ratio = AUTO_SPEC[2], 5
    budget = AVAIL_BEFORE_LOAD_GB * AUTO_MEM_FRACTION - WEIGHTS_GB - DRAFT_WEIGHTS_GB
    share = budget * 0.9 / 1.9
    slot = share / (1 + draft + (AUTO_MAMBA_SLOTS + 0.5) * (1 + draft / ratio))
    return slot / 2 if cfg.mamba_ssm_dtype != "float32" else slot


def _mamba_ratio(cfg: SimConfig) -> tuple[int, str]:
    strategy = cfg.mamba_radix_cache_strategy
    if strategy == "auto":
        strategy = "extra_buffer"  # overlap scheduling is on, so auto picks extra_buffer
    if cfg.disable_radix_cache:
        return 1, strategy
    tracking = {"no_buffer": 0, "extra_buffer": 2, "extra_buffer_lazy": 1}[strategy]
    return 3 + tracking, strategy


def _spec_params(cfg: SimConfig) -> tuple[int | None, int | None, int | None]:
    if not cfg.speculative:
        return None, None, None
    steps = cfg.speculative_num_steps or AUTO_SPEC[0]
    topk = cfg.speculative_eagle_topk or AUTO_SPEC[1]
    draft = steps + 1 if topk == 1 else (cfg.speculative_num_draft_tokens or AUTO_SPEC[2])
    return steps, topk, draft


def _capture_bs(max_bs: int) -> tuple[int, ...]:
    sizes = [bs for bs in [1, 2, 4, 8, 12, *range(16, 4097, 8)] if bs <= max_bs]
    return tuple(sizes if sizes and sizes[-1] == max_bs else [*sizes, max_bs])


def plan_capacity(cfg: SimConfig) -> Capacity:
    """Decide pool sizes and the effective running cap the way SGLang [R] does."""
    warnings: list[str] = []
    mfs = cfg.mem_fraction_static or AUTO_MEM_FRACTION
    steps, topk, draft = _spec_params(cfg)
    gpus = cfg.rank_gpus
    weights = (WEIGHTS_GB + (DRAFT_WEIGHTS_GB if cfg.speculative else 0.0)) / (
        cfg.tp_size * cfg.pp_size)  # per GPU
    budget = gpus * (AVAIL_BEFORE_LOAD_GB * mfs - weights)
    requested = cfg.max_running_requests
    if requested is None and cfg.speculative:
        requested = SPEC_DEFAULT_RUNNING
    # The ask is the server's; DP-attention ranks share it, other DP ranks each take it whole.
    asked = requested // cfg.dp_size if requested is not None and cfg.enable_dp_attention \
        else requested
    ratio, strategy = _mamba_ratio(cfg)
    mamba_k: int | None = None
    mamba_gb = spec_state_gb = 0.0
    fatal: str | None = None
    if cfg.hybrid:
        mamba_k, spec_state_gb, fatal = _mamba_pool(cfg, budget, ratio, draft, asked)
        mamba_gb = (max(0, mamba_k) + 1) * _slot_gb(cfg) + spec_state_gb
    kv_budget = budget - mamba_gb
    per_token = HYBRID_KV_BYTES_PER_TOKEN if cfg.hybrid else DENSE_KV_BYTES_PER_TOKEN
    tokens = max(0, int(kv_budget * GIB / per_token))
    if cfg.max_total_tokens is not None:
        if cfg.max_total_tokens > tokens:
            warnings.append(f"max_total_tokens={cfg.max_total_tokens} is larger than the profiled "
                            f"value {tokens}. Use the profiled value instead.")
        tokens = min(tokens, cfg.max_total_tokens)
    if tokens <= 0 and fatal is None:
        fatal = ("RuntimeError: Not enough memory. Please try to increase "
                 f"--mem-fraction-static. Current value: mem_fraction_static={mfs}")
    effective = _base_running(cfg, asked, tokens, warnings)
    if fatal is None and effective <= 0:
        fatal = "AssertionError: max_running_request is zero"
    if fatal is None and mamba_k is not None and mamba_k // ratio < effective:
        effective, fatal = _mamba_cap(mamba_k, ratio, warnings)
    graph_bs = cfg.cuda_graph_max_bs_decode or DEFAULT_CUDA_GRAPH_MAX_BS
    if cfg.cuda_graph_max_bs_decode is None and requested is not None:
        graph_bs = min(graph_bs, requested)
    kv_gb = tokens * per_token / GIB / gpus
    mamba_gb, spec_state_gb = mamba_gb / gpus, spec_state_gb / gpus
    graph_gb = round(0.35 + graph_bs * 0.004, 2)
    free_gb = AVAIL_BEFORE_LOAD_GB - weights - kv_gb - mamba_gb
    need_gb = graph_gb * (4 / 3 if draft else 1) + ACTIVATION_RESERVE_GB  # draft graphs: 1/3
    if fatal is None and free_gb < need_gb:
        fatal = ("Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate "
                 f"{graph_gb * 1024:.2f} MiB. GPU 0 has a total capacity of 79.19 GiB of which "
                 f"{max(free_gb, 0.0) * 1024:.2f} MiB is free. Possible solutions: 1. set "
                 "--mem-fraction-static to a smaller value (e.g., 0.8 or 0.7); 2. set "
                 "--cuda-graph-max-bs-decode to a smaller value (e.g., 16); 3. disable torch "
                 "compile by not using --enable-torch-compile; 4. disable CUDA graph by "
                 "--disable-cuda-graph. (Not recommended. Huge performance loss)")
    return Capacity(tokens, requested, effective, mamba_k, ratio if cfg.hybrid else None,
                    strategy if cfg.hybrid else None, graph_bs, _capture_bs(graph_bs),
                    steps, topk, draft, mfs, weights, kv_gb, mamba_gb, spec_state_gb, graph_gb,
                    tuple(warnings), fatal)


def _mamba_pool(cfg: SimConfig, budget: float, ratio: int, draft: int | None,
                requested: int | None) -> tuple[int, float, str | None]:
    """(max_mamba_cache_size, GB of speculative buffers, fatal) as SGLang 0.5.23 decides them.

    The slots are given (--max-mamba-cache-size), implied by --disable-radix-cache, or
    auto-fitted (§7.3). The speculative buffers hold D draft tokens' states for each request
    the pool can run (plus the padding slot), not for each slot: SGLang sizes them by
    min(requested, K // ratio), so slots kept only for prefix caching cost no buffer.
    """
    slot = _slot_gb(cfg)
    d = draft or 0
    running = max(1, requested or 1)
    if cfg.max_mamba_cache_size is not None:
        k = cfg.max_mamba_cache_size
        requests = min(running, k // ratio)
    elif cfg.disable_radix_cache and cfg.max_running_requests is not None:
        k = max(1, cfg.max_running_requests)
        requests = k
    else:
        share = budget * cfg.mamba_full_memory_ratio / (1 + cfg.mamba_full_memory_ratio)
        k = math.floor((share - slot * (1 + d)) / (slot * (1 + d / ratio)))
        requests = min(running, k // ratio)
    spec_gb = slot * (requests + 1) * d
    if k <= 0:
        return k, spec_gb, (
            "RuntimeError: Not enough GPU memory for hybrid (mamba/linear-attention) state "
            f"cache. Computed max_mamba_cache_size={k} (total_rest_memory="
            f"{budget - spec_gb:.2f} GB, mamba_cache_per_req={slot * 1024:.2f} MB). Try: (1) "
            "reduce --max-running-requests, (2) increase --mem-fraction-static, (3) reduce "
            "--speculative-num-draft-tokens, or (4) use GPUs with more memory.")
    return k, spec_gb, None


def _base_running(cfg: SimConfig, requested: int | None, tokens: int,
                  warnings: list[str]) -> int:
    if requested is None:
        estimated = min(max(int(tokens / cfg.context_len * 512), 2048), 4096)
        return min(estimated, tokens // 2)
    if tokens // 2 < requested:
        warnings.append(f"max_running_requests was reduced from the requested {requested} to "
                        f"{tokens // 2} (per dp worker) due to the available KV cache capacity.")
    return min(requested, tokens // 2)


def _mamba_cap(k: int, ratio: int, warnings: list[str]) -> tuple[int, str | None]:
    capped = k // ratio
    if capped <= 0:
        return 0, (
            "RuntimeError: Hybrid (mamba/linear-attention) state cache is too small to serve "
            f"any requests. max_mamba_cache_size={k}, mamba_ratio={ratio}, resulting "
            f"max_num_reqs={capped}. Try: (1) reduce --max-running-requests, (2) increase "
            "--mem-fraction-static, or (3) use GPUs with more memory.")
    warnings.append(
        f"max_running_requests is capped to {capped} by the mamba state cache "
        f"(max_mamba_cache_size={k}, {ratio} state slots per request). To raise it: increase "
        "--mamba-full-memory-ratio or --max-mamba-cache-size, or halve the state size with "
        "--mamba-ssm-dtype bfloat16.")
    return capped, None
