"""Request models and error bodies with SGLang's exact shapes (and the other flavours').

As in docs/reference/sglang.md#chat-request and docs/reference/sglang.md#errors; the vLLM
and strict shapes are described in docs/development/simulator.md#other-engines.

The chat model keeps SGLang's field names, types and defaults for every field the simulator
reads; unknown fields are ignored, as in SGLang (no `extra="forbid"`). Validation errors are
turned into the message SGLang's RequestValidationError handler builds,
`"<str(exc)> <exc.errors()>"`, from FastAPI-style errors (loc prefixed with "body", no url).
Real SGLang under FastAPI >= 0.120 also appends the endpoint's file and line to `str(exc)`;
those name SGLang's own source file, so the simulator leaves them out.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import Any, Literal

import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError, field_validator

from launcher.sim.errors import SimError

ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "user")
MEDIA_TYPE_ERROR = [{"loc": ["header", "content-type"],
                     "msg": "Unsupported Media Type: Only 'application/json' is allowed",
                     "type": "value_error"}]
# OpenAI's chat-completion request fields (openai 2.x), for when the `openai` package that
# transformers serve reads them from is not installed (strict_fields).
OPENAI_CHAT_FIELDS = frozenset((
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "n", "parallel_tool_calls", "prediction", "presence_penalty", "reasoning_effort",
    "response_format", "seed", "service_tier", "stop", "store", "stream", "stream_options",
    "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "web_search_options",
    "prompt_cache_key", "safety_identifier", "verbosity"))
# What transformers serve accepts beyond OpenAI's schema (TransformersCompletionCreateParams).
TRANSFORMERS_CHAT_FIELDS = frozenset(("generation_config", "seed", "chat_template_kwargs"))


class Message(BaseModel):
    """One chat message (SGLang's generic and user message params, merged)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _normalize_role(cls, value: Any) -> str:
        if not isinstance(value, str):  # pydantic reports ValueError, not TypeError
            raise ValueError("'role' must be a string")  # noqa: TRY004
        if value.lower() not in ROLES:
            allowed = ", ".join(repr(r) for r in ROLES)
            raise ValueError(f"'role' must be one of {allowed} (case-insensitive).")
        return value.lower()


class Function(BaseModel):
    """A tool's function description."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False


class Tool(BaseModel):
    """A tool offered to the model."""

    type: str = "function"
    function: Function


class ToolChoiceName(BaseModel):
    """The function named by a tool_choice object."""

    name: str | None = None


class ToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`."""

    function: ToolChoiceName
    type: Literal["function"] = "function"


class StreamOptions(BaseModel):
    """`stream_options`."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ChatRequest(BaseModel):
    """The fields of SGLang's ChatCompletionRequest that change what the simulator does.

    Two are vLLM's only (`include_reasoning`, `request_id`); SGLang ignores them as unknown.
    """

    messages: list[Message]
    model: str = "default"
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | Literal["auto", "required", "none"] = "auto"
    reasoning_effort: (Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
                       | float | None) = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    rid: str | list[str] | None = None
    return_meta_info: bool = False
    priority: int | None = None
    include_reasoning: bool = True
    request_id: str | None = None


class RequestError(SimError):
    """A request answered with an error body instead of a completion."""

    def __init__(self, status: int, body: bytes,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(body.decode(errors="replace"))
        self.status = status
        self.body = body
        self.headers = headers or {}


def error_body(message: str, type_: str, code: int) -> bytes:
    """SGLang's ErrorResponse: `{"object","message","type","param","code"}`."""
    return orjson.dumps({"object": "error", "message": message, "type": type_, "param": None,
                         "code": code})


def flavor_error(flavor: str, status: int, message: str, type_: str) -> RequestError:
    """An error answer of the chat route, in the shape of `flavor`'s server.

    sglang: SGLang's ErrorResponse (error_body). vllm: what vLLM 0.11.0's
    `create_error_response` returns, `{"error": {"message", "type", "param", "code"}}`.
    strict: FastAPI's HTTPException, `{"detail": message}`, as transformers serve raises.
    """
    if flavor == "vllm":
        body = orjson.dumps({"error": {"message": message, "type": type_, "param": None,
                                       "code": status}})
    elif flavor == "strict":
        body = orjson.dumps({"detail": message})
    else:
        body = error_body(message, type_, status)
    return RequestError(status, body)


def bad_request(message: str, flavor: str = "sglang") -> RequestError:
    """A 400 of type BadRequestError (context length and `_validate_request` failures)."""
    return flavor_error(flavor, 400, message, "BadRequestError")


def validation_error(errors: list[Any], flavor: str = "sglang") -> RequestError:
    """The answer to a malformed body: SGLang's and vLLM's RequestValidationError handlers
    build one message, `"<str(exc)> <exc.errors()>"`, with type "Bad Request" (400); the
    strict server keeps FastAPI's default, 422 `{"detail": [errors]}`."""
    if flavor == "strict":
        return RequestError(422, orjson.dumps({"detail": errors}))
    exc_str = str(RequestValidationError(errors))
    errors_str = str(errors)
    message = f"{exc_str} {errors_str}" if errors_str and errors_str != exc_str else exc_str
    return flavor_error(flavor, 400, message, "Bad Request")


def parse_json_body(content_type: str | None, body: bytes, check_media_type: bool,
                    flavor: str = "sglang") -> Any:
    """The decoded body, or the RequestError FastAPI + SGLang would answer with."""
    media_type = (content_type or "").lower().split(";", maxsplit=1)[0]
    if check_media_type and media_type != "application/json":
        raise validation_error(MEDIA_TYPE_ERROR, flavor)
    if not body:
        raise validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required",
                                 "input": None}], flavor)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        try:  # FastAPI parses with the stdlib: its verdict, position and wording count
            return json.loads(body)
        except json.JSONDecodeError as exc:
            raise validation_error([{"type": "json_invalid", "loc": ("body", exc.pos),
                                     "msg": "JSON decode error", "input": {},
                                     "ctx": {"error": exc.msg}}], flavor) from exc
        except ValueError as exc:  # undecodable bytes: FastAPI's generic HTTPException
            raise flavor_error(flavor, 400, "There was an error parsing the body",
                               "400") from exc


@functools.cache
def strict_fields() -> frozenset[str]:
    """The request fields the strict flavour accepts: OpenAI's chat-completion schema plus
    transformers serve's own. Read from the installed `openai` package, as transformers
    serve reads them, so a newer schema is followed; OPENAI_CHAT_FIELDS stands in without it.
    """
    try:
        # imported here: openai is a test-only dependency, and only the strict flavour asks
        from openai.types.chat.completion_create_params import (
            CompletionCreateParamsStreaming,
        )
    except ImportError:
        openai_fields = OPENAI_CHAT_FIELDS
    else:
        openai_fields = frozenset(CompletionCreateParamsStreaming.__annotations__)
    return openai_fields | TRANSFORMERS_CHAT_FIELDS


def check_strict_fields(fields: Iterable[str]) -> None:
    """transformers serve's `_validate_request`: any field outside its schema is a 422."""
    unexpected = set(fields) - strict_fields()
    if unexpected:
        detail = f"Unexpected fields in the request: {unexpected}"
        raise RequestError(422, orjson.dumps({"detail": detail}))


def parse_chat(content_type: str | None, body: bytes, flavor: str = "sglang") -> ChatRequest:
    """Validate a /v1/chat/completions body as `flavor`'s server (SGLang + FastAPI) does."""
    data = parse_json_body(content_type, body, check_media_type=flavor != "strict",
                           flavor=flavor)
    if flavor == "strict":
        if not isinstance(data, dict):  # the handler's `body: dict` parameter
            raise validation_error([{"type": "dict_type", "loc": ("body",),
                                     "msg": "Input should be a valid dictionary",
                                     "input": data}], flavor)
        check_strict_fields(data)
    if flavor != "sglang" and isinstance(data, dict) and data.get("model", "") is None:
        del data["model"]  # optional in vLLM's and OpenAI's schemas, a str in SGLang's
    if isinstance(data, dict) and data.get("tool_choice") is None:
        data["tool_choice"] = "none" if data.get("tools") is None else "auto"
    try:
        return ChatRequest.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise validation_error(errors, flavor) from exc


class CompletionRequest(BaseModel):
    """The fields of `/v1/completions` (SGLang's and vLLM's CompletionRequest) that change
    what the simulator does; unknown fields are ignored."""

    prompt: str | list[str] | list[int] | list[list[int]]
    model: str | None = "default"
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    min_tokens: int = 0
    ignore_eos: bool = False
    rid: str | list[str] | None = None
    request_id: str | None = None


class EmbeddingRequest(BaseModel):
    """`/v1/embeddings`: `input` a string, a list of strings, a token-id list or a list of
    them; `encoding_format` is checked by each engine in its own way (embeddings.py)."""

    input: list[int] | list[list[int]] | str | list[str]
    model: str | None = "default"
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    rid: str | list[str] | None = None
    request_id: str | None = None


class ClassifyRequest(BaseModel):
    """`/v1/classify` (SGLang) and `/classify` (vLLM): `input` as an embedding's;
    `use_activation` is vLLM's (false: the raw logits)."""

    input: list[int] | list[list[int]] | str | list[str]
    model: str | None = "default"
    user: str | None = None
    use_activation: bool | None = None
    rid: str | list[str] | None = None
    request_id: str | None = None


def one_per_sequence(given: str | list[str] | list[int] | list[list[int]]
                     ) -> list[str | list[int]]:
    """A completion's `prompt` or an embedding's `input` as its sequences: each a text or
    a token-id list (a flat id list is one sequence)."""
    if isinstance(given, str):
        return [given]
    out: list[str | list[int]] = []
    for item in given:
        if isinstance(item, int):
            return [[i for i in given if isinstance(i, int)]]
        out.append(item)
    return out


def _parse(model: type[BaseModel], content_type: str | None, body: bytes, flavor: str) -> Any:
    data = parse_json_body(content_type, body, check_media_type=True, flavor=flavor)
    if flavor != "sglang" and isinstance(data, dict) and data.get("model", "") is None:
        del data["model"]
    try:
        return model.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise validation_error(errors, flavor) from exc


def parse_completion(content_type: str | None, body: bytes, flavor: str) -> CompletionRequest:
    """Validate a /v1/completions body as `flavor`'s server does."""
    req: CompletionRequest = _parse(CompletionRequest, content_type, body, flavor)
    return req


def parse_embedding(content_type: str | None, body: bytes, flavor: str) -> EmbeddingRequest:
    """Validate a /v1/embeddings body as `flavor`'s server does."""
    req: EmbeddingRequest = _parse(EmbeddingRequest, content_type, body, flavor)
    if flavor == "vllm" and req.encoding_format not in ("float", "base64"):
        # vLLM's field is Literal["float", "base64"]: pydantic's literal_error
        raise validation_error([{
            "type": "literal_error", "loc": ("body", "encoding_format"),
            "msg": "Input should be 'float' or 'base64'", "input": req.encoding_format,
            "ctx": {"expected": "'float' or 'base64'"}}], flavor)
    return req


def parse_classify(content_type: str | None, body: bytes, flavor: str) -> ClassifyRequest:
    """Validate a classify body as `flavor`'s server does."""
    req: ClassifyRequest = _parse(ClassifyRequest, content_type, body, flavor)
    return req


# The API each vLLM route serves, as its "does not support" message names it.
VLLM_APIS = {"chat": "Chat Completions API", "completions": "Completions API",
             "embeddings": "Embeddings API"}


def wrong_mode(flavor: str, route: str) -> RequestError:
    """What a server answers on a route its mode does not serve (route: chat, completions,
    embeddings).

    vLLM registers every route and answers `The model does not support <API>` with status
    200 (its handler returns the ErrorResponse model itself, which FastAPI sends as a 200).
    SGLang's generation server refuses embeddings in its tokenizer manager (400); its
    embedding server has no such check and the generation handlers fail on the embedding
    output with a KeyError, which serving_base answers as a 500.
    """
    if flavor == "vllm":
        err = flavor_error("vllm", 400, f"The model does not support {VLLM_APIS[route]}",
                           "BadRequestError")
        return RequestError(200, err.body)
    if route == "embeddings":
        return bad_request("This model does not appear to be an embedding model by default. "
                           "Please add `--is-embedding` when launching the server or try "
                           "another model.")
    return flavor_error(flavor, 500, "Internal server error: 'text'", "InternalServerError")
