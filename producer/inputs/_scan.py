"""Scan: one streaming pass over an input's parts, counting lines (rows) and bytes as it goes."""

import bisect
import hashlib
from collections.abc import Callable, Iterator

from producer.inputs._errors import InputError
from producer.inputs._ids import IdIndex
from producer.inputs._line import JobEndpoint, PromptRecord, parse_line, parse_row
from producer.inputs._source import JSONL, InputSource, Part
from producer.inputs._table import Table

_BOM = b"\xef\xbb\xbf"  # some editors start a UTF-8 file with it; orjson refuses it


class Scan:
    """One pass over an input, yielding a PromptRecord or an InputError per non-blank line (per
    row of a table).

    A record's ``line`` counts lines and rows across the whole input, in order (a one-file
    input: its line number); an error names the part and the line or row in it.
    ``progress(bytes_read, lines_read)`` is called every ``every`` lines and once at the end.
    With ``hash_bytes``, ``identity`` is the input's identity once the pass is over. Lines are
    read for the endpoint ``endpoint`` (None: the one the first line names, else chat);
    ``job.current`` is the job's endpoint once the pass is over.
    """

    def __init__(
        self,
        source: InputSource,
        progress: Callable[[int, int], None] | None,
        every: int,
        hash_bytes: bool = False,
        endpoint: str | None = None,
    ):
        self.source = source
        self.job = JobEndpoint(endpoint, source.columns.text)
        self.name = source.name
        self.progress = progress
        self.every = every
        self.identity = ""
        self.ignored: dict[str, None] = {}  # table columns passed over, in order
        self._hash_bytes = hash_bytes
        self._digest = hashlib.sha256()
        self._starts: list[int] = []  # the ordinal before each part's first line, for `place`
        self.lines = self.bytes = self.blank_lines = 0

    def __iter__(self) -> Iterator[PromptRecord | InputError]:
        ids = IdIndex()
        digests = []
        done_bytes = 0
        for part in self.source.parts:
            self._starts.append(self.lines)
            self._digest = hashlib.sha256()
            if part.kind == JSONL:
                yield from self._lines(part, ids)
            else:
                yield from self._rows(part, ids, done_bytes)
            done_bytes += part.size
            self.bytes = done_bytes
            if self._hash_bytes:
                digests.append(self.source.digest(part, self._digest.hexdigest()))
        if self._hash_bytes:
            self.identity = self.source.identity(digests)
        if self.progress is not None:
            self.progress(self.bytes, self.lines)

    def place(self, ordinal: int) -> str:
        """Where record ``ordinal`` is, for a duplicate's error: "line 7", or "row 7 of NAME"
        in an input of several parts."""
        index = bisect.bisect_left(self._starts, ordinal) - 1
        part = self.source.parts[index]
        unit = "line" if part.kind == JSONL else "row"
        where = f"{unit} {ordinal - self._starts[index]}"
        return where if len(self.source.parts) == 1 else f"{where} of {part.name}"

    def _lines(self, part: Part, ids: IdIndex) -> Iterator[PromptRecord | InputError]:
        first = self.lines
        with self.source.lines(part) as lines:
            for raw in lines:
                self._count(raw)
                if self.lines == first + 1 and raw.startswith(_BOM):
                    raw = raw[len(_BOM) :]
                if not raw or raw.isspace():
                    self.blank_lines += 1
                    continue
                record = parse_line(raw, self.lines, ids, part.name, self.place, self.job)
                if isinstance(record, InputError) and first:
                    # An error names the line in its own file.
                    record.line -= first
                yield record

    def _rows(self, part: Part, ids: IdIndex, done_bytes: int) -> Iterator[PromptRecord | InputError]:
        path = self.source.table_path(part)
        if self._hash_bytes and part.obj is None:
            with open(path, "rb") as f:
                self._digest = hashlib.file_digest(f, "sha256")
        table = Table(path, part.kind, part.name, self.source.columns, self.job)
        self.ignored.update(dict.fromkeys(table.plan.ignored))
        first = self.lines
        try:
            for cells in table.rows():
                self.lines += 1
                if self.progress is not None and self.lines % self.every == 0:
                    self.progress(done_bytes + table.bytes_read(), self.lines)
                yield parse_row(cells, self.lines, self.lines - first, ids, part.name,
                                self.place, table.plan.column_of, self.job)
        finally:
            table.close()

    def _count(self, raw: bytes) -> None:
        self.lines += 1
        self.bytes += len(raw)
        if self._hash_bytes:
            self._digest.update(raw)
        if self.progress is not None and self.lines % self.every == 0:
            self.progress(self.bytes, self.lines)
