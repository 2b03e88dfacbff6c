"""Every Redis key, queue name and sink key fleetgen uses, spelled once.

Redis (the ledger, rebuildable from the sink):
    fg:jobs                      set    jobs not finished (creating, running, paused): what
                                        the reconciler walks
    fg:jobs:finished             zset   finished jobs (done, cancelled) -> when they finished;
                                        their keys expire FLEETGEN_JOB_RETENTION after it
    fg:workers                   hash   worker -> its server, state, capacity, in flight
    fg:tuning                    hash   node -> what its launcher's tuning does now (JSON:
                                        fleetgen/fleet.py `TuningNote`)
    fg:job:{job}                 hash   the job's fields, JOB_FIELDS below (manifest, state,
                                        reason, clock, canary, quality, breaker, rounds)
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
    fg:job:{job}:enqueue         string the job's lock (named when only enqueue took it): held
                                        by the enqueue creating or resuming the job, a
                                        `requeue`, a `rebuild` (fleetgen/creation.py)
    fg:job:{job}:workers         hash   "{worker}|{counter}" -> value, per-GPU throughput
    fg:job:{job}:minutes         hash   unix minute -> prompts done in it (rate, ETA)
    fg:job:{job}:worker_minutes  hash   "{worker}|{minute}|prompts|tokens" -> done in it, per
                                        GPU (`producer report`'s throughput over time)
    fg:job:{job}:failures        list   latest failure reasons (capped), newest first
    fg:job:{job}:recent          list   the canary's window of recent answers
    fg:job:{job}:outcomes        list   the failure breaker's window, newest first: "" per
                                        answer, the cause per failure (fleetgen/breaker.py)
    fg:job:{job}:progress_due    string set for 60 s after progress.json was written
    fg:job:{job}:progress_mark   string what the last progress.json of a stopped job said
    fg:job:{job}:extra           set    batches made by `requeue --failed`
    fg:ckpt:{job}:{batch}        hash   prompt id -> finished result (prompt-level resume)
    fg:calls:{job}:{batch}       hash   "{prompt id}#{k}" -> the result of a rollout's call k
                                        (the journal a rollout replays on resume; dropped
                                        with the checkpoint once the batch is written)
    fg:lease:{job}:{batch}       string owner token "{worker}/{random}", with TTL (heartbeat-renewed)
    fg:ownerless                 set    "{job}|{batch}|{token}" leases whose worker had no
                                        Redis connection at the last reconciler round
    fg:placement                 hash   job -> the ledger shard holding its keys (fleetgen/
                                        ledger/_shards.py); REDIS_URL's server only, like
                                        fg:workers. A job it does not name is on REDIS_URL's.
    fg:placement:expiry          zset   job -> when its keys expire (unix ms): its placement
                                        goes some time after (Jobs.settle)
    fg:shard                     string the name of the ledger shard this server (DB) is,
                                        minted once; on every shard, REDIS_URL's included
With FLEETGEN_LEDGER_URLS, fg:jobs, fg:jobs:finished and every per-job key above live on the
job's shard; fg:workers, fg:tuning, fg:reconciler, fg:ownerless, fg:placement (and its
expiry) and the broker's queues on REDIS_URL's server; each shard holds its own fg:shard.
Sink, under {output}/{job}/:
    manifest.json, inputs/{batch}.jsonl, results/{batch}.jsonl, errors/{batch}.jsonl,
    rejects.jsonl, progress.json (JOB_ENTRIES)
Batches: `b000001` ... in input order (enqueue), `r01-000001` ... for requeue round 1; rounds
past 99 have more digits (`r100-000001`), so batches are ordered by `batch_order`, never by name.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from typing import Literal, get_args

PREFIX = "fg"
# Every GPU worker consumes this queue besides its own gpuN queue, so fast GPUs take more work.
SHARED_QUEUE = "fleetgen"
# A server's own queue names the GPUs it holds: gpu3 for one GPU; gpu0-1 or gpu4-7 for a
# server over a range of GPUs (tensor, pipeline or data parallel); gpu0_2 when its GPUs are
# not one range. The first number, the server's lead GPU, is GPU_QUEUE's group 1.
GPU_QUEUE = re.compile(r"^gpu(\d+)((?:[-_]\d+)*)$")
# gpuN's worker (gpuN-M's too: N is its lead GPU) serves its metrics on METRICS_BASE_PORT + N,
# beside its server on 30000 + N. 20000 lies in a gap GPU nodes leave free: above the
# Prometheus exporters' block 9100-9999 (node_exporter 9100, NVIDIA's DCGM exporter 9400),
# Prometheus 9090, Flower 5555 and Ray's worker ports (10002-19999); below SGLang's random NCCL
# ports (22000-29999), its servers (30000 up) and the kernel's ephemeral range (32768 up).
# `launcher up --base-port` moves it with the servers, and every base it accepts (30000 to
# 31767) keeps it in that gap.
METRICS_BASE_PORT = 20000
TASK_RUN_BATCH = "fleetgen.run_batch"
# What the node supervisor sends a worker before it drains and restarts the worker's server
# (Celery leaves SIGUSR2 alone unless CELERY_RDBSIG is set).
RESTART_SIGNAL = signal.SIGUSR2
# Broker priorities (kombu on Redis: 0 is served first, one list per step of 0/3/6/9, and a
# worker pops the highest priority of all its queues first). Re-dispatched work goes before
# fresh work, whichever queue it is in.
REDRIVE_PRIORITY = 0
FRESH_PRIORITY = 6
# kombu's own Redis layout (its queue lists, the unacked hash) is read in fleetgen/broker.py.


def task_id(job: str, batch: str, nonce: str) -> str:
    """Task ids carry job and batch, so a broker scan can tell which batches are waiting."""
    return f"{job}:{batch}:{nonce}"


def parse_task_id(value: str) -> tuple[str, str] | None:
    parts = value.rsplit(":", 2)
    return (parts[0], parts[1]) if len(parts) == 3 else None


JOBS = f"{PREFIX}:jobs"
FINISHED_JOBS = f"{PREFIX}:jobs:finished"
# The parts of a job that live as long as it does, all expiring together once it finishes
# (Jobs.settle; its unfinished batches' checkpoints too). `enqueue` and `progress_due` are
# left out: they expire on their own, and must never be made to last.
JobPart = Literal["queued", "running", "done", "attempts", "causes", "stats", "written",
                  "workers", "minutes", "worker_minutes", "failures", "recent", "outcomes",
                  "extra", "progress_mark", "enqueue", "progress_due"]
JOB_PARTS: tuple[JobPart, ...] = tuple(
    part for part in get_args(JobPart) if part not in ("enqueue", "progress_due"))

# The fields of the job's hash fg:job:{job}, each written by the module named.
JOB_MANIFEST = "manifest"                  # the manifest's JSON (ledger)
JOB_STATE = "state"                        # creating, running, paused, cancelled (ledger)
JOB_REASON = "reason"                      # why it is paused or cancelled (ledger)
JOB_UPDATED = "updated"                    # when the manifest or state last changed (ledger)
JOB_STARTED_AT = "started_at"              # when it first ran (ledger)
JOB_LAST_WRITE_AT = "last_write_at"        # when a batch was last written (finish_batch.lua)
JOB_INPUTS_STORED = "inputs_stored"        # inputs stored so far while creating (enqueue)
JOB_ROUNDS = "requeue_rounds"              # the number of its last requeue round (ledger)
JOB_CANARY_SEEN = "canary_seen"            # answers the canary judged (quality)
JOB_CANARY_END = "canary_end"              # the canary's verdict, JSON (quality)
JOB_QUALITY_SEEN = "quality_seen"          # answers the quality watch judged (quality)
JOB_QUALITY_EXAMPLES = "quality_examples"  # the answers that paused it, JSON (quality)
JOB_QUALITY_ACCEPTED = "quality_accepted"  # when `resume --accept-quality` ran (control)
JOB_BREAKER_CAUSE = "breaker_cause"        # the failure cause that paused it (breaker)
JOB_BREAKER_EXAMPLE = "breaker_example"    # one failure of that cause, JSON (breaker)
JOB_BREAKER_ACCEPTED = "breaker_accepted"  # causes `resume --accept-failures` kept (control)
# What every job keeps under `{output}/{job}/`: no job may be named like one of them, or its
# folder could be taken for part of another job's (a `results` job inside a job's output).
SINK_MANIFEST = "manifest.json"
JOB_ENTRIES = (SINK_MANIFEST, "inputs", "results", "errors", "rejects.jsonl",
               "progress.json", ".fleetgen")
# hash: worker name -> its registry entry, JSON (fleetgen/fleet.py `WorkerEntry`)
WORKERS = f"{PREFIX}:workers"
TUNING = f"{PREFIX}:tuning"
RECONCILER_LOCK = f"{PREFIX}:reconciler"
# Redis CLIENT SETNAME of every connection a worker opens: its connections vanish from
# CLIENT LIST the moment its process dies (the reconciler's fast dead-worker signal).
WORKER_CLIENT_PREFIX = "fleetgen-worker:"
# set of "job|batch|token": leases whose owner had no connection at the last reconciler round
OWNERLESS = f"{PREFIX}:ownerless"
# hash: job -> the name of the ledger shard its keys live on (the shard's own fg:shard)
PLACEMENT = f"{PREFIX}:placement"
# zset: job -> when its finished job's keys expire (unix ms), for its placement to follow them
PLACEMENT_EXPIRY = f"{PREFIX}:placement:expiry"
# string: the ledger shard's name, written once (SET NX) by the first process that reaches the
# server as a shard, so that every process knows it by the same name however it spells its URL
SHARD = f"{PREFIX}:shard"
JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def worker_client(worker: str) -> str:
    return WORKER_CLIENT_PREFIX + re.sub(r"\s", "_", worker)


def lease_owner(token: str) -> str:
    """The worker in a lease token (`WORKER/RANDOM`, batch.py)."""
    return token.rsplit("/", 1)[0]


def gpu_queue(gpus: int | Sequence[int]) -> str:
    """The queue of the server on `gpus`: `gpu3`, `gpu0-1` (GPUs 0 and 1), `gpu0_2`."""
    indices = sorted({gpus} if isinstance(gpus, int) else set(gpus))
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return "gpu" + "_".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def job(name: str) -> str:
    return f"{PREFIX}:job:{name}"


def job_part(name: str, part: JobPart) -> str:
    return f"{PREFIX}:job:{name}:{part}"


def job_keys(name: str) -> list[str]:
    """The job's hash and every part of JOB_PARTS: what expires when it finishes."""
    return [job(name)] + [job_part(name, part) for part in JOB_PARTS]


def checkpoint(name: str, batch: str) -> str:
    return f"{PREFIX}:ckpt:{name}:{batch}"


def calls(name: str, batch: str) -> str:
    return f"{PREFIX}:calls:{name}:{batch}"


def call_field(answer: str, index: int) -> str:
    """The journal field of call `index` of the rollout of answer key `answer`."""
    return f"{answer}#{index}"


def lease(name: str, batch: str) -> str:
    return f"{PREFIX}:lease:{name}:{batch}"


def batch_id(index: int) -> str:
    return f"b{index:06d}"


# `requeue --failed` round N's batches; N has at least two digits and as many as it needs.
_REQUEUE_BATCH = re.compile(r"^r(\d+)-(\d+)$")
_BASE_BATCH = re.compile(r"^b(\d+)$")


def round_name(round_no: int) -> str:
    """Requeue round `round_no` (from 1) as its batch names begin: `r01`, ..., `r100`."""
    return f"r{round_no:02d}"


def requeue_batch_id(round_no: int, index: int) -> str:
    """The `index`th batch (from 1) of requeue round `round_no`."""
    return f"{round_name(round_no)}-{index:06d}"


def requeue_round(batch: str) -> int | None:
    """The requeue round a batch belongs to; None for a batch enqueue made (or no batch)."""
    match = _REQUEUE_BATCH.match(batch)
    return int(match[1]) if match else None


def batch_order(batch: str) -> tuple[int, int]:
    """Sort key of a job's batches: enqueued ones (round 0) in input order, then each requeue
    round by its number. By name, `r100-` would come before `r99-`."""
    match = _REQUEUE_BATCH.match(batch) or _BASE_BATCH.match(batch)
    if match is None:
        raise ValueError(f"{batch!r} is not a batch name")
    return (int(match[1]), int(match[2])) if match.re is _REQUEUE_BATCH else (0, int(match[1]))


def is_batch(name: str) -> bool:
    return bool(_REQUEUE_BATCH.match(name) or _BASE_BATCH.match(name))


def sink_manifest(name: str) -> str:
    return f"{name}/{SINK_MANIFEST}"


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
