"""The test suite never reaches a Redis, S3 or server it did not start (tests/isolation.py).

The proof runs a slice of the fast layer, in a pytest of its own, beside a developer's Redis
where the walkthrough's `python -m launcher redis` puts it: the default port, its password in
`.fleetgen/redis/` of the folder the tests run from, no REDIS_URL set. Found that way, a bare
`Settings.from_env()` reaches it with its password; the slice (the tuning notes, the producer's
and the launcher's command lines) must not make a single connection to it. The rules of the
guard and of the environment are tested in this process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetgen.ports import HOST, free_port, port_is_free
from fleetgen.redisconn import endpoints
from fleetgen.settings import EMBEDDED_REDIS_URL, Settings
from launcher.services import RedisServer
from tests.conftest import unavailable
from tests.isolation import Guard, shell_ports

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REDIS_PORT = endpoints(EMBEDDED_REDIS_URL)[0][1]
# Tests that wrote to, or read from, the Redis of the environment before the guard, and a
# few of each command line: what a developer runs while working on them.
SLICE = [
    "tests/launcher/node/test_tune.py",
    "tests/launcher/node/test_autotune.py",
    "tests/producer/test_job_lookup.py",
    "tests/producer/test_cli_help.py",
    "tests/fleetgen/test_settings.py",
]
# What tests/isolation.py sets for the whole session.
SESSION_VARIABLES = ("REDIS_URL", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
                     "AWS_EC2_METADATA_DISABLED")


@pytest.fixture
def developers_redis(tmp_path: Path, valkey_bin: Path) -> Iterator[RedisServer]:
    """`python -m launcher redis` as the walkthrough starts it, in the folder `tmp_path`."""
    if not port_is_free(DEFAULT_REDIS_PORT):
        unavailable(f"port {DEFAULT_REDIS_PORT} is taken (a Redis of this machine's own?): the "
                    "test starts a developer's Redis there")
    server = RedisServer(data_dir=tmp_path / ".fleetgen" / "redis", port=DEFAULT_REDIS_PORT,
                         binary=valkey_bin)
    with server:
        yield server


def test_the_fast_layer_never_connects_to_a_developers_redis_on_the_default_port(
        developers_redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The developer's shell: none of the variables this session set for itself, and no
    # coverage or pytest state of the pytest this one runs in.
    shell = {k: v for k, v in os.environ.items()
             if k not in SESSION_VARIABLES and not k.startswith(("COV_CORE_", "PYTEST_"))}
    monkeypatch.chdir(tmp_path)
    # From that folder, fleetgen's settings with no REDIS_URL find it, password and all.
    assert Settings.from_env({}).redis_url == developers_redis.url
    client = developers_redis.client()
    try:
        before = connections(client)
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "not e2e and not chaos",
             "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
             *(str(ROOT / path) for path in SLICE)],
            cwd=tmp_path, env=shell, capture_output=True, text=True, timeout=240, check=False)
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        assert connections(client) == before
        assert client.dbsize() == 0
    finally:
        client.close()


def connections(client: Any) -> int:
    """How many connections the server has accepted since it started."""
    return int(client.info("stats")["total_connections_received"])


def test_a_connection_to_a_watched_port_nothing_of_this_session_serves_is_refused_and_kept(
) -> None:
    port = free_port()
    guard = Guard([port])
    try:
        with socket.socket() as sock, pytest.raises(ConnectionRefusedError) as refused:
            guard.check(sock, (HOST, port))
        with guard.watching("a test") as reaches, socket.socket() as sock:
            assert guard.refuses("localhost", port) and guard.refuses("::1", port)
            with pytest.raises(ConnectionRefusedError):
                guard.check(sock, ("::ffff:127.0.0.1", port))
        assert [r.test for r in reaches] == ["a test"]
        assert not guard.refuses("10.0.0.5", port)  # another machine is another's business
        assert not guard.refuses(HOST, free_port())  # a port of the test's own
    finally:
        guard.close()
    assert f"reached for {HOST}:{port}, a port of the services a developer runs on this " \
           "machine, which this test session did not start" in str(refused.value)


def test_a_server_this_session_started_on_a_watched_port_is_let_through() -> None:
    with socket.socket() as server:
        server.bind((HOST, 0))
        server.listen()
        port = server.getsockname()[1]
        guard = Guard([port])
        try:
            assert not guard.refuses(HOST, port)
        finally:
            guard.close()


def test_the_tests_redis_url_names_a_port_that_refuses_every_connection() -> None:
    url = os.environ["REDIS_URL"]
    assert Settings.from_env().redis_url == url
    assert not any(os.environ.get(name) for name in (
        "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_PROFILE", "FLEETGEN_REDIS_PASSWORD_FILE",
        "FLEETGEN_SERVER_URL", "FLEETGEN_OUTPUT"))
    host, port = endpoints(url)[0]
    probe = ("import socket, sys\n"
             "try:\n"
             f"    socket.create_connection(({host!r}, {port}), timeout=5)\n"
             "except ConnectionRefusedError:\n"
             "    sys.exit(0)\n"
             "sys.exit(1)\n")
    assert subprocess.run([sys.executable, "-c", probe], timeout=60, check=False).returncode == 0


def test_the_local_services_a_developers_shell_names_are_watched() -> None:
    ports = shell_ports({"REDIS_URL": "redis://:pw@127.0.0.1:7000/0",
                         "AWS_ENDPOINT_URL": "http://localhost:9000",
                         "FLEETGEN_SERVER_URL": "http://10.0.0.5:7001"})
    assert {7000, 9000} <= ports and 7001 not in ports
