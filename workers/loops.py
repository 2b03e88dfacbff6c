"""The event loop every fleetgen process runs its asyncio side on.

uvloop when it is installed (a dependency on Linux and macOS), because the worker's loop thread
is the one place a worker spends CPU per prompt: uvloop's socket transports and callbacks cut
that cost by about a third. The standard loop otherwise; both behave the same to our code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import ModuleType

uvloop: ModuleType | None
try:
    import uvloop
except ImportError:  # Windows, or an install without it
    uvloop = None


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    if uvloop is None:
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def new_event_loop() -> asyncio.AbstractEventLoop:
    return loop_factory()()


def name() -> str:
    return "uvloop" if uvloop is not None else "asyncio"
