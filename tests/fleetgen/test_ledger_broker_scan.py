"""The reconciler reads kombu's Redis layout to tell a waiting batch from a lost one.

Messages are published by the workers' own Celery app and taken by kombu's own channel, so
the test sees exactly what a worker leaves in Redis: one list per queue and priority
(`gpu0`, `gpu0\\x06\\x166`, ...) and the `unacked` hash indexed by `unacked_index`.
"""

from __future__ import annotations

from typing import Any

from fleetgen.dispatch import dispatch
from fleetgen.ledger import Ledger


def test_batches_waiting_in_any_priority_list_or_held_unacked_are_found(
    celery_app: Any, redis_url: str, redis_client: Any
) -> None:
    ledger = Ledger.from_url(redis_url)
    dispatch(celery_app, ledger, "job", ["fresh"], "gpu0")
    dispatch(celery_app, ledger, "job", ["redriven"], "gpu0", redrive=True)
    dispatch(celery_app, ledger, "job", ["taken"], "gpu1")
    with celery_app.connection_for_read() as conn:
        # Taken by a consumer and not acked yet: kombu moves it to the unacked hash.
        taken = conn.default_channel.basic_get("gpu1", no_ack=False)
        assert taken is not None and taken.headers["id"].startswith("job:taken:")
        assert redis_client.hlen("unacked") == 1

        assert ledger.batches.in_broker(grace_s=60) == {
            ("job", "fresh"), ("job", "redriven"), ("job", "taken")}
        # Held unacked longer than the grace period: its worker died before leasing it.
        assert ledger.batches.in_broker(grace_s=0) == {("job", "fresh"), ("job", "redriven")}
