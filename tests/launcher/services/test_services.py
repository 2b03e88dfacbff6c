"""The embedded Redis and S3: the fixtures work, data survives SIGKILL, the commands stop cleanly.

Tests that kill or restart a server start their own, so the session servers stay untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from botocore.exceptions import ClientError

from fleetgen.poll import wait_until
from fleetgen.ports import free_port
from launcher import services
from launcher.errors import PortBusyError
from launcher.services import (
    BinaryNotFoundError,
    RedisServer,
    S3Ports,
    S3Server,
    ServiceStartError,
    data_dir_holder,
    free_s3_base,
    redis_password,
)

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.e2e  # the embedded servers as processes: started, killed, restarted


def running(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def children(pid: int) -> list[int]:
    """PIDs whose parent is `pid`."""
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat_file.parent.name))
    return found


def listening(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket `pid` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # the fd closed between listing and reading it
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                hex_ip, hex_port = cols[1].split(":")
                ip = ".".join(str(int(hex_ip[i : i + 2], 16)) for i in (6, 4, 2, 0))
                found.add((ip if table == "tcp" else f"v6:{hex_ip}", int(hex_port, 16)))
    return found


def grpc_sockets_in_tmp(ports: S3Ports) -> list[Path]:
    return [path for path in ports.grpc_sockets() if path.exists()]


def redis_answers(client: Any) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture
def launcher_log(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "launcher.log"
    yield path
    if path.exists():
        print(path.read_text())  # shown by pytest when the test failed


def launch(
    log_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "launcher", *args], cwd=ROOT, env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def only_child(proc: subprocess.Popen[bytes]) -> int:
    kids = children(proc.pid)
    assert len(kids) == 1, f"expected one server process under the launcher, found {kids}"
    return kids[0]


def test_redis_client_answers_ping_and_stores_a_value(redis_client: Any) -> None:
    assert redis_client.ping()
    redis_client.set("greeting", "hello")
    assert redis_client.get("greeting") == b"hello"


def test_redis_listens_on_loopback_only_with_aof_and_no_eviction(
    redis_server: RedisServer, redis_client: Any
) -> None:
    assert redis_server.pid is not None
    assert listening(redis_server.pid) == {("127.0.0.1", redis_server.port)}
    config = redis_client.config_get("*")
    wanted = {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}
    assert {name: config[name] for name in wanted} == wanted
    assert config["save"] == "", "no RDB snapshots: the AOF is the only persistence"


def test_redis_keeps_acknowledged_writes_across_sigkill_and_restart(
    tmp_path: Path, valkey_bin: Path
) -> None:
    with RedisServer(data_dir=tmp_path / "redis") as server:
        client = server.client()
        client.rpush("queue", *range(100))
        client.close()
        crashed, port = server.pid, server.port
        assert crashed is not None
        server.kill()
        assert not running(crashed)
        began = time.monotonic()
        server.restart()
        print(f"redis restart after SIGKILL: {time.monotonic() - began:.3f}s")
        assert (server.port, server.pid != crashed) == (port, True)
        client = server.client()
        assert client.lrange("queue", 0, -1) == [str(i).encode() for i in range(100)]
        client.close()


def test_redis_start_fails_on_the_servers_exit_not_its_deadline_with_the_log_tail(
    tmp_path: Path, valkey_bin: Path
) -> None:
    manifest = tmp_path / "appendonlydir" / "appendonly.aof.manifest"
    manifest.parent.mkdir()
    manifest.write_text("this is not a manifest\n")
    server = RedisServer(data_dir=tmp_path, startup_timeout=300)
    exited = "(?s)exited with code 1.*Invalid AOF manifest"
    with pytest.raises(ServiceStartError, match=exited) as failed:
        server.start()
    # Seen by the exit check, not by the startup deadline running out.
    assert isinstance(failed.value.__cause__, ServiceStartError), failed.value
    assert "timed out" not in str(failed.value)
    assert not server.alive()


def test_redis_start_reports_a_missing_binary(tmp_path: Path) -> None:
    with pytest.raises(BinaryNotFoundError, match="no-such-valkey"):
        RedisServer(data_dir=tmp_path, binary=tmp_path / "no-such-valkey").start()


def test_redis_start_refuses_a_port_already_in_use(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    with pytest.raises(PortBusyError, match=str(redis_server.port)):
        RedisServer(data_dir=tmp_path, port=redis_server.port).start()


def test_s3_conditional_put_rejects_a_second_put_with_412(
    s3_server: S3Server, s3_client: Any
) -> None:
    bucket, key = s3_server.bucket, "runs/r1/done/p0001"
    s3_client.put_object(Bucket=bucket, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as rejected:
        s3_client.put_object(Bucket=bucket, Key=key, Body=b"second", IfNoneMatch="*")
    assert rejected.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert s3_client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"first"


def test_s3_rejects_an_unknown_access_key(s3_server: S3Server) -> None:
    client = dataclasses.replace(s3_server, access_key="stranger").client()
    with pytest.raises(ClientError) as rejected:
        client.list_objects_v2(Bucket=s3_server.bucket)
    client.close()
    assert rejected.value.response["Error"]["Code"] == "InvalidAccessKeyId"


def test_s3_env_alone_points_boto3_at_the_embedded_server(
    s3_server: S3Server, s3_env: dict[str, str], s3_client: Any
) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client("s3", config=Config(s3={"addressing_style": "path"}))
    client.put_object(Bucket=s3_server.bucket, Key="from-env", Body=b"ok")
    client.close()
    assert s3_client.get_object(Bucket=s3_server.bucket, Key="from-env")["Body"].read() == b"ok"
    assert s3_env["AWS_DEFAULT_REGION"] == "us-east-1"


def test_s3_listens_on_loopback_only_on_its_documented_ports(s3_server: S3Server) -> None:
    assert s3_server.pid is not None
    assert listening(s3_server.pid) == {("127.0.0.1", port) for port in s3_server.ports.all()}


def test_s3_ports_are_all_derived_from_the_s3_port() -> None:
    ports = S3Ports(8333)
    assert ports.all() == [*range(8333, 8342), 18341]
    assert "-s3.port=8333" in ports.flags()
    assert "-admin.port.grpc=18341" in ports.flags()


def test_s3_keeps_objects_across_sigkill_and_restart(tmp_path: Path, weed_bin: Path) -> None:
    with S3Server(data_dir=tmp_path / "s3", bucket="chaos") as server:
        client = server.client()
        for i in range(3):
            client.put_object(Bucket="chaos", Key=f"obj{i}", Body=f"body{i}".encode())
        crashed = server.pid
        assert crashed is not None
        server.kill()
        assert not running(crashed)
        assert not grpc_sockets_in_tmp(server.ports), "a killed weed's /tmp sockets are removed"
        began = time.monotonic()
        server.restart()
        print(f"s3 restart after SIGKILL: {time.monotonic() - began:.3f}s")
        bodies = [client.get_object(Bucket="chaos", Key=f"obj{i}")["Body"].read() for i in range(3)]
        client.close()
    assert bodies == [b"body0", b"body1", b"body2"]
    assert not grpc_sockets_in_tmp(server.ports)


def test_launcher_redis_serves_until_sigterm_and_leaves_no_process(
    tmp_path: Path, launcher_log: Path, valkey_bin: Path
) -> None:
    port, data_dir = free_port(), tmp_path / "redis"
    proc = launch(launcher_log, "redis", "--port", str(port), "--data-dir", str(data_dir))
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1,
                         password=redis_password(data_dir))
    try:
        wait_until(lambda: redis_answers(client), timeout=15, what="`launcher redis` to answer")
        client.set("kept", "yes")
        server_pid = only_child(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        client.close()
        proc.kill()
        proc.wait()
    assert not running(server_pid)
    assert "ready to exit" in (data_dir / "valkey.log").read_text(), "valkey shut down cleanly"
    with RedisServer(data_dir=data_dir, port=port) as again:
        client = again.client()
        assert client.get("kept") == b"yes"
        client.close()


def test_launcher_redis_server_dies_with_a_sigkilled_launcher(
    tmp_path: Path, launcher_log: Path, valkey_bin: Path
) -> None:
    port = free_port()
    proc = launch(launcher_log, "redis", "--port", str(port), "--data-dir", str(tmp_path))
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1,
                         password=redis_password(tmp_path))
    try:
        wait_until(lambda: redis_answers(client), timeout=15, what="`launcher redis` to answer")
        server_pid = only_child(proc)
    finally:
        client.close()
        proc.kill()  # as honcho does after its grace period
        proc.wait()
    try:
        wait_until(lambda: not running(server_pid), timeout=10, what="the orphaned valkey to exit")
    finally:
        if running(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_launcher_s3_serves_until_sigterm_and_leaves_no_process(
    tmp_path: Path, launcher_log: Path, weed_bin: Path
) -> None:
    base = free_s3_base()
    keys = {"AWS_ACCESS_KEY_ID": "cli-key", "AWS_SECRET_ACCESS_KEY": "cli-secret"}
    args = ["s3", "--port", str(base), "--data-dir", str(tmp_path / "s3"), "--bucket", "cli"]
    proc = launch(launcher_log, *args, env=keys)
    view = S3Server(data_dir=tmp_path, port=base, bucket="cli", access_key="cli-key",
                    secret_key="cli-secret")  # fmt: skip
    client = view.client(retries={"total_max_attempts": 1}, connect_timeout=1)

    def answers() -> bool:
        assert proc.poll() is None, f"launcher exited with {proc.returncode}"
        try:
            client.put_object(Bucket="cli", Key="k", Body=b"v")
        except Exception:  # noqa: BLE001 - any failure here means "not up yet"
            return False
        return bool(client.get_object(Bucket="cli", Key="k")["Body"].read() == b"v")

    try:
        wait_until(answers, timeout=30, interval=0.1, what="`launcher s3` to answer")
        server_pid = only_child(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        client.close()
        proc.kill()
        proc.wait()
    assert not running(server_pid)
    assert not grpc_sockets_in_tmp(S3Ports(base))


@contextlib.contextmanager
def held_port(below: int) -> Iterator[int]:
    """A port under `below` (out of the ephemeral range) that a socket of this process listens
    on while the block runs."""
    for port in random.sample(range(12000, below), 200):
        try:
            held = socket.create_server(("127.0.0.1", port))
        except OSError:
            continue
        with held:
            yield port
        return
    pytest.skip("no free port to hold")


@pytest.mark.parametrize(("service", "remedy"), [
    ("redis", "pass another --port (its clients then need REDIS_URL=redis://127.0.0.1:PORT/0)"),
    ("s3", "pass another --port, which moves the whole block (its clients then need "
           "AWS_ENDPOINT_URL=http://127.0.0.1:PORT)"),
])
def test_a_service_on_a_taken_port_names_its_holder_and_the_flag_that_moves_it(
        service: str, remedy: str, tmp_path: Path) -> None:
    with held_port(22000) as port:  # S3 takes P..P+8 and P+10008: all below the ephemeral range
        done = subprocess.run([sys.executable, "-m", "launcher", service, "--port", str(port),
                               "--data-dir", str(tmp_path / service)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == services.EXIT_START_FAILED
    assert done.stderr.count("\n") == 1, done.stderr  # one line, no traceback
    assert (f" {service}: could not start: port {port} on 127.0.0.1 is in use by pid "
            f"{os.getpid()} (") in done.stderr
    assert done.stderr.endswith(f"; stop it, or {remedy}\n")


@pytest.mark.parametrize(("argv", "env", "said"), [
    (["s3", "--port", "0"], {}, "error: --port must be in 1..65535, not 0"),
    (["s3"], {"AWS_ACCESS_KEY_ID": "only-the-id"},
     "error: set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither"),
])
def test_a_bad_service_flag_or_variable_is_one_error_line_and_exit_2(
        argv: list[str], env: dict[str, str], said: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert services.main(argv) == services.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1


class ArmedOnServing(logging.Handler):
    """Set once `launcher redis|s3` logs that it serves: its foreground loop runs from then."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def emit(self, record: logging.LogRecord) -> None:
        self.armed = self.armed or "serving" in record.getMessage()


# Not the loop's own code: the logging of its "serving" line, pytest's capture of it.
OTHERS = ("logging", "_pytest")


@pytest.mark.timeout(60)  # a run the signal hangs ends here, its stack naming where
def test_launcher_redis_stops_on_a_sigterm_landing_at_any_point_of_its_foreground_loop(
    tmp_path: Path, valkey_bin: Path,
) -> None:
    # The signal is raised at the n-th Python call or return of the loop, so that over the runs
    # it lands at every point of an iteration, also where the loop holds a lock; a handler that
    # took that same lock would wait on itself for good.
    armed = ArmedOnServing()
    logging.getLogger("launcher").addHandler(armed)
    logging.getLogger("launcher").setLevel(logging.INFO)
    try:
        for n in range(1, 31):
            armed.armed, events = False, 0

            def raise_at_nth_event(frame: Any, event: str, arg: Any, n: int = n) -> None:
                nonlocal events
                if armed.armed and not frame.f_globals["__name__"].startswith(OTHERS):
                    events += 1
                    if events == n:
                        signal.raise_signal(signal.SIGTERM)

            sys.setprofile(raise_at_nth_event)
            try:
                code = services.main(["redis", "--port", str(free_port()),
                                      "--data-dir", str(tmp_path / f"redis{n}")])
            finally:
                sys.setprofile(None)
            assert armed.armed and events >= n, f"run {n}: the signal was never raised"
            assert code == services.EXIT_OK, f"SIGTERM at event {n} of the loop: exit {code}"
            assert data_dir_holder(tmp_path / f"redis{n}") is None, "its valkey still runs"
    finally:
        logging.getLogger("launcher").removeHandler(armed)
        logging.getLogger("launcher").setLevel(logging.NOTSET)
