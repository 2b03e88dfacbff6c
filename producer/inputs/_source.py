"""InputSource: where a job's prompts are read from, as a list of parts (files or S3 objects)
read in order, and the identity that tells a changed input from the same one.

    a.jsonl, a.parquet, a.arrow          one local file
    folder/                              its *.jsonl and *.parquet files, in name order
    dataset/                             a Hugging Face dataset saved with save_to_disk: the
                                         Arrow shards its state.json lists (a DatasetDict
                                         folder: the --split named)
    s3://bucket/key.jsonl|.parquet       one object
    s3://bucket/prefix/                  the prefix's objects as a folder's files (or a saved
                                         dataset, by its state.json)

The identity (the manifest's ``input.sha256``) is the sha256 of a local file's bytes when the
input is that one file; otherwise the sha256 of one line per part, ``name<TAB>digest``, in
order: ``name`` relative to the input, ``digest`` the sha256 of a local file's bytes, or an S3
object's ETag, VersionId and size. Every S3 read is pinned to the version the identity names
(open_pinned), so the two passes of one enqueue read the same bytes or the second one stops. An
S3 Parquet or Arrow object is downloaded once, into a temporary folder removed on ``close``:
those formats are read from their end first, which a stream cannot do.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, Self

import orjson

from fleetgen.errors import SinkError
from fleetgen.sink import S3Sink, StoredObject, open_sink
from producer.inputs._errors import UnreadableInput
from producer.inputs._table import ARROW, PARQUET, Columns, require_pyarrow

JSONL = "jsonl"
_SHARD_KINDS = {".jsonl": JSONL, ".parquet": PARQUET}
_HF_STATE = "state.json"
_HF_SPLITS = "dataset_dict.json"
_NO_MAPPING = Columns()


@dataclass(frozen=True)
class Part:
    """One file of an input: what errors call it, its kind (jsonl, parquet, arrow), size, and a
    local path or an S3 object."""

    name: str
    relative: str
    kind: str
    size: int
    path: Path | None = None
    obj: StoredObject | None = None


class InputSource:
    """An input's parts, read in order. Use as a context manager: ``close`` removes what was
    downloaded. ``name`` is what the manifest and a whole-input error call it."""

    def __init__(self, name: str, parts: list[Part], columns: Columns = _NO_MAPPING,
                 s3: S3Sink | None = None) -> None:
        self.name = name
        self.parts = parts
        self.columns = columns
        self.size = sum(p.size for p in parts)
        self._s3 = s3
        self._downloads: dict[str, Path] = {}
        self._folder: Path | None = None
        if any(p.kind != JSONL for p in parts):
            require_pyarrow(name)
        elif columns.prompt is not None or columns.id is not None:
            raise UnreadableInput(f"{name}: --prompt-column and --id-column are for Parquet "
                                  "and saved datasets; a JSONL line names its own fields")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
            self._downloads.clear()

    @property
    def one_local_file(self) -> bool:
        return len(self.parts) == 1 and self.parts[0].path is not None

    @contextmanager
    def lines(self, part: Part) -> Iterator[IO[bytes]]:
        """A JSONL part's bytes as a buffered stream (an S3 object's read as it comes)."""
        if part.path is not None:
            with open(part.path, "rb", buffering=1 << 20) as f:
                yield f
            return
        assert self._s3 is not None and part.obj is not None
        body = self._s3.open_pinned(part.obj)
        try:
            yield body
        finally:
            body.close()

    def table_path(self, part: Part) -> Path:
        """A Parquet or Arrow part as a local file (an S3 object downloaded the first time)."""
        if part.path is not None:
            return part.path
        assert self._s3 is not None and part.obj is not None
        if part.name not in self._downloads:
            if self._folder is None:
                self._folder = Path(tempfile.mkdtemp(prefix="fleetgen-input-"))
            path = self._folder / f"{len(self._downloads):06d}{PurePosixPath(part.name).suffix}"
            with self._s3.open_pinned(part.obj) as body, path.open("wb") as out:
                shutil.copyfileobj(body, out, 1 << 20)
            self._downloads[part.name] = path
        return self._downloads[part.name]

    def digest(self, part: Part, content_sha256: str | None) -> str:
        """A part's line of the identity: its bytes' sha256 (local), or its S3 version."""
        if part.obj is not None:
            return f"etag {part.obj.etag} version {part.obj.version or '-'} size {part.size}"
        assert content_sha256 is not None
        return content_sha256

    def identity(self, digests: list[str]) -> str:
        """The input's identity from each part's ``digest`` (the module docstring)."""
        if self.one_local_file:
            return digests[0]
        lines = "".join(f"{p.relative}\t{d}\n" for p, d in zip(self.parts, digests, strict=True))
        return hashlib.sha256(lines.encode()).hexdigest()


def local_input(path: str | Path, name: str | None = None) -> InputSource:
    """One local JSONL file (what enqueue read before it read anything else)."""
    path = Path(path)
    shown = str(path) if name is None else name
    return InputSource(shown, [Part(shown, path.name, JSONL, path.stat().st_size, path)])


def open_input(spec: str, *, columns: Columns = _NO_MAPPING, split: str | None = None,
               name: str | None = None) -> InputSource:
    """The input ``spec`` names (a file, a folder or an ``s3://`` URI), checked to exist and
    to hold something to read; UnreadableInput saying why not."""
    if spec.startswith("s3://"):
        return _s3_input(spec, columns, split)
    path = Path(spec).expanduser()
    shown = spec if name is None else name
    if path.is_dir():
        return InputSource(shown, _folder_parts(_LocalFolder(path), shown, split), columns)
    if not path.exists():
        raise UnreadableInput(f"{shown}: no such file or folder")
    if split is not None:
        raise UnreadableInput(f"--split {split}: {shown} is one file, not a saved dataset")
    part = Part(shown, path.name, _kind(path.name), path.stat().st_size, path)
    return InputSource(shown, [part], columns)


def _kind(name: str) -> str:
    suffix = PurePosixPath(name).suffix.lower()
    return PARQUET if suffix == ".parquet" else ARROW if suffix == ".arrow" else JSONL


class _LocalFolder:
    def __init__(self, root: Path) -> None:
        self.root = root

    def files(self, sub: str) -> list[Part]:
        folder = self.root / sub
        return [Part(str(p), p.relative_to(self.root).as_posix(), _kind(p.name),
                     p.stat().st_size, p) for p in sorted(folder.iterdir()) if p.is_file()]

    def read(self, part: Part) -> bytes:
        assert part.path is not None
        return part.path.read_bytes()


class _S3Folder:
    def __init__(self, s3: S3Sink, prefix: str) -> None:
        self.s3 = s3
        self.prefix = prefix

    def files(self, sub: str) -> list[Part]:
        start = self.prefix + (f"{sub}/" if sub else "")
        return [Part(f"s3://{self.s3.bucket}/{o.key}", o.key[len(self.prefix):], _kind(o.key),
                     o.size, obj=o) for o in sorted(self.s3.objects(start), key=lambda o: o.key)]

    def read(self, part: Part) -> bytes:
        assert part.obj is not None
        with self.s3.open_pinned(part.obj) as body:
            return body.read()


def _folder_parts(folder: _LocalFolder | _S3Folder, shown: str, split: str | None) -> list[Part]:
    """A folder's parts: a saved dataset's shards (by its state.json), else its input files."""
    files = {p.relative: p for p in folder.files("")}
    if _HF_SPLITS in files:
        splits = _json(folder, files[_HF_SPLITS]).get("splits") or []
        if split is None or split not in splits:
            got = "" if split is None else f"no split {split!r}; "
            raise UnreadableInput(f"{shown}: a saved dataset of several splits; {got}name one "
                                  f"with --split ({', '.join(map(str, splits))})")
        files = {p.relative: p for p in folder.files(split)}
        return _dataset_parts(folder, files, f"{shown.rstrip('/')}/{split}")
    if split is not None:
        raise UnreadableInput(f"--split {split}: {shown} is no saved dataset of several splits "
                              f"(it has no {_HF_SPLITS})")
    if any(PurePosixPath(name).name == _HF_STATE for name in files):
        return _dataset_parts(folder, files, shown)
    parts = [p for p in files.values() if PurePosixPath(p.relative).suffix in _SHARD_KINDS]
    if not parts:
        raise UnreadableInput(f"{shown}: no *.jsonl or *.parquet file in it, and no saved "
                              f"dataset ({_HF_STATE})")
    return parts


def _dataset_parts(folder: _LocalFolder | _S3Folder, files: dict[str, Part],
                   shown: str) -> list[Part]:
    """The Arrow shards a saved dataset's state.json lists, in its order."""
    by_name = {PurePosixPath(rel).name: p for rel, p in files.items()}
    state = by_name.get(_HF_STATE)
    if state is None:
        raise UnreadableInput(f"{shown}: no {_HF_STATE}; not a dataset saved with save_to_disk")
    parts = []
    for entry in _json(folder, state).get("_data_files") or []:
        filename = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(filename, str) or PurePosixPath(filename).name != filename:
            raise UnreadableInput(f"{shown}: {_HF_STATE} lists {filename!r}, not a file name")
        if filename not in by_name:
            raise UnreadableInput(f"{shown}: {_HF_STATE} lists {filename}, which is missing")
        parts.append(by_name[filename])
    if not parts:
        raise UnreadableInput(f"{shown}: {_HF_STATE} lists no data files")
    return parts


def _json(folder: _LocalFolder | _S3Folder, part: Part) -> dict[str, Any]:
    try:
        data = orjson.loads(folder.read(part))
    except orjson.JSONDecodeError as exc:
        raise UnreadableInput(f"{part.name}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UnreadableInput(f"{part.name}: not a JSON object")
    return data


def _s3_input(spec: str, columns: Columns, split: str | None) -> InputSource:
    bucket, _, key = spec[len("s3://"):].partition("/")
    if not bucket:
        raise UnreadableInput(f"{spec}: an S3 input needs a bucket, e.g. s3://bucket/prompts.jsonl")
    sink = open_sink(f"s3://{bucket}")
    if not isinstance(sink, S3Sink):
        raise SinkError(f"{spec}: not an S3 location")
    obj = sink.head(key) if key and not key.endswith("/") else None
    if obj is not None:
        if split is not None:
            raise UnreadableInput(f"--split {split}: {spec} is one object, not a saved dataset")
        name = PurePosixPath(key).name
        return InputSource(spec, [Part(spec, name, _kind(key), obj.size, obj=obj)], columns, sink)
    prefix = key.rstrip("/") + "/" if key else ""
    folder = _S3Folder(sink, prefix)
    if not folder.files(""):
        raise UnreadableInput(f"{spec}: no such object, and no objects under {prefix or 'the bucket'}"
                              f" (at {sink.endpoint()})")
    return InputSource(spec, _folder_parts(folder, spec, split), columns, sink)
