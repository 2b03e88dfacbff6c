"""The worker's Celery application: `celery -A workers worker -Q gpu0` and `celery -A workers flower`.

The broker configuration is the domain's (fleetgen/broker.py), shared with the producer; this
module adds the worker's tasks and Flower's defaults, and turns off Celery's gossip and mingle
in every worker of this app, with or without `--without-gossip --without-mingle`.

fleetgen uses neither: gossip is Celery's worker-to-worker chatter (elections, join and leave
events) and mingle its start-up sync with other workers (revoked task ids, clocks); the fleet's
workers know of each other through the registry in Redis. And Celery's gossip step does not
stop cleanly after a broker loss: the consumer drops its connection before it stops its steps,
so when closing gossip's channel fails on the lost Redis, Celery's cleanup reads the dropped
connection and logs "Error on restarting Gossip: AttributeError(...)" with six chained
tracebacks, on many a Redis restart.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import signals

from fleetgen import broker
from fleetgen.settings import Settings

settings = Settings.from_env()

# Flower reads its FLOWER_* variables when its command starts, after `-A workers` (or
# CELERY_APP=workers) has imported this module: point it at the installed package's defaults so
# `celery -A workers flower` loads them from any directory. --conf or FLOWER_CONF still win.
os.environ.setdefault("FLOWER_CONF", str(Path(__file__).with_name("flowerconfig.py")))

app = broker.make_app(settings, include=["workers.tasks"])


@signals.worker_init.connect
def _without_gossip_or_mingle(sender: Any, **_: Any) -> None:
    """What `--without-gossip --without-mingle` set. The worker's options become its consumer's
    just after this signal, which builds its gossip and mingle steps from them."""
    if sender.app is app:
        sender.options.update(without_gossip=True, without_mingle=True)
