"""The worker's Celery app runs without Celery's gossip and mingle, whatever its command says:
fleetgen uses neither, and gossip's restart after a broker loss logs an error with six chained
tracebacks (workers/app.py). The end-to-end test runs the plain command
`celery -A workers worker -Q gpu0 -n gpu0@test --loglevel INFO` through a Redis crash.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetgen.poll import wait_until
from launcher.services import RedisServer
from tests.stack import CELERY, FAST_WORKER_ENV, Proc, Stack


def consumer_steps(**options: bool) -> list[str]:
    """The steps a worker of the app would start its consumer with (built, never started)."""
    from workers.app import app

    worker = app.WorkController(hostname="gpu0@test", pool_cls="solo", queues=["gpu0"],
                                **options)
    return [step.alias for step in worker.consumer.steps]


def test_a_worker_of_the_app_has_no_gossip_or_mingle_even_when_its_options_ask_for_them() -> None:
    for options in ({}, {"without_gossip": False, "without_mingle": False}):
        steps = consumer_steps(**options)
        assert "Gossip" not in steps and "Mingle" not in steps, steps
        assert "Connection" in steps and "Tasks" in steps, steps


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(data_dir=tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.e2e
def test_the_plain_worker_command_rides_a_redis_crash_without_a_traceback(
    own_redis: RedisServer, tmp_path: Path
) -> None:
    stack = Stack(tmp_path, {"REDIS_URL": own_redis.url})
    try:
        _, url = stack.sim("sim0")
        # The command as a user types it: no --without-gossip, no --without-mingle.
        argv = [CELERY, "-A", "workers", "worker", "-Q", "gpu0", "-n", "gpu0@test",
                "--loglevel", "INFO"]
        env = stack.env({**FAST_WORKER_ENV, "FLEETGEN_SERVER_URL": url})
        worker = Proc("gpu0", argv, env, tmp_path / "gpu0.log").start()
        stack.procs.append(worker)

        def log() -> str:
            return worker.log_path.read_text(errors="replace") if worker.log_path.exists() else ""

        wait_until(lambda: "ready." in log() or not worker.alive(), 60, what="gpu0 ready")
        own_redis.kill()
        wait_until(lambda: "Connection to broker lost" in log() or not worker.alive(), 60,
                   what="the worker to see Redis gone")
        own_redis.start()
        wait_until(lambda: log().count("Connected to redis://") >= 2 or not worker.alive(), 90,
                   what="the worker to reconnect")
        assert worker.alive(), log()
        text = log()
        assert "Traceback" not in text and "Error on restarting" not in text, text
        assert "mingle:" not in text, text
    finally:
        stack.close()
