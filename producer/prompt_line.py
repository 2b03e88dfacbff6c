"""One prompt line: the PromptRecord it yields, its three shapes (chat, plain, OpenAI Batch) and
its id (given or content hash, unique in the file)."""

from dataclasses import dataclass
from typing import Any

import orjson

from producer.prompt_id import IdIndex, hash_id, id_problem
from producer.request_fields import (
    SAMPLING_PARAMS,
    _checked_messages,
    _checked_sampling,
    _checked_tools,
    _Invalid,
    _show,
)

OPENAI_METHOD = "POST"
OPENAI_URL = "/v1/chat/completions"
_CHAT_FIELDS = ("id", "messages", "prompt", "tools", "sampling")
_OPENAI_FIELDS = ("custom_id", "method", "url", "body")
_NOT_SAMPLING = ("messages", "tools", "model", "stream")  # the worker sets model and stream


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """One valid prompt: its id, 1-based line number, and chat-completions request fields.

    ``body`` holds ``messages``, ``tools`` if any, and the line's own sampling params; the producer
    merges the job defaults under it, so the line's values win.
    """

    id: str
    line: int
    body: dict[str, Any]


def _record(raw: bytes, line: int, ids: IdIndex) -> PromptRecord:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _Invalid("line", _json_problem(raw, exc)) from None
    if not isinstance(obj, dict):
        raise _Invalid("line", f"expected a JSON object; got {_show(obj)}")
    if any(key in obj for key in _OPENAI_FIELDS) and "messages" not in obj and "prompt" not in obj:
        id_field, body = "custom_id", _openai_body(obj)
    elif any(key in obj for key in _CHAT_FIELDS):
        id_field, body = "id", _chat_body(obj)
    else:
        raise _Invalid("line", 'no prompt: expected "messages", "prompt" or an OpenAI Batch line')
    prompt_id = _given_id(obj, id_field)
    if prompt_id is None:
        prompt_id = hash_id(body)
    first = ids.add(prompt_id, line)
    if first is not None:
        raise _Invalid(id_field, _duplicate_problem(prompt_id, first, id_field in obj))
    return PromptRecord(prompt_id, line, body)


def _json_problem(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"not valid UTF-8 at byte {bad.start + 1} (0x{raw[bad.start]:02x})"
    # Parse again without the line break, so orjson's position is a column of this line.
    try:
        orjson.loads(raw.rstrip(b"\r\n"))
    except orjson.JSONDecodeError as in_line:
        exc = in_line
    return f"invalid JSON: {exc.msg} at column {exc.colno}"


def _duplicate_problem(prompt_id: str, first: int, given: bool) -> str:
    if given:
        return f"duplicate id {_show(prompt_id)}, first on line {first}"
    return (
        f"same content as line {first} (hash id {prompt_id}); "
        'a line without an id is named by its content, so give repeated prompts an "id"'
    )


def _given_id(obj: dict[str, Any], field: str) -> str | None:
    if field not in obj:
        return None
    value = obj[field]
    if field == "id" and type(value) is int:
        value = str(value)
    if not isinstance(value, str):
        expected = "a string or an integer" if field == "id" else "a string"
        raise _Invalid(field, f"expected {expected}; got {_show(value)}")
    problem = id_problem(value)
    if problem is not None:
        raise _Invalid(field, problem)
    return value


def _chat_body(obj: dict[str, Any]) -> dict[str, Any]:
    for key in obj:
        if key not in _CHAT_FIELDS:
            hint = ' (sampling params go under "sampling")' if key in SAMPLING_PARAMS else ""
            raise _Invalid(key, f"unknown field{hint}; a prompt line has {', '.join(_CHAT_FIELDS)}")
    if "prompt" in obj:
        if "messages" in obj:
            raise _Invalid("prompt", 'give either "prompt" or "messages", not both')
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise _Invalid("prompt", f"expected a non-empty string; got {_show(prompt)}")
        body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
    elif "messages" in obj:
        body = {"messages": _checked_messages(obj["messages"], "messages")}
    else:
        raise _Invalid("messages", 'missing; a prompt line needs "messages" or "prompt"')
    if obj.get("tools") is not None:
        body["tools"] = _checked_tools(obj["tools"], "tools")
    sampling = obj.get("sampling")
    if sampling is not None:
        if not isinstance(sampling, dict):
            raise _Invalid("sampling", f"expected an object; got {_show(sampling)}")
        for key in _NOT_SAMPLING:
            if key in sampling:
                raise _Invalid(f"sampling.{key}", "not a sampling parameter")
        body.update(_checked_sampling(sampling, "sampling"))
    return body


def _openai_body(obj: dict[str, Any]) -> dict[str, Any]:
    for key in obj:
        if key not in _OPENAI_FIELDS:
            raise _Invalid(
                key, f"unknown field; an OpenAI Batch line has {', '.join(_OPENAI_FIELDS)}"
            )
    for key in _OPENAI_FIELDS:
        if key not in obj:
            raise _Invalid(key, f"missing; an OpenAI Batch line needs {', '.join(_OPENAI_FIELDS)}")
    if obj["method"] != OPENAI_METHOD:
        raise _Invalid("method", f'expected "{OPENAI_METHOD}"; got {_show(obj["method"])}')
    if obj["url"] != OPENAI_URL:
        raise _Invalid("url", f'expected "{OPENAI_URL}"; got {_show(obj["url"])}')
    request = obj["body"]
    if not isinstance(request, dict):
        raise _Invalid("body", f"expected an object; got {_show(request)}")
    if "messages" not in request:
        raise _Invalid("body.messages", "missing")
    body: dict[str, Any] = {"messages": _checked_messages(request["messages"], "body.messages")}
    if request.get("tools") is not None:
        body["tools"] = _checked_tools(request["tools"], "body.tools")
    params = {k: v for k, v in request.items() if k not in _NOT_SAMPLING}
    body.update(_checked_sampling(params, "body"))
    return body
