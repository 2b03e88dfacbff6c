"""A hung server (`--hang chat|partial`): generation requests are taken and never answered,
while the routes that probe the server (`/health`, `/metrics`, `/v1/models`, ...) answer as
before, as when a GPU or an NCCL collective hangs behind a healthy HTTP front end.

- `chat`: nothing of an answer goes out, not even its status line.
- `partial`: the status line and the headers go out (with the content-length of the whole
  body), then the first half of the body, then nothing.

The hang acts where an answer leaves the server (`Gate`, on every message of a generation
request), so requests already under way stop too: one not yet answered sends nothing, a stream
stops at its next chunk. The scheduler does not hang: its requests finish on time and free
their slots; only their answers wait.

A held message waits until the hang ends, then goes out (the request completes, late), or
until its client leaves: then it and everything after it are dropped, and the request ends
quietly. A server shutting down closes the connections of held requests, as a dying process
would, rather than wait for them (`HELD` marks them in their ASGI scope).
"""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive, Scope, Send

HANGS = ("chat", "partial")
HELD = "sim.held"  # ASGI scope key: the request's answer is held by the hang now


class Hang:
    """The hang in force (`mode`, None when the server answers) and the requests it held."""

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode
        self.hung = 0  # requests held at least once since start
        self.holding = 0  # requests held now
        self._over = asyncio.Event()  # binds to the serving loop on first use
        if mode is None:
            self._over.set()

    def switch(self, mode: str | None) -> None:
        """Start a hang (or change its mode), or end it (None): held requests go on."""
        if mode is None:
            self._over.set()
        else:
            self._over.clear()
        self.mode = mode

    async def wait_over(self) -> None:
        """Until the hang in force ends."""
        await self._over.wait()


class Gate:
    """One generation request's answer on its way out past the hang.

    `send` passes messages on while the server answers; during a hang it holds them (in
    `partial`, after half of the next body). A request that met the hang is counted once.
    """

    __slots__ = ("gone", "hang", "met", "receive", "scope", "send")

    def __init__(self, hang: Hang, scope: Scope, receive: Receive, send: Send) -> None:
        self.hang = hang
        self.scope = scope
        self.receive = receive
        self.send = send
        self.gone = False  # the client left while held: nothing more goes out
        self.met = False

    def meet(self) -> None:
        """Count the request as hung (once)."""
        if not self.met:
            self.met = True
            self.hang.hung += 1

    async def __call__(self, message: Message) -> None:
        if self.gone:
            return
        mode = self.hang.mode
        if mode is None or (mode == "partial" and message["type"] == "http.response.start"):
            await self.send(message)
            return
        if mode == "partial" and message["type"] == "http.response.body":
            body = message.get("body", b"")
            half = len(body) // 2
            await self.send({"type": "http.response.body", "body": body[:half],
                             "more_body": True})
            message = {**message, "body": body[half:]}
        if await self._hold():
            await self.send(message)
        else:
            self.gone = True

    async def _hold(self) -> bool:
        """Wait until the hang ends (True) or the client leaves (False)."""
        self.meet()
        hang = self.hang
        hang.holding += 1
        self.scope[HELD] = True
        left = asyncio.ensure_future(_disconnect(self.receive))
        over = asyncio.ensure_future(hang.wait_over())
        try:
            await asyncio.wait((left, over), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            over.cancel()
            hang.holding -= 1
            self.scope[HELD] = False
        return not (left.done() and not left.cancelled())


async def _disconnect(receive: Receive) -> None:
    # The body was read before the answer was ready: what comes now is the client leaving.
    while (await receive())["type"] != "http.disconnect":
        pass
