"""One machine, several stacks: an embedded Redis moved to another port is reached with only
REDIS_URL, two servers never share a data dir (nor two demos a state folder), a dying stack
names the process that died, and a port held by a connection says so."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import fleetgen.settings
from fleetgen.poll import wait_until
from fleetgen.ports import busy_reason, ephemeral_range, free_port, port_is_free
from fleetgen.settings import Settings
from launcher.demo import DemoPorts, stack_failure
from launcher.errors import PortBusyError
from launcher.services import (
    DataDirBusyError,
    RedisServer,
    S3Server,
    data_dir_holder,
    redis_password,
)

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.e2e  # real `launcher redis` and `launcher demo` processes


def answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory of the user's, outside any clone."""
    monkeypatch.setattr(fleetgen.settings, "PROJECT_DIR", tmp_path / "no-clone")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def moved_redis(here: Path, valkey_bin: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`python -m launcher redis --port P` run in `here`, P not the default, as the README says
    when 6389 is taken."""
    port = free_port()
    log = (here / "launcher.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "redis", "--port", str(port)],
                            cwd=here, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    client = redis.Redis(port=port, password=redis_password(here / ".fleetgen" / "redis"),
                         socket_timeout=1)
    try:
        wait_until(lambda: answers(client), 20, what="`launcher redis --port` to answer")
        yield proc, port
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


# --- an embedded Redis on another port ----------------------------------------------------------


def test_a_loopback_redis_url_without_a_password_reaches_the_embedded_redis_on_its_port(
    moved_redis: tuple[subprocess.Popen[bytes], int],
) -> None:
    _, port = moved_redis
    for host in ("127.0.0.1", "localhost"):
        settings = Settings.from_env({"REDIS_URL": f"redis://{host}:{port}/0"})
        client = redis.Redis.from_url(settings.redis_url)
        try:
            assert client.ping()
        finally:
            client.close()
    # With no REDIS_URL at all, a bare command next to it finds it on its port too.
    assert Settings.from_env({}).redis_url.endswith(f"@127.0.0.1:{port}/0")


def test_the_producer_next_to_a_moved_embedded_redis_needs_only_its_redis_url(
    moved_redis: tuple[subprocess.Popen[bytes], int], here: Path,
) -> None:
    _, port = moved_redis
    env = {k: v for k, v in os.environ.items() if k != "FLEETGEN_REDIS_PASSWORD_FILE"}
    done = subprocess.run([sys.executable, "-m", "producer", "jobs"], cwd=here,
                          env={**env, "REDIS_URL": f"redis://127.0.0.1:{port}/0",
                               "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "no jobs" in done.stdout


def test_another_local_redis_is_never_sent_the_embedded_password(
    moved_redis: tuple[subprocess.Popen[bytes], int], here: Path,
) -> None:
    proc, port = moved_redis
    other = f"redis://127.0.0.1:{free_port()}/0"
    assert Settings.from_env({"REDIS_URL": other}).redis_url == other
    named_user = f"redis://flower@127.0.0.1:{port}/0"
    assert Settings.from_env({"REDIS_URL": named_user}).redis_url == named_user
    proc.terminate()
    proc.wait(timeout=30)
    # Stopped, it serves no port: whatever listens there next gets no password.
    mine = f"redis://127.0.0.1:{port}/0"
    assert Settings.from_env({"REDIS_URL": mine}).redis_url == mine


# --- two servers, one data dir ------------------------------------------------------------------


def test_a_second_redis_on_a_data_dir_in_use_is_refused_naming_the_process_that_holds_it(
    moved_redis: tuple[subprocess.Popen[bytes], int], here: Path,
) -> None:
    proc, port = moved_redis
    data_dir = here / ".fleetgen" / "redis"
    manifest = sorted(p.name for p in (data_dir / "appendonlydir").iterdir())
    holder = data_dir_holder(data_dir)
    assert holder is not None and holder.startswith(f"pid {proc.pid} (")
    with pytest.raises(DataDirBusyError, match=f"is in use by pid {proc.pid} .*--data-dir"):
        RedisServer(data_dir=data_dir, port=free_port()).start()
    assert sorted(p.name for p in (data_dir / "appendonlydir").iterdir()) == manifest
    # The one that runs is untouched and still serves.
    client = redis.Redis(port=port, password=redis_password(data_dir))
    try:
        assert client.ping()
    finally:
        client.close()


def test_a_second_s3_on_a_data_dir_in_use_is_refused(s3_server: S3Server) -> None:
    with pytest.raises(DataDirBusyError, match=f"in use by pid {os.getpid()} "):
        S3Server(data_dir=s3_server.data_dir, port=0).start()
    assert s3_server.alive()


def test_a_data_dir_is_free_again_once_its_server_stopped(tmp_path: Path, valkey_bin: Path,
                                                          ) -> None:
    with RedisServer(data_dir=tmp_path / "redis"):
        assert data_dir_holder(tmp_path / "redis") is not None
    assert data_dir_holder(tmp_path / "redis") is None
    with RedisServer(data_dir=tmp_path / "redis") as again:
        assert again.alive()


def free_base() -> int:
    """A demo port base whose every port is free now."""
    for _ in range(50):
        base = random.randrange(10000, 22700, 20)
        if all(port_is_free(port) for port in DemoPorts.from_base(base).all()):
            return base
    pytest.skip("no free block of demo ports")


def run_demo(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launcher", "demo", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=240, check=False)


def test_the_demo_refuses_a_state_folder_another_stack_uses_naming_the_process(
    moved_redis: tuple[subprocess.Popen[bytes], int], here: Path,
) -> None:
    proc, _ = moved_redis
    log_before = (here / ".fleetgen" / "redis" / "valkey.log").read_bytes()
    done = run_demo("--state-dir", str(here / ".fleetgen"), "--port-base", str(free_base()))
    assert done.returncode == 2, done.stderr
    assert f"in use by pid {proc.pid} (" in done.stderr
    assert f"kill {proc.pid}" in done.stderr and "--state-dir" in done.stderr
    assert "stack up" not in done.stdout
    assert (here / ".fleetgen" / "redis" / "valkey.log").read_bytes() == log_before
    assert not (here / ".fleetgen" / "demo.log").exists()


# --- a stack that dies --------------------------------------------------------------------------

HONCHO_LOG = """\
05:29:50 system   | redis.1 started (pid=27691)
05:29:50 system   | s3.1 started (pid=27693)
05:29:50 system   | gpu0.1 started (pid=27705)
05:29:50 redis.1  | 2026-12-04 05:29:50,826 INFO launcher.services._embedded: redis: ready
05:29:51 s3.1     | 2026-12-04 05:29:51,832 ERROR launcher.services._command: s3: could not start: s3 exited with code 1 during startup
05:29:51 s3.1     | --- tail of /x/s3/weed.log ---
05:29:51 s3.1     | I1204 05:30:04.093000 mini.go:1200 starting
05:29:51 s3.1     | F1204 05:30:04.093308 volume.go:80 listen tcp 127.0.0.1:8337: bind: address already in use
05:29:51 s3.1     | goroutine 1 [running]:
05:29:52 system   | s3.1 stopped (rc=3)
05:29:52 system   | sending SIGTERM to redis.1 (pid 27691)
05:29:52 system   | sending SIGTERM to gpu0.1 (pid 27705)
05:29:52 gpu0.1   | worker: Warm shutdown (MainProcess) error
05:29:52 system   | gpu0.1 stopped (rc=-15)
05:29:53 system   | redis.1 stopped (rc=-15)
"""


def test_a_dead_stack_is_told_by_the_process_that_died_first_and_its_fatal_line() -> None:
    told = stack_failure(HONCHO_LOG)
    assert told is not None
    first = told.splitlines()[0]
    assert first.startswith("the stack stopped: s3 exited (code 3): F1204 ")
    assert first.endswith("listen tcp 127.0.0.1:8337: bind: address already in use")
    assert "Warm shutdown" not in told and "SIGTERM" not in told
    assert stack_failure("05:29:50 system   | redis.1 started (pid=1)\n") is None


def test_the_demo_names_the_process_that_died_and_why_not_the_shutdown(tmp_path: Path,
                                                                       valkey_bin: Path) -> None:
    state = tmp_path / "state"
    (state / "redis").mkdir(parents=True, mode=0o700)
    (state / "redis" / "users.acl").write_text("user bob on this-is-no-acl-rule\n")
    done = run_demo("--state-dir", str(state), "--port-base", str(free_base()))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "demo: the stack stopped: redis exited (code 3): " in done.stderr
    assert "ACL errors" in done.stderr.splitlines()[0]
    assert "sending SIGTERM" not in done.stderr
    assert f"{state / 'demo.log'}" in done.stderr


# --- ports held by a connection ----------------------------------------------------------------


@pytest.fixture
def connection_port() -> Iterator[int]:
    """The local port of an open outgoing connection: the kernel took it from its ephemeral
    range, and nothing listens on it."""
    with (socket.create_server(("127.0.0.1", 0)) as server,
          socket.create_connection(server.getsockname()) as client):
        peer, _ = server.accept()
        with peer:
            yield client.getsockname()[1]


def test_a_port_held_by_a_connection_is_named_as_such_with_the_ephemeral_range(
    connection_port: int, tmp_path: Path, valkey_bin: Path,
) -> None:
    first, last = ephemeral_range()
    reason = busy_reason(connection_port)
    assert reason.startswith("held by a connection, not a server")
    assert f"ephemeral range {first}-{last}" in reason and f"below {first}" in reason
    with pytest.raises(PortBusyError, match="held by a connection, not a server"):
        RedisServer(data_dir=tmp_path / "redis", port=connection_port).start()


def test_a_port_a_server_listens_on_is_named_with_its_process() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert busy_reason(server.getsockname()[1]).startswith(f"in use by pid {os.getpid()} (")


def test_the_demo_refuses_a_port_base_reaching_into_the_ephemeral_range(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from launcher.demo import main

    first, _ = ephemeral_range()
    with pytest.raises(ValueError, match="ephemeral range"):
        DemoPorts.from_base(first - 100)  # its S3 admin gRPC port, B+10018, lies far inside
    with pytest.raises(SystemExit) as refused:
        main(["--port-base", str(first + 1000)])
    assert refused.value.code == 2
    assert f"pick a port below {first}" in capsys.readouterr().err
    assert all(port < first for port in DemoPorts().all())
    assert all(port < first for port in DemoPorts.from_base(21000).all())


def test_launcher_redis_on_a_port_in_the_ephemeral_range_warns_and_names_a_better_one(
    tmp_path: Path, valkey_bin: Path,
) -> None:
    port = free_port()  # the kernel's pick for port 0 comes from its ephemeral range
    first, _ = ephemeral_range()
    assert port >= first
    out = tmp_path / "launcher.log"
    with out.open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", "redis", "--port", str(port),
                                 "--data-dir", str(tmp_path / "redis")], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: "serving" in out.read_text(), 20, what="`launcher redis` to serve")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert f"redis: port(s) {port} lie in the kernel's ephemeral range" in out.read_text()
    assert f"pick a port below {first}" in out.read_text()
