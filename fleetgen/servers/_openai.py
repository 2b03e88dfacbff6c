"""Any other OpenAI-compatible server (TGI, `transformers serve`, llama.cpp, a router, a hosted
endpoint): nothing is added to OpenAI's chat schema, and nothing says how many requests it runs
at once, so the worker finds that by measuring (workers/limits.py)."""

from __future__ import annotations

from fleetgen.servers._kind import ServerKind


class OpenAICompatible(ServerKind):
    name = "openai"


class Router(ServerKind):
    """A router in front of several servers (sglang-router, a gateway): an OpenAI-compatible
    server of servers. What it says of itself (sglang-router's router-manager info) states no
    capacity, its `/metrics` (if any) are not its backends' queues, and a probe lands on one
    backend: the worker sizes it from answers and probes over many backends
    (workers/limits.py), and one failing backend only fails the requests sent to it."""

    name = "router"
    several = True
