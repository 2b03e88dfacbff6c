"""The broker: one Celery configuration for every process that publishes or consumes batches.

`make_app` builds the Celery app from the settings: the worker's (`workers.app`, with its
tasks) and the producer's, which publishes by task name and never imports the worker.
Delivery is at-least-once with loss windows on Redis (docs/development/delivery.md);
correctness lives in leases, create-if-absent writes and the reconciler, so the broker settings
below only keep the broker from fighting them.

kombu's Redis transports are replaced by ones that fail like a lost connection once their
connection is gone:

When the broker connection drops, Celery's consumer lets kombu `collect()` the connection, which
detaches the transport from it (`transport.client = None`), and then closes it again; a batch
that finishes later acks its message on the same old channel. Either step can make the old
channel build a new Redis pool from the detached transport, and kombu then raises
`AttributeError` ("'NoneType' object has no attribute 'hostname'"), which neither Celery's
`ignore_errors` nor `ack_log_error` expects: the worker logged "Unrecoverable error" and exited
after a few Redis restarts in a row. A channel of a detached transport raises the Redis
`ConnectionError` instead, which both already handle as the broker loss it is; the message it
could not ack or restore comes back through the visibility timeout, and our leases cover the
batch either way.

kombu's Redis layout is read here too (`queue_lists`, `waiting_batches`): the lists that hold a
queue's messages and the hash of those delivered and not acked, where the reconciler and
enqueue look for the batches the broker still holds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson
import redis
from celery import Celery
from kombu import Queue  # type: ignore[attr-defined]
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

from fleetgen import keys, redisconn
from fleetgen.settings import Settings

# kombu's Redis transport keeps priority p > 0 of queue q in the list "q\x06\x16p"
# (keys.REDRIVE_PRIORITY, keys.FRESH_PRIORITY are steps of these).
_PRIORITY_STEPS = (0, 3, 6, 9)
# kombu's Redis transport: messages delivered to a worker and not acked yet (hash tag ->
# [message, exchange, routing key]) and when each was delivered (zset tag -> time).
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"


class _DetachedChannelFails:
    """Mixin for a kombu Redis channel: no new pool once the connection has been collected."""

    connection: Any

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection is None or self.connection.client is None:
            raise redis.ConnectionError("the broker connection was closed after a loss")
        params: dict[str, Any] = super()._connparams(asynchronous)  # type: ignore[misc]
        return params


class Channel(_DetachedChannelFails, kombu_redis.Channel):
    """A `redis://` channel."""


class SentinelChannel(_DetachedChannelFails, kombu_redis.SentinelChannel):
    """A `sentinel://` channel."""


class Transport(kombu_redis.Transport):
    """The `redis://` transport with `Channel`."""

    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    """The `sentinel://` transport with `SentinelChannel`."""

    Channel = SentinelChannel


def install() -> None:
    """Make kombu's Redis URL schemes (`redis`, `rediss`, `redis+socket`, `sentinel`) use these.

    kombu picks a transport by the URL's scheme from its alias table; replacing the entries
    keeps its URL parsing (TLS for `rediss://`, Sentinel lists, sockets) as it is.
    """
    redis_transport = f"{__name__}:Transport"
    TRANSPORT_ALIASES.update({"redis": redis_transport, "rediss": redis_transport,
                              "sentinel": f"{__name__}:SentinelTransport"})


def make_app(settings: Settings, include: Sequence[str] = ()) -> Celery:
    """The Celery app on the settings' broker; `include` names the task modules (the worker's)."""
    install()
    app = Celery("fleetgen", include=list(include))
    app.conf.update(
        broker_url=settings.redis_url,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_transport_options={
            # A safety net only: leases re-dispatch a dead worker's batch within a minute.
            "visibility_timeout": settings.visibility_timeout_s,
            "unacked_restore_interval": 10,
            "unacked_restore_throttle": 3,
            "unacked_mutex_expire": 60,
            # Own gpuN queue first, then the shared queue (kombu "priority" = order given in -Q).
            "queue_order_strategy": "priority",
            "socket_timeout": 30,
            "socket_connect_timeout": 5,
            "socket_keepalive": True,
            "health_check_interval": 10,
            # kombu's `sentinel://` transport asks the Sentinels for this master (redisconn.py).
            **({"master_name": settings.redis_master_name}
               if redisconn.is_sentinel(settings.redis_url) else {}),
        },
        # A message carries two strings (job, batch): Celery's own json is all it needs.
        task_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        event_serializer="json",
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure=True,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_prefetch_multiplier=1,
        # One process per GPU; its batches share one request limiter and the gate (gate.py) takes
        # the next batch when the prompts in hand run low. Threads, not prefork: the batches must
        # share one event loop (docs/development/delivery.md#pool; the chaos test kills Redis under
        # this layout).
        worker_pool="threads",
        worker_concurrency=settings.batch_concurrency,
        task_default_queue=keys.SHARED_QUEUE,
        task_queues=[Queue(keys.SHARED_QUEUE, routing_key=keys.SHARED_QUEUE)],
        task_create_missing_queues=True,
        worker_send_task_events=True,
        task_send_sent_event=True,
    )
    return app


def queue_lists(queue: str) -> list[str]:
    """The Redis lists that hold a queue's waiting messages, one per priority step."""
    return [queue if p == 0 else f"{queue}\x06\x16{p}" for p in _PRIORITY_STEPS]


def waiting_batches(r: redis.Redis, *, grace_s: float) -> set[tuple[str, str]]:
    """(job, batch) of every message waiting in a queue list or held unacked by a worker.

    An unacked message delivered more than `grace_s` ago whose batch has no lease belongs to
    a worker that died between taking it and leasing it; it does not count as waiting.
    Only kombu's JSON envelope is read (`headers.id`, the task id), never the body, so the
    task serializer does not matter; the layout does (see the kombu pin in pyproject.toml).
    """
    found: set[tuple[str, str]] = set()
    for name in r.scan_iter(match="*", count=1000, _type="list"):
        for raw in r.lrange(name, 0, -1):
            _collect_task(found, raw)
    now = time.time()
    indexed: list[tuple[bytes, float]] = r.zrange(  # type: ignore[assignment]
        UNACKED_INDEX, 0, -1, withscores=True)
    recent = {tag for tag, score in indexed if now - score < grace_s}
    unacked: dict[bytes, bytes] = r.hgetall(UNACKED)  # type: ignore[assignment]
    for tag, raw in unacked.items():
        if tag not in recent:
            continue
        try:
            _collect_task(found, orjson.dumps(orjson.loads(raw)[0]))
        except (orjson.JSONDecodeError, IndexError, TypeError):
            continue
    return found


def _collect_task(found: set[tuple[str, str]], raw: Any) -> None:
    """Add the (job, batch) of a kombu message envelope's task id, if it is one of ours."""
    try:
        message = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return
    task_id = (message.get("headers") or {}).get("id") if isinstance(message, dict) else None
    parsed = keys.parse_task_id(task_id) if isinstance(task_id, str) else None
    if parsed:
        found.add(parsed)
