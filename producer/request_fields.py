"""Checks of a prompt's chat-request fields (messages, tools, sampling params: SAMPLING_PARAMS) and
the bad-field error they raise, with ``_show`` to describe a bad value in that error."""

import difflib
from collections.abc import Callable
from typing import Any

import orjson

from workers.job import MAX_TEMPERATURE, MAX_TOKENS_LIMIT

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
        rule = SAMPLING_PARAMS.get(key)
        if rule is None:
            raise _Invalid(f"{field}.{key}", _unknown_param(key))
        if value is None:
            continue
        if not rule[0](value):
            raise _Invalid(f"{field}.{key}", f"expected {rule[1]}; got {_show(value)}")
        checked[key] = value
    return checked


def _unknown_param(key: str) -> str:
    close = difflib.get_close_matches(key, SAMPLING_PARAMS, n=1)
    if close:
        return f"unknown sampling parameter; did you mean {close[0]}?"
    return f"unknown sampling parameter; known: {', '.join(SAMPLING_PARAMS)}"


def _is_list_of_objects(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is a subclass of int, and true is not a token count


def _int_in(low: int, high: int) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and low <= v <= high


def _number_in(low: float, high: float, *, open_low: bool = False) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if not _is_number(value):
            return False
        return bool(low < value if open_low else low <= value) and value <= high

    return check


def _is_number(value: Any) -> bool:
    return type(value) is int or type(value) is float


def _is_strings(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(item, str) for item in value)
    )


def _is_bool(value: Any) -> bool:
    return type(value) is bool


def _is_object(value: Any) -> bool:
    return isinstance(value, dict)


_TOKENS = f"an integer in [1, {MAX_TOKENS_LIMIT}]"
_PENALTY = "a number in [-2, 2]"
_TOOL_CHOICES = ("auto", "required", "none")
_EFFORTS = ("low", "medium", "high")

# Every key a prompt's "sampling" (or an OpenAI Batch line's "body") may hold, with its check and
# what it expects: the chat-completions fields SGLang 0.5.5 reads for one answer, with the ranges
# of its SamplingParams.verify() and protocol.ChatCompletionRequest. Any other key is a typo or a
# field SGLang would silently ignore, so it is rejected. The worker owns model, stream and the
# request plumbing (rid, lora_path, ...), so those are not here either.
SAMPLING_PARAMS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (_int_in(1, MAX_TOKENS_LIMIT), _TOKENS),
    "max_completion_tokens": (_int_in(1, MAX_TOKENS_LIMIT), _TOKENS),
    "min_tokens": (_int_in(0, MAX_TOKENS_LIMIT), f"an integer in [0, {MAX_TOKENS_LIMIT}]"),
    "temperature": (_number_in(0, MAX_TEMPERATURE), f"a number in [0, {MAX_TEMPERATURE:g}]"),
    "top_p": (_number_in(0, 1, open_low=True), "a number in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and (v == -1 or v >= 1), "-1 (no limit) or an integer >= 1"),
    "min_p": (_number_in(0, 1), "a number in [0, 1]"),
    "frequency_penalty": (_number_in(-2, 2), _PENALTY),
    "presence_penalty": (_number_in(-2, 2), _PENALTY),
    # SGLang's verify() lets 0 through, but the penalty divides logits: 0 is never meant.
    "repetition_penalty": (_number_in(0, 2, open_low=True), "a number in (0, 2]"),
    "seed": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "stop": (_is_strings, "a string or a list of strings"),
    "stop_token_ids": (
        lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v),
        "a list of token ids (integers >= 0)",
    ),
    "stop_regex": (_is_strings, "a string or a list of strings"),
    "ignore_eos": (_is_bool, "true or false"),
    "no_stop_trim": (_is_bool, "true or false"),
    "skip_special_tokens": (_is_bool, "true or false"),
    "logit_bias": (_is_object, "an object"),
    "logprobs": (_is_bool, "true or false"),
    "top_logprobs": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    # One answer per prompt is what a result holds; n > 1 would lose the rest silently.
    "n": (lambda v: _is_int(v) and v == 1, "1 (one answer per prompt)"),
    "response_format": (_is_object, "an object"),
    "regex": (lambda v: isinstance(v, str), "a string"),
    "ebnf": (lambda v: isinstance(v, str), "a string"),
    "tool_choice": (
        lambda v: v in _TOOL_CHOICES or isinstance(v, dict),
        f"one of {', '.join(_TOOL_CHOICES)} or an object",
    ),
    "reasoning_effort": (lambda v: v in _EFFORTS, f"one of {', '.join(_EFFORTS)}"),
    "separate_reasoning": (_is_bool, "true or false"),
    "continue_final_message": (_is_bool, "true or false"),
    "chat_template_kwargs": (_is_object, "an object"),
}


def _show(value: Any) -> str:
    """Describe a JSON value in an error: scalars as JSON (cut short), containers by kind."""
    if isinstance(value, dict):
        return "object" if value else "{}"
    if isinstance(value, list):
        return "array" if value else "[]"
    shown = orjson.dumps(value).decode()
    return shown if len(shown) <= 60 else shown[:57] + '..."'
