"""Any other OpenAI-compatible server (TGI, `transformers serve`, llama.cpp, a router, a hosted
endpoint): nothing is added to OpenAI's chat schema, and nothing says how many requests it runs
at once, so the worker finds that by measuring (workers/limits.py)."""

from __future__ import annotations

from fleetgen.servers._kind import ServerKind


class OpenAICompatible(ServerKind):
    name = "openai"
