"""`python -m producer upload`: put local files into S3, where `enqueue s3://...` reads them.

It writes through the sink's S3 client (fleetgen/sink.py), so it reaches the store `enqueue`,
`export` and the workers reach: the same endpoint (`AWS_ENDPOINT_URL`), credentials and
region. No other S3 tool is needed, e.g. for the embedded S3 of `python -m launcher s3`:

    upload(["prompts.jsonl"], "s3://fleetgen/prompts/")  # -> s3://fleetgen/prompts/prompts.jsonl
    upload(["prompts.jsonl"], "s3://fleetgen/in/p.jsonl")  # -> that key

Every file and target is checked before anything is written: a missing file, a URL that is not
`s3://bucket/...`, a missing bucket or an object already there (unless `force`) writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from fleetgen.errors import FleetgenError, SinkError
from fleetgen.sink import Sink, open_sink, s3_failure

# The embedded S3 creates the one bucket it is told to when it starts (launcher/services/_s3.py).
EMBEDDED_BUCKET_HINT = ("the embedded S3 creates its bucket when it starts: "
                        "`python -m launcher s3 --bucket {bucket}`")


class UploadError(FleetgenError):
    """The upload cannot be done as asked: no such file, a target that is not S3, no such
    bucket, an object already there. Nothing was written."""


@dataclass(frozen=True)
class Uploaded:
    """A file written to S3: where from, where to (`s3://bucket/key`), its size in bytes, and
    the S3 endpoint that stored it."""

    path: Path
    uri: str
    size: int
    endpoint: str | None


def targets(files: Sequence[Path], to: str) -> tuple[str, list[tuple[Path, str]]]:
    """The bucket `to` names and each file's key in it. `to` ending in `/`, or naming a bucket
    alone, is a prefix: each file keeps its name under it. Otherwise it is the one file's key."""
    parsed = urlparse(to)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise UploadError(f"{to}: upload writes to S3: give s3://bucket/prefix/ (each file keeps "
                          "its name) or s3://bucket/key")
    key = parsed.path.lstrip("/")
    if key and not key.endswith("/"):
        if len(files) > 1:
            raise UploadError(f"{to} is one object's key, for one file: end it with / to put "
                              f"the {len(files)} files under it")
        return parsed.netloc, [(files[0], key)]
    pairs = [(path, key + path.name) for path in files]
    names = [name for _, name in pairs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UploadError(f"several files would be written to {to}{twice[0].removeprefix(key)}: "
                          "upload them to different prefixes")
    return parsed.netloc, pairs


def upload(files: Sequence[Path], to: str, *, force: bool = False) -> Iterator[Uploaded]:
    """Write each file to its key under `to` (see `targets`), one after the other, yielding each
    once it is stored; an object already there is replaced only with `force`."""
    bucket, pairs = targets(files, to)
    sizes = [_size(path) for path, _ in pairs]
    sink = _bucket(bucket)
    if not force:
        there = [sink.describe(key) for _, key in pairs if sink.exists(key)]
        if there:
            raise UploadError(f"{there[0]} exists"
                              + (f" (and {len(there) - 1} more)" if len(there) > 1 else "")
                              + ": pass --force to replace it, or upload to another key")
    for (path, key), size in zip(pairs, sizes, strict=True):
        try:
            with path.open("rb") as data:
                sink.put_file(key, data)
        except OSError as exc:
            raise UploadError(f"{path}: {exc.strerror or exc}") from exc
        yield Uploaded(path, sink.describe(key), size, sink.endpoint())


def _size(path: Path) -> int:
    """The file's size; UploadError unless it is a regular file this process may read."""
    if path.is_dir():
        raise UploadError(f"{path}: a folder; upload its files to a prefix, e.g. `python -m "
                          f"producer upload {path}/* s3://bucket/prefix/`")
    if not path.exists():
        raise UploadError(f"{path}: no such file")
    if not path.is_file():
        raise UploadError(f"{path}: not a regular file")
    try:
        with path.open("rb"):
            return path.stat().st_size
    except OSError as exc:
        raise UploadError(f"{path}: {exc.strerror or exc}") from exc


def _bucket(bucket: str) -> Sink:
    """The bucket opened as a sink; a missing one is an UploadError saying how to make it."""
    try:
        return open_sink(f"s3://{bucket}")
    except SinkError as exc:
        cause = exc.__cause__
        if isinstance(cause, Exception) and s3_failure(cause, f"s3://{bucket}").status == 404:
            raise UploadError(f"{exc}; {EMBEDDED_BUCKET_HINT.format(bucket=bucket)}") from exc
        raise


__all__ = ["UploadError", "Uploaded", "targets", "upload"]
