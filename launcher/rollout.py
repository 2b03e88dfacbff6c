"""Restart orders (`Order`, `OrderError`) and the supervisor's part that rolls them out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from launcher.server import LaunchSpec
from launcher.slot import Slot

# The supervisor's logger: these lines were always logged as the supervisor's, and log
# filters and readers rely on that name.
log = logging.getLogger("launcher.supervisor")


@dataclass(frozen=True)
class Order:
    """Restart these GPUs with these specs (the same spec to just restart); from SIGHUP."""

    id: str
    specs: Mapping[int, LaunchSpec]
    rolling: bool = True


class OrderError(Exception):
    """A restart request that cannot be carried out (e.g. its new arguments are invalid)."""

    def __init__(self, order_id: str, reason: str) -> None:
        super().__init__(reason)
        self.order_id, self.reason = order_id, reason


class Rollouts:
    """Supervisor mixin: load, accept or reject, and carry out restart orders.

    Each GPU's own loop takes the spec handed to it (`Slot.order`) and settles its future;
    this part only decides which GPUs get an order and when.
    """

    # Set by the supervisor's __init__.
    slots: dict[int, Slot]
    load_order: Callable[[], Order | None]
    rollout: dict[str, Any] | None
    _tasks: list[asyncio.Task[None]]

    def changed(self) -> None:
        """Publish the current snapshot (the supervisor defines it)."""
        raise NotImplementedError

    def hangup(self) -> None:
        """SIGHUP: load a restart order (written by `launcher restart`) and start it."""
        try:
            order = self.load_order()
        except OrderError as exc:
            self._reject(exc.order_id, exc.reason)
            return
        except Exception:  # a broken request file must not take the node down
            log.exception("node: cannot load the restart request")
            return
        if order is not None:
            self.submit(order)

    def _reject(self, order_id: str, reason: str) -> None:
        self.rollout = {**(self.rollout or {}), "rejected": {"id": order_id, "reason": reason}}
        log.warning("node: restart %s rejected: %s", order_id, reason)
        self.changed()

    def submit(self, order: Order) -> None:
        """Start a rollout, unless one is running (then the order is recorded as rejected)."""
        unknown = sorted(set(order.specs) - set(self.slots))
        if (self.rollout is not None and self.rollout["state"] == "running") or unknown:
            why = f"GPU {unknown} not on this node" if unknown else \
                f"restart {self.rollout['id'] if self.rollout else ''} is still running"
            self._reject(order.id, why)
            return
        self.rollout = {"id": order.id, "state": "running", "rolling": order.rolling,
                        "gpus": sorted(order.specs), "done": [], "current": None,
                        "reason": None}
        self._tasks.append(asyncio.create_task(self._roll(order)))
        self.changed()

    async def _roll(self, order: Order) -> None:
        assert self.rollout is not None
        rollout, gpus = self.rollout, sorted(order.specs)
        log.info("node: restart %s of GPU %s (%s)", order.id, gpus,
                 "rolling" if order.rolling else "all at once")
        batches = [[g] for g in gpus] if order.rolling else [gpus]
        for n, batch in enumerate(batches):
            rollout["current"] = batch[0] if order.rolling else None
            self.changed()
            results = await asyncio.gather(*(self._order(g, order.specs[g]) for g in batch))
            failed = [(g, why) for g, why in zip(batch, results, strict=True) if why is not None]
            rollout["done"] += [g for g in batch if g not in dict(failed)]
            if failed:
                rest = [g for b in batches[n + 1:] for g in b]
                untouched = f"; GPU {rest} not restarted" if rest else ""
                rollout.update(state="failed", current=None, reason="; ".join(
                    f"GPU {g}: {why} (back on its previous arguments)" for g, why in failed)
                    + untouched)
                log.error("node: restart %s failed: %s", order.id, rollout["reason"])
                self.changed()
                return
        rollout.update(state="done", current=None)
        log.info("node: restart %s done", order.id)
        self.changed()

    def _order(self, gpu: int, spec: LaunchSpec) -> asyncio.Future[str | None]:
        slot = self.slots[gpu]
        slot.order = spec
        slot.order_done = asyncio.get_running_loop().create_future()
        return slot.order_done
