"""What a ready server says about itself: the Reading and how it is read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from launcher.logs import LogReport, as_float, as_int, from_server_info

T = TypeVar("T")


@dataclass(frozen=True)
class Reading:
    """What a ready server says about itself: `/server_info` first, its log second."""

    version: str | None
    weights_gb: float | None
    kv_tokens: int | None
    mamba_slots: int | None
    max_total_num_tokens: int | None
    context_length: int | None
    chunked_prefill_size: int | None
    cuda_graph_max_bs: int | None
    requested: int | None
    effective: int | None  # per DP rank; workers size their concurrency from this
    binding: str | None
    reason: str

    def summary(self) -> str:
        """One line for the `ready` log line and `status`."""
        parts = [f"weights {_v(self.weights_gb)} GB", f"KV {_v(self.kv_tokens)} tokens"]
        if self.mamba_slots is not None:
            parts.append(f"Mamba {self.mamba_slots} slots")
        parts += [f"max_total_num_tokens {_v(self.max_total_num_tokens)}",
                  f"context {_v(self.context_length)}",
                  f"chunked prefill {_v(self.chunked_prefill_size)}",
                  f"cuda graph bs {_v(self.cuda_graph_max_bs)}",
                  f"max_running_requests {_v(self.effective)} (asked {self.requested or 'auto'})"]
        return ", ".join(parts) + f" -- {self.reason}"


def read_server(info: Mapping[str, object] | None, report: LogReport) -> Reading:
    """Combine a `/server_info` body (None if it failed) with what the log said."""
    log = report.to_json()
    cap = report.capacity()
    server = from_server_info(info) if info is not None else None
    if server is not None and server.capacity.effective is not None:
        cap = server.capacity
    state = _first_state(info)
    memory = state.get("memory_usage")
    memory = memory if isinstance(memory, Mapping) else {}
    return Reading(
        version=server.version if server else None,
        weights_gb=_pick(as_float(memory.get("weight")), as_float(log["weights_gb"])),
        kv_tokens=_pick(as_int(log["kv_tokens"]), as_int(memory.get("token_capacity"))),
        mamba_slots=_pick(as_int(state.get("max_mamba_cache_size")),
                          as_int(log["mamba_slots"])),
        max_total_num_tokens=_pick(server.max_total_num_tokens if server else None,
                                   as_int(log["max_total_num_tokens"])),
        context_length=_pick(server.context_length if server else None,
                             as_int(log["context_len"])),
        chunked_prefill_size=_pick(server.chunked_prefill_size if server else None,
                                   as_int(log["chunked_prefill_size"])),
        cuda_graph_max_bs=_pick(as_int(log["cuda_graph_max_bs"]),
                                as_int((info or {}).get("cuda_graph_max_bs_decode")),
                                as_int((info or {}).get("cuda_graph_max_bs"))),
        requested=cap.requested, effective=cap.effective, binding=cap.binding,
        reason=cap.reason,
    )


def _first_state(info: Mapping[str, object] | None) -> Mapping[str, object]:
    states = (info or {}).get("internal_states")
    first = states[0] if isinstance(states, list) and states else None
    return first if isinstance(first, Mapping) else {}


def _pick(*values: T | None) -> T | None:
    return next((v for v in values if v is not None), None)


def _v(value: object) -> str:
    return "-" if value is None else str(value)
