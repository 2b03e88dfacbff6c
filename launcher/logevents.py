"""Typed events of the SGLang log parser: one frozen dataclass per kind of recognised line.

`launcher.logparse.parse_line` builds these; they are re-exported from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

FatalKind = Literal[
    "kv_no_memory", "weights_no_memory", "zero_requests", "pool_too_small", "mamba_no_memory",
    "mamba_too_small", "cuda_graph", "cuda_oom", "watchdog", "scheduler_exception",
    "scheduler_died", "warmup_failed", "init_failed", "health_check", "port_in_use", "sigquit",
]
CapKind = Literal["mamba", "kv", "spec"]


@dataclass(frozen=True, kw_only=True)
class Event:
    """Base of every parsed line: when it was logged (None without a prefix) and by which ranks."""

    ts: datetime | None = None
    ranks: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerArgs(Event):
    """`server_args={...}` ([R]) or `server_args=ServerArgs(...)` (older): the resolved args."""

    args: Mapping[str, object]


@dataclass(frozen=True)
class WeightsLoading(Event):
    """`Load weight begin. avail mem=X GB`."""

    avail_gb: float | None


@dataclass(frozen=True)
class WeightsLoaded(Event):
    """`Load weight end. ...`; a draft/MTP model logs a second one (`is_draft`)."""

    elapsed_s: float | None
    model_class: str | None
    avail_gb: float | None
    mem_usage_gb: float | None
    is_draft: bool
    dtype: str | None = None
    quant: str | None = None


@dataclass(frozen=True)
class MambaCache(Event):
    """`Mamba Cache is allocated. max_mamba_cache_size: N, ...`: state slots per DP shard."""

    max_mamba_cache_size: int | None
    conv_gb: float | None
    ssm_gb: float | None
    intermediate_ssm_gb: float | None = None
    intermediate_conv_gb: float | None = None


@dataclass(frozen=True)
class KVCache(Event):
    """`KV Cache is allocated. [dtype: D, ]#tokens: N, K size/V size | KV size`.

    `kv_gb` is the printed `KV size` (MLA) or K + V; `dtype` is None before 2026-05-24.
    """

    tokens: int | None
    dtype: str | None
    k_gb: float | None
    v_gb: float | None
    kv_gb: float | None
    upper_bound: bool = False


@dataclass(frozen=True)
class CudaGraph(Event):
    """A CUDA (or CPU/NPU) graph capture line: begin, the old `bs [...]` line, or end.

    `stage` is decode/verify/prefill/piecewise, or "" in the old format that names none;
    `legacy` marks the format used before 2026-06-22.
    """

    max_bs: int | None
    bs_list: tuple[int, ...]
    elapsed_s: float | None
    mem_gb: float | None
    avail_gb: float | None = None
    role: str = "target"
    stage: str = ""
    done: bool = False
    legacy: bool = False


@dataclass(frozen=True)
class Summary(Event):
    """`max_total_num_tokens=N, ...`; `max_running_requests` is the effective per-DP cap."""

    max_total_num_tokens: int | None
    chunked_prefill_size: int | None
    max_prefill_tokens: int | None
    max_running_requests: int | None
    context_len: int | None
    available_gpu_mem_gb: float | None
    fields: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Ready(Event):
    """`The server is fired up and ready to roll!`."""


@dataclass(frozen=True)
class _Batch(Event):
    fields: Mapping[str, str]
    running: int | None
    queue: int | None
    token_usage: float | None
    full_token_usage: float | None
    swa_token_usage: float | None
    mamba_usage: float | None
    cuda_graph: bool | None
    iteration: int | None
    sep: str  # "." before 2025-10-26, "," after
    trailing_comma: bool  # 2025-07 to 2026-01

    @property
    def kv_usage(self) -> float | None:
        """KV usage whichever way it was printed (`token usage` or hybrid `full token usage`)."""
        return self.token_usage if self.token_usage is not None else self.full_token_usage


@dataclass(frozen=True)
class PrefillBatch(_Batch):
    """`Prefill batch[ [iter]][.,] ...`, every era and hybrid variant."""

    new_seq: int | None = None
    new_token: int | None = None
    cached_token: int | None = None
    pending_token: int | None = None
    input_throughput: float | None = None


@dataclass(frozen=True)
class DecodeBatch(_Batch):
    """`Decode batch[ [iter]][.,] ...`, every era, hybrid Mamba/SWA and speculative variant."""

    tokens: int | None = None
    mamba_num: int | None = None
    accept_len: float | None = None
    accept_rate: float | None = None
    gen_throughput: float | None = None


@dataclass(frozen=True)
class CapWarning(Event):
    """A warning that max_running_requests was lowered (mamba, kv) or defaulted (spec, 48)."""

    kind: CapKind
    requested: int | None
    effective: int | None
    slots: int | None = None
    per_request: int | None = None


@dataclass(frozen=True)
class Fatal(Event):
    """A line that means the server failed or is about to die (§6.4)."""

    kind: FatalKind
    message: str
    exit_code: int | None = None


@dataclass(frozen=True)
class Draining(Event):
    """SIGTERM received or `Gracefully exiting... Remaining number of requests N`."""

    remaining: int | None = None
