"""The output location: S3 (any endpoint, through boto3) or a local folder.

The sink is the source of truth. A batch is done when its result object exists, and objects
are written once: `put_new` is an atomic create-if-absent (S3 `If-None-Match: *`, or a local
temp file hard-linked into place), so a late duplicate writer is a no-op, never an overwrite.

    sink = open_sink("s3://bucket/runs")     # or "/data/runs", "file:///data/runs"
    sink.put_new("job/results/b000001.jsonl", data)  -> True (written) | False (already there)
    sink.list_keys("job/results/")  -> "job/results/b000001.jsonl", ...

Both sinks list one level, in key order: `list_keys("job/results/")` never shows what lies in
a folder (an S3 prefix) below it, so the two agree, and nothing inside `results/` is read as
the job's batches but its own objects.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar
from urllib.parse import urlparse

from fleetgen import keys
from fleetgen.errors import SinkError
from fleetgen.job import InputLine, read_input_line
from fleetgen.records import OutputRecord, read_record

T = TypeVar("T")


class Sink(Protocol):
    uri: str

    def put_new(self, key: str, data: bytes) -> bool: ...
    def put(self, key: str, data: bytes) -> None: ...
    def put_file(self, key: str, data: IO[bytes]) -> None: ...
    def get(self, key: str) -> bytes | None: ...
    def exists(self, key: str) -> bool: ...
    def list_keys(self, prefix: str) -> Iterator[str]: ...
    def describe(self, key: str) -> str: ...
    def endpoint(self) -> str | None: ...
    def manifests_above(self) -> Iterator[tuple[str, bytes]]: ...


def open_sink(uri: str, *, addressing_style: str = "path") -> Sink:
    """Open `s3://bucket[/prefix]`, `file:///path` or a plain folder path.

    An S3 bucket must exist already: fleetgen never creates one, so a mistyped bucket is an
    error here (before anything is written), not a new bucket some store creates on upload.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise SinkError(f"{uri}: an S3 output needs a bucket, e.g. s3://bucket/runs")
        sink = S3Sink(uri, parsed.netloc, parsed.path.strip("/"), addressing_style)
        sink.require_bucket()
        return sink
    if parsed.scheme in ("", "file"):
        return LocalSink(uri, Path(parsed.path if parsed.scheme else uri))
    raise SinkError(f"{uri}: unsupported output scheme {parsed.scheme!r} (use s3:// or a folder)")


def absolute(uri: str) -> str:
    """The output `uri` as every process must read it back: a folder as its absolute path (a
    relative one would be resolved in each reader's own working folder), `~` expanded;
    `s3://` and `file://` URIs as given."""
    if urlparse(uri).scheme:
        return uri
    return os.path.abspath(os.path.expanduser(uri))


def location(uri: str) -> str:
    """The output `uri` in one spelling, ending in `/`, to tell whether two outputs overlap:
    `s3://bucket/prefix/`, or a folder's absolute path (`~`, `..` and symlinks resolved)."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        prefix = parsed.path.strip("/")
        return f"s3://{parsed.netloc}/{prefix}/" if prefix else f"s3://{parsed.netloc}/"
    if parsed.scheme not in ("", "file"):
        return uri.rstrip("/") + "/"
    return _folder(parsed.path if parsed.scheme else uri).as_posix().rstrip("/") + "/"


def _folder(path: str) -> Path:
    return Path(path).expanduser().resolve()


@dataclass(frozen=True)
class StoredObject:
    """One S3 object as a reader pins it: its key in the bucket, size, ETag, and VersionId where
    the bucket keeps versions (None where it does not, or where a listing did not say)."""

    key: str
    size: int
    etag: str
    version: str | None = None


class LocalSink:
    """A folder. Create-if-absent is `link(2)`, which fails atomically when the name exists."""

    def __init__(self, uri: str, root: Path) -> None:
        self.uri = uri
        self.root = _folder(str(root))

    def _path(self, key: str) -> Path:
        return self.root / key

    def _write_temp(self, path: Path, data: bytes | IO[bytes]) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".part")
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
            else:
                shutil.copyfileobj(data, f)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put_new(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        try:
            tmp = self._write_temp(path, data)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        except OSError as exc:
            raise SinkError(f"{path}: {exc.strerror or exc}") from exc

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            os.replace(self._write_temp(path, data), path)
        except OSError as exc:
            raise SinkError(f"{path}: {exc.strerror or exc}") from exc

    def put_file(self, key: str, data: IO[bytes]) -> None:
        """`put` of a file's contents, streamed (memory does not grow with its size)."""
        path = self._path(key)
        try:
            os.replace(self._write_temp(path, data), path)
        except OSError as exc:
            raise SinkError(f"{path}: {exc.strerror or exc}") from exc

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SinkError(f"{self._path(key)}: {exc.strerror or exc}") from exc

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def list_keys(self, prefix: str) -> Iterator[str]:
        """The files of `prefix`'s folder whose key starts with `prefix` (one level)."""
        base = self._path(prefix)
        folder = base if prefix.endswith("/") or not prefix else base.parent
        if not folder.is_dir():
            return
        for path in sorted(folder.iterdir()):
            key = path.relative_to(self.root).as_posix()
            if key.startswith(prefix) and not path.name.startswith(".tmp-") and path.is_file():
                yield key

    def describe(self, key: str) -> str:
        return str(self._path(key))

    def endpoint(self) -> str | None:
        """None: a folder is reached through no endpoint."""
        return None

    def manifests_above(self) -> Iterator[tuple[str, bytes]]:
        """Each `manifest.json` in this folder and every folder above it, nearest first, as
        (path, bytes); one that cannot be read is passed over. A job's manifest there means this
        output lies inside that job's folder."""
        for folder in (self.root, *self.root.parents):
            path = folder / keys.SINK_MANIFEST
            try:
                data = path.read_bytes()
            except OSError:  # none there, a folder of that name, or not ours to read
                continue
            yield str(path), data


class S3Sink:
    """A bucket and prefix, through boto3 (endpoint and credentials from the AWS environment)."""

    def __init__(self, uri: str, bucket: str, prefix: str, addressing_style: str) -> None:
        import boto3
        from botocore.config import Config

        self.uri = uri
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        # botocore's own retries cover brief blips; a longer outage is the caller's retry loop.
        config = Config(
            s3={"addressing_style": addressing_style},
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=5,
            read_timeout=60,
            max_pool_connections=32,
        )
        self._s3: Any = boto3.client("s3", config=config)

    def _key(self, key: str) -> str:
        return self.prefix + key

    def require_bucket(self) -> None:
        """SinkError unless the bucket exists and these credentials may use it."""
        where = f"s3://{self.bucket} at {self.endpoint()}"
        try:
            self._s3.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            failure = s3_failure(exc, where)
            if failure.status == 404:
                raise SinkError(f"{where}: no such bucket (fleetgen never creates buckets: "
                                "create it, or fix the output's bucket name)") from exc
            if failure.status == 403:
                raise SinkError(f"{where}: access denied (check the credentials and the "
                                "bucket's policy)") from exc
            raise failure.error from exc

    def put_new(self, key: str, data: bytes) -> bool:
        try:
            self._s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
            return True
        except Exception as exc:
            failure = s3_failure(exc, self.describe(key))
            # 412: the object exists; 409: a concurrent conditional write won the race.
            if failure.status in (409, 412):
                return False
            raise failure.error from exc

    def put(self, key: str, data: bytes) -> None:
        try:
            self._s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as exc:
            raise s3_failure(exc, self.describe(key)).error from exc

    def put_file(self, key: str, data: IO[bytes]) -> None:
        """`put` of a file's contents, streamed in parts (boto3's managed upload)."""
        try:
            self._s3.upload_fileobj(data, self.bucket, self._key(key))
        except Exception as exc:
            raise s3_failure(exc, self.describe(key)).error from exc

    def get(self, key: str) -> bytes | None:
        try:
            body: bytes = self._s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
            return body
        except Exception as exc:
            failure = s3_failure(exc, self.describe(key))
            if failure.status == 404:
                return None
            raise failure.error from exc

    def exists(self, key: str) -> bool:
        return self.head(self._key(key)) is not None

    def list_keys(self, prefix: str) -> Iterator[str]:
        """The objects whose key starts with `prefix` and has no `/` after it (one level, as
        a folder lists: what lies below is in CommonPrefixes, not read)."""
        for obj in self.objects(prefix):
            yield obj.key[len(self.prefix) :]

    def objects(self, prefix: str) -> Iterator[StoredObject]:
        """`list_keys` with each object's size and ETag (keys in the bucket, prefix included)."""
        try:
            pages = self._s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix), Delimiter="/"
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    # A console's "folder" marker (`prefix/`) is no object of ours.
                    if not obj["Key"].endswith("/"):
                        yield StoredObject(obj["Key"], int(obj["Size"]), obj["ETag"])
        except Exception as exc:
            raise s3_failure(exc, self.describe(prefix)).error from exc

    def head(self, key: str) -> StoredObject | None:
        """The object at `key` (in the bucket, prefix included) as it is now, or None."""
        try:
            head = self._s3.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            failure = s3_failure(exc, f"s3://{self.bucket}/{key}")
            if failure.status == 404:
                return None
            raise failure.error from exc
        return StoredObject(key, int(head["ContentLength"]), head["ETag"], head.get("VersionId"))

    def open_pinned(self, obj: StoredObject) -> IO[bytes]:
        """A buffered stream of exactly the version `obj` names: by VersionId where it has one,
        else only while the ETag is still `obj.etag` (If-Match, and the answer's ETag checked
        too, for stores that ignore If-Match). SinkError saying it changed otherwise."""
        where = f"s3://{self.bucket}/{obj.key}"
        pin = {"VersionId": obj.version} if obj.version else {"IfMatch": obj.etag}
        changed = SinkError(f"{where}: changed while enqueue was reading it (it was ETag "
                            f"{obj.etag}); run the command again to check the new version")
        try:
            answer = self._s3.get_object(Bucket=self.bucket, Key=obj.key, **pin)
        except Exception as exc:
            failure = s3_failure(exc, where)
            if failure.status in (404, 412):
                raise changed from exc
            raise failure.error from exc
        if answer["ETag"] != obj.etag:
            answer["Body"].close()
            raise changed
        return io.BufferedReader(_Body(answer["Body"], where), 1 << 20)

    def describe(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def endpoint(self) -> str:
        """The S3 endpoint, said to be AWS's own when it is: boto3 goes to AWS unless
        AWS_ENDPOINT_URL (or the AWS config) names another store, which is easy to miss."""
        url: str = self._s3.meta.endpoint_url
        host = urlparse(url).hostname or ""
        if host == "amazonaws.com" or host.endswith(".amazonaws.com"):
            return f"AWS ({url}; AWS_ENDPOINT_URL is not set to another S3 store)"
        return url

    def manifests_above(self) -> Iterator[tuple[str, bytes]]:
        """Each `manifest.json` at this prefix and every prefix above it up to the bucket,
        nearest first, as (s3 URI, bytes); one missing or these credentials may not read is
        passed over."""
        parts = self.prefix.strip("/").split("/") if self.prefix else []
        for depth in range(len(parts), -1, -1):
            key = "/".join([*parts[:depth], keys.SINK_MANIFEST])
            try:
                body: bytes = self._s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            except Exception as exc:
                failure = s3_failure(exc, f"s3://{self.bucket}/{key}")
                if failure.status in (403, 404):
                    continue
                raise failure.error from exc
            yield f"s3://{self.bucket}/{key}", body


class _Body(io.RawIOBase):
    """An S3 answer's body as a raw stream, so io.BufferedReader splits its lines as a file's
    (on newlines only) and a failed read is a SinkError."""

    def __init__(self, body: Any, where: str) -> None:
        self._body = body
        self._where = where

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            data = self._body.read(len(buffer))
        except Exception as exc:
            raise s3_failure(exc, self._where).error from exc
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._body.close()
        super().close()


def stored_inputs(sink: Sink, job: str) -> Iterator[InputLine]:
    """Every line of the job's stored batch inputs, objects in key order."""
    for key in sorted(sink.list_keys(f"{job}/inputs/")):
        if key.endswith(".jsonl"):
            for line in (sink.get(key) or b"").splitlines():
                if line:
                    yield read_input_line(line)


def batch_records(sink: Sink, job: str, batch: str) -> Iterator[OutputRecord]:
    """The records a written batch holds: its error lines, then its result lines."""
    for key in (keys.sink_errors(job, batch), keys.sink_result(job, batch)):
        for line in (sink.get(key) or b"").splitlines():
            if line:
                yield read_record(line)


@dataclass(frozen=True)
class S3Failure:
    """A failed S3 call, as the sink's callers see it: the HTTP status and error code of S3's
    answer (None when no answer came: no credentials, a connection refused), and the SinkError
    it is raised as."""

    status: int | None
    code: str | None
    error: SinkError


def s3_failure(exc: Exception, where: str) -> S3Failure:
    """The one mapping of a boto3/botocore failure at `where` (an s3:// URI) to fleetgen's
    errors: `where: Code: Message` for an S3 answer, `where: text` for anything else; a missing
    credential says where credentials come from."""
    from botocore.exceptions import ClientError, NoCredentialsError

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)) or None
        return S3Failure(status, error.get("Code"), SinkError(
            f"{where}: {error.get('Code', '?')}: {error.get('Message', exc)}"))
    if isinstance(exc, NoCredentialsError):
        return S3Failure(None, None, SinkError(
            f"{where}: no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "AWS_PROFILE)"))
    return S3Failure(None, None, SinkError(f"{where}: {exc}"))
