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
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from fleetgen.commandline import CommandParser
from fleetgen.ports import HOST, ephemeral_text, in_ephemeral_range
from fleetgen.redact import redact
from fleetgen.settings import SettingsError
from launcher.errors import LauncherError, PortBusyError
from launcher.services._redis import RedisServer
from launcher.services._s3 import S3Ports, S3Server

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
# What a taken port leaves to do besides stopping its holder, as `launcher sim` says it: the
# flag that moves the server, and what its clients then need.
MOVE_HINT = {
    "redis": "pass another --port (its clients then need REDIS_URL=redis://{host}:PORT/0)",
    "s3": "pass another --port, which moves the whole block (its clients then need "
          "AWS_ENDPOINT_URL=http://{host}:PORT)",
}


@dataclass(frozen=True)
class ServiceRun:
    """What `python -m launcher redis|s3` runs: its flags, resolved once (flag > default).

    Not a second settings class: fleetgen's settings are `fleetgen.settings.Settings`, which
    this command must not build (it would wait for the password file this very server
    writes). The S3 server's identity is boto3's own AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY.
    """

    service: str
    port: int
    data_dir: Path
    bucket: str = DEFAULT_BUCKET
    # Loopback unless the fleet's other nodes must reach it (docs/getting-started/several-nodes.md).
    host: str = HOST
    # Empty: the data dir's keys, generated at the first start.
    access_key: str = field(default="", repr=False)
    secret_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.service not in DEFAULTS:
            raise SettingsError(f"unknown service {self.service!r}; expected one of {list(DEFAULTS)}")
        if not 0 < self.port < 65536:
            raise SettingsError(f"--port must be in 1..65535, not {self.port}")
        if not self.bucket:
            raise SettingsError("--bucket must not be empty")
        if bool(self.access_key) != bool(self.secret_key):
            raise SettingsError("set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither "
                                "(then the server's own keys are generated into its data dir)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> ServiceRun:
        port, data_dir = DEFAULTS[args.service]
        return cls(
            service=args.service,
            port=args.port if args.port is not None else port,
            data_dir=Path(args.data_dir if args.data_dir is not None else data_dir),
            bucket=getattr(args, "bucket", None) or DEFAULT_BUCKET,
            host=args.host,
            access_key=environ.get("AWS_ACCESS_KEY_ID") or "",
            secret_key=environ.get("AWS_SECRET_ACCESS_KEY") or "",
        )


# What each service's --port takes: Valkey one port, SeaweedFS a block derived from it.
PORT_HELP = {
    "redis": "listen port on 127.0.0.1, the only port Redis takes (default {port})",
    "s3": "S3 port P on 127.0.0.1; SeaweedFS also takes P+1..P+8 and P+10008 for its inner "
          "parts (default {port}: ports {ports})",
}


def build_parser() -> CommandParser:
    parser = CommandParser(prog="python -m launcher", description=__doc__)
    commands = parser.add_subparsers(dest="service", required=True)
    for service, (port, data_dir) in DEFAULTS.items():
        sub = commands.add_parser(
            service, help=f"run the embedded {service} in the foreground",
            description=f"Run the embedded {service} in the foreground until SIGTERM/SIGINT.",
            epilog=f"example:\n  python -m launcher {service} --port {port + 1000} "
                   f"--data-dir /tmp/{service}")
        sub.add_argument("--port", type=int,
                         help=PORT_HELP[service].format(port=port, ports=S3Ports(port).text()))
        sub.add_argument("--host", default=HOST,
                         help="listen address (another node's workers need this node's address)")
        sub.add_argument("--data-dir", help=f"data and log directory (default {data_dir})")
        if service == "s3":
            sub.add_argument("--bucket", help=f"bucket to create (default {DEFAULT_BUCKET})")
    return parser


def make_server(run: ServiceRun) -> RedisServer | S3Server:
    """The server object for `run` (not started)."""
    if run.service == "redis":
        return RedisServer(data_dir=run.data_dir, port=run.port, host=run.host)
    return S3Server(
        data_dir=run.data_dir, port=run.port, bucket=run.bucket, host=run.host,
        access_key=run.access_key, secret_key=run.secret_key,
    )  # fmt: skip


def serve(server: RedisServer | S3Server, stopping: Callable[[], bool]) -> int:
    """Run `server` until `stopping()` or the server dies; always leave it stopped."""
    ports = server.ports.all() if isinstance(server, S3Server) else [server.port]
    if inside := in_ephemeral_range(ports):
        log.warning("%s: port(s) %s lie in %s", server.name, ", ".join(map(str, inside)),
                    ephemeral_text())
    try:
        server.start()
        taken = server.ports.text() if isinstance(server, S3Server) else str(server.port)
        log.info("%s: serving %s (ports %s) until SIGTERM/SIGINT; credentials in %s",
                 server.name, server.address, taken, server.credentials_file)
        while not stopping():
            if not server.alive():
                log.error("%s: server exited with code %s; its output:\n%s",
                          server.name, server.exit_code, server.log_tail())  # fmt: skip
                return EXIT_SERVER_DIED
            time.sleep(POLL_SECONDS)
        log.info("%s: signal received, stopping", server.name)
        return EXIT_OK
    except PortBusyError as exc:
        log.error("%s: could not start: %s; stop it, or %s", server.name,
                  str(exc).removeprefix(f"{server.name}: "),
                  MOVE_HINT[server.name].format(host=server.host))
        return EXIT_START_FAILED
    except LauncherError as exc:  # a ServiceError
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
        run = ServiceRun.from_args(build_parser().parse_args(argv), os.environ)
    except SettingsError as exc:  # one line naming the flag or variable, never a traceback
        print(f"error: {redact(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # argparse has printed the usage error
        return EXIT_USAGE if exc.code else EXIT_OK
    # The handler only records the signal, taking no lock: one that set a threading.Event
    # would hang this process for good whenever the signal landed while the main thread held
    # that Event's lock (inside Event.wait, between two polls), as a loaded machine makes likely.
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return serve(make_server(run), lambda: bool(received))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
