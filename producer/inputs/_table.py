"""Prompt tables: Parquet files and Arrow IPC streams (a saved Hugging Face dataset's shards),
read one record batch at a time, their columns matched to a prompt line's fields.

A column is read as the field of its name (``id``, ``custom_id``, ``messages``, ``prompt``,
``tools``, ``sampling``, and an OpenAI Batch table's ``method``, ``url``, ``body``), or as the
field ``Columns`` maps it to: ``prompt`` names the prompt's column (read as ``messages`` when it
holds lists, as ``prompt`` when it holds strings), ``id`` the id's. ``custom_id`` is the id in
a table without ``body``. A completions or embeddings job's table has its text column (``text``
for embeddings, ``prompt`` for completions, or the one ``Columns.text`` names) read as the text
field of its plain lines. Any other column is passed over (a dataset keeps its answers and
labels beside its prompts), unless it looks like a mistake a pass-over would hide: a sampling
parameter as a column of its own, or a near-miss of a field's name.

pyarrow is imported only here, and only when a table is read.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.inputs._errors import UnreadableInput
from producer.inputs._line import SAMPLING_PARAMS, TABLE_FIELDS, JobEndpoint

# Rows per record batch read: memory holds one batch's Python values at a time (a few MB of
# ~1 KB prompts), and batches are large enough that pyarrow's per-batch cost is nothing.
BATCH_ROWS = 4096
PARQUET = "parquet"
ARROW = "arrow"


@dataclass(frozen=True)
class Columns:
    """Which columns hold the prompt and the id where they are not named ``prompt``/``messages``
    and ``id``/``custom_id`` (``--prompt-column``, ``--id-column``), and which field or column
    holds the text of a completions or embeddings job's plain lines (``--text-column``; a JSONL
    line's field too)."""

    prompt: str | None = None
    id: str | None = None
    text: str | None = None


@dataclass(frozen=True)
class Plan:
    """How one file's columns are read: ``fields`` maps each read column to its field,
    ``column_of`` each field back to its column where the names differ, ``ignored`` the columns
    passed over."""

    fields: dict[str, str]
    column_of: dict[str, str] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()


def require_pyarrow(name: str) -> None:
    """UnreadableInput unless pyarrow can be imported: said before anything is read."""
    if importlib.util.find_spec("pyarrow") is None:
        raise UnreadableInput(f"{name}: reading Parquet or Arrow needs pyarrow, which is not "
                              "installed: pip install 'fleetgen[parquet]'")


def plan(names: list[str], nested: set[str], columns: Columns, path: str,
         job: JobEndpoint | None = None) -> Plan:
    """Match a file's column ``names`` to fields (``nested``: those holding lists or structs),
    for the lines of ``job`` (its text column, when it is given one that has one)."""
    fields: dict[str, str] = {}
    for given, flag in ((columns.prompt, "--prompt-column"), (columns.id, "--id-column"),
                        (columns.text, "--text-column")):
        if given is not None and given not in names:
            raise UnreadableInput(f"{path}: {flag} {given}: no such column; the columns are "
                                  f"{', '.join(names)}")
    text = job.text if job is not None and job.given is not None else None
    if text is not None and text not in names and "body" not in names:
        assert job is not None
        raise UnreadableInput(f"{path}: no column {text} (this {job.current.name} job's text; "
                              f"--text-column names another); the columns are "
                              f"{', '.join(names)}")
    if text is not None and text in names:
        fields[text] = text
    # A completions or embeddings table's chat columns are passed over, as any column of no
    # field of its lines (a dataset may keep its chat form beside the text).
    known = TABLE_FIELDS if text is None else tuple(
        f for f in TABLE_FIELDS if f not in ("messages", "prompt", "tools"))
    if columns.prompt is not None:
        fields[columns.prompt] = "messages" if columns.prompt in nested else "prompt"
    if columns.id is not None:
        fields[columns.id] = "id"
    id_name = "id" if "body" in names or columns.id is not None else _id_column(names)
    for name in names:
        if name in fields:
            continue
        if name == id_name:
            fields[name] = "id"
        elif name in known and name not in fields.values():
            fields[name] = name
    ignored = tuple(name for name in names if name not in fields)
    for name in ignored:
        problem = _suspect(name)
        if problem:
            raise UnreadableInput(f"{path}: column {name}: {problem}")
    column_of = {f: c for c, f in fields.items() if c != f}
    return Plan(fields, column_of, ignored)


def _id_column(names: list[str]) -> str:
    return "custom_id" if "custom_id" in names and "id" not in names else "id"


def _suspect(name: str) -> str | None:
    """Why passing over column ``name`` would hide a mistake, or None."""
    if name in TABLE_FIELDS:
        return None  # a field the job's lines do not have, passed over on purpose
    if name in SAMPLING_PARAMS:
        return ("a sampling parameter as a column of its own would not be used; put it in a "
                '"sampling" column (a struct, or JSON text)')
    close = difflib.get_close_matches(name, TABLE_FIELDS, n=1, cutoff=0.8)
    if close:
        return (f"did you mean {close[0]!r}? (a column that is no prompt field is passed over; "
                "--prompt-column and --id-column name a prompt or id column of another name)")
    return None


class Table:
    """One Parquet file or Arrow IPC stream, read batch by batch: ``rows()`` yields each row as
    {field: cell} (cells as Python values, column by column)."""

    def __init__(self, path: Path, kind: str, name: str, columns: Columns,
                 job: JobEndpoint | None = None) -> None:
        import pyarrow as pa
        import pyarrow.ipc
        import pyarrow.parquet as pq

        self.name = name
        try:
            if kind == PARQUET:
                self._parquet: Any = pq.ParquetFile(path)
                schema = self._parquet.schema_arrow
                self.rows_total: int | None = self._parquet.metadata.num_rows
            else:
                # Read, not memory-mapped: a mapped file's pages count as this process's
                # memory once touched, so a large shard would look like a leak.
                self._file: Any = pa.OSFile(str(path))
                self._stream: Any = pyarrow.ipc.open_stream(self._file)
                schema = self._stream.schema
                self.rows_total = None
        except (pa.ArrowException, OSError) as exc:
            what = "a Parquet file" if kind == PARQUET else "an Arrow IPC stream"
            raise UnreadableInput(f"{name}: not {what}: {exc}") from None
        self.kind = kind
        self.size = path.stat().st_size
        self._rows_read = 0
        nested = {f.name for f in schema if pa.types.is_nested(f.type)}
        self.plan = plan(list(schema.names), nested, columns, name, job)

    def _parquet_batches(self) -> Iterator[Any]:
        # One reader per row group: a single iter_batches over the whole file keeps what it
        # decoded until it ends, so memory would grow with the file, not with a row group.
        for group in range(self._parquet.num_row_groups):
            yield from self._parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=[group],
                                                  columns=list(self.plan.fields))

    def bytes_read(self) -> int:
        """About how much of the file is read: a Parquet file's share of rows, an Arrow
        stream's position."""
        if self.kind == PARQUET:
            return self.size * self._rows_read // max(1, self.rows_total or 0)
        return int(self._file.tell())

    def close(self) -> None:
        if self.kind == PARQUET:
            self._parquet.close()
        else:
            self._file.close()

    def rows(self) -> Iterator[dict[str, Any]]:
        import pyarrow as pa

        batches = self._parquet_batches() if self.kind == PARQUET else self._stream
        try:
            for batch in batches:
                fields = [self.plan.fields[name] for name in batch.schema.names
                          if name in self.plan.fields]
                cells = [batch.column(name).to_pylist() for name in batch.schema.names
                         if name in self.plan.fields]
                for values in zip(*cells, strict=True):
                    self._rows_read += 1
                    yield dict(zip(fields, values, strict=True))
        except pa.ArrowException as exc:
            raise UnreadableInput(f"{self.name}: {exc}") from None
