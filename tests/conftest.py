"""Shared fixtures: a real Redis (Valkey, AOF on) and a real S3 (SeaweedFS), one each per session.

    def test_worker_writes_results(redis_client, s3_env): ...

- `redis_server` / `redis_url`: session-wide Valkey on a free port in a tmp dir.
- `redis_client`: a `redis.Redis` (bytes replies) on that server's DB 0, flushed before and
  after the test.
- `s3_server`: session-wide `weed mini` on a free block of ports, with bucket `fleetgen`.
- `s3_env`: the AWS_* variables for `s3_server`, set in os.environ for the test.
- `s3_client`: a boto3 client; the bucket is emptied before and after the test.
- `valkey_bin` / `weed_bin`: the server binaries, for tests that start their own servers.
- `celery_app`: the workers' Celery app publishing to `redis_server`.

If a server binary is not installed the tests that need it are skipped, except under CI=true
where they fail: CI must never pass by skipping. Tests marked `slow` run only with `--run-slow`
(or under CI=true). Tests that kill or restart servers start their own (see
tests/test_services.py); the session servers are shared and must stay up.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from launcher.services import BinaryNotFoundError, RedisServer, S3Server, valkey_binary, weed_binary


def in_ci() -> bool:
    """True on CI, where a missing service is a failure, never a skip."""
    return os.environ.get("CI", "").lower() == "true"


def unavailable(reason: str) -> NoReturn:
    """Skip locally, fail on CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a missing service fails the run)", pytrace=False)
    pytest.skip(reason)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds; needs --run-slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow") or in_ci():
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


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
def redis_client(redis_server: RedisServer) -> Iterator[Any]:
    client = redis_server.client()
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


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
