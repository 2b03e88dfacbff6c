"""How a shipped rollout asks several calls: one after another, or all at once.

Either way call k asks `bodies[k]` on every run, as a replay after a crash requires: the worker
numbers a call when it is made (before the call's first await), and `asyncio.gather` starts
its coroutines in list order. The outcomes come back in the bodies' order, a refused call as
its CallFailed, for the rollout to decide whether it fails the prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fleetgen.rollouts._contract import Body, CallFailed, Completion, Generate

Outcome = Completion | CallFailed


async def ask_in_turn(generate: Generate, bodies: Sequence[Body], *,
                      stop_at_failure: bool) -> list[Outcome]:
    """Each body once the call before it has ended; none after a refused one when
    `stop_at_failure`."""
    outcomes: list[Outcome] = []
    for body in bodies:
        try:
            outcomes.append(await generate(body))
        except CallFailed as exc:
            outcomes.append(exc)
            if stop_at_failure:
                break
    return outcomes


async def ask_together(generate: Generate, bodies: Sequence[Body]) -> list[Outcome]:
    """Every body at once. All calls are waited for, so that none is left running after the
    rollout ends; what ended a call other than CallFailed (the worker handing the prompt back,
    a replay that asked otherwise) is raised then, the first in order."""
    ended = await asyncio.gather(*(generate(body) for body in bodies), return_exceptions=True)
    outcomes: list[Outcome] = []
    for outcome in ended:
        if isinstance(outcome, BaseException) and not isinstance(outcome, CallFailed):
            raise outcome
        outcomes.append(outcome)
    return outcomes
