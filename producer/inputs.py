"""Streaming, validating reader of prompt JSONL files.

Each non-blank line is one prompt in one of three shapes:

    chat:    {"id"?: str|int, "messages": [...], "tools"?: [...], "sampling"?: {...}}
    plain:   {"id"?: str|int, "prompt": "...", "tools"?: [...], "sampling"?: {...}}
    OpenAI:  {"custom_id": str, "method": "POST", "url": "/v1/chat/completions", "body": {...}}

The file is read one line at a time, so memory stays flat whatever its size, apart from 8-byte
digests of the ids seen (``prompt_id.IdIndex``). Ids without an ``id`` are content hashes
(``prompt_id.hash_id``). Other top-level fields are rejected rather than ignored, so a misplaced
``max_tokens`` cannot silently fall back to the job default. A sampling value of null means "not
set" and is dropped, so the job default applies.

    summary = validate_file("prompts.jsonl")    # raises InputErrors naming every bad line
    for record in read_prompts("prompts.jsonl"):
        enqueue(record.id, record.body)
"""

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from producer.prompt_id import IdIndex, hash_id, id_problem

ROLES = ("system", "user", "assistant", "tool", "developer")
OPENAI_METHOD = "POST"
OPENAI_URL = "/v1/chat/completions"
PROGRESS_EVERY = 10_000  # lines: often enough for a progress bar, rare enough to cost nothing
REJECT_RAW_CHARS = 1000
_BOM = b"\xef\xbb\xbf"  # some editors start a UTF-8 file with it; orjson refuses it
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


@dataclass(frozen=True, slots=True)
class FileSummary:
    """What one clean pass over an input file found; ``sha256`` is of the file's bytes."""

    path: str
    lines: int
    prompts: int
    bytes: int
    sha256: str
    blank_lines: int
    rejected: int = 0  # bad lines passed to validate_file's on_error


class InputError(Exception):
    """One bad line. ``str(e)`` is ``FILE:LINE: FIELD: what is wrong``; ``raw`` is the line text."""

    def __init__(self, path: str, line: int, field: str, message: str, raw: str | None = None):
        super().__init__(path, line, field, message, raw)
        self.path = path
        self.line = line
        self.field = field
        self.message = message
        self.raw = raw

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.field}: {self.message}"


class InputErrors(Exception):
    """Several bad lines: ``errors`` holds the first ones kept, ``total`` counts them all."""

    SHOWN = 20

    def __init__(self, errors: list[InputError], total: int | None = None):
        super().__init__(errors, total)
        self.errors = errors
        self.total = len(errors) if total is None else total

    def __str__(self) -> str:
        shown = [str(error) for error in self.errors[: self.SHOWN]]
        if self.total > len(shown):
            shown.append(f"... and {self.total - len(shown)} more")
        return "\n".join(shown)


def read_prompts(
    path: str | Path,
    *,
    skip_invalid: bool = False,
    on_error: Callable[[InputError], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[PromptRecord]:
    """Yield the prompts of a JSONL file in order, one line in memory at a time.

    The first bad line raises InputError, unless ``skip_invalid``: then each bad line (including
    the second occurrence of an id) goes to ``on_error`` and is skipped. ``progress(bytes_read,
    lines_read)`` is called every PROGRESS_EVERY lines and once at the end.
    """
    for result in _Scan(path, progress):
        if isinstance(result, PromptRecord):
            yield result
        elif not skip_invalid:
            raise result
        elif on_error is not None:
            on_error(result)


def validate_file(
    path: str | Path,
    *,
    max_errors: int = 20,
    progress: Callable[[int, int], None] | None = None,
    on_error: Callable[[InputError], None] | None = None,
) -> FileSummary:
    """Check every line of a JSONL file in one streaming pass and summarise it.

    Raises InputErrors holding the first ``max_errors`` bad lines and the count of all of them.
    With ``on_error``, every bad line goes there instead and the summary counts them as
    ``rejected`` (the ``--skip-invalid`` case: one pass, nothing raised).
    """
    if max_errors < 1:
        raise ValueError(f"max_errors must be at least 1, got {max_errors}")
    scan = _Scan(path, progress, hash_bytes=True)
    errors: list[InputError] = []
    total = prompts = 0
    for result in scan:
        if isinstance(result, PromptRecord):
            prompts += 1
            continue
        total += 1
        if on_error is not None:
            on_error(result)
        elif len(errors) < max_errors:
            errors.append(result)
    if errors:
        raise InputErrors(errors, total)
    digest = scan.digest.hexdigest()
    return FileSummary(str(path), scan.lines, prompts, scan.bytes, digest, scan.blank_lines, total)


def write_rejects(path: str | Path, errors: Iterable[InputError]) -> int:
    """Write one reject_line per error to ``path`` (replacing it); return how many were written."""
    count = 0
    with open(path, "wb") as out:
        for error in errors:
            out.write(reject_line(error))
            count += 1
    return count


def reject_line(error: InputError) -> bytes:
    """One rejects-file JSONL line: ``{"line", "field", "error", "raw"}``, raw cut short."""
    raw = None if error.raw is None else error.raw[:REJECT_RAW_CHARS]
    reject = {"line": error.line, "field": error.field, "error": error.message, "raw": raw}
    return orjson.dumps(reject, option=orjson.OPT_APPEND_NEWLINE)


class _Invalid(Exception):
    """A bad line, raised while parsing and turned into an InputError by _Scan."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message)
        self.field = field
        self.message = message


class _Scan:
    """One pass over a file, yielding a PromptRecord or an InputError per non-blank line."""

    def __init__(
        self,
        path: str | Path,
        progress: Callable[[int, int], None] | None,
        hash_bytes: bool = False,
    ):
        self.path = path
        self.progress = progress
        self.digest = hashlib.sha256()
        self._hash_bytes = hash_bytes
        self.lines = self.bytes = self.blank_lines = 0

    def __iter__(self) -> Iterator[PromptRecord | InputError]:
        ids = IdIndex()
        with open(self.path, "rb", buffering=1 << 20) as lines:
            for raw in lines:
                self._count(raw)
                if self.lines == 1 and raw.startswith(_BOM):
                    raw = raw[len(_BOM) :]
                if not raw or raw.isspace():
                    self.blank_lines += 1
                    continue
                try:
                    yield _record(raw, self.lines, ids)
                except _Invalid as bad:
                    text = raw.decode("utf-8", "replace").rstrip("\r\n")
                    yield InputError(str(self.path), self.lines, bad.field, bad.message, text)
        if self.progress is not None:
            self.progress(self.bytes, self.lines)

    def _count(self, raw: bytes) -> None:
        self.lines += 1
        self.bytes += len(raw)
        if self._hash_bytes:
            self.digest.update(raw)
        if self.progress is not None and self.lines % PROGRESS_EVERY == 0:
            self.progress(self.bytes, self.lines)


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
            hint = ' (sampling params go under "sampling")' if key in _SAMPLING_CHECKS else ""
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
