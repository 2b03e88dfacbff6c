"""vLLM: no `/server_info`; `/metrics` shows requests running and waiting (`vllm:` names), so
its real concurrency is found by watching the queue; it takes `chat_template_kwargs` and
separates reasoning whenever it runs a reasoning parser."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from fleetgen.servers._kind import Combine, ServerKind


class VLLM(ServerKind):
    name = "vllm"
    gauges: ClassVar[Mapping[str, tuple[str, Combine]]] = {
        "running": ("vllm:num_requests_running", "sum"),
        "queue": ("vllm:num_requests_waiting", "sum"),
        # The KV cache's share in use (renamed from gpu_cache_usage_perc in vLLM 0.10).
        "token_usage": ("vllm:kv_cache_usage_perc", "max"),
        "gpu_cache_usage": ("vllm:gpu_cache_usage_perc", "max"),
    }

    def added_fields(self, thinking: bool) -> dict[str, Any]:
        return {"chat_template_kwargs": {"enable_thinking": thinking}}
