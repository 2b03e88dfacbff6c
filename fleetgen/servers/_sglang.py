"""SGLang: `/server_info` says what it runs at once; it takes `separate_reasoning` and
`chat_template_kwargs`, and `n`; its `/metrics` names start with `sglang:`.

`n` is expanded into n requests in its scheduler, each with the same sampling parameters, the
seed included. The seed is honoured only with `--enable-deterministic-inference`; without it
the n choices are drawn apart whatever the seed, with it they would all be the same answer,
so such a server is sent one request per answer, each with its own seed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from fleetgen.servers._chat import RequestBody
from fleetgen.servers._kind import Combine, ServerKind
from fleetgen.servers._server_info import ServerInfo


class SGLang(ServerKind):
    name = "sglang"
    # It answers a request of any model name with the model it serves.
    any_model = True
    gauges: ClassVar[Mapping[str, tuple[str, Combine]]] = {
        "running": ("sglang:num_running_reqs", "sum"),
        "queue": ("sglang:num_queue_reqs", "sum"),
        "token_usage": ("sglang:token_usage", "max"),
        # The KV pool alone where exported: a hybrid server's token_usage is its fullest pool,
        # Mamba included (SGLang's get_max_pool_usage).
        "full_token_usage": ("sglang:full_token_usage", "max"),
        "mamba_usage": ("sglang:mamba_usage", "max"),
        "gen_throughput": ("sglang:gen_throughput", "sum"),
        "accept_length": ("sglang:spec_accept_length", "mean"),
    }

    def takes_n(self, info: ServerInfo | None) -> bool:
        return not (info is not None and info.args.get("enable_deterministic_inference"))

    def added_fields(self, thinking: bool) -> RequestBody:
        # Reasoning in its own field (the canary checks it), thinking as the job asks.
        return {"separate_reasoning": True, "chat_template_kwargs": {"enable_thinking": thinking}}
