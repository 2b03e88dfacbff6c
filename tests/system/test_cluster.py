"""Several real nodes (network namespaces, tests/cluster.py) over two Redis servers (REDIS_URL's
and a second ledger shard): a node joins mid-job while a second job runs on the other shard, a
node dies, a node is cut off and comes back, and `producer status` and `producer jobs` on the
control node see every GPU and every job.

Each scenario ends with an export holding every input id exactly once and prints its figure
(`-s` shows them); no figure is asserted, the machine may be busy.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from fleetgen import keys
from fleetgen.jobview import JobStatus, job_status
from fleetgen.ledger import FLEET, Ledger
from fleetgen.poll import wait_until
from tests.cluster import BUCKET, Cluster, leases_held
from tests.stack import chat_rows, write_jsonl

# Three nodes of five processes each on a CI machine of two cores: minutes, not seconds.
pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(900)]

OUTPUT = f"s3://{BUCKET}/runs"


def enqueue(cluster: Cluster, tmp_path: Path, job: str, prompts: int) -> list[dict[str, Any]]:
    rows = chat_rows(prompts)
    source = write_jsonl(tmp_path / f"{job}.jsonl", rows)
    cluster.producer("enqueue", str(source), "--job", job, "--output", OUTPUT,
                     "--batch-size", "10")
    return rows


def fleet_ledger(cluster: Cluster) -> Ledger:
    """The ledger as every process of the fleet sees it: REDIS_URL's server and the second
    ledger shard."""
    return Ledger.from_url(cluster.env["REDIS_URL"],
                           ledger_urls=(cluster.env["FLEETGEN_LEDGER_URLS"],))


def status_of(ledger: Ledger, job: str) -> JobStatus:
    return job_status(ledger, job)


def wait_done(cluster: Cluster, ledger: Ledger, job: str, at_least: int, timeout: float,
              what: str) -> None:
    def reached() -> bool:
        return int(status_of(ledger, job).done) >= at_least

    try:
        wait_until(reached, timeout, interval=0.5, what=what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}: {status_of(ledger, job)}\n{cluster.logs()}") from None


def seconds_for(cluster: Cluster, ledger: Ledger, job: str, prompts: int) -> float:
    """Seconds the fleet takes for the next `prompts` answers of `job`."""
    began, start = time.monotonic(), int(status_of(ledger, job).done)
    wait_done(cluster, ledger, job, start + prompts, 600, f"{prompts} more answers")
    return time.monotonic() - began


def finish_exactly_once(cluster: Cluster, ledger: Ledger, job: str, rows: list[dict[str, Any]],
                        tmp_path: Path) -> JobStatus:
    """Wait for the end of `job`, export it, and check every input id is there exactly once."""
    def over() -> bool:
        return bool(status_of(ledger, job).state == "done")

    try:
        wait_until(over, 900, interval=0.5, what=f"job {job} done")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}: {status_of(ledger, job)}\n{cluster.logs()}") from None
    status = status_of(ledger, job)
    assert (status.done, status.failed) == (len(rows), 0), status
    target = tmp_path / f"{job}-export.jsonl"
    export = cluster.producer("export", job, "--to", str(target))
    assert "missing 0" in export.stdout, export.stdout
    lines = [orjson.loads(x) for x in target.read_bytes().splitlines()]
    ids = [x.get("custom_id") or x.get("id") for x in lines]
    assert sorted(ids) == sorted(r.get("id") or r["custom_id"] for r in rows)
    assert max(collections.Counter(ids).values()) == 1
    return status


def until_back(r: redis.Redis, job: str, batches: set[str], host: str) -> Callable[[], bool]:
    """True once every one of `batches` is leased by a worker of another node, or done."""
    pending = set(batches)

    def back() -> bool:
        for batch in list(pending):
            owner = r.get(keys.lease(job, batch))
            elsewhere = owner is not None and not keys.lease_owner(owner.decode()).endswith(
                f"@{host}")
            if elsewhere or r.sismember(keys.job_part(job, "done"), batch):
                pending.discard(batch)
        return not pending

    return back


def test_a_third_node_joins_mid_job_takes_work_and_status_on_the_control_node_sees_every_gpu(
    cluster: Cluster, tmp_path: Path,
) -> None:
    cluster.start_node("node1")
    cluster.start_node("node2")
    ledger = fleet_ledger(cluster)
    rows = enqueue(cluster, tmp_path, "join", 900)
    wait_done(cluster, ledger, "join", 60, 300, "the job under way on two nodes")
    before = seconds_for(cluster, ledger, "join", 150)
    print(f"\njoin: 150 answers in {before:.1f}s on two nodes", flush=True)
    node3 = cluster.start_node("node3")
    wait_until(lambda: leases_held(ledger.r, "join", "node3"), 120, interval=0.2,
               what="node3 working on the job")
    print(f"join: node3 working at {status_of(ledger, 'join').done} answers", flush=True)
    wait_done(cluster, ledger, "join", int(status_of(ledger, "join").done) + 30, 300,
              "node3 warmed up")

    # `producer status` on the control node: every node's GPUs, read live at their published
    # address (the node's address on its route to Redis), grouped by node.
    out = cluster.producer("status", "join").stdout
    lines = out.splitlines()
    for name, node in cluster.nodes.items():
        assert f"  node {name}" in lines, out
        for worker in node.workers():
            row = next(line for line in lines if line.split()[:1] == [worker])
            assert row.split()[1] == "ready" and " down " not in row, row
    fleet = orjson.loads(cluster.producer("status", "join", "--json").stdout)["fleet"]
    by_worker = {row["worker"]: row for row in fleet}
    for node in cluster.nodes.values():
        for gpu, worker in enumerate(node.workers()):
            row = by_worker[worker]
            assert row["host"] == node.name
            assert row["server"] == f"http://{node.ns.address}:{30000 + gpu}"
            assert row["server_state"] == "up" and row["effective_max"] == 8, row
    entry = orjson.loads(ledger.r.hget(keys.WORKERS, node3.workers()[0]))
    assert entry["local_server"] == "http://127.0.0.1:30000"

    after = seconds_for(cluster, ledger, "join", 150)
    # A second job, enqueued while the first runs: the fleet puts it on the other Redis server
    # (the shard with the fewest active jobs), and runs both.
    small = enqueue(cluster, tmp_path, "small", 60)
    fleet = redis.Redis.from_url(cluster.env["REDIS_URL"])
    shard = redis.Redis.from_url(cluster.env["FLEETGEN_LEDGER_URLS"])
    raw = shard.get(keys.SHARD)  # the name the second server holds
    assert isinstance(raw, bytes) and raw.decode() != FLEET
    other = raw.decode()
    assert fleet.hgetall(keys.PLACEMENT) == {b"join": FLEET.encode(), b"small": raw}
    assert fleet.exists(keys.job("join")) and not shard.exists(keys.job("join"))
    assert shard.exists(keys.job("small")) and not fleet.exists(keys.job("small"))
    status = finish_exactly_once(cluster, ledger, "join", rows, tmp_path)
    finish_exactly_once(cluster, ledger, "small", small, tmp_path)
    listing = cluster.producer("jobs").stdout
    shown = {line.split()[0]: line for line in listing.splitlines()[1:] if line.strip()}
    assert FLEET in shown["join"] and other in shown["small"], listing
    assert shown["join"].split()[1] == "done" and shown["small"].split()[1] == "done", listing
    share = sum(int(w.get("prompts_done", 0)) for name, w in status.workers.items()
                if name.endswith("@node3"))
    assert share > 0
    ratio = before / after
    print(f"\ncluster join: {150 / before:.1f} prompts/s on 2 nodes, {150 / after:.1f} on 3 "
          f"(x{ratio:.2f}, ideal x1.5: {ratio / 1.5:.0%} of it); node3 answered {share} of "
          f"{len(rows)}")


def test_a_dead_nodes_batches_run_again_on_the_other_nodes(
    cluster: Cluster, tmp_path: Path,
) -> None:
    for name in ("node1", "node2", "node3"):
        cluster.start_node(name)
    ledger = fleet_ledger(cluster)
    # Enough for the job to outlast the kill: node2's batches cannot finish until they run
    # again elsewhere.
    rows = enqueue(cluster, tmp_path, "death", 600)
    wait_done(cluster, ledger, "death", 150, 300, "the job under way")
    wait_until(lambda: leases_held(ledger.r, "death", "node2"), 60, interval=0.1,
               what="node2 holding batches")
    held = leases_held(ledger.r, "death", "node2")
    cluster.node("node2").ns.kill()
    killed_at = time.monotonic()
    wait_until(until_back(ledger.r, "death", held, "node2"), 180, interval=0.2,
               what=f"node2's batches {sorted(held)} running elsewhere")
    back_s = time.monotonic() - killed_at
    finish_exactly_once(cluster, ledger, "death", rows, tmp_path)
    print(f"\ncluster node death: {len(held)} batches of the SIGKILLed node back in work on the "
          f"others after {back_s:.1f}s (lease TTL {cluster.env['FLEETGEN_LEASE_TTL_S']}s)")


def test_a_partitioned_node_loses_its_batches_and_takes_new_work_when_it_comes_back(
    cluster: Cluster, tmp_path: Path,
) -> None:
    for name in ("node1", "node2", "node3"):
        cluster.start_node(name)
    ledger = fleet_ledger(cluster)
    # Warm-up requests of the simulators count too: only what the job adds is compared.
    served_before = sum(cluster.requests_served(n) for n in cluster.nodes.values())
    rows = enqueue(cluster, tmp_path, "split", 1800)
    wait_done(cluster, ledger, "split", 150, 300, "the job under way")
    wait_until(lambda: leases_held(ledger.r, "split", "node3"), 60, interval=0.1,
               what="node3 holding batches")
    node3 = cluster.node("node3")
    held = leases_held(ledger.r, "split", node3.name)
    node3.ns.partition()
    cut_at = time.monotonic()
    try:
        wait_until(until_back(ledger.r, "split", held, node3.name), 180, interval=0.2,
                   what=f"node3's batches {sorted(held)} running elsewhere")
        back_s = time.monotonic() - cut_at
    finally:
        node3.ns.heal()
    cut_s = time.monotonic() - cut_at
    answered_at_heal = _answered_by(ledger, "split", node3.name)

    # Back on the network, node3 works again: its answers of the job grow.
    wait_until(lambda: _answered_by(ledger, "split", node3.name) > answered_at_heal, 180,
               interval=0.5, what="node3 answering again after the partition")
    finish_exactly_once(cluster, ledger, "split", rows, tmp_path)
    logs = "\n".join(p.read_text(errors="replace")
                     for p in (node3.run_dir / "logs").glob("worker_gpu*.log"))
    stopped = [b for b in held if f"batch split/{b}: stopped" in logs]
    assert stopped, f"node3's workers never stopped their lost batches {sorted(held)}"
    served = sum(cluster.requests_served(n) for n in cluster.nodes.values()) - served_before
    print(f"\ncluster partition: node3 cut off {cut_s:.1f}s; its {len(held)} batches back in "
          f"work elsewhere after {back_s:.1f}s; {len(stopped)} stopped by node3 itself; GPU "
          f"work done twice: {served - len(rows)} prompts ({served} answered for {len(rows)})")


def _answered_by(ledger: Ledger, job: str, host: str) -> int:
    workers = status_of(ledger, job).workers
    return sum(int(w.get("prompts_done", 0)) for name, w in workers.items()
               if name.endswith(f"@{host}"))
