"""Scan: one streaming pass over an input file, counting lines and bytes as it goes."""

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

from producer.inputs._errors import InputError
from producer.inputs._ids import IdIndex
from producer.inputs._line import PromptRecord, parse_line

_BOM = b"\xef\xbb\xbf"  # some editors start a UTF-8 file with it; orjson refuses it


class Scan:
    """One pass over a file, yielding a PromptRecord or an InputError per non-blank line.

    ``progress(bytes_read, lines_read)`` is called every ``every`` lines and once at the end.
    ``name`` is what errors call the file (default: its path), e.g. ``<stdin>`` for a spooled copy.
    """

    def __init__(
        self,
        path: str | Path,
        progress: Callable[[int, int], None] | None,
        every: int,
        hash_bytes: bool = False,
        name: str | None = None,
    ):
        self.path = path
        self.name = str(path) if name is None else name
        self.progress = progress
        self.every = every
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
                yield parse_line(raw, self.lines, ids, self.name)
        if self.progress is not None:
            self.progress(self.bytes, self.lines)

    def _count(self, raw: bytes) -> None:
        self.lines += 1
        self.bytes += len(raw)
        if self._hash_bytes:
            self.digest.update(raw)
        if self.progress is not None and self.lines % self.every == 0:
            self.progress(self.bytes, self.lines)
