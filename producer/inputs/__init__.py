"""Streaming, validating reader of prompt inputs: JSONL files, Parquet files, saved Hugging
Face datasets, folders of them, and the same in S3 (``open_input``).

Each non-blank line is one prompt in one of three shapes:

    chat:    {"id"?: str|int, "messages": [...], "tools"?: [...], "sampling"?: {...}}
    plain:   {"id"?: str|int, "prompt": "...", "tools"?: [...], "sampling"?: {...}}
    OpenAI:  {"custom_id": str, "method": "POST", "url": "/v1/chat/completions", "body": {...}}

That is a chat job's (the default). A job of another endpoint (fleetgen/endpoints.py, the
``endpoint`` argument, ``enqueue --endpoint``) reads its own plain lines and OpenAI ``url``:

    completions: {"id"?, "prompt": "...", "sampling"?: {...}}    -> body {"prompt": "...", ...}
                 OpenAI url "/v1/completions", body {"prompt": "...", ...}
    embeddings:  {"id"?, "text": "..."}                          -> body {"input": "..."}
                 OpenAI url "/v1/embeddings", body {"input": str | [str, ...], "dimensions"?,
                 "encoding_format"?, "user"?}

(``Columns.text`` names another text field.) Without ``endpoint``, the first line of a shape
decides: an OpenAI line by its ``url``, a plain line for chat; ``FileSummary.endpoint`` says
which, and a line of another ``url`` is a bad line.

The file is read one line at a time, so memory stays flat whatever its size, apart from 8-byte
digests of the ids seen (``IdIndex``). Ids without an ``id`` are content hashes (``hash_id``).
Other top-level fields are rejected rather than ignored, so a misplaced ``max_tokens`` cannot
silently fall back to the job default. A sampling value of null means "not
set" and is dropped, so the job default applies.

    summary = validate_file("prompts.jsonl")    # raises InputErrors naming every bad line
    for record in read_prompts("prompts.jsonl"):
        enqueue(record.id, record.body)

With ``--skip-invalid`` the bad lines go to a Rejects file as they are found, so memory stays
bounded by the longest line however many lines are bad:

    rejects = Rejects()
    summary = validate_file("prompts.jsonl", on_error=rejects)
    rejects.upload(sink, "job/rejects.jsonl")

A table's rows are checked by the same rules, column by column (``_table`` says how columns
map to fields); its errors read ``FILE: row ROW: column COLUMN: what is wrong``. Any input other
than one local JSONL file is opened first, and closed after (it may download S3 objects):

    with open_input("s3://bucket/prompts/", columns=Columns(prompt="question")) as source:
        summary = validate_file(source)

This module is the package's one public face; inside, each private module holds one part whole:
``_line`` one line (its shapes, its id, the checks of its fields), ``_ids`` the id rules, content
hash and index, ``_source`` where an input's parts are and its identity, ``_table`` Parquet and
Arrow files, ``_scan`` the streaming pass, ``_errors`` the error types, ``_rejects`` the rejects
file.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fleetgen.endpoints import CHAT
from producer.inputs._errors import (
    REJECT_RAW_CHARS,
    InputError,
    InputErrors,
    NoPrompts,
    UnreadableInput,
)
from producer.inputs._ids import IdIndex, hash_id
from producer.inputs._line import (
    COMPLETION_PARAMS,
    MAX_EMBEDDING_INPUTS,
    RESERVED_FIELDS,
    SAMPLING_PARAMS,
    TEXT_FIELDS,
    PromptRecord,
)
from producer.inputs._rejects import Rejects, reject_line
from producer.inputs._scan import Scan
from producer.inputs._source import InputSource, local_input, open_input
from producer.inputs._table import BATCH_ROWS, Columns

__all__ = [
    "BATCH_ROWS",
    "COMPLETION_PARAMS",
    "MAX_EMBEDDING_INPUTS",
    "PROGRESS_EVERY",
    "REJECT_RAW_CHARS",
    "RESERVED_FIELDS",
    "SAMPLING_PARAMS",
    "TEXT_FIELDS",
    "Columns",
    "FileSummary",
    "IdIndex",
    "InputError",
    "InputErrors",
    "InputSource",
    "NoPrompts",
    "PromptRecord",
    "Rejects",
    "UnreadableInput",
    "hash_id",
    "local_input",
    "open_input",
    "read_prompts",
    "reject_line",
    "validate_file",
]

# Lines between two progress callbacks: often enough for a progress bar, rare enough to cost
# nothing. Read when a pass starts, so a test may set it smaller here.
PROGRESS_EVERY = 10_000


@dataclass(frozen=True, slots=True)
class FileSummary:
    """What one clean pass over an input found; ``sha256`` is its identity (of a local file: of
    its bytes; InputSource has the rule), ``lines`` its lines or rows, ``bytes`` its size.

    ``path`` is the name the input was read under (validate_file's ``name``, default its path);
    ``ignored_columns`` a table's columns passed over; ``endpoint`` the job's endpoint, given or
    named by the first line (fleetgen/endpoints.py).
    """

    path: str
    lines: int
    prompts: int
    bytes: int
    sha256: str
    blank_lines: int
    rejected: int = 0  # bad lines passed to validate_file's on_error
    answers: int = 0  # answers the prompts ask for: each line's own n, else validate_file's samples
    ignored_columns: tuple[str, ...] = ()
    endpoint: str = CHAT


def read_prompts(
    path: str | Path | InputSource,
    *,
    skip_invalid: bool = False,
    on_error: Callable[[InputError], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    name: str | None = None,
    endpoint: str | None = None,
) -> Iterator[PromptRecord]:
    """Yield the prompts of a JSONL file in order, one line in memory at a time.

    The first bad line raises InputError, unless ``skip_invalid``: then each bad line (including
    the second occurrence of an id) goes to ``on_error`` and is skipped. ``progress(bytes_read,
    lines_read)`` is called every PROGRESS_EVERY lines and once at the end. Errors name the file
    ``name`` (default: its path). Lines are read for ``endpoint`` (None: the one the first line
    names, else chat); pass validate_file's the same, so both passes read the same prompts.
    """
    for result in Scan(_source(path, name), progress, PROGRESS_EVERY, endpoint=endpoint):
        if isinstance(result, PromptRecord):
            yield result
        elif not skip_invalid:
            raise result
        elif on_error is not None:
            on_error(result)


def validate_file(
    path: str | Path | InputSource,
    *,
    max_errors: int = 20,
    progress: Callable[[int, int], None] | None = None,
    on_error: Callable[[InputError], None] | None = None,
    name: str | None = None,
    samples: int = 1,
    endpoint: str | None = None,
) -> FileSummary:
    """Check every line of a JSONL file in one streaming pass and summarise it.

    Raises InputErrors holding the first ``max_errors`` bad lines and the count of all of them.
    With ``on_error``, every bad line goes there instead and the summary counts them as
    ``rejected`` (the ``--skip-invalid`` case: one pass, nothing raised). Errors and the summary
    name the file ``name`` (default: its path). ``samples`` is the answers asked of a prompt
    whose line gives no ``n``; the summary counts ``answers``. Lines are read for ``endpoint``
    (None: the one the first line names, else chat); the summary says which it was.
    """
    if max_errors < 1:
        raise ValueError(f"max_errors must be at least 1, got {max_errors}")
    scan = Scan(_source(path, name), progress, PROGRESS_EVERY, hash_bytes=True,
                endpoint=endpoint)
    errors: list[InputError] = []
    total = prompts = answers = 0
    for result in scan:
        if isinstance(result, PromptRecord):
            prompts += 1
            answers += result.samples or samples
            continue
        total += 1
        if on_error is not None:
            on_error(result)
        elif len(errors) < max_errors:
            errors.append(result)
    if errors:
        raise InputErrors(errors, total)
    return FileSummary(scan.name, scan.lines, prompts, scan.bytes, scan.identity,
                       scan.blank_lines, total, answers, tuple(scan.ignored),
                       scan.job.current.name)


def _source(path: str | Path | InputSource, name: str | None) -> InputSource:
    return path if isinstance(path, InputSource) else local_input(path, name)
