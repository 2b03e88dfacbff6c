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

With ``--skip-invalid`` the bad lines go to a Rejects file as they are found, so memory stays
bounded by the longest line however many lines are bad:

    rejects = Rejects()
    summary = validate_file("prompts.jsonl", on_error=rejects)
    rejects.upload(sink, "job/rejects.jsonl")
"""

import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import orjson

from producer.input_errors import REJECT_RAW_CHARS, InputError, InputErrors, NoPrompts
from producer.prompt_line import OPENAI_METHOD, OPENAI_URL, PromptRecord
from producer.request_fields import ROLES
from producer.scan import PROGRESS_EVERY, _Scan
from workers.sink import Sink

__all__ = [
    "OPENAI_METHOD",
    "OPENAI_URL",
    "PROGRESS_EVERY",
    "REJECT_RAW_CHARS",
    "ROLES",
    "FileSummary",
    "InputError",
    "InputErrors",
    "NoPrompts",
    "PromptRecord",
    "Rejects",
    "read_prompts",
    "reject_line",
    "validate_file",
    "write_rejects",
]


@dataclass(frozen=True, slots=True)
class FileSummary:
    """What one clean pass over an input file found; ``sha256`` is of the file's bytes.

    ``path`` is the name the file was read under (validate_file's ``name``, default its path).
    """

    path: str
    lines: int
    prompts: int
    bytes: int
    sha256: str
    blank_lines: int
    rejected: int = 0  # bad lines passed to validate_file's on_error


def read_prompts(
    path: str | Path,
    *,
    skip_invalid: bool = False,
    on_error: Callable[[InputError], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    name: str | None = None,
) -> Iterator[PromptRecord]:
    """Yield the prompts of a JSONL file in order, one line in memory at a time.

    The first bad line raises InputError, unless ``skip_invalid``: then each bad line (including
    the second occurrence of an id) goes to ``on_error`` and is skipped. ``progress(bytes_read,
    lines_read)`` is called every PROGRESS_EVERY lines and once at the end. Errors name the file
    ``name`` (default: its path).
    """
    for result in _Scan(path, progress, name=name):
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
    name: str | None = None,
) -> FileSummary:
    """Check every line of a JSONL file in one streaming pass and summarise it.

    Raises InputErrors holding the first ``max_errors`` bad lines and the count of all of them.
    With ``on_error``, every bad line goes there instead and the summary counts them as
    ``rejected`` (the ``--skip-invalid`` case: one pass, nothing raised). Errors and the summary
    name the file ``name`` (default: its path).
    """
    if max_errors < 1:
        raise ValueError(f"max_errors must be at least 1, got {max_errors}")
    scan = _Scan(path, progress, hash_bytes=True, name=name)
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
    return FileSummary(scan.name, scan.lines, prompts, scan.bytes, digest, scan.blank_lines, total)


class Rejects:
    """The rejected lines of one pass, written to an unnamed temporary file as they are found.

    Call it with each InputError (it is validate_file's ``on_error``). It keeps in memory only
    ``count`` and the first ``keep`` errors (``first``, to show on screen), never the rejects
    themselves. The file has no name: it vanishes when closed, when the Rejects is dropped, or
    with the process.
    """

    def __init__(self, keep: int = InputErrors.SHOWN) -> None:
        self.count = 0
        self.first: list[InputError] = []
        self._keep = keep
        self._file: IO[bytes] | None = None  # created by the first reject: most runs have none

    def __call__(self, error: InputError) -> None:
        if self._file is None:
            # It outlives this call: upload() or close() closes it, or the finalizer below, with
            # the Rejects, so a run that fails before upload() leaks nothing.
            self._file = tempfile.TemporaryFile(prefix="fleetgen-rejects-")  # noqa: SIM115
            self._closer = weakref.finalize(self, self._file.close)
        self._file.write(reject_line(error))
        self.count += 1
        if len(self.first) < self._keep:
            self.first.append(error)

    def upload(self, sink: Sink, key: str) -> None:
        """Store every reject line, in order, at ``key`` in ``sink`` (streamed from the file),
        then close the file."""
        if self._file is None:
            sink.put(key, b"")
        else:
            self._file.seek(0)
            sink.put_file(key, self._file)
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._closer()
            self._file = None


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
