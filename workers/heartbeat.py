"""A running batch's lease heartbeat: renew it, and stop the batch when it is lost.

The heartbeat also carries the job's state to the batch: a cancelled job stops it, a paused
one holds its unsent prompts (QualityWatch.held).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from fleetgen.errors import JobError, LeaseLostError
from fleetgen.ledger import STATE_CANCELLED, STATE_PAUSED
from fleetgen.liveledger import LiveLedger
from fleetgen.settings import Settings

log = logging.getLogger(__name__)


async def keep_lease(live: LiveLedger, settings: Settings, job: str, batch: str, token: str,
                     on_paused: Callable[[str, bool], None]) -> None:
    """Renew the lease; stop everything (self-fence) if it was lost or cannot be renewed."""
    last_ok = time.monotonic()
    ttl = settings.lease_ttl_s
    while True:
        await asyncio.sleep(settings.lease_renew_s)
        try:
            if not await live.renew_lease(job, batch, token, ttl):
                raise LeaseLostError(f"batch {job}/{batch}: lease taken over")
            last_ok = time.monotonic()
            state = await live.job_state(job)
            if state == STATE_CANCELLED:
                raise JobError(f"job {job} was cancelled")
            on_paused(job, state == STATE_PAUSED)
        except (LeaseLostError, JobError):
            raise
        except Exception as exc:  # Redis unreachable: keep working while the lease may live.
            if time.monotonic() - last_ok > ttl - 2 * settings.lease_renew_s:
                raise LeaseLostError(f"batch {job}/{batch}: cannot renew lease ({exc})") from exc
            log.info("batch %s/%s: lease renewal failed, retrying (%s)", job, batch, exc)


async def cancel(task: asyncio.Task[Any]) -> None:
    """Cancel until the task has ended: on Python 3.11 a cancel that lands while redis-py's
    `wait_for` completes is lost (CPython gh-86296), which left a finished batch renewing its
    lease forever."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)


async def follow(heartbeat: asyncio.Task[None]) -> None:
    """End as the heartbeat ends (raising what it raised); cancelling this leaves it running."""
    await asyncio.shield(heartbeat)


async def stop_heartbeat(heartbeat: asyncio.Task[None]) -> None:
    """Stop a batch's heartbeat at its release; a failure it ended with was acted on already."""
    await cancel(heartbeat)
    if not heartbeat.cancelled():
        heartbeat.exception()  # retrieved: it was the batch's to act on, not the loop's
