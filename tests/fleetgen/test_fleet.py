"""The workers' registry (fleetgen/fleet.py): each entry read as its worker wrote it."""

from __future__ import annotations

from dataclasses import asdict

import orjson

from fleetgen import keys
from fleetgen.fleet import (
    LOST_AFTER_S,
    ServerHealth,
    WorkerEntry,
    WorkerError,
    registry,
)
from fleetgen.ledger import Ledger
from fleetgen.readings import ServerReading
from tests.job_figures import (
    NOW,
    register,
)


def test_the_registry_reads_each_entry_as_its_worker_wrote_it_and_skips_what_is_not_one(
    ledger: Ledger,
) -> None:
    register(ledger, "gpu0@a", "http://127.0.0.1:30000", updated=NOW - 2, queues=["gpu0"],
             last_error={"error": "boom", "job": "j", "at": NOW - 5},
             reading=asdict(ServerReading("up", running=3, effective_max=8)))
    register(ledger, "gpu1@a", "http://127.0.0.1:30001", updated=NOW - LOST_AFTER_S - 1)
    ledger.r.hset(keys.WORKERS, mapping={"gpu2@a": b"not json", "gpu3@a": b'{"in_flight": 4}'})
    entries = registry(ledger, NOW)
    assert set(entries) == {"gpu0@a", "gpu1@a"}
    entry = entries["gpu0@a"]
    assert (entry.state, entry.queues, entry.age_s(NOW)) == ("ready", ["gpu0"], 2.0)
    assert entry.last_error == WorkerError(error="boom", job="j", at=NOW - 5)
    assert entry.reading == ServerReading("up", running=3, effective_max=8)
    assert WorkerEntry.from_json(entry.to_json()) == entry
    # Stale: its worker is gone.
    assert entries["gpu1@a"].state == "lost"


def test_a_task_results_server_is_its_health_with_the_failed_share_and_what_status_says() -> None:
    health = ServerHealth(window_s=300.0, answered=683, failed={"HTTP 500": 317}, refused={},
                          overloaded={"HTTP 429": 12}, in_rotation=False, out_since=NOW - 20,
                          out_reason="5 requests in a row failed (HTTP 500)", ejections=1,
                          limit=8, limit_reason="cut after HTTP 429")
    # As Celery stores it (JSON) and Flower shows it.
    result = orjson.loads(orjson.dumps(health.as_task_result()))
    says = result.pop("says")
    assert result.pop("failed_share") == 0.317
    assert ServerHealth(**result) == health
    assert says == health.summary() and says[0].startswith("out of rotation: 5 requests")
