"""Shared fixtures: a real Redis (Valkey, AOF on) and a real S3 (SeaweedFS), one each per session.

    def test_worker_writes_results(redis_client, s3_env): ...

- `redis_server` / `redis_url`: session-wide Valkey on a free port in a tmp dir.
- `redis_client`: a `redis.Redis` (bytes replies) on that server's DB 0, flushed before and
  after the test.
- `celery_app`: the workers' Celery app publishing to that server.
- `cli_env`: the producer's `main([...])` pointed at that server (REDIS_URL, no FLEETGEN_OUTPUT
  from the developer's shell), the Celery app publishing there too.
- `s3_server`: session-wide `weed mini` on a free block of ports, with bucket `fleetgen`.
- `s3_env`: the AWS_* variables for `s3_server`, set in os.environ for the test.
- `s3_client`: a boto3 client; the bucket is emptied before and after the test.
- `valkey_bin` / `weed_bin`: the server binaries, for tests that start their own servers.
- `chromium`: headless Chromium (tests/browser.py) with a throwaway profile in the test's tmp.
- `cluster`: a fleet of real nodes in network namespaces (tests/cluster.py); needs root.

If a server binary is not installed the tests that need it are skipped, except under CI=true
where they fail: CI must never pass by skipping. Tests that kill or restart servers start their
own (see tests/launcher/services/test_services.py); the session servers are shared and must stay up.

A test that starts a simulator, worker or producer process through tests/stack.py must be
marked `e2e` (pytest_runtest_setup tells the stack), so `-m "not e2e and not chaos"` stays the
fast layer.

No test reaches a Redis, S3 or server it did not start (tests/isolation.py): before
collection, the variables that name services are dropped and REDIS_URL names a port that
refuses every connection; a test whose process connects to it, or to a default port of the
services a developer runs on this machine (the walkthrough's Redis on 6389, S3 on 8333,
servers from 30000), fails, unless that server is one this session started.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from launcher.services import BinaryNotFoundError, RedisServer, S3Server, valkey_binary, weed_binary
from tests.browser import CHROMIUM, Browser
from tests.isolation import Guard, default_ports, isolate_environment, shell_ports

GUARD = pytest.StashKey[Guard]()


def in_ci() -> bool:
    """True on CI, where a missing service is a failure, never a skip."""
    return os.environ.get("CI", "").lower() == "true"


def unavailable(reason: str) -> NoReturn:
    """Skip locally, fail on CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a missing service fails the run)", pytrace=False)
    pytest.skip(reason)


def pytest_configure(config: pytest.Config) -> None:
    # Python's bytecode caches are written even where PYTHONDONTWRITEBYTECODE is set (a common
    # container default): without them every test process rewrites the asserts of every test
    # module, and every plugin's package, and compiles them again at each run, which was most
    # of its collection. They go to __pycache__ (ignored by git); the processes the tests start
    # keep the variable, so they write none, and read the ones written here.
    sys.dont_write_bytecode = False
    # A shell starts a background job (`.ci/run &`, nohup, a CI runner's script) with SIGINT
    # ignored, and every process the tests start inherits "ignored": Ctrl-C tests (status
    # --watch, enqueue interrupted, the walkthrough's terminals) would then test nothing and
    # hang. Python's own handler here means a default SIGINT in every child, as at a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Before collection: test modules import code that reads the environment at import.
    guard = Guard(default_ports() | shell_ports(os.environ))
    walls = pytest.MonkeyPatch()
    isolate_environment(walls, guard.stand_in)
    guard.install(walls)
    config.stash[GUARD] = guard
    config.add_cleanup(guard.close)
    config.add_cleanup(walls.undo)


@pytest.fixture(autouse=True)
def reaches_only_what_it_started(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test if its process reached for a Redis, S3 or server that this session did
    not start (tests/isolation.py)."""
    with request.config.stash[GUARD].watching(request.node.nodeid) as reaches:
        yield
    if reaches:
        said = dict.fromkeys(f"this test {r.describe()}" for r in reaches)  # once each
        pytest.fail("\n".join(said), pytrace=False)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    # Reaches between tests (a session fixture, a thread a test left running) fail the run.
    stray = [r for r in config.stash[GUARD].reaches if r.test is None]
    if stray:
        terminalreporter.section("connections refused between tests (tests/isolation.py)")
        for reach in stray:
            terminalreporter.line(f"something {reach.describe()}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if any(r.test is None for r in session.config.stash[GUARD].reaches):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_runtest_setup(item: pytest.Item) -> None:
    from tests import stack

    stack.running_e2e = item.get_closest_marker("e2e") is not None


@pytest.fixture(scope="session")
def valkey_bin() -> Path:
    try:
        return valkey_binary()
    except BinaryNotFoundError as exc:
        unavailable(f"embedded Redis unavailable: {exc}")


@pytest.fixture(scope="session")
def weed_bin() -> Path:
    try:
        return weed_binary()
    except BinaryNotFoundError as exc:
        unavailable(f"embedded S3 unavailable: {exc}")


@pytest.fixture(scope="session")
def redis_server(
    valkey_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    with RedisServer(data_dir=tmp_path_factory.mktemp("redis"), binary=valkey_bin) as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def celery_app(redis_url: str) -> Any:
    """The workers' Celery app, pointed at the test Redis, for publishing from the test."""
    from workers.app import app

    app.conf.broker_url = redis_url
    app._pool = None  # drop connections made for another broker URL
    return app


@pytest.fixture
def cli_env(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer's command line (`main([...])`) and the Celery app on the test Redis."""
    from workers.app import app

    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.delenv("FLEETGEN_OUTPUT", raising=False)
    monkeypatch.setattr(app.conf, "broker_url", redis_url)
    app._pool = None  # drop connections made for another broker URL


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[Any]:
    client = redis_server.client()
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def ledger(redis_client: Any) -> Any:
    """A `fleetgen.ledger.Ledger` on `redis_client` (flushed before and after, then closed)."""
    from fleetgen.ledger import Ledger

    return Ledger(redis_client)


@pytest.fixture(scope="session")
def s3_server(weed_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with S3Server(data_dir=tmp_path_factory.mktemp("s3"), binary=weed_bin) as server:
        yield server


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    # A profile or session token from the developer's shell would override the static keys.
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    env = s3_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def s3_client(s3_server: S3Server) -> Iterator[Any]:
    client = s3_server.client()
    empty_bucket(client, s3_server.bucket)
    yield client
    empty_bucket(client, s3_server.bucket)
    client.close()


def empty_bucket(client: Any, bucket: str) -> None:
    """Delete every object in `bucket`."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


@pytest.fixture
def stack(tmp_path: Path, redis_url: str, redis_client: Any, s3_server: S3Server) -> Iterator[Any]:
    """Simulated servers and real worker processes on this test's Redis and S3 (tests/stack.py)."""
    from tests.stack import Stack

    s = Stack(tmp_path, {"REDIS_URL": redis_url, **s3_server.env()})
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[Browser]:
    if not Path(CHROMIUM).is_file():
        unavailable(f"{CHROMIUM} not found: the browser tests need Chromium; install it "
                    "with `apt-get install -y chromium` (as root; .ci/run does this)")
    home = tmp_path / "chromium-home"
    home.mkdir()
    yield Browser(home)


@pytest.fixture
def cluster(valkey_bin: Path, weed_bin: Path, tmp_path: Path) -> Iterator[Any]:
    """A control node (Valkey, SeaweedFS) in its own network namespace; GPU nodes are started by
    the test with `cluster.start_node(name)` (tests/cluster.py). Torn down after the test."""
    import shutil

    from tests.cluster import Cluster

    if os.geteuid() != 0:
        unavailable("the cluster tests build network namespaces: run them as root")
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        unavailable(f"the cluster tests need iproute2 and util-linux: {missing} not found")
    built = Cluster.build(tmp_path, valkey_bin, weed_bin)
    try:
        yield built
    finally:
        built.close()
