"""_Scan: one streaming pass over an input file, counting lines and bytes as it goes."""

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

from producer.input_errors import REJECT_RAW_CHARS, InputError
from producer.prompt_id import IdIndex
from producer.prompt_line import PromptRecord, _record
from producer.request_fields import _Invalid

PROGRESS_EVERY = 10_000  # lines: often enough for a progress bar, rare enough to cost nothing
_BOM = b"\xef\xbb\xbf"  # some editors start a UTF-8 file with it; orjson refuses it
# An error keeps REJECT_RAW_CHARS characters of its line; UTF-8 spends at most 4 bytes on one, so
# decoding this many bytes is enough, and a bad line of megabytes is never decoded whole.
_RAW_BYTES = 4 * REJECT_RAW_CHARS


class _Scan:
    """One pass over a file, yielding a PromptRecord or an InputError per non-blank line.

    ``name`` is what errors call the file (default: its path), e.g. ``<stdin>`` for a spooled copy.
    """

    def __init__(
        self,
        path: str | Path,
        progress: Callable[[int, int], None] | None,
        hash_bytes: bool = False,
        name: str | None = None,
    ):
        self.path = path
        self.name = str(path) if name is None else name
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
                    text = raw[:_RAW_BYTES].decode("utf-8", "replace").rstrip("\r\n")
                    yield InputError(self.name, self.lines, bad.field, bad.message, text)
        if self.progress is not None:
            self.progress(self.bytes, self.lines)

    def _count(self, raw: bytes) -> None:
        self.lines += 1
        self.bytes += len(raw)
        if self._hash_bytes:
            self.digest.update(raw)
        if self.progress is not None and self.lines % PROGRESS_EVERY == 0:
            self.progress(self.bytes, self.lines)
