"""A REDIS_URL that points at something that is not Redis (a plain web server, `python -m
http.server`) is said in one `error:` line by the producer and by a starting worker, which exits
78 without a traceback, as a wrong password or nothing listening already are.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetgen import redisconn
from fleetgen.poll import wait_until
from fleetgen.ports import free_port
from tests.stack import CELERY, FAST_WORKER_ENV, PYTHON, Proc, Stack, chat_rows, write_jsonl

EXIT_CONFIG = 78


@pytest.fixture
def web(tmp_path: Path) -> Iterator[tuple[Stack, str]]:
    """A plain web server on a free port, and a Stack whose REDIS_URL names that port."""
    port = free_port()
    www = tmp_path / "www"
    www.mkdir()
    stack = Stack(tmp_path, {"REDIS_URL": f"redis://:s3cret-pw@127.0.0.1:{port}/0"})
    server = Proc("web", [PYTHON, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                          "--directory", str(www)], stack.env(), tmp_path / "web.log").start()
    stack.procs.append(server)
    try:
        wait_until(lambda: "Serving HTTP" in server.log() or not server.alive(), 30,
                   what="the web server")
        yield stack, f"redis://:***@127.0.0.1:{port}/0"
    finally:
        stack.close()


def one_error_line(output: str, shown_url: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    assert "Traceback" not in output, output
    assert "s3cret-pw" not in output, output
    assert errors[0].startswith(f"error: REDIS_URL {shown_url} is not a Redis server "
                                "(it answered '<"), output
    assert errors[0].endswith("): point REDIS_URL at your Redis"), output
    return errors[0]


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["jobs", "enqueue"])
def test_the_producer_pointed_at_a_web_server_says_it_is_not_redis_in_one_line(
    web: tuple[Stack, str], tmp_path: Path, command: str
) -> None:
    stack, shown = web
    args = ["jobs"] if command == "jobs" else [
        "enqueue", str(write_jsonl(tmp_path / "in.jsonl", chat_rows(3))), "--job", "nowhere",
        "--output", str(tmp_path / "out")]
    done = stack.producer(*args, check=False)
    assert done.returncode != 0, done.stdout + done.stderr
    one_error_line(done.stdout + done.stderr, shown)


@pytest.mark.e2e
def test_a_worker_pointed_at_a_web_server_refuses_to_start_in_one_line(
    web: tuple[Stack, str], tmp_path: Path
) -> None:
    stack, shown = web
    argv = [CELERY, "-A", "workers", "worker", "-Q", "gpu0", "-n", "gpu0@test",
            "--without-mingle", "--without-gossip", "--loglevel", "INFO"]
    env = stack.env({**FAST_WORKER_ENV, "FLEETGEN_SERVER_URL": "http://127.0.0.1:9"})
    worker = Proc("gpu0", argv, env, tmp_path / "gpu0.log").start()
    stack.procs.append(worker)
    assert worker.popen is not None
    assert worker.popen.wait(60) == EXIT_CONFIG, worker.log()
    one_error_line(worker.log(), shown)
    assert "ready." not in worker.log()


@pytest.mark.parametrize("said, answered", [
    ('Protocol error, got "<" as reply type byte', "'<...'"),  # hiredis
    ("Protocol Error: b'<!DOCTYPE HTML>'", "'<!DOCTYPE HTML>'"),  # redis-py's own parser
    ("Protocol Error: b'HTTP/1.0 400 Bad request version (\\'RTSP/1.0\\')'",
     "'HTTP/1.0 400 Bad request version (\\'RTSP...'"),
])
def test_the_not_redis_line_quotes_the_start_of_the_answer(said: str, answered: str) -> None:
    line = redisconn.not_redis("redis://:pw@10.0.0.5:8000/0", Exception(said))
    assert line == (f"REDIS_URL redis://:***@10.0.0.5:8000/0 is not a Redis server (it answered "
                    f"{answered}): point REDIS_URL at your Redis")
