"""The ledger over two Redis servers: jobs placed on each, every part's keys of a job on its
shard, listings that merge both, and REDIS_URL's server as the shard of a job never placed.

Two real Valkey servers: the session's (REDIS_URL's, shard 0, also the broker and registry)
and a second one this module starts the same way (AOF on, its own port and data dir).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis import Redis

from fleetgen import keys
from fleetgen.checkpoints import Entry
from fleetgen.errors import UnknownJobError
from fleetgen.ledger import FLEET, FailureExample, Ledger, UnknownShardError
from fleetgen.ledger._shards import PLACEMENT_GRACE_S
from fleetgen.liveledger import LiveLedger
from fleetgen.settings import Settings, SettingsError, ledger_shard_name
from launcher.services import RedisServer
from tests.stack import make_job

# A second Valkey process of this module's own: end to end by the marker's definition.
pytestmark = pytest.mark.e2e

OTHER = "other"  # the second server's address in these tests (its name is minted from it)


@pytest.fixture(scope="module")
def second_server(valkey_bin: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[RedisServer]:
    with RedisServer(data_dir=tmp_path_factory.mktemp("redis-shard"), binary=valkey_bin) as server:
        yield server


@pytest.fixture
def second(second_server: RedisServer) -> Iterator[Any]:
    client = second_server.client()
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def sharded(redis_client: Any, second: Any) -> Ledger:
    """A ledger on the session's Redis (shard 0) and the second server."""
    return Ledger(redis_client, shards={OTHER: second})


def keys_on(client: Any) -> set[str]:
    return {k.decode() for k in client.scan_iter(match="fg:*")}


def shard_at(ledger: Ledger, address: str) -> str:
    """The name of the shard `address` reaches, as its server holds it."""
    ledger.shards.names()
    return {a: name for name, a in ledger.shards.ids.address.items()}[address]


def placed(ledger: Ledger, name: str, address: str) -> None:
    """Place `name` on the shard at `address` as enqueue would have."""
    ledger.r.hset(keys.PLACEMENT, name, shard_at(ledger, address))


def test_a_new_job_goes_to_the_shard_with_the_fewest_active_jobs(sharded: Ledger,
                                                                 redis_client: Any) -> None:
    other = shard_at(sharded, OTHER)
    assert sharded.shards.place("first") == FLEET  # a tie goes to the first listed
    make_job(sharded, "first", "/tmp/out")
    assert sharded.shards.place("second") == other
    make_job(sharded, "second", "/tmp/out")
    assert sharded.shards.place("third") == FLEET
    assert redis_client.hgetall(keys.PLACEMENT) == {
        b"first": FLEET.encode(), b"second": other.encode(), b"third": FLEET.encode()}


def test_a_placed_job_keeps_its_shard_when_enqueued_again(sharded: Ledger) -> None:
    placed(sharded, "busy", OTHER)
    make_job(sharded, "busy", "/tmp/out")
    for i in range(3):
        make_job(sharded, f"filler{i}", "/tmp/out")  # on shard 0: no placement
    assert sharded.shards.place("busy") == shard_at(sharded, OTHER)


def test_a_job_with_no_placement_is_on_shard_0_and_stays_there(sharded: Ledger,
                                                                redis_client: Any,
                                                                second: Any) -> None:
    make_job(sharded, "old", "/tmp/out")  # made before the shards: no placement
    assert keys.job("old") in keys_on(redis_client) and keys_on(second) == set()
    assert sharded.jobs.load("old").name == "old"
    # Its enqueue run again places it where it is, not on the emptier shard.
    assert sharded.shards.place("old") == FLEET


def test_every_part_writes_a_job_on_its_own_shard(sharded: Ledger, redis_client: Any,
                                                  second: Any) -> None:
    placed(sharded, "far", OTHER)
    for name in ("far", "near"):
        make_job(sharded, name, "/tmp/out", prompts=20, batch_size=10)
        sharded.batches.mark_queued_and_settle(name, ["b000001", "b000002"])
        assert sharded.leases.acquire(name, "b000001", "w/1", 30) == 1
        sharded.leases.note_cause(name, "b000001", "test")
        assert sharded.leases.release(name, "b000001", "w/1", refund=True)
        assert sharded.leases.acquire(name, "b000001", "w/2", 30) == 1
        sharded.counters.claim_progress_turn(name, time.time(), 60)
        sharded.counters.set_progress_mark(name, b"{}")
        sharded.guards.accept_causes(name, ["http_500"])
        sharded.rounds.next(name, 0)
        sharded.rounds.record(name, ["r01-000001"], {"http_500": 1})
        assert sharded.batches.finish_and_settle(name, "b000001", {"prompts_done": 10}, "w", [])
        with sharded.jobs.lock(name, 5):
            pass
    far, near = keys_on(second), keys_on(redis_client)
    assert {k for k in far if "near" in k} == set()
    assert {k for k in near if "far" in k} == set()
    assert {keys.job("far"), keys.job_part("far", "done"), keys.job_part("far", "attempts"),
            keys.job_part("far", "causes"), keys.job_part("far", "progress_mark"),
            keys.job_part("far", "extra"), keys.job_part("far", "stats"),
            keys.job_part("far", "written"), keys.lease("far", "b000001"), keys.JOBS} <= far
    # What each job's reads return comes from its shard.
    for name in ("far", "near"):
        assert sharded.batches.done(name) == {"b000001"}
        assert sharded.leases.token(name, "b000001") == "w/2"
        assert sharded.guards.accepted_causes_raw(name) == b'["http_500"]'
        assert sharded.counters.counts(name)[2] == 1
    # The placement, the broker's and the registry's keys stay on REDIS_URL's server.
    assert keys.PLACEMENT in near and keys.PLACEMENT not in far


def test_listings_merge_the_jobs_of_every_shard(sharded: Ledger) -> None:
    placed(sharded, "far", OTHER)
    placed(sharded, "far-done", OTHER)
    for name in ("near", "far", "near-done", "far-done"):
        make_job(sharded, name, "/tmp/out", prompts=10, batch_size=10)
    for name in ("near-done", "far-done"):
        sharded.batches.finish_and_settle(name, "b000001", {"prompts_done": 10}, "w", [])
    assert sharded.jobs.active() == ["far", "near"]
    assert set(sharded.jobs.finished()) == {"near-done", "far-done"}
    assert sharded.jobs.names() == ["far", "far-done", "near", "near-done"]
    raws = sharded.jobs.manifests_raw(["near", "far", "gone"])
    assert [raw is not None for raw in raws] == [True, True, False]
    summaries = sharded.jobs.finished_summaries(["far-done", "near-done"])
    assert [s.prompts_done if s else None for s in summaries] == [10, 10]


def test_a_shard_out_of_reach_leaves_its_jobs_out_and_the_others_listed(
        redis_client: Any, valkey_bin: Path, tmp_path: Path) -> None:
    with RedisServer(data_dir=tmp_path / "down", binary=valkey_bin) as down:
        client = down.client()
        ledger = Ledger(redis_client, shards={OTHER: client})
        placed(ledger, "far", OTHER)
        make_job(ledger, "far", "/tmp/out")
        make_job(ledger, "near", "/tmp/out")
        assert ledger.jobs.active() == ["far", "near"]
    assert ledger.jobs.active() == ["near"]
    assert ledger.shards.down == {shard_at(ledger, OTHER)}
    assert ledger.shards.place("new") == FLEET  # placed only where it can run
    client.close()


def test_a_placement_on_a_shard_this_process_does_not_know_is_refused(sharded: Ledger,
                                                                      redis_client: Any) -> None:
    sharded.r.hset(keys.PLACEMENT, "elsewhere", "10.9.9.9:6379/0~abcdef")
    with pytest.raises(UnknownShardError, match="10.9.9.9:6379/0~abcdef, which this process "
                       "was not given: FLEETGEN_LEDGER_URLS must list"):
        sharded.jobs.load("elsewhere")


def test_an_unknown_job_is_looked_for_on_shard_0(sharded: Ledger) -> None:
    with pytest.raises(UnknownJobError, match="ledger shard"):
        sharded.jobs.load("nobody")


def test_the_live_ledger_routes_each_job_to_its_shard(sharded: Ledger, redis_server: Any,
                                                      second_server: RedisServer,
                                                      redis_client: Any, second: Any) -> None:
    placed(sharded, "far", OTHER)
    for name in ("far", "near"):
        make_job(sharded, name, "/tmp/out", prompts=10, batch_size=10)
        sharded.leases.acquire(name, "b000001", "w/1", 30)
    judged: list[tuple[str, int, int]] = []

    async def judge(job: str, before: int, after: int) -> None:
        judged.append((job, before, after))

    async def run() -> dict[str, Any]:
        live = LiveLedger(aioredis.Redis.from_url(redis_server.url),
                          {OTHER: aioredis.Redis.from_url(second_server.url)})
        try:
            writer = live.checkpoint_writer("w", judge, lambda job: 0, 0.0)
            out: dict[str, Any] = {}
            for name in ("far", "near"):
                out[name] = (
                    await live.renew_lease(name, "b000001", "w/1", 30),
                    await live.job_state(name),
                    await writer.add(Entry(name, "b000001", "p1", b'{"id": "p1"}',
                                           {"prompts_done": 1}, b"{}")),
                )
                await live.journal_call(name, "b000001", "p1#0", b"x")
                await live.pause_by_breaker(name, "stop", "http_500",
                                            FailureExample("p1", "http_500", "m"))
            await live.publish_worker("w", b"{}")
            return out
        finally:
            await live.aclose()

    found = asyncio.run(run())
    assert found == {"far": (True, "running", True), "near": (True, "running", True)}
    assert second.hget(keys.job("far"), keys.JOB_BREAKER_CAUSE) == b"http_500"
    assert redis_client.hget(keys.job("near"), keys.JOB_BREAKER_CAUSE) == b"http_500"
    assert {keys.checkpoint("far", "b000001"), keys.calls("far", "b000001")} <= keys_on(second)
    assert {k for k in keys_on(redis_client) if "far" in k} == set()
    assert redis_client.hexists(keys.WORKERS, "w") and not second.exists(keys.WORKERS)


def test_the_setting_lists_extra_servers_and_hides_their_passwords() -> None:
    settings = Settings.from_env({
        "REDIS_URL": "redis://a:6379/0",
        "FLEETGEN_LEDGER_URLS": "redis://:s3cret@b:6380/0, redis://c/2"})
    assert settings.ledger_urls == ("redis://:s3cret@b:6380/0", "redis://c/2")
    assert [ledger_shard_name(u) for u in settings.ledger_urls] == ["b:6380/0", "c:6379/2"]
    assert "s3cret" not in repr(settings)
    assert Settings.from_env({}).ledger_urls == ()


@pytest.mark.parametrize(("urls", "why"), [
    ("redis://b:6379/0,redis://:pw@b:6379", "twice"),
    ("sentinel://s1:26379", "redis://, rediss:// or unix://"),
])
def test_the_setting_refuses_what_cannot_be_a_shard(urls: str, why: str) -> None:
    with pytest.raises(SettingsError, match=why) as caught:
        Settings.from_env({"FLEETGEN_LEDGER_URLS": urls})
    assert "pw" not in str(caught.value)


def test_one_redis_means_no_placement_is_read_or_written(ledger: Ledger,
                                                         redis_client: Any) -> None:
    assert not ledger.shards.several
    assert ledger.shards.place("solo") == FLEET
    make_job(ledger, "solo", "/tmp/out")
    assert not redis_client.exists(keys.PLACEMENT)


def test_a_shard_is_named_by_its_address_never_its_credentials() -> None:
    assert ledger_shard_name("redis://user:pw@10.0.0.3:6380/1") == "10.0.0.3:6380/1"
    assert ledger_shard_name("unix:///run/valkey.sock") == "/run/valkey.sock"


def test_a_shard_has_one_name_however_its_url_is_spelled(redis_client: Any,
                                                        second_server: RedisServer,
                                                        second: Any) -> None:
    """Two processes that spell the second server differently place and find a job alike."""
    pw = second_server.password
    one = Ledger(redis_client, shards={
        f"127.0.0.1:{second_server.port}/0": Redis(host="127.0.0.1", port=second_server.port,
                                                   password=pw)})
    two = Ledger(redis_client, shards={
        f"localhost:{second_server.port}/0": Redis(host="localhost", port=second_server.port,
                                                   password=pw)})
    placed(one, "far", f"127.0.0.1:{second_server.port}/0")
    make_job(one, "far", "/tmp/out")
    name = second.get(keys.SHARD).decode()
    assert name.startswith(f"127.0.0.1:{second_server.port}/0~")  # minted once, by the first
    assert two.shards.name_of("far") == name
    assert two.jobs.load("far").name == "far"
    assert redis_client.get(keys.SHARD) == FLEET.encode()


def test_two_urls_of_one_server_are_refused(redis_client: Any, second_server: RedisServer,
                                            second: Any) -> None:
    ledger = Ledger(redis_client, shards={"a": second_server.client(),
                                          "b": second_server.client()})
    with pytest.raises(SettingsError, match="a and b are the same server .* list it once"):
        ledger.shards.place("new")
    assert not redis_client.hexists(keys.PLACEMENT, "new")


def test_redis_urls_own_server_as_a_shard_is_refused(redis_client: Any,
                                                     redis_server: Any) -> None:
    ledger = Ledger(redis_client, shards={"again": redis_server.client()})
    with pytest.raises(SettingsError, match="again is REDIS_URL's own server"):
        ledger.jobs.active()


def test_a_process_given_no_shard_names_the_shard_of_a_job_placed_on_one(
        sharded: Ledger, ledger: Ledger) -> None:
    placed(sharded, "far", OTHER)
    make_job(sharded, "far", "/tmp/out")
    other = shard_at(sharded, OTHER)
    with pytest.raises(UnknownShardError, match=f"job far is on the ledger shard {other}, "
                       "which this process was not given: FLEETGEN_LEDGER_URLS must list"):
        ledger.jobs.load("far")
    assert ledger.shards.strangers() == {other: ["far"]}
    assert sharded.shards.strangers() == {}


def test_a_rebuilt_job_goes_to_the_shard_holding_its_hash_or_the_emptiest(
        sharded: Ledger, redis_client: Any, second: Any) -> None:
    placed(sharded, "kept", OTHER)
    make_job(sharded, "kept", "/tmp/out")
    for name in ("busy", "busier"):
        make_job(sharded, name, "/tmp/out")  # shard 0 has more active jobs
    redis_client.delete(keys.PLACEMENT)  # REDIS_URL's server lost its data
    fresh = Ledger(redis_client, shards={OTHER: second})
    assert fresh.shards.place("kept") == shard_at(sharded, OTHER)
    assert fresh.shards.place("lost") == shard_at(sharded, OTHER)  # the fewest active jobs


def test_a_finished_jobs_placement_goes_after_its_keys(sharded: Ledger,
                                                       redis_client: Any) -> None:
    placed(sharded, "old", OTHER)
    placed(sharded, "again", OTHER)
    for name in ("old", "again"):
        make_job(sharded, name, "/tmp/out", prompts=10, batch_size=10)
        sharded.batches.finish_and_settle(name, "b000001", {"prompts_done": 10}, "w", [])
    assert redis_client.zscore(keys.PLACEMENT_EXPIRY, "old") is not None
    sharded.shards.place("again")  # enqueued again: its placement stays
    later = time.time() + sharded.jobs.job_retention + PLACEMENT_GRACE_S + 60
    placed(sharded, "new", OTHER)
    make_job(sharded, "new", "/tmp/out", prompts=10, batch_size=10)
    sharded.batches.finish_and_settle("new", "b000001", {"prompts_done": 10}, "w", [])
    sharded.jobs.settle("new", now=later)
    assert not redis_client.hexists(keys.PLACEMENT, "old")
    assert redis_client.hexists(keys.PLACEMENT, "again")
    assert redis_client.hexists(keys.PLACEMENT, "new")
