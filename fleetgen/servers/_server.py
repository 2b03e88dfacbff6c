"""One server as the worker found it at first contact: its kind, the models it serves, and what
it taught the worker since (fields it refuses, the model it is pinned to).

    server = await detect(client.http)          # SGLang, vLLM or any OpenAI-compatible server
    body = server.prepare(stored_body, thinking=True, n=4)   # n only where `takes_n`
    ...  # on HTTP 400/422: server.learn(status, message, body) -> what changed, or None

Bodies are stored neutral at enqueue (OpenAI's chat schema plus the line's own fields); the
kind's own fields and the served model are added here, at send time, for this server only.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import cast

import httpx
import orjson

from fleetgen.endpoints import Endpoint
from fleetgen.errors import ModelChoiceError
from fleetgen.servers._chat import RequestBody
from fleetgen.servers._kind import ServerKind
from fleetgen.servers._openai import OpenAICompatible, Router
from fleetgen.servers._server_info import ServerInfo, fetch_server_info
from fleetgen.servers._sglang import SGLang
from fleetgen.servers._vllm import VLLM

log = logging.getLogger(__name__)

KINDS: dict[str, ServerKind] = {k.name: k for k in (SGLang(), VLLM(), OpenAICompatible(),
                                                    Router())}
# `owned_by` of `/v1/models` entries, as each engine fills it.
OWNERS = {"vllm": "vllm", "sglang": "sglang"}
# What a strict server says when it refuses a field it does not know: pydantic's
# "Extra inputs are not permitted", `transformers serve`'s "Unexpected fields in the request",
# OpenAI's "Unrecognized request argument supplied", TGI's "unknown field".
_REFUSAL = re.compile(r"unexpected|unrecogni[sz]ed|unknown|extra|not permitted|not allowed"
                      r"|unsupported|not supported", re.IGNORECASE)
# The request parameter `n` named in a refusal ("n > 1 is not supported", "Unsupported
# parameter: 'n'"); only a refusal of a request that asked several answers is read so.
_N_PARAM = re.compile(r"(?<![\w\\])n(?!\w)|parallel sampling", re.IGNORECASE)
# `transformers serve` pinned to one model: "Server is pinned to 'DIR'; requested 'default'."
_PINNED = re.compile(r"pinned to '([^']+)'")
# Sent when the server names no model at all: OpenAI's schema requires the field, and a
# server pinned to one model says which in its refusal (learned above).
UNNAMED_MODEL = "default"


@dataclass
class Server:
    """What is known of one server; `prepare` is called once per request, so it is cheap."""

    kind: ServerKind
    models: tuple[str, ...] = ()
    info: ServerInfo | None = None
    version: str | None = None
    # Learned from the server's refusals (`learn`), kept for the worker's life.
    refused: set[str] = field(default_factory=set)
    pinned: str | None = None

    def __post_init__(self) -> None:
        self._added = {flag: self._fields(flag) for flag in (True, False)}

    @property
    def model(self) -> str | None:
        """The model a request that names none is sent to, if the server leaves no doubt."""
        if self.pinned:
            return self.pinned
        if self.info is not None and self.info.model:
            return self.info.model
        return self.models[0] if len(self.models) == 1 else None

    @property
    def model_problem(self) -> str | None:
        """Why a request that names no model cannot be sent here, or None."""
        if self.model is None and len(self.models) > 1:
            return (f"the server serves {len(self.models)} models ({', '.join(self.models)}) "
                    "and the job names none: cancel it and enqueue the prompts as a new job with "
                    "--model NAME")
        return None

    @property
    def takes_n(self) -> bool:
        """Whether a prompt's answers go to it as one request with `n`: its kind says so and it
        has not refused `n` (`learn`)."""
        return "n" not in self.refused and self.kind.takes_n(self.info)

    def serves(self, endpoint: Endpoint) -> bool | None:
        """Whether it serves `endpoint`'s requests, where it says so: a pooling model (SGLang's
        `--is-embedding`: an embedding, classifier or reward model) answers embeddings and
        classify only, a generation model never does. None where it does not say."""
        embeds = self.info.embeds if self.info is not None else None
        return None if embeds is None else embeds == (not endpoint.generates)

    def path(self, endpoint: Endpoint) -> str:
        """Where `endpoint`'s requests go on this server: its kind's route for it, else the
        endpoint's own path."""
        return self.kind.routes.get(endpoint.path, endpoint.path)

    def describe(self) -> str:
        parts = [self.kind.name + (f" {self.version}" if self.version else "")]
        if self.model:
            parts.append(f"model {self.model!r}")
        if self.refused:
            parts.append(f"without {', '.join(sorted(self.refused))}")
        return ", ".join(parts)

    def prepare(self, body: RequestBody, *, thinking: bool, n: int = 1,
                chat: bool = True) -> RequestBody:
        """The request for this server: the kind's fields under the stored body's own (a chat
        request's: they shape chat templates and reasoning), the served model when the body
        names none, and `n` when it asks several answers."""
        added = self._added[thinking] if chat else {}
        out: RequestBody = {**added, **body}
        if n > 1:
            out["n"] = n
        if "chat_template_kwargs" in added and "chat_template_kwargs" in body:
            out["chat_template_kwargs"] = {**(added["chat_template_kwargs"] or {}),
                                           **(body["chat_template_kwargs"] or {})}
        if "model" not in body:
            model = self.model
            if model is None and len(self.models) > 1:
                raise ModelChoiceError(str(self.model_problem))
            out["model"] = model or UNNAMED_MODEL
        return out

    def learn(self, status: int | None, message: str, sent: RequestBody,
              stored: RequestBody) -> str | None:
        """Learn from a 400/422 that refused what fleetgen added on its own (never a field of
        the prompt line's): the fields it names are dropped, a model it is pinned to is used.
        A refusal of `n` by a request that asked several answers is learned too: the answers of
        a prompt then go as one request each (`takes_n`).
        Returns what changed (for one log line), or None when nothing new was learned: then
        `resend` tells whether the refusal was still fleetgen's (a request sent before another
        one taught the same thing)."""
        if status not in (400, 422):
            return None
        pinned = _PINNED.search(message)
        if (pinned and "model" not in stored and sent.get("model") != pinned.group(1)
                and self.pinned != pinned.group(1)):
            self.pinned = pinned.group(1)
            return f"uses model {self.pinned!r}, the one it is pinned to"
        if (sent.get("n", 1) > 1 and "n" not in self.refused and _N_PARAM.search(message)
                and _REFUSAL.search(message)):
            self.refused.add("n")
            return "refuses n (several answers in one request): one request per answer"
        ours = [name for name in self._added[True] if name in message and name not in stored]
        if ours and _REFUSAL.search(message):
            self.refused.update(ours)
            self.__post_init__()
            return f"refuses {', '.join(ours)}: no longer sent"
        return None

    def resend(self, sent: RequestBody, stored: RequestBody, *, thinking: bool,
               chat: bool = True) -> bool:
        """Whether a refused request would now be sent otherwise (what was learned since)."""
        try:
            return self.prepare(stored, thinking=thinking, n=sent.get("n", 1), chat=chat) != sent
        except ModelChoiceError:
            return False

    def _fields(self, thinking: bool) -> RequestBody:
        # The kind's own fields, less those this server refused: keys of a RequestBody still.
        return cast(RequestBody, {k: v for k, v in self.kind.added_fields(thinking).items()
                                  if k not in self.refused})


async def detect(http: httpx.AsyncClient, timeout_s: float = 30.0) -> Server:
    """Find what the server at `http`'s base URL is: a router by its router-manager info (or
    by models an engine owns with none of that engine's info or gauges), SGLang by its
    `/server_info`, vLLM by its `/metrics` names or `/v1/models` owner, anything else as a plain
    OpenAI-compatible server.

    httpx errors are raised (a server that is down is not a server of another kind)."""
    info = await fetch_server_info(http, timeout_s=timeout_s)
    models, owners = await _models(http, timeout_s)
    if info is not None and info.router:
        # Its models' owner is its backends' engine, its /metrics not their queues.
        return Server(KINDS["router"], models, info, info.version)
    if info is not None:
        return Server(KINDS["sglang"], models, info, info.version)
    metrics = await http.get("/metrics", timeout=timeout_s)
    if metrics.status_code == 200 and "vllm:" in metrics.text:
        return Server(KINDS["vllm"], models, version=await _version(http, timeout_s))
    for owner in owners:
        if owner in OWNERS:
            # Models an engine owns, but neither its info nor its gauges: a router or gateway
            # in front of such engines (their /v1/models passed through).
            if metrics.status_code != 200 or f"{owner}:" not in metrics.text:
                return Server(KINDS["router"], models)
            return Server(KINDS[OWNERS[owner]], models)
    return Server(KINDS["openai"], models)


async def _models(http: httpx.AsyncClient, timeout_s: float) -> tuple[tuple[str, ...],
                                                                      tuple[str, ...]]:
    """The ids and owners `/v1/models` lists (nothing where it has no such endpoint)."""
    response = await http.get("/v1/models", timeout=timeout_s)
    if response.status_code >= 500:
        # Not read now (a router whose backend failed it), which is not "no models".
        response.raise_for_status()
    if response.status_code != 200:
        return (), ()
    try:
        data = orjson.loads(response.content).get("data") or []
    except (orjson.JSONDecodeError, AttributeError):
        return (), ()
    entries = [e for e in data if isinstance(e, dict) and isinstance(e.get("id"), str)]
    return (tuple(e["id"] for e in entries),
            tuple(str(e.get("owned_by") or "").lower() for e in entries))


async def _version(http: httpx.AsyncClient, timeout_s: float) -> str | None:
    response = await http.get("/version", timeout=timeout_s)
    if response.status_code != 200:
        return None
    try:
        version = orjson.loads(response.content).get("version")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return version if isinstance(version, str) else None
