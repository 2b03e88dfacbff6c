"""The workers' registry (fleetgen/fleet.py): each entry read as its worker wrote it."""

from __future__ import annotations

from dataclasses import asdict

from fleetgen import keys
from fleetgen.fleet import (
    LOST_AFTER_S,
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
