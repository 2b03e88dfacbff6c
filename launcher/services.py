"""The embedded Redis (Valkey) and S3 (SeaweedFS `weed mini`), and `python -m launcher redis|s3`.

The API, for tests, the demo and benchmarks:

    with RedisServer(data_dir=tmp / "redis") as redis_server, S3Server(data_dir=tmp / "s3") as s3:
        broker_url, aws_env = redis_server.url, s3.env()

The commands run one server in the foreground until SIGTERM/SIGINT, for a Procfile under honcho
(the server's own output goes to a log file in its data dir; this process logs lifecycle lines):

    redis: python -m launcher redis --port 6389 --data-dir .fleetgen/redis
    s3:    python -m launcher s3 --port 8333 --data-dir .fleetgen/s3 --bucket fleetgen

Both are locked by default (docs/security.md). Redis generates a password into
DATA/password at its first start (clients: FLEETGEN_REDIS_PASSWORD_FILE); S3 takes its keys
from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, else generates them into DATA/credentials
(clients: AWS_SHARED_CREDENTIALS_FILE). On SIGTERM or SIGINT the server is stopped (SIGTERM,
then SIGKILL after a deadline shorter than honcho's 5 s grace) and nothing is left running.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from launcher.embedded import (
    BinaryNotFoundError,
    PortUnavailableError,
    ServiceError,
    ServiceStartError,
    free_port,
    wait_until,
)

# The servers live in their own modules; they are re-exported here because tests, the demo and
# benchmarks import them from launcher.services.
from launcher.redis_server import RedisServer, redis_password, valkey_binary
from launcher.s3_server import S3Ports, S3Server, free_s3_base, s3_credentials, weed_binary

__all__ = [
    "BinaryNotFoundError", "PortUnavailableError", "RedisServer", "S3Ports", "S3Server",
    "ServiceError", "ServiceStartError", "free_port", "free_s3_base", "main", "redis_password",
    "s3_credentials", "valkey_binary", "wait_until", "weed_binary",
]  # fmt: skip

log = logging.getLogger(__name__)

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
# How often the foreground loop checks that the server is still alive.
POLL_SECONDS = 0.2


@dataclass(frozen=True)
class Settings:
    """What to run, resolved once: flag > environment > default."""

    service: str
    port: int
    data_dir: Path
    bucket: str = DEFAULT_BUCKET
    # Empty: the data dir's keys, generated at the first start.
    access_key: str = field(default="", repr=False)
    secret_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.service not in DEFAULTS:
            raise ValueError(f"unknown service {self.service!r}; expected one of {list(DEFAULTS)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, not {self.port}")
        if not self.bucket:
            raise ValueError("the bucket name must not be empty")
        if bool(self.access_key) != bool(self.secret_key):
            raise ValueError("set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither "
                             "(then the server's own keys are generated into its data dir)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
        port, data_dir = DEFAULTS[args.service]
        return cls(
            service=args.service,
            port=args.port if args.port is not None else port,
            data_dir=Path(args.data_dir if args.data_dir is not None else data_dir),
            bucket=getattr(args, "bucket", None) or DEFAULT_BUCKET,
            access_key=environ.get("AWS_ACCESS_KEY_ID") or "",
            secret_key=environ.get("AWS_SECRET_ACCESS_KEY") or "",
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
        log.info("%s: serving %s until SIGTERM/SIGINT; credentials in %s", server.name,
                 server.address, server.credentials_file)
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
