"""A fleet over two Redis servers: REDIS_URL's (the broker, the registry, shard 0) and a second
ledger shard (FLEETGEN_LEDGER_URLS). Two jobs enqueued one after the other land on different
shards; two workers with simulated servers run both, each prompt exactly once; one export each;
`producer jobs` shows both, with their shards, in one command.

One machine (tests/stack.py), not the network namespaces of tests/system/test_cluster.py: what
is proven here is the routing of every process over two servers, which namespaces add nothing to.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.jobview import job_status
from fleetgen.ledger import FLEET, Ledger
from fleetgen.poll import wait_until
from fleetgen.settings import Settings
from launcher.services import RedisServer
from tests.stack import Stack, chat_rows, write_jsonl

pytestmark = pytest.mark.e2e

SIM_FLAGS = ("--max-running-requests", "8", "--decode-tps", "80", "--mean-output-tokens", "100",
             "--speed", "50")
PROMPTS = 300


@pytest.fixture
def second(valkey_bin: Path, tmp_path: Path) -> Iterator[RedisServer]:
    """The second Redis, started as the session's (AOF on), on its own port and data dir."""
    with RedisServer(data_dir=tmp_path / "redis-shard", binary=valkey_bin) as server:
        yield server


def test_two_jobs_on_two_redis_servers_run_once_each_and_show_in_one_listing(
        stack: Stack, second: RedisServer, redis_url: str, redis_client: Any,
        tmp_path: Path) -> None:
    stack.base_env["FLEETGEN_LEDGER_URLS"] = second.url
    ledger = Ledger.connect(Settings(redis_url=redis_url, ledger_urls=(second.url,)))
    other = ledger.shards.names()[1]  # the name the second server holds (fg:shard)
    output = tmp_path / "out"
    rows = {job: chat_rows(PROMPTS, prefix=job) for job in ("alpha", "beta")}
    for job, job_rows in rows.items():
        src = write_jsonl(tmp_path / f"{job}.jsonl", job_rows)
        stack.producer("enqueue", str(src), "--job", job, "--output", str(output),
                       "--max-tokens", "300")
    # alpha went to the first shard listed (both empty); beta to the one without an active job.
    assert redis_client.hgetall(keys.PLACEMENT) == {b"alpha": FLEET.encode(),
                                                    b"beta": other.encode()}
    # The workers start once both wait: alpha is still active when beta is placed.
    for gpu in (0, 1):
        _, url = stack.sim(f"sim{gpu}", *SIM_FLAGS)
        stack.worker(gpu, url)

    wait_until(lambda: all(job_status(ledger, job).state == "done" for job in rows), 300,
               interval=0.5, what="both jobs done")
    for job, job_rows in rows.items():
        status = job_status(ledger, job)
        assert (status.done, status.failed) == (PROMPTS, 0), status
        target = tmp_path / f"{job}-export.jsonl"
        export = stack.producer("export", job, "--output", str(output), "--to", str(target))
        assert "missing 0" in export.stdout, export.stdout
        lines = [orjson.loads(line) for line in target.read_bytes().splitlines()]
        ids = [x.get("custom_id") or x.get("id") for x in lines]
        assert sorted(ids) == sorted(r.get("id") or r["custom_id"] for r in job_rows)
        assert max(collections.Counter(ids).values()) == 1

    # Each job's ledger keys are on its own shard only; the placement on REDIS_URL's.
    near = {k.decode() for k in redis_client.scan_iter(match="fg:*")}
    far = {k.decode() for k in second.client().scan_iter(match="fg:*")}
    assert keys.job("alpha") in near and keys.job("beta") in far
    assert not {k for k in near if "beta" in k} and not {k for k in far if "alpha" in k}
    assert keys.PLACEMENT in near and keys.WORKERS in near and keys.WORKERS not in far

    listing = stack.producer("jobs").stdout
    shown = {line.split()[0]: line for line in listing.splitlines()[1:]}
    assert "shard" in listing.splitlines()[0]
    assert shown["alpha"].split()[1:2] == ["done"] and FLEET in shown["alpha"]
    assert shown["beta"].split()[1:2] == ["done"] and other in shown["beta"]
    for job in rows:
        assert f"{PROMPTS:,}" in shown[job]
        view = stack.producer("status", job).stdout
        assert job in view and "done" in view
