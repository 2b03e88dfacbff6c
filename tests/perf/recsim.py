"""The SGLang simulator with a request log: `python -m tests.perf.recsim --record F <sim flags>`.

The simulator itself is unchanged (`launcher.sim.server.run`); an ASGI wrapper around its app
appends one line per chat request to F, with `time.monotonic()` (one clock for every process
of the machine):

    R <t> <prompt id>                            request received (body read)
    D <t> <prompt id> <status> <completion tokens> response sent

The prompt id is found in the request text (`workload.ID_PATTERN`), so the log tells which
prompts a server received, when, and how often: what the crash and tail figures count.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any, TextIO

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.perf.workload import ID_PATTERN

CHAT_PATH = "/v1/chat/completions"
_TOKENS = re.compile(rb'"completion_tokens":(\d+)')


class Recorder:
    """ASGI middleware logging chat requests and responses by prompt id."""

    def __init__(self, app: ASGIApp, out: TextIO) -> None:
        self.app = app
        self.out = out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") != CHAT_PATH:
            await self.app(scope, receive, send)
            return
        body = bytearray()
        found: dict[str, Any] = {"id": None, "status": 0}

        async def receive_logged() -> Message:
            message = await receive()
            if message["type"] == "http.request" and found["id"] is None:
                body.extend(message.get("body", b""))
                if not message.get("more_body"):
                    match = ID_PATTERN.search(body)
                    found["id"] = match.group(1).decode() if match else "-"
                    self.out.write(f"R {time.monotonic():.6f} {found['id']}\n")
            return message

        async def send_logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                found["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                match = _TOKENS.search(message.get("body", b""))
                tokens = int(match.group(1)) if match else 0
                self.out.write(f"D {time.monotonic():.6f} {found['id']} {found['status']} "
                               f"{tokens}\n")
            await send(message)

        await self.app(scope, receive_logged, send_logged)


def main(argv: list[str]) -> int:
    """Run the simulator with `argv` minus `--record PATH`, logging to PATH."""
    from launcher.sim import server
    from launcher.sim.cli import main as sim_main

    at = argv.index("--record")
    path, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    # Line-buffered: a SIGKILLed simulator still leaves every finished line on disk.
    out = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's lifetime)
    # server.run builds its app with the module's asgi_app: wrap that one name.
    plain_app = server.asgi_app  # type: ignore[attr-defined]
    server.asgi_app = lambda sim: Recorder(plain_app(sim), out)  # type: ignore[attr-defined]
    try:
        return sim_main(rest)
    finally:
        out.close()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
