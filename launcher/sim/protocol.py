"""Request models and error bodies with SGLang's exact shapes.

As in docs/reference/sglang.md#chat-request and docs/reference/sglang.md#errors.

The chat model keeps SGLang's field names, types and defaults for every field the simulator
reads; unknown fields are ignored, as in SGLang (no `extra="forbid"`). Validation errors are
turned into the message SGLang's RequestValidationError handler builds,
`"<str(exc)> <exc.errors()>"`, from FastAPI-style errors (loc prefixed with "body", no url).
Real SGLang under FastAPI >= 0.120 also appends the endpoint's file and line to `str(exc)`;
those name SGLang's own source file, so the simulator leaves them out.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError, field_validator

ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "user")
MEDIA_TYPE_ERROR = [{"loc": ["header", "content-type"],
                     "msg": "Unsupported Media Type: Only 'application/json' is allowed",
                     "type": "value_error"}]


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
    """The fields of SGLang's ChatCompletionRequest that change what the simulator does."""

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


class RequestError(Exception):
    """A request answered with an error body instead of a completion."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(body.decode(errors="replace"))
        self.status = status
        self.body = body


def error_body(message: str, type_: str, code: int) -> bytes:
    """SGLang's ErrorResponse: `{"object","message","type","param","code"}`."""
    return orjson.dumps({"object": "error", "message": message, "type": type_, "param": None,
                         "code": code})


def bad_request(message: str) -> RequestError:
    """A 400 of type BadRequestError (context length and `_validate_request` failures)."""
    return RequestError(400, error_body(message, "BadRequestError", 400))


def validation_error(errors: list[Any]) -> RequestError:
    """The 400 SGLang's RequestValidationError handler returns (type "Bad Request")."""
    exc_str = str(RequestValidationError(errors))
    errors_str = str(errors)
    message = f"{exc_str} {errors_str}" if errors_str and errors_str != exc_str else exc_str
    return RequestError(400, error_body(message, "Bad Request", 400))


def parse_json_body(content_type: str | None, body: bytes, check_media_type: bool) -> Any:
    """The decoded body, or the RequestError FastAPI + SGLang would answer with."""
    media_type = (content_type or "").lower().split(";", maxsplit=1)[0]
    if check_media_type and media_type != "application/json":
        raise validation_error(MEDIA_TYPE_ERROR)
    if not body:
        raise validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required",
                                 "input": None}])
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        try:  # FastAPI parses with the stdlib: its verdict, position and wording count
            return json.loads(body)
        except json.JSONDecodeError as exc:
            raise validation_error([{"type": "json_invalid", "loc": ("body", exc.pos),
                                     "msg": "JSON decode error", "input": {},
                                     "ctx": {"error": exc.msg}}]) from exc
        except ValueError as exc:  # undecodable bytes: FastAPI's generic HTTPException
            raise RequestError(400, error_body("There was an error parsing the body", "400",
                                               400)) from exc


def parse_chat(content_type: str | None, body: bytes) -> ChatRequest:
    """Validate a /v1/chat/completions body as SGLang + FastAPI do."""
    data = parse_json_body(content_type, body, check_media_type=True)
    if isinstance(data, dict) and data.get("tool_choice") is None:
        data["tool_choice"] = "none" if data.get("tools") is None else "auto"
    try:
        return ChatRequest.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise validation_error(errors) from exc


class ContextLengthError(ValueError):
    """The prompt (or prompt + max_new_tokens) does not fit the context (tokenizer manager)."""


def input_too_long(input_tokens: int, context_len: int) -> ContextLengthError:
    """SGLang's message for a prompt at or over the context length."""
    return ContextLengthError(f"The input ({input_tokens} tokens) is longer than the model's "
                              f"context length ({context_len} tokens).")


def check_context(input_tokens: int, max_new: int | None, context_len: int,
                  auto_truncate: bool) -> tuple[int, int | None]:
    """(input, max_new_tokens) after SGLang's `_validate_one_request` checks."""
    if auto_truncate:  # --allow-auto-truncate: clamp instead of refusing
        input_tokens = min(input_tokens, context_len - 2)
        if max_new is not None and max_new + input_tokens >= context_len:
            max_new = context_len - input_tokens - 1
        return input_tokens, max_new
    if input_tokens >= context_len:
        raise input_too_long(input_tokens, context_len)
    if max_new is not None and max_new + input_tokens >= context_len:
        raise ContextLengthError(
            f"Requested token count exceeds the model's maximum context length of {context_len} "
            f"tokens. You requested a total of {max_new + input_tokens} tokens: {input_tokens} "
            f"tokens from the input messages and {max_new} tokens for the completion. Please "
            "reduce the number of tokens in the input messages or the completion to fit within "
            "the limit.")
    return input_tokens, max_new
