"""The Celery application: `celery -A workers worker -Q gpu0` and `celery -A workers flower`.

Delivery is at-least-once with loss windows on Redis (docs/development/delivery.md);
correctness lives in leases, create-if-absent writes and the reconciler, so the broker settings
below only keep the broker from fighting them.
"""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery
from kombu import Queue  # type: ignore[attr-defined]

from workers import broker, keys, redisconn
from workers.settings import Settings

settings = Settings.from_env()

# Flower reads its FLOWER_* variables when its command starts, after `-A workers` (or
# CELERY_APP=workers) has imported this module: point it at the installed package's defaults so
# `celery -A workers flower` loads them from any directory. --conf or FLOWER_CONF still win.
os.environ.setdefault("FLOWER_CONF", str(Path(__file__).with_name("flowerconfig.py")))

# kombu's Redis channels fail like the lost connection they are once it is gone (broker.py).
broker.install()

app = Celery("fleetgen", include=["workers.tasks"])
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
