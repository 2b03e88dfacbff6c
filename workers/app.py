"""The worker's Celery application: `celery -A workers worker -Q gpu0` and `celery -A workers flower`.

The broker configuration is the domain's (fleetgen/broker.py), shared with the producer; this
module adds the worker's tasks and Flower's defaults.
"""

from __future__ import annotations

import os
from pathlib import Path

from fleetgen import broker
from fleetgen.settings import Settings

settings = Settings.from_env()

# Flower reads its FLOWER_* variables when its command starts, after `-A workers` (or
# CELERY_APP=workers) has imported this module: point it at the installed package's defaults so
# `celery -A workers flower` loads them from any directory. --conf or FLOWER_CONF still win.
os.environ.setdefault("FLOWER_CONF", str(Path(__file__).with_name("flowerconfig.py")))

app = broker.make_app(settings, include=["workers.tasks"])
