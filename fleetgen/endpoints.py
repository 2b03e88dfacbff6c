"""The kinds of request a job makes: one endpoint per job, named in its manifest.

    chat         /v1/chat/completions   messages in, a message out (the default)
    completions  /v1/completions        a prompt string in, its continuation out
    embeddings   /v1/embeddings         texts in (`input`: a string or a list), a vector each out
    classify     /v1/classify           texts in (`input`), a label and its probabilities each
                                        out, from a classifier or reward model (vLLM serves it
                                        at /classify: fleetgen/servers, `ServerKind.routes`)

An OpenAI Batch line names its endpoint by `url`; a plain file's job by `enqueue --endpoint`.
The worker sends a job's requests to its endpoint's path; chat and completions give answers
(text, a finish reason, the canary and the breaker judge them), embeddings give vectors and
classify labels, and for those two the worker packs several prompts' texts into one request, as
the server batches them anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

CHAT: Final = "chat"
COMPLETIONS: Final = "completions"
EMBEDDINGS: Final = "embeddings"
CLASSIFY: Final = "classify"


@dataclass(frozen=True)
class Endpoint:
    """One kind of request: its name in a manifest, its path on a server (also the `url` of an
    OpenAI Batch line), whether it answers with generated text, and the other paths an
    OpenAI Batch line may name it by (an engine's own route for it)."""

    name: str
    path: str
    generates: bool
    aliases: tuple[str, ...] = ()

    def inputs(self, body: Mapping[str, Any]) -> int:
        """How many sequences a request body of this endpoint puts on the server: the texts of
        an embeddings `input` (a list of strings, or one string or list of token ids), one
        otherwise (a classify `input` is read the same). The server batches each as a request
        of its own."""
        if self.generates:
            return 1
        given = body.get("input")
        if isinstance(given, list) and given and not isinstance(given[0], int):
            return len(given)
        return 1


ENDPOINTS: Final[Mapping[str, Endpoint]] = {
    e.name: e for e in (
        Endpoint(CHAT, "/v1/chat/completions", generates=True),
        Endpoint(COMPLETIONS, "/v1/completions", generates=True),
        Endpoint(EMBEDDINGS, "/v1/embeddings", generates=False),
        # SGLang's route; vLLM's is /classify, the same request and answer.
        Endpoint(CLASSIFY, "/v1/classify", generates=False, aliases=("/classify",)),
    )
}
BY_PATH: Final[Mapping[str, Endpoint]] = {
    path: e for e in ENDPOINTS.values() for path in (e.path, *e.aliases)}


def endpoint(name: str) -> Endpoint:
    """The endpoint called `name`; ValueError naming the known ones for another."""
    try:
        return ENDPOINTS[name]
    except KeyError:
        raise ValueError(f"endpoint {name!r}: use one of {', '.join(ENDPOINTS)}") from None
