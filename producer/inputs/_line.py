"""One prompt line: its shapes (chat, plain, OpenAI Batch), its id (given or content hash,
unique in the file), and the checks of its request fields (messages, tools, the sampling params
of SAMPLING_PARAMS, an embedding's input). ``parse_line`` turns the line into a PromptRecord, or
into the InputError that names what is wrong with it.

A job makes one kind of request (fleetgen/endpoints.py), and a line is read for it
(``JobEndpoint``): a plain line's fields are that endpoint's (chat: ``messages`` or ``prompt``;
completions and embeddings: the text field, ``TEXT_FIELDS`` unless ``--text-column`` names
another), and an OpenAI Batch line's ``url`` must be its path. Without ``--endpoint`` the first
line of a shape decides: an OpenAI Batch line by its ``url``, a plain line for chat.

A table's row is a line in another encoding: ``parse_row`` takes its cells by field name and
checks them with the same rules, after the table's own conventions (a null cell is an absent
field, a null struct field an absent key, a string cell of ``messages``, ``tools``,
``sampling`` or ``body`` holds that field as JSON); its errors name the row and the column."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import orjson

from fleetgen.endpoints import (
    BY_PATH,
    CHAT,
    CLASSIFY,
    COMPLETIONS,
    EMBEDDINGS,
    ENDPOINTS,
    Endpoint,
)
from fleetgen.job import MAX_SAMPLES, MAX_TEMPERATURE, MAX_TOKENS_LIMIT
from producer.inputs._errors import REJECT_RAW_CHARS, InputError
from producer.inputs._ids import IdIndex, hash_id, id_problem

if TYPE_CHECKING:  # the servers' package loads httpx, which reading prompts never needs
    from fleetgen.servers import RequestBody

OPENAI_METHOD = "POST"
ROLES = ("system", "user", "assistant", "tool", "developer")
_CHAT_FIELDS = ("id", "messages", "prompt", "tools", "sampling")
_OPENAI_FIELDS = ("custom_id", "method", "url", "body")
_NOT_SAMPLING = ("messages", "tools", "model", "stream")  # the worker sets model and stream
# Every column a prompt table may have: the fields of a line's three shapes (a completions or
# embeddings table adds its text column, JobEndpoint.text).
TABLE_FIELDS = tuple(dict.fromkeys((*_CHAT_FIELDS, *_OPENAI_FIELDS)))
# The field of a plain completions or embeddings line (a table's column) holding its text,
# unless `--text-column` names another: a completion's is its prompt, as in a plain chat line;
# an embedding's is a text, as datasets of passages name it.
TEXT_FIELDS = {COMPLETIONS: "prompt", EMBEDDINGS: "text", CLASSIFY: "text"}
# What a text field may not be called: the other fields of its plain line, read as themselves.
# Any other name is the text (`--text-column body` too: a line holding its text field is a plain
# line, even one named like an OpenAI Batch line's).
RESERVED_FIELDS = ("id", "sampling")
# The keys of an embeddings request body besides `model` (which the worker sets).
EMBEDDING_FIELDS = ("input", "dimensions", "encoding_format", "user")
# A classify body's (SGLang's ClassifyRequest; `use_activation` is vLLM's: false gives the
# logits, a reward model's raw score).
CLASSIFY_FIELDS = ("input", "user", "use_activation")
ENCODING_FORMATS = ("float", "base64")
# What errors call a plain line of each endpoint.
_A_LINE = {CHAT: "a prompt line", COMPLETIONS: "a completions line", EMBEDDINGS: "an embeddings line",
           CLASSIFY: "a classify line"}
# Most texts one embeddings request may hold: OpenAI's limit on `input`'s length.
MAX_EMBEDDING_INPUTS = 2048
# A table's string cell of one of these holds the field as JSON (a list or an object).
_JSON_FIELDS = ("messages", "tools", "sampling", "body")
# An error keeps REJECT_RAW_CHARS characters of its line; UTF-8 spends at most 4 bytes on one, so
# decoding this many bytes is enough, and a bad line of megabytes is never decoded whole.
_RAW_BYTES = 4 * REJECT_RAW_CHARS
# Each sampling parameter's check, and what it expects (for the error).
_Rules = dict[str, tuple[Callable[[Any], bool], str]]


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """One valid prompt: its id, 1-based line number, and chat-completions request fields.

    ``body`` holds ``messages``, ``tools`` if any, and the line's own sampling params; the producer
    merges the job defaults under it, so the line's values win. ``samples`` is the line's own
    ``n`` (answers asked of the prompt), taken out of ``body``: each answer is its own outcome
    (the worker decides how they are sent); None when the line does not say, so the job's default applies.
    """

    id: str
    line: int
    body: RequestBody
    samples: int | None = None


class JobEndpoint:
    """The endpoint an input's lines are read for: ``given`` (``--endpoint``), else the one the
    first line of a shape names (an OpenAI Batch line's ``url``; a plain line: chat), kept in
    ``found`` with ``where`` that line is. ``text`` is the field (column) of a plain line holding
    its text, for completions and embeddings (default: TEXT_FIELDS).

    One per pass over an input: the first line decides for the lines after it.
    """

    def __init__(self, given: str | None = None, text: str | None = None) -> None:
        self.given = ENDPOINTS[given] if given is not None else None
        self._text = text
        self.found: Endpoint | None = None
        self.where = ""

    @property
    def current(self) -> Endpoint:
        """The endpoint lines are read for now: given, found, else chat."""
        return self.given or self.found or ENDPOINTS[CHAT]

    @property
    def text(self) -> str | None:
        """The text field of a plain line of this endpoint; None for chat."""
        name = self.current.name
        return None if name == CHAT else self._text or TEXT_FIELDS[name]

    def decide(self, kind: Endpoint, where: str) -> None:
        """The first line of a shape sets the endpoint of a job given none."""
        if self.given is None and self.found is None:
            self.found = kind
            self.where = where

    def origin(self) -> str:
        """Where the endpoint comes from, for an error: "--endpoint" or "line 1"."""
        return "--endpoint" if self.given is not None else self.where or "the default"

    def plain_fields(self) -> tuple[str, ...]:
        """The fields of a plain line of this endpoint."""
        name = self.current.name
        if name == CHAT:
            return _CHAT_FIELDS
        assert self.text is not None
        return ("id", self.text, "sampling") if name == COMPLETIONS else ("id", self.text)

    def content_fields(self) -> tuple[str, ...]:
        """The fields holding a plain line's prompt: one of them makes it a plain line."""
        return ("messages", "prompt") if self.text is None else (self.text,)


class _Invalid(Exception):
    """What is wrong with the line, raised by the checks below; parse_line makes it an InputError
    (which also needs the file's name and the line's text)."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message)
        self.field = field
        self.message = message


def parse_line(raw: bytes, line: int, ids: IdIndex, path: str,
               place: Callable[[int], str] | None = None,
               job: JobEndpoint | None = None) -> PromptRecord | InputError:
    """Parse and check line number ``line`` (``raw``, not blank) of the file errors call ``path``,
    for the endpoint ``job`` (default: chat, or what the line names).

    A valid line's id is added to ``ids``; a bad line, or a second use of an id, comes back as an
    InputError holding the start of the line. ``place`` says where an earlier record was, for a
    duplicate (default: "line N").
    """
    try:
        return _checked(_json_object(raw), line, ids, place or _on_line, job or JobEndpoint())
    except _Invalid as bad:
        text = raw[:_RAW_BYTES].decode("utf-8", "replace").rstrip("\r\n")
        return InputError(path, line, bad.field, bad.message, text)


def parse_row(cells: dict[str, Any], ordinal: int, row: int, ids: IdIndex, path: str,
              place: Callable[[int], str], column_of: dict[str, str],
              job: JobEndpoint | None = None) -> PromptRecord | InputError:
    """Check row ``row`` (1-based in its file ``path``) of a table, given as {field: cell}, for
    the endpoint ``job``.

    ``ordinal`` is its position in the whole input (the record's ``line``); ``column_of`` names
    the column a field was read from where they differ (``--prompt-column``), so an error names
    the column the user has.
    """
    try:
        job = job or JobEndpoint()
        return _checked(_row_object(cells, job.text), ordinal, ids, place, job)
    except _Invalid as bad:
        head = bad.field.split(".", 1)[0].split("[", 1)[0]
        field = "row" if head == "line" else column_of.get(head, head) + bad.field[len(head):]
        text = orjson.dumps(cells, default=str).decode()
        return InputError(path, row, field, bad.message, text, unit="row")


def _on_line(line: int) -> str:
    return f"line {line}"


def _json_object(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _Invalid("line", _json_problem(raw, exc)) from None


def _row_object(cells: dict[str, Any], text: str | None) -> dict[str, Any]:
    obj = {}
    for key, value in cells.items():
        if value is None:
            continue  # a null cell: the row has no such field
        if key == text:
            obj[key] = value  # the text column is text, whatever its name
            continue
        if key in _JSON_FIELDS and isinstance(value, str):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise _Invalid(key, f"a string here must be JSON: {exc.msg}") from None
        elif key in _JSON_FIELDS:
            value = _without_nulls(value)
        obj[key] = value
    return obj


def _without_nulls(value: Any) -> Any:
    """A nested cell as JSON would spell it: a struct's null fields are keys it does not have
    (a column of structs has every key any row uses, null where a row lacks it)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _checked(obj: Any, line: int, ids: IdIndex, place: Callable[[int], str],
             job: JobEndpoint) -> PromptRecord:
    if not isinstance(obj, dict):
        raise _Invalid("line", f"expected a JSON object; got {_show(obj)}")
    if any(key in obj for key in _OPENAI_FIELDS) and not any(
            key in obj for key in job.content_fields()):
        id_field, body = "custom_id", _openai_body(obj, job, place(line))
    elif any(key in obj for key in job.plain_fields()):
        job.decide(job.current, place(line))
        id_field, body = "id", _plain_body(obj, job)
    else:
        known = (*job.plain_fields(), *_OPENAI_FIELDS)
        content = " or ".join(f'"{f}"' for f in job.content_fields())
        for key in obj:  # a misspelt "prompt" says so, not only that no prompt was found
            if _close_field(key, known):
                raise _Invalid(key, _unknown_field(key, known, f"a prompt line has {content}, "
                                                   "or is an OpenAI Batch line"))
        raise _Invalid("line", f"no prompt: expected {content} or an OpenAI Batch line"
                       + _text_hint(job, obj))
    prompt_id = _given_id(obj, id_field)
    if prompt_id is None:
        prompt_id = hash_id(body)  # with `n` in it: a line's hash id is what it always was
    first = ids.add(prompt_id, line)
    if first is not None:
        raise _Invalid(id_field, _duplicate_problem(prompt_id, place(first), id_field in obj))
    return PromptRecord(prompt_id, line, body, body.pop("n", None))


def _text_hint(job: JobEndpoint, obj: dict[str, Any]) -> str:
    """For a plain line of completions or embeddings without its text: the fields it has, and
    the flag that names another."""
    if job.text is None:
        return ""
    name = job.current.name
    return (f"; this line has {', '.join(obj) or 'no field'}: --text-column names the field "
            f'holding the text (default for {name}: "{TEXT_FIELDS[name]}")')


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


def _duplicate_problem(prompt_id: str, first: str, given: bool) -> str:
    if given:
        return f"duplicate id {_show(prompt_id)}, first on {first}"
    return (
        f"same content as {first} (hash id {prompt_id}); "
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


def _plain_body(obj: dict[str, Any], job: JobEndpoint) -> RequestBody:
    fields, name = job.plain_fields(), job.current.name
    if job.text is not None and job.text not in obj:
        # Before its other fields: a text under another name is the likelier mistake.
        raise _Invalid(job.text, "missing" + _text_hint(job, obj))
    for key in obj:
        if key not in fields:
            raise _Invalid(key, _plain_unknown(key, fields, name))
    if name == CHAT:
        return _chat_body(obj)
    text = _text(obj, job)
    if not ENDPOINTS[name].generates:
        return cast("RequestBody", {"input": text})
    body = cast("RequestBody", {"prompt": text})
    body.update(_line_sampling(obj, COMPLETION_PARAMS))
    return body


def _plain_unknown(key: str, fields: tuple[str, ...], name: str) -> str:
    shape = f"{_A_LINE[name]} has {', '.join(fields)}"
    if not ENDPOINTS[name].generates and (key == "sampling" or key in SAMPLING_PARAMS):
        return _NO_SAMPLING_CLASSIFY if name == CLASSIFY else _NO_SAMPLING
    if key in SAMPLING_PARAMS:
        return f'unknown field (sampling params go under "sampling"); {shape}'
    return _unknown_field(key, fields, shape)


def _chat_body(obj: dict[str, Any]) -> RequestBody:
    if "prompt" in obj:
        if "messages" in obj:
            raise _Invalid("prompt", 'give either "prompt" or "messages", not both')
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise _Invalid("prompt", f"expected a non-empty string; got {_show(prompt)}")
        body: RequestBody = {"messages": [{"role": "user", "content": prompt}]}
    elif "messages" in obj:
        body = {"messages": _checked_messages(obj["messages"], "messages")}
    else:
        raise _Invalid("messages", 'missing; a prompt line needs "messages" or "prompt"')
    if obj.get("tools") is not None:
        body["tools"] = _checked_tools(obj["tools"], "tools")
    body.update(_line_sampling(obj, SAMPLING_PARAMS))
    return body


def _text(obj: dict[str, Any], job: JobEndpoint) -> str:
    """A plain completions or embeddings line's text: one non-empty string."""
    field = job.text
    assert field is not None
    value = obj[field]
    if job.current.name == COMPLETIONS:
        return _one_prompt(value, field)
    if not isinstance(value, str) or not value:
        raise _Invalid(field, f"expected a non-empty string (one text per line; an OpenAI Batch "
                       f"line's body.input may hold a list); got {_show(value)}")
    return value


def _one_prompt(value: Any, field: str) -> str:
    if isinstance(value, list):
        raise _Invalid(field, "one prompt per line: a list would be several prompts (or token "
                       "ids), each its own request; give each prompt a line of its own")
    if not isinstance(value, str) or not value:
        raise _Invalid(field, f"expected a non-empty string; got {_show(value)}")
    return value


def _line_sampling(obj: dict[str, Any], rules: _Rules) -> RequestBody:
    """A plain line's ``sampling`` object, checked against ``rules``."""
    sampling = obj.get("sampling")
    if sampling is None:
        return {}
    if not isinstance(sampling, dict):
        raise _Invalid("sampling", f"expected an object; got {_show(sampling)}")
    for key in _NOT_SAMPLING:
        if key in sampling:
            raise _Invalid(f"sampling.{key}", "not a sampling parameter")
    return _checked_sampling(sampling, "sampling", rules)


def _openai_body(obj: dict[str, Any], job: JobEndpoint, where: str) -> RequestBody:
    for key in obj:
        if key not in _OPENAI_FIELDS:
            raise _Invalid(key, _unknown_field(
                key, _OPENAI_FIELDS, f"an OpenAI Batch line has {', '.join(_OPENAI_FIELDS)}"))
    for key in _OPENAI_FIELDS:
        if key not in obj:
            raise _Invalid(key, f"missing; an OpenAI Batch line needs {', '.join(_OPENAI_FIELDS)}")
    if obj["method"] != OPENAI_METHOD:
        raise _Invalid("method", f'expected "{OPENAI_METHOD}"; got {_show(obj["method"])}')
    url = obj["url"]
    kind = BY_PATH.get(url) if isinstance(url, str) else None
    if kind is None:
        paths = ", ".join(f'"{path}"' for path in BY_PATH)
        raise _Invalid("url", f"expected one of {paths}; got {_show(url)}")
    job.decide(kind, where)
    if kind != job.current:
        raise _Invalid("url", f"{_show(url)} is another endpoint: this job's endpoint is "
                       f"{job.current.path} (from {job.origin()}); a job makes one kind of "
                       "request, so give these lines a job of their own")
    request = obj["body"]
    if not isinstance(request, dict):
        raise _Invalid("body", f"expected an object; got {_show(request)}")
    if kind.name == COMPLETIONS:
        return _openai_completion(request)
    if kind.name == EMBEDDINGS:
        return _openai_embedding(request)
    if kind.name == CLASSIFY:
        return _openai_classify(request)
    return _openai_chat(request)


def _openai_chat(request: dict[str, Any]) -> RequestBody:
    if "messages" not in request:
        raise _Invalid("body.messages", "missing")
    body: RequestBody = {"messages": _checked_messages(request["messages"], "body.messages")}
    if request.get("tools") is not None:
        body["tools"] = _checked_tools(request["tools"], "body.tools")
    params = {k: v for k, v in request.items() if k not in _NOT_SAMPLING}
    body.update(_checked_sampling(params, "body", SAMPLING_PARAMS))
    return body


def _openai_completion(request: dict[str, Any]) -> RequestBody:
    if "prompt" not in request:
        raise _Invalid("body.prompt", "missing; a /v1/completions body has a prompt string")
    body = cast("RequestBody", {"prompt": _one_prompt(request["prompt"], "body.prompt")})
    params = {k: v for k, v in request.items() if k not in ("prompt", "model", "stream")}
    body.update(_checked_sampling(params, "body", COMPLETION_PARAMS))
    return body


def _pooled_body(request: dict[str, Any], fields: tuple[str, ...], what: str,
                 no_sampling: str) -> dict[str, Any]:
    """The `input` and `user` of the body of a request that generates nothing (`what`: "an
    embeddings", "a classify"), after refusing a field not among `fields` (and model)."""
    for key in request:
        if key != "model" and key not in fields:
            raise _Invalid(f"body.{key}", no_sampling if key in SAMPLING_PARAMS else
                           _unknown_field(key, fields, f"{what} body has "
                                          f"{', '.join(fields)} (and model)"))
    if request.get("input") is None:
        raise _Invalid("body.input", f"missing; {what} body has input: a string or a list "
                       "of strings")
    body: dict[str, Any] = {"input": _embedding_input(request["input"])}
    user = request.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise _Invalid("body.user", f"expected a string; got {_show(user)}")
        body["user"] = user
    return body


def _openai_embedding(request: dict[str, Any]) -> RequestBody:
    body = _pooled_body(request, EMBEDDING_FIELDS, "an embeddings", _NO_SAMPLING)
    dimensions = request.get("dimensions")
    if dimensions is not None:
        if not _is_int(dimensions) or dimensions < 1:
            raise _Invalid("body.dimensions", f"expected an integer >= 1; got {_show(dimensions)}")
        body["dimensions"] = dimensions
    encoding = request.get("encoding_format")
    if encoding is not None:
        if encoding not in ENCODING_FORMATS:
            raise _Invalid("body.encoding_format", f"expected one of "
                           f"{', '.join(ENCODING_FORMATS)}; got {_show(encoding)}")
        body["encoding_format"] = encoding
    return cast("RequestBody", body)


def _openai_classify(request: dict[str, Any]) -> RequestBody:
    body = _pooled_body(request, CLASSIFY_FIELDS, "a classify", _NO_SAMPLING_CLASSIFY)
    activation = request.get("use_activation")
    if activation is not None:
        if not isinstance(activation, bool):
            raise _Invalid("body.use_activation", f"expected true or false; got {_show(activation)}")
        body["use_activation"] = activation
    return cast("RequestBody", body)


def _embedding_input(value: Any) -> str | list[str]:
    if isinstance(value, str) and value:
        return value
    if not isinstance(value, list) or not value:
        raise _Invalid("body.input", "expected a non-empty string or a non-empty list of "
                       f"strings; got {_show(value)}")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise _Invalid("body.input", f"{len(value)} texts; one request holds at most "
                       f"{MAX_EMBEDDING_INPUTS}: split them over several lines")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise _Invalid(f"body.input[{i}]", f"expected a non-empty string; got {_show(item)}")
    return value


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


def _checked_sampling(params: dict[str, Any], field: str, rules: _Rules) -> RequestBody:
    """`params` checked against `rules` (SAMPLING_PARAMS, or COMPLETION_PARAMS: their keys are
    RequestBody's)."""
    checked: dict[str, Any] = {}
    for key, value in params.items():
        rule = rules.get(key)
        if rule is None and key in SAMPLING_PARAMS:
            raise _Invalid(f"{field}.{key}", "a chat parameter; a completions request has none")
        if rule is None:
            raise _Invalid(f"{field}.{key}", _unknown_param(key, rules))
        if value is None:
            continue
        if not rule[0](value):
            raise _Invalid(f"{field}.{key}", f"expected {rule[1]}; got {_show(value)}")
        checked[key] = value
    return cast("RequestBody", checked)


def _close_field(key: str, known: tuple[str, ...]) -> str | None:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return close[0] if close else None


def _unknown_field(key: str, known: tuple[str, ...], shape: str) -> str:
    """`promt` -> "unknown field; did you mean 'prompt'? ...": a typo names its likely field."""
    close = _close_field(key, known)
    return f"unknown field; did you mean {close!r}? {shape}" if close else f"unknown field; {shape}"


def _unknown_param(key: str, rules: _Rules) -> str:
    close = difflib.get_close_matches(key, rules, n=1)
    if close:
        return f"unknown sampling parameter; did you mean {close[0]}?"
    return f"unknown sampling parameter; known: {', '.join(rules)}"


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


_NO_SAMPLING = ("an embeddings request takes no sampling parameters (n, temperature, max_tokens, "
                "...): it gives one vector per text, the same every time")
_NO_SAMPLING_CLASSIFY = ("a classify request takes no sampling parameters (n, temperature, "
                         "max_tokens, ...): it gives one class per text, the same every time")
_TOKENS = f"an integer in [1, {MAX_TOKENS_LIMIT}]"
_PENALTY = "a number in [-2, 2]"
_TOOL_CHOICES = ("auto", "required", "none")
_EFFORTS = ("low", "medium", "high")

# Every key a prompt's "sampling" (or an OpenAI Batch line's "body") may hold, with its check and
# what it expects: the chat-completions fields SGLang 0.5.5 reads for one answer, with the ranges
# of its SamplingParams.verify() and protocol.ChatCompletionRequest. Any other key is a typo or a
# field SGLang would silently ignore, so it is rejected. The worker owns model, stream and the
# request plumbing (rid, lora_path, ...), so those are not here either.
SAMPLING_PARAMS: _Rules = {
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
    # Answers asked of the prompt: each is its own outcome and record (PromptRecord.samples).
    "n": (_int_in(1, MAX_SAMPLES), f"an integer in [1, {MAX_SAMPLES}] (answers per prompt)"),
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


# The keys of SAMPLING_PARAMS a /v1/completions request has not: a chat template's, tools' and
# reasoning's, which need messages. Its `logprobs` is the count of top log-probabilities per
# token (chat's is a switch, with the count in `top_logprobs`).
_CHAT_ONLY = ("max_completion_tokens", "tool_choice", "reasoning_effort", "separate_reasoning",
              "continue_final_message", "chat_template_kwargs", "top_logprobs")
COMPLETION_PARAMS: _Rules = {
    **{key: rule for key, rule in SAMPLING_PARAMS.items() if key not in _CHAT_ONLY},
    "logprobs": (lambda v: _is_int(v) and v >= 0,
                 "an integer >= 0 (top log-probabilities per token)"),
}


def _show(value: Any) -> str:
    """Describe a JSON value in an error: scalars as JSON (cut short), containers by kind."""
    if isinstance(value, dict):
        return "object" if value else "{}"
    if isinstance(value, list):
        return "array" if value else "[]"
    shown = orjson.dumps(value).decode()
    return shown if len(shown) <= 60 else shown[:57] + '..."'
