"""The Redis ledger: job manifests, batch states, leases, checkpoints and counters.

A batch moves `queued -> running -> done`; `running` means a worker holds its lease. The ledger
is bookkeeping for speed and visibility: the sink decides what is done, and `rounds.restore`
puts back what a reading of the sink found (producer/rebuild.py) when Redis lost it or it is in
doubt. A finished job (done or cancelled) leaves the active jobs for the finished index, and its
keys expire FLEETGEN_JOB_RETENTION after it finished (`jobs.settle`).

One `Ledger` holds the clients; its parts are grouped by what their keys are (fleetgen/keys.py
lists them), each a small class over the same `Shards`: a job's keys live on one Redis, the
ledger shard it was placed on (REDIS_URL's own unless FLEETGEN_LEDGER_URLS adds others), and
each call goes to the shard of the job it names; a listing of jobs reads every shard. The
clients are the ledger's own: code outside fleetgen/ledger/ and fleetgen/liveledger.py calls
the parts' methods, never `ledger.r`.

    jobs       Jobs       the job's hash (manifest, state, clock), the active and finished
                          indexes, the job's lock, retention
    batches    Batches    queued, running and done batches, those waiting in the broker,
                          checkpoints, a written batch recorded once
    leases     Leases     a batch's lease, its attempts and their causes
    counters   Counters   live, written, per-worker and per-minute counters; progress.json's turn
    rounds     Rounds     `requeue --failed`'s rounds, the written work restored from the sink
    guards     Guards     what the canary and the failure breaker found, what the operator accepted
    registry   Registry   the workers' entries and connections, the reconciler's turn and the
                          ownerless leases (REDIS_URL's server only, as the broker)
    shards     Shards     the ledger shards, each named by its own fg:shard, which one holds
                          each job (`place`), and when a finished job's placement goes

The scripts (*.lua) sit beside the modules that load them, `script(name)` reads one (the
checkpoints' group commit, fleetgen/checkpoints.py, loads its own from here too); each file
says what its KEYS and ARGV are. The asyncio side, on a worker's loop, is
fleetgen/liveledger.py; kombu's queues are read in fleetgen/broker.py (`Batches.in_broker`
asks it).
"""

from fleetgen.ledger._batches import FAILURES_KEPT, Batches
from fleetgen.ledger._counters import Counters
from fleetgen.ledger._guards import (
    CanaryProgress,
    EndVerdict,
    FailureExample,
    Guards,
    QualityExample,
    QualityPause,
)
from fleetgen.ledger._jobs import (
    ACTIVE,
    FINISHED,
    GONE,
    JOB_STATES,
    STATE_CANCELLED,
    STATE_CREATING,
    STATE_PAUSED,
    STATE_RUNNING,
    FinishedSummary,
    JobLock,
    Jobs,
    JobTimes,
)
from fleetgen.ledger._leases import RENEW_LEASE, Leases
from fleetgen.ledger._ledger import Ledger
from fleetgen.ledger._registry import Registry
from fleetgen.ledger._replies import script
from fleetgen.ledger._rounds import Rounds
from fleetgen.ledger._shards import FLEET, Identities, Shards, UnknownShardError, mint

__all__ = [
    "ACTIVE", "FAILURES_KEPT", "FINISHED", "FLEET", "GONE", "JOB_STATES", "RENEW_LEASE",
    "STATE_CANCELLED", "STATE_CREATING", "STATE_PAUSED", "STATE_RUNNING", "Batches",
    "CanaryProgress", "Counters", "EndVerdict", "FailureExample", "FinishedSummary", "Guards",
    "Identities", "JobLock", "JobTimes", "Jobs", "Leases", "Ledger", "QualityExample",
    "QualityPause", "Registry", "Rounds", "Shards", "UnknownShardError", "mint", "script",
]
