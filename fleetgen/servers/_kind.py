"""The interface of a server kind: what fleetgen needs to know to use one engine at full speed.

A kind says how a request is shaped for it (the fields beyond OpenAI's chat schema it takes,
whether one request may ask several answers with `n`), where it serves an endpoint whose path
differs from the endpoint's own, which `/metrics` gauges show its load, and nothing else: the HTTP exchange, the error mapping
and the answer's reading are the same for every OpenAI-compatible server (workers/client.py,
fleetgen/records.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from fleetgen.servers._chat import RequestBody
from fleetgen.servers._server_info import ServerInfo

# How readings of several schedulers (DP ranks, engines) combine into one per server.
Combine = str  # "sum" | "max" | "mean"


class ServerKind:
    """One engine family. Subclasses set the class attributes; instances carry no state."""

    name: ClassVar[str]
    # Whether it serves a request whatever model it names (else the served name must be sent).
    any_model: ClassVar[bool] = False
    # Whether it is a server of servers (a router): a request, a probe, a failure concerns
    # one of its backends, not all of it.
    several: ClassVar[bool] = False
    # Short gauge name -> (Prometheus family, how several samples combine). `running` and
    # `queue` are what the capacity discovery reads; the rest are shown in `status`.
    gauges: ClassVar[Mapping[str, tuple[str, Combine]]] = {}
    # An endpoint's path (fleetgen/endpoints.py) -> the path this kind serves it at, where the
    # two differ; a server of an unknown kind is sent to the endpoint's own path.
    routes: ClassVar[Mapping[str, str]] = {}

    def takes_n(self, info: ServerInfo | None) -> bool:
        """Whether one request with `n` gives n distinct answers of a prompt here (else each
        answer is a request of its own)."""
        return False

    def added_fields(self, thinking: bool) -> RequestBody:
        """The fields fleetgen adds to every request for this kind (beyond OpenAI's schema).
        A prompt line's own values win over them; `chat_template_kwargs` is merged."""
        return {}

    @property
    def reads_load(self) -> bool:
        """Whether its `/metrics` shows requests running and waiting (capacity discovery)."""
        return "running" in self.gauges and "queue" in self.gauges

    def __repr__(self) -> str:
        return self.name
