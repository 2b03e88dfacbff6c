"""A ledger shard down mid-job: the worker hands its job's batches back, no attempt spent, and
says once that the shard is out of reach; the shard restarted from its AOF, the job finishes,
each prompt exactly once.

Two real Valkey servers: the session's (REDIS_URL's, the broker's) and a second one this module
starts (AOF on), stopped as a process and started again on its port and data dir.
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
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from fleetgen.settings import Settings
from launcher.services import RedisServer
from tests.stack import Stack, chat_rows, iter_ids, write_jsonl

pytestmark = pytest.mark.e2e

SLOW = ("--max-running-requests", "4", "--decode-tps", "40", "--mean-output-tokens", "100",
        "--speed", "10")
PROMPTS = 200
JOB = "far"


@pytest.fixture
def second(valkey_bin: Path, tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(data_dir=tmp_path / "redis-shard", binary=valkey_bin) as server:
        yield server


def test_a_job_whose_shard_goes_down_waits_and_then_finishes_exactly_once(
        stack: Stack, second: RedisServer, redis_url: str, tmp_path: Path) -> None:
    stack.base_env["FLEETGEN_LEDGER_URLS"] = second.url
    ledger = Ledger.connect(Settings(redis_url=redis_url, ledger_urls=(second.url,)))
    far = ledger.shards.names()[1]
    ledger.r.hset(keys.PLACEMENT, JOB, far)  # on the second server, as enqueue may place it
    rows = chat_rows(PROMPTS)
    output = tmp_path / "out"
    stack.producer("enqueue", str(write_jsonl(tmp_path / "p.jsonl", rows)), "--job", JOB,
                   "--output", str(output), "--batch-size", "10", "--max-tokens", "200")
    assert second.client().exists(keys.job(JOB))
    _, url = stack.sim("sim0", *SLOW)
    worker = stack.worker(0, url)
    wait_until(lambda: job_status(ledger, JOB).done >= 20, 120, interval=0.3,
               what="a few batches written")

    second.stop()
    log = tmp_path / "gpu0.log"
    said = f"job {JOB}: its ledger shard {far} is out of reach"
    wait_until(lambda: said in log.read_text(errors="replace"), 120, interval=0.3,
               what="the worker saying the shard is out of reach")
    second.start()

    wait_until(lambda: job_status(ledger, JOB).state == "done", 240, interval=0.5,
               what="the job done")
    status = job_status(ledger, JOB)
    assert (status.done, status.failed) == (PROMPTS, 0), status
    text = log.read_text(errors="replace")
    assert text.count(said) == 1
    assert "Traceback" not in text and "raised unexpected" not in text, text[-4000:]
    assert worker.alive()

    target = tmp_path / "export.jsonl"
    export = stack.producer("export", JOB, "--to", str(target))
    assert "missing 0" in export.stdout, export.stdout
    ids = [orjson.loads(line).get("id") or orjson.loads(line).get("custom_id") for line in target.read_bytes().splitlines()]
    assert sorted(ids) == sorted(iter_ids(rows))
    assert max(collections.Counter(ids).values()) == 1
    # No attempt was spent on the outage: no batch's prompts got near the attempts' limit.
    attempts: dict[Any, Any] = second.client().hgetall(keys.job_part(JOB, "attempts"))
    assert all(int(v) <= 2 for v in attempts.values()), attempts
    ledger.close()
