"""The Celery worker (`celery -A workers worker -Q gpu0`): one process per server, taking
batches from its queues, keeping its server full and writing what it answers to the sink.
The job's state and every view of it are the domain's (the `fleetgen` package).

Importing this package builds nothing and reads no environment: the Celery app is built the
first time Celery (or a caller) asks for `workers.app`.
"""

from __future__ import annotations

import sys
from typing import Any


def __getattr__(name: str) -> Any:
    # `celery -A workers` looks up `workers.app`; only then is the app built (workers/app.py).
    if name == "app":
        from fleetgen.redact import redact
        from fleetgen.settings import SettingsError

        try:
            from workers.app import app
        except SettingsError as exc:
            # Celery would print a traceback: one `error:` line and exit 2, as every fleetgen
            # command says a bad setting.
            print(f"error: {redact(exc)}", file=sys.stderr)
            raise SystemExit(2) from None
        return app
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
