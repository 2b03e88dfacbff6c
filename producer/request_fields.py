"""Checks of a prompt's chat-request fields (messages, tools, sampling params) and the bad-field
error they raise, with ``_show`` to describe a bad value in that error."""

from collections.abc import Callable
from typing import Any

import orjson

ROLES = ("system", "user", "assistant", "tool", "developer")


class _Invalid(Exception):
    """A bad line, raised while parsing and turned into an InputError by _Scan."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message)
        self.field = field
        self.message = message


def _checked_messages(messages: Any, field: str) -> list[Any]:
    if not isinstance(messages, list) or not messages:
        raise _Invalid(field, f"expected a non-empty list of messages; got {_show(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _Invalid(f"{field}[{i}]", f"expected an object; got {_show(message)}")
        _check_message(message, f"{field}[{i}]")
    return messages


def _check_message(message: dict[str, Any], field: str) -> None:
    role = message.get("role")
    if role not in ROLES:
        got = "missing" if "role" not in message else f"got {_show(role)}"
        raise _Invalid(f"{field}.role", f"expected one of {', '.join(ROLES)}; {got}")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not _is_list_of_objects(tool_calls):
        raise _Invalid(
            f"{field}.tool_calls", f"expected a list of objects; got {_show(tool_calls)}"
        )
    content = message.get("content")
    if isinstance(content, str):
        return
    if isinstance(content, list):
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _Invalid(f"{field}.content[{i}]", 'expected an object with a string "type"')
        return
    if content is None and role == "assistant" and tool_calls:
        return
    if content is None:
        got = "missing" if "content" not in message else "got null"
        raise _Invalid(
            f"{field}.content", f"{got}; only an assistant message with tool_calls may omit it"
        )
    raise _Invalid(
        f"{field}.content",
        f"expected a string, a list of content parts or null; got {_show(content)}",
    )


def _checked_tools(tools: Any, field: str) -> list[Any]:
    if not isinstance(tools, list) or not _is_list_of_objects(tools):
        raise _Invalid(field, f"expected a list of objects; got {_show(tools)}")
    return tools


def _checked_sampling(params: dict[str, Any], field: str) -> dict[str, Any]:
    checked = {}
    for key, value in params.items():
        if value is None:
            continue
        check = _SAMPLING_CHECKS.get(key)
        if check is not None and not check[0](value):
            raise _Invalid(f"{field}.{key}", f"expected {check[1]}; got {_show(value)}")
        checked[key] = value
    return checked


def _is_list_of_objects(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is a subclass of int, and true is not a token count


def _is_count(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _is_number(value: Any) -> bool:
    return type(value) is int or type(value) is float


def _is_stop(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(item, str) for item in value)
    )


_SAMPLING_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (_is_count, "an integer >= 0"),
    "max_completion_tokens": (_is_count, "an integer >= 0"),
    "min_tokens": (_is_count, "an integer >= 0"),
    "seed": (_is_count, "an integer >= 0"),
    "top_k": (lambda v: _is_int(v) and v >= -1, "an integer >= 0, or -1 for no limit"),
    "temperature": (_is_number, "a number"),
    "top_p": (_is_number, "a number"),
    "min_p": (_is_number, "a number"),
    "frequency_penalty": (_is_number, "a number"),
    "presence_penalty": (_is_number, "a number"),
    "repetition_penalty": (_is_number, "a number"),
    "stop": (_is_stop, "a string or a list of strings"),
    "ignore_eos": (lambda v: type(v) is bool, "true or false"),
    "chat_template_kwargs": (lambda v: isinstance(v, dict), "an object"),
}


def _show(value: Any) -> str:
    """Describe a JSON value in an error: scalars as JSON (cut short), containers by kind."""
    if isinstance(value, dict):
        return "object" if value else "{}"
    if isinstance(value, list):
        return "array" if value else "[]"
    shown = orjson.dumps(value).decode()
    return shown if len(shown) <= 60 else shown[:57] + '..."'
