"""vLLM: no `/server_info`; `/metrics` shows requests running and waiting (`vllm:` names), so
its real concurrency is found by watching the queue; it takes `chat_template_kwargs` and
separates reasoning whenever it runs a reasoning parser.

It takes `n`: the request becomes n child requests in its engine, child i seeded with the
request's seed plus i (its parallel sampling), so a prompt's answers asked together are the
answers asked one by one with seeds `seed`, `seed + 1`, ...

Its classification route is `/classify` (no `/v1/`), the request and answer SGLang's
`/v1/classify` takes and gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from fleetgen.servers._chat import RequestBody
from fleetgen.servers._kind import Combine, ServerKind
from fleetgen.servers._server_info import ServerInfo


class VLLM(ServerKind):
    name = "vllm"
    gauges: ClassVar[Mapping[str, tuple[str, Combine]]] = {
        "running": ("vllm:num_requests_running", "sum"),
        "queue": ("vllm:num_requests_waiting", "sum"),
        # The KV cache's share in use (renamed from gpu_cache_usage_perc in vLLM 0.10).
        "token_usage": ("vllm:kv_cache_usage_perc", "max"),
        "gpu_cache_usage": ("vllm:gpu_cache_usage_perc", "max"),
    }
    routes: ClassVar[Mapping[str, str]] = {"/v1/classify": "/classify"}

    def takes_n(self, info: ServerInfo | None) -> bool:
        return True

    def added_fields(self, thinking: bool) -> RequestBody:
        return {"chat_template_kwargs": {"enable_thinking": thinking}}
