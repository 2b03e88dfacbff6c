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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from celery import Celery
from kombu import Queue  # type: ignore[attr-defined]
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

from fleetgen import keys, redisconn
from fleetgen.settings import Settings


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
