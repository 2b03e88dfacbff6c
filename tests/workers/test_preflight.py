"""A misconfigured worker says so instead of stalling a job (real Valkey, SeaweedFS, simulator
and `celery -A workers worker` processes):

- a worker that cannot tell its server, cannot use Redis, or whose name a live worker holds
  refuses to start with one `error:` line and takes no batch;
- a worker whose S3 credentials cannot write the job's output hands its batches back unstarted
  (no attempt spent) while a worker with good ones finishes the job, exported exactly once;
- `producer status` names the stall: the last error a worker met and how long ago, or the queue
  nobody consumes.

The seconds from the fault to the message are printed (`pytest -s`), never asserted.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.errors import SinkUnusableError
from fleetgen.jobview import JobStatus, job_status
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from fleetgen.ports import free_port
from fleetgen.sink import LocalSink
from producer.status import render
from tests.stack import CELERY, FAST_WORKER_ENV, Proc, Stack, chat_rows, queue_depth, write_jsonl
from workers.preflight import SinkChecks

pytestmark = pytest.mark.e2e

FAST_SIM = ("--max-running-requests", "8", "--decode-tps", "200", "--mean-output-tokens", "40",
            "--speed", "20")


def start_worker(stack: Stack, name: str, *queue_flags: str, env: dict[str, str] | None = None,
                 drop: tuple[str, ...] = (), log: str | None = None) -> Proc:
    """`celery -A workers worker [-Q ...] -n NAME@test`, without waiting for it to be ready."""
    argv = [CELERY, "-A", "workers", "worker", *queue_flags, "-n", f"{name}@test",
            "--without-mingle", "--without-gossip", "--loglevel", "INFO"]
    full = {k: v for k, v in stack.env({**FAST_WORKER_ENV, **(env or {})}).items()
            if k not in drop}
    proc = Proc(log or name, argv, full, stack.tmp / f"{log or name}.log").start()
    stack.procs.append(proc)
    return proc


def refusal(proc: Proc) -> str:
    """The one `error:` line of a worker that refused to start (it must have exited non-zero)."""
    assert proc.popen is not None
    code = proc.popen.wait(60)
    log = proc.log()
    assert code != 0, log
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, log
    assert "ready." not in log, log
    return errors[0]


def enqueue(stack: Stack, tmp: Path, job: str, n: int, *flags: str, output: str | None = None,
            ) -> None:
    src = write_jsonl(tmp / f"{job}.jsonl", chat_rows(n, prefix=job))
    stack.producer("enqueue", str(src), "--job", job, "--output", output or str(tmp / "out"),
                   "--batch-size", "10", "--no-canary", *flags)


def test_a_worker_that_cannot_tell_its_server_refuses_to_start_and_takes_no_batch(
    stack: Stack, tmp_path: Path, redis_client: Any,
) -> None:
    enqueue(stack, tmp_path, "waiting", 30)
    before = queue_depth(redis_client, keys.SHARED_QUEUE)
    # No -Q gpuN and no FLEETGEN_SERVER_URL: which server would it send prompts to?
    line = refusal(start_worker(stack, "noserver", drop=("FLEETGEN_SERVER_URL",)))
    assert "cannot tell this worker's server" in line and "FLEETGEN_SERVER_URL" in line
    assert queue_depth(redis_client, keys.SHARED_QUEUE) == before == 3
    assert not redis_client.hgetall(keys.job_part("waiting", "attempts"))


def test_a_worker_whose_redis_refuses_its_password_refuses_to_start(
    stack: Stack, redis_url: str,
) -> None:
    wrong = re.sub(r"redis://:[^@]*@", "redis://:WRONG-pass-123@", redis_url)
    line = refusal(start_worker(stack, "badpass", "-Q", "gpu0",
                                env={"REDIS_URL": wrong, "FLEETGEN_SERVER_URL": "http://127.0.0.1:9"}))
    assert "refused the password that was given" in line
    assert "WRONG-pass-123" not in line


def test_a_worker_given_no_redis_password_says_one_is_needed(
    stack: Stack, redis_url: str,
) -> None:
    bare = re.sub(r"redis://:[^@]*@", "redis://", redis_url)
    line = refusal(start_worker(stack, "nopass", "-Q", "gpu0",
                                env={"REDIS_URL": bare, "FLEETGEN_SERVER_URL": "http://127.0.0.1:9"},
                                drop=("FLEETGEN_REDIS_PASSWORD_FILE",)))
    assert line.startswith(f"error: Redis at {bare} needs a password and none was given")
    assert "FLEETGEN_REDIS_PASSWORD_FILE" in line


def test_a_worker_with_no_redis_at_its_address_refuses_to_start(stack: Stack) -> None:
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    line = refusal(start_worker(stack, "noredis", "-Q", "gpu0",
                                env={"REDIS_URL": nowhere, "FLEETGEN_SERVER_URL": "http://127.0.0.1:9"}))
    assert line.startswith(f"error: cannot reach Redis at {nowhere}")


def test_a_second_worker_under_a_live_workers_name_refuses_naming_its_host_and_pid(
    stack: Stack, redis_client: Any,
) -> None:
    _, url = stack.sim("sim0", *FAST_SIM)
    first = stack.worker(0, url)
    wait_until(lambda: redis_client.hexists(keys.WORKERS, "gpu0@test"), 30, what="registered")
    host = orjson.loads(redis_client.hget(keys.WORKERS, "gpu0@test"))["host"]
    line = refusal(start_worker(stack, "gpu0", "-Q", "gpu0", env={"FLEETGEN_SERVER_URL": url},
                                log="second-gpu0"))
    assert f"worker name gpu0@test is taken by a live worker on host {host} (pid {first.pid})" \
        in line
    assert first.alive()
    # Killed, its fresh registry entry is no reason to refuse the restart: its connections
    # are gone.
    first.kill()
    stack.worker(0, url)


def test_a_worker_that_cannot_write_the_jobs_output_hands_its_batches_back_to_a_good_worker(
    stack: Stack, tmp_path: Path, redis_client: Any, s3_server: Any, s3_client: Any,
) -> None:
    ledger = Ledger(redis_client)
    _, url0 = stack.sim("sim0", *FAST_SIM)
    _, url1 = stack.sim("sim1", *FAST_SIM)
    bad = stack.worker(0, url0, extra_env={"AWS_SECRET_ACCESS_KEY": "not-the-secret",
                                           "FLEETGEN_SINK_RECHECK_S": "600"})
    output = f"s3://{s3_server.bucket}/runs"
    fault = time.monotonic()
    enqueue(stack, tmp_path, "creds", 60, output=output)

    # Alone, the bad worker takes nothing from the job: status says why.
    said: list[JobStatus] = []

    def status_names_the_error() -> bool:
        s = job_status(ledger, "creds")
        said[:] = [s]
        return bool(s.stalled and s.stalled.last_error)

    wait_until(status_names_the_error, 90, interval=0.5, what="status names the stall")
    seen_after = time.monotonic() - fault
    text = render(said[0])
    print(f"\nbad credentials: `status` names the error {seen_after:.1f}s after enqueue")
    assert re.search(r"stalled: no batch finished for \d+ s; last error on gpu0@test "
                     r"\(\d+ s ago\): cannot use the output of job creds", text), text
    assert "access denied" in text, text
    assert "not-the-secret" not in text
    assert said[0].worker_errors[0].worker == "gpu0@test"
    assert said[0].done == 0
    assert not redis_client.hgetall(keys.job_part("creds", "attempts"))

    stack.worker(1, url1)
    final = _wait_done(stack, ledger, "creds")
    assert (final.done, final.failed) == (60, 0)
    # Every attempt the good worker took was given back at its batch's end; the bad worker
    # never took one.
    attempts = {k.decode(): int(v) for k, v in
                redis_client.hgetall(keys.job_part("creds", "attempts")).items()}
    assert set(attempts.values()) <= {0}, attempts
    assert final.workers.keys() == {"gpu1@test"}
    assert bad.alive()
    exported = tmp_path / "creds-export.jsonl"
    stack.producer("export", "creds", "--to", str(exported))
    rows = [orjson.loads(line) for line in exported.read_bytes().splitlines()]
    ids = [r.get("custom_id") or r["id"] for r in rows]
    assert sorted(ids) == sorted(f"creds{i:05d}" for i in range(60))


def test_a_job_pinned_to_a_queue_no_worker_consumes_says_so_in_status(
    stack: Stack, tmp_path: Path, redis_client: Any,
) -> None:
    ledger = Ledger(redis_client)
    _, url = stack.sim("sim0", *FAST_SIM)
    stack.worker(0, url)
    wait_until(lambda: redis_client.hexists(keys.WORKERS, "gpu0@test"), 30, what="registered")
    fault = time.monotonic()
    enqueue(stack, tmp_path, "pinned", 20, "--queue", "gpu99")
    said: list[JobStatus] = []

    def says_no_consumer() -> bool:
        said[:] = [job_status(ledger, "pinned")]
        return bool(said[0].stalled)

    wait_until(says_no_consumer, 30, interval=0.2, what="status names the missing consumer")
    print(f"\nno consumer: `status` says so {time.monotonic() - fault:.1f}s after enqueue")
    stalled = said[0].stalled
    assert stalled is not None and stalled.reason == "no_consumer"
    text = stack.producer("status", "pinned").stdout
    assert "stalled: no worker consumes queue gpu99 (live workers consume fleetgen, gpu0)" \
        in text, text
    as_json = orjson.loads(stack.producer("status", "pinned", "--json").stdout)
    assert as_json["stalled"]["queue"] == "gpu99"


def _wait_done(stack: Stack, ledger: Ledger, job: str) -> JobStatus:
    from tests.stack import wait_job_done

    return wait_job_done(stack, job, timeout=180)


def test_a_jobs_output_that_fails_the_check_is_left_alone_until_the_recheck_then_used_again(
    tmp_path: Path,
) -> None:
    # A file where the output folder should be: nothing can be written under it.
    blocker = tmp_path / "out"
    blocker.write_text("not a folder")
    sink = LocalSink(str(blocker), blocker)
    opened: list[int] = []

    def open_sink() -> LocalSink:
        opened.append(1)
        return sink

    patient = SinkChecks("gpu0@t", recheck_s=600)
    with pytest.raises(SinkUnusableError, match="cannot use the output of job j with this "
                                                 "worker's credentials: .*out/j/.fleetgen"):
        patient.require("j", open_sink)
    blocker.unlink()
    # Fixed, but not checked again before the recheck time: the job stays blocked here.
    with pytest.raises(SinkUnusableError):
        patient.require("j", open_sink)
    assert len(opened) == 1
    # Once the recheck is due, the fixed output is used, and checked no more.
    eager = SinkChecks("gpu0@t", recheck_s=0)
    blocker.write_text("not a folder")
    with pytest.raises(SinkUnusableError):
        eager.require("j", open_sink)
    blocker.unlink()
    assert eager.require("j", open_sink) is sink
    assert (blocker / "j/.fleetgen/write-check/gpu0@t").is_file()
    assert eager.require("j", open_sink) is sink
    assert eager.require("other", open_sink) is sink
    assert (blocker / "other/.fleetgen/write-check/gpu0@t").is_file()
