"""Every Redis key, queue name and sink key fleetgen uses, spelled once.

Redis (the ledger, rebuildable from the sink):
    fg:jobs                      set    job names
    fg:workers                   hash   worker -> its server, state, capacity, in flight
    fg:job:{job}                 hash   manifest (json), state, reason, created/updated
    fg:job:{job}:queued          zset   batch -> time dispatched to the broker
    fg:job:{job}:running         zset   batch -> time its lease was taken
    fg:job:{job}:done            set    batches whose result object exists in the sink
    fg:job:{job}:attempts        hash   batch -> attempts spent: leases taken and not handed
                                        back (its worker died, lost the lease, or failed)
    fg:job:{job}:causes          hash   batch -> why its last attempt ended unfinished
    fg:job:{job}:stats           hash   live counters, moved per prompt at its checkpoint
                                        (answers, tokens, finish reasons, bytes ...)
    fg:job:{job}:written         hash   what the sink holds: prompts done, failed, failed by
                                        code; moved once per written batch (export's figures)
    fg:job:{job}:enqueue         string lock held by the enqueue creating or resuming the job
    fg:job:{job}:workers         hash   "{worker}|{counter}" -> value, per-GPU throughput
    fg:job:{job}:minutes         hash   unix minute -> prompts done in it (rate, ETA)
    fg:job:{job}:worker_minutes  hash   "{worker}|{minute}|prompts|tokens" -> done in it, per
                                        GPU (`producer report`'s throughput over time)
    fg:job:{job}:failures        list   latest failure reasons (capped), newest first
    fg:job:{job}:recent          list   the canary's window of recent answers
    fg:job:{job}:outcomes        list   the failure breaker's window, newest first: "" per
                                        answer, the cause per failure (workers/breaker.py)
    fg:job:{job}:progress_due    string set for 60 s after progress.json was written
    fg:job:{job}:extra           set    batches made by `requeue --failed`
    fg:ckpt:{job}:{batch}        hash   prompt id -> finished result (prompt-level resume)
    fg:lease:{job}:{batch}       string owner token "{worker}/{random}", with TTL (heartbeat-renewed)
    fg:ownerless                 set    "{job}|{batch}|{token}" leases whose worker had no
                                        Redis connection at the last reconciler round
Sink, under {output}/{job}/:
    manifest.json, inputs/{batch}.jsonl, results/{batch}.jsonl, errors/{batch}.jsonl
"""

from __future__ import annotations

import re

PREFIX = "fg"
# Every GPU worker consumes this queue besides its own gpuN queue, so fast GPUs take more work.
SHARED_QUEUE = "fleetgen"
GPU_QUEUE = re.compile(r"^gpu(\d+)$")
TASK_RUN_BATCH = "fleetgen.run_batch"
# Broker priorities (kombu on Redis: 0 is served first, one list per step of 0/3/6/9, and a
# worker pops the highest priority of all its queues first). Re-dispatched work goes before
# fresh work, whichever queue it is in.
REDRIVE_PRIORITY = 0
FRESH_PRIORITY = 6
# kombu's Redis transport keeps priority p > 0 of queue q in the list "q\x06\x16p".
_PRIORITY_STEPS = (0, 3, 6, 9)


def broker_lists(queue: str) -> list[str]:
    """The Redis lists that hold a queue's waiting messages, one per priority step."""
    return [queue if p == 0 else f"{queue}\x06\x16{p}" for p in _PRIORITY_STEPS]

JOBS = f"{PREFIX}:jobs"
# hash: worker node name -> json {server, state, capacity, in_flight, updated}
WORKERS = f"{PREFIX}:workers"
RECONCILER_LOCK = f"{PREFIX}:reconciler"
# Redis CLIENT SETNAME of every connection a worker opens: its connections vanish from
# CLIENT LIST the moment its process dies (the reconciler's fast dead-worker signal).
WORKER_CLIENT_PREFIX = "fleetgen-worker:"
# set of "job|batch|token": leases whose owner had no connection at the last reconciler round
OWNERLESS = f"{PREFIX}:ownerless"
JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def worker_client(worker: str) -> str:
    return WORKER_CLIENT_PREFIX + re.sub(r"\s", "_", worker)


def lease_owner(token: str) -> str:
    """The worker in a lease token (`WORKER/RANDOM`, batch.py)."""
    return token.rsplit("/", 1)[0]


def gpu_queue(index: int) -> str:
    return f"gpu{index}"


def job(name: str) -> str:
    return f"{PREFIX}:job:{name}"


def job_part(name: str, part: str) -> str:
    return f"{PREFIX}:job:{name}:{part}"


def checkpoint(name: str, batch: str) -> str:
    return f"{PREFIX}:ckpt:{name}:{batch}"


def lease(name: str, batch: str) -> str:
    return f"{PREFIX}:lease:{name}:{batch}"


def batch_id(index: int) -> str:
    return f"b{index:06d}"


def sink_manifest(name: str) -> str:
    return f"{name}/manifest.json"


def sink_input(name: str, batch: str) -> str:
    return f"{name}/inputs/{batch}.jsonl"


def sink_result(name: str, batch: str) -> str:
    return f"{name}/results/{batch}.jsonl"


def sink_errors(name: str, batch: str) -> str:
    return f"{name}/errors/{batch}.jsonl"


def sink_results_prefix(name: str) -> str:
    return f"{name}/results/"


def sink_errors_prefix(name: str) -> str:
    return f"{name}/errors/"
