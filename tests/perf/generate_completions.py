"""The hand-written baseline: a plain asyncio + httpx script, as people write before fleetgen.

    python tests/perf/generate_completions.py --input prompts.jsonl --output out.jsonl \\
        --server http://127.0.0.1:30000 --server http://127.0.0.1:30001 --concurrency 44

It reads every prompt into memory, puts them in one shared queue and runs `--concurrency`
coroutines per server, each taking the next prompt as soon as its previous answer is back, so
no server ever waits while another still has work: the strongest simple script (no Redis, no
checkpoints, no crash recovery). Answers are appended to `--output` as they arrive. The request
body is the one fleetgen sends for the same line (fleetgen/job.py `GenerationParams`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import orjson

ATTEMPTS = 3


def request_body(line: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """fleetgen's chat body for a chat-shaped line with the job defaults."""
    return {"model": "default", "max_tokens": max_tokens, "temperature": 0.6, "top_p": 0.95,
            "separate_reasoning": True, "messages": line["messages"],
            "chat_template_kwargs": {"enable_thinking": True}}


async def serve(server: str, queue: asyncio.Queue[dict[str, Any]], concurrency: int,
                max_tokens: int, out: BinaryIO) -> int:
    """Keep `concurrency` requests in flight to `server` until the queue is empty."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=server, timeout=None, limits=limits) as client:
        counts = await asyncio.gather(
            *(_loop(client, queue, max_tokens, out) for _ in range(concurrency)))
    return sum(counts)


async def _loop(client: httpx.AsyncClient, queue: asyncio.Queue[dict[str, Any]],
                max_tokens: int, out: BinaryIO) -> int:
    done = 0
    while not queue.empty():
        line = queue.get_nowait()
        answer = await _post(client, request_body(line, max_tokens))
        out.write(orjson.dumps({"id": line["id"], "response": answer},
                               option=orjson.OPT_APPEND_NEWLINE))
        done += 1
    return done


async def _post(client: httpx.AsyncClient, body: dict[str, Any]) -> Any:
    for attempt in range(1, ATTEMPTS + 1):
        try:
            response = await client.post("/v1/chat/completions", content=orjson.dumps(body),
                                         headers={"Content-Type": "application/json"})
            response.raise_for_status()
            return orjson.loads(response.content)
        except httpx.HTTPError:
            if attempt == ATTEMPTS:
                raise
            await asyncio.sleep(attempt)
    raise AssertionError("unreachable")


async def run(args: argparse.Namespace) -> int:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for raw in args.input.read_bytes().splitlines():
        if raw.strip():
            queue.put_nowait(orjson.loads(raw))
    with args.output.open("wb") as out:
        counts = await asyncio.gather(
            *(serve(s, queue, args.concurrency, args.max_tokens, out) for s in args.server))
    return sum(counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--server", action="append", required=True)
    parser.add_argument("--concurrency", type=int, required=True, help="in flight per server")
    parser.add_argument("--max-tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    start = time.monotonic()
    done = asyncio.run(run(args))
    print(f"{done} answers in {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
