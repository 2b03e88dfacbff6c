"""The rejects file of ``--skip-invalid``: one JSONL line per bad input line, kept out of memory."""

import tempfile
import weakref
from typing import IO

import orjson

from fleetgen.sink import Sink
from producer.inputs._errors import REJECT_RAW_CHARS, InputError, InputErrors


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


def reject_line(error: InputError) -> bytes:
    """One rejects-file JSONL line: ``{"line", "field", "error", "raw"}``, raw cut short; a
    table's row is ``{"file", "row", "field", "error", "raw"}``, raw its cells as JSON."""
    raw = None if error.raw is None else error.raw[:REJECT_RAW_CHARS]
    where: dict[str, object] = ({"line": error.line} if error.unit == "line"
                                else {"file": error.path, error.unit: error.line})
    reject = {**where, "field": error.field, "error": error.message, "raw": raw}
    return orjson.dumps(reject, option=orjson.OPT_APPEND_NEWLINE)
