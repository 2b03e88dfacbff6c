"""Checkpoint traffic of N simulated GPUs through fleetgen's own CheckpointWriter, in real time.

Run by tests/perf/checkpoint_cost.py as a script with a tree first on PYTHONPATH (this one or
a baseline revision's), so it imports nothing but that tree's `fleetgen`. Each GPU is one
CheckpointWriter with its own connection, built with the tree's defaults, fed as a worker
feeds it: a chat answer adds its record when it ends (answers end one by one, evenly spaced
at `rate` a second); an embeddings request of `per_request` texts ends every
`per_request / rate` seconds and adds its records together, or one after another, each
awaited, with `--sequential` (how a worker before the grouped add did it). A tree whose
embeddings skip the checkpoint (its writer has `answered`: the batch is their group) notes
each request's answers for the breaker's window instead, and records each batch of
`--batch` texts once with their counters (Batches.finish_and_settle), as its worker does.
Each writer keeps the failure breaker's window the settings' defaults give. Prints one JSON
line: Redis CPU (INFO cpu, less an idle Redis's) per record over the measured window, records
per script call (INFO commandstats), and the time from `add` to its commit.

    python tests/perf/checkpoint_load.py URL --mode chat --gpus 20 --rate 25 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import inspect
import json
import os
import time
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis

from fleetgen.checkpoints import CheckpointWriter, Entry
from fleetgen.ledger import Ledger
from fleetgen.settings import Settings

JOB = "perf-checkpoints"


def _record(mode: str, n: int, dim: int) -> tuple[bytes, dict[str, float]]:
    """A finished prompt's record and counters, shaped as fleetgen's (fleetgen/records.py)."""
    head = {
        "id": f"p{n:07d}",
        "line": n,
        "latency_s": 0.8,
        "server": "http://127.0.0.1:30000",
        "worker": "gpu0@perf",
        "attempt": 1,
        "tool_calls": None,
        "reasoning_content": None,
    }
    if mode == "chat":
        record = {
            **head,
            "content": "word " * 180,
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 260, "completion_tokens": 250, "reasoning_tokens": 0},
        }
        return orjson.dumps(record), {
            "prompts_done": 1,
            "input_tokens": 260,
            "output_tokens": 250,
            "reasoning_tokens": 0,
            "latency_s": 0.8,
            "finish_stop": 1,
        }
    vector = base64.b64encode(os.urandom(4 * dim)).decode()
    record = {
        **head,
        "content": "",
        "finish_reason": None,
        "embedding": [vector],
        "embedding_format": "float",
        "usage": {"prompt_tokens": 30, "completion_tokens": 0, "reasoning_tokens": 0},
    }
    return orjson.dumps(record), {
        "prompts_done": 1,
        "input_tokens": 30,
        "latency_s": 0.8,
        "embeddings": 1,
    }


async def _judge(job: str, before: int, after: int) -> None:
    return None


async def _judge_failures(job: str, failures: list[Entry], seen: Any) -> None:
    return None


class Gpu:
    def __init__(self, url: str, index: int, args: argparse.Namespace) -> None:
        self.r = aioredis.Redis.from_url(url)
        window = Settings().checkpoint_window_s if args.window is None else args.window
        settings = Settings()
        breaker: dict[str, Any] = {}
        if "outcomes_kept" in inspect.signature(CheckpointWriter).parameters:
            breaker = {"judge_failures": _judge_failures,
                       "outcomes_kept": max(settings.breaker_streak, settings.breaker_window)}
        self.worker = f"gpu{index}@perf"
        self.writer = CheckpointWriter(self.r, self.worker, _judge, lambda job: 0, window,
                                       **breaker)
        self.index, self.args = index, args
        # The tree's worker keeps an embeddings batch's answers and records them with it.
        self.grouped = args.mode == "embedding" and hasattr(self.writer, "answered")
        self.ledger = Ledger.from_url(url) if self.grouped else None
        self.added = 0
        self.waits: list[float] = []

    async def _request(self, size: int) -> None:
        """An embeddings request's answers, as a tree whose batch is their group takes them."""
        await self.writer.answered(JOB, size)
        batch, self.added = self.added // self.args.batch, self.added + size
        if self.added // self.args.batch > batch:
            _, counters = _record(self.args.mode, 0, self.args.dim)
            live = {k: v * self.args.batch for k, v in counters.items()}
            assert self.ledger is not None
            ledger = self.ledger
            await asyncio.to_thread(
                lambda: ledger.batches.finish_and_settle(
                    JOB, f"g{self.index}b{batch:06d}", {"prompts_done": self.args.batch},
                    self.worker, [], live=live))

    async def _add(self, n: int) -> None:
        record, counters = _record(self.args.mode, n, self.args.dim)
        batch = f"b{n // 100 % 1000:06d}"
        began = time.monotonic()
        await self.writer.add(
            Entry(JOB, batch, f"g{self.index}p{n}", record, counters, b"", outcome="")
        )
        self.waits.append(time.monotonic() - began)
        self.added += 1

    async def run(self, stop: asyncio.Event) -> None:
        args = self.args
        size = 1 if args.mode == "chat" else args.per_request
        period = size / args.rate
        # GPUs start spread over one period, as a fleet's do.
        began = time.monotonic() + period * self.index / args.gpus
        n, tasks = 0, set()
        while not stop.is_set():
            wait = began + (n // size + 1) * period - time.monotonic()
            if wait > 0:
                try:
                    await asyncio.wait_for(stop.wait(), wait)
                    break
                except TimeoutError:
                    pass
            first = n + self.index * 10_000_000
            if self.grouped:
                tasks.add(asyncio.create_task(self._request(size)))
            elif args.sequential:
                tasks.add(asyncio.create_task(self._one_by_one(first, size)))
            else:
                tasks.update(asyncio.create_task(self._add(first + i)) for i in range(size))
            tasks = {t for t in tasks if not t.done()}
            n += size
        await asyncio.gather(*tasks)
        await self.r.aclose()
        if self.ledger is not None:
            self.ledger.close()

    async def _one_by_one(self, first: int, size: int) -> None:
        for i in range(size):
            await self._add(first + i)


def _redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _script_calls(r: redis.Redis) -> int:
    stats = r.info("commandstats")
    return sum(
        int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")
    )


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    sync = redis.Redis.from_url(args.url)
    sync.flushall()
    began_cpu, began = _redis_cpu(sync), time.monotonic()
    await asyncio.sleep(1.0)
    idle = (_redis_cpu(sync) - began_cpu) / (time.monotonic() - began)
    gpus = [Gpu(args.url, i, args) for i in range(args.gpus)]
    stop = asyncio.Event()
    running = [asyncio.create_task(g.run(stop)) for g in gpus]
    await asyncio.sleep(args.warmup)
    added0, calls0 = sum(g.added for g in gpus), _script_calls(sync)
    for g in gpus:
        g.waits.clear()
    cpu0, t0 = _redis_cpu(sync), time.monotonic()
    await asyncio.sleep(args.seconds)
    cpu1, t1 = _redis_cpu(sync), time.monotonic()
    added, calls = sum(g.added for g in gpus) - added0, _script_calls(sync) - calls0
    waits = sorted(w for g in gpus for w in g.waits)
    stop.set()
    await asyncio.gather(*running)
    sync.flushall()
    busy = (cpu1 - cpu0) - idle * (t1 - t0)
    return {
        "mode": args.mode,
        "dim": args.dim if args.mode != "chat" else None,
        "gpus": args.gpus,
        "rate_per_gpu": args.rate,
        "sequential": args.sequential,
        "records": added,
        "achieved_rate_per_gpu": added / (t1 - t0) / args.gpus,
        "redis_us_per_record": 1e6 * busy / max(added, 1),
        "redis_core_share": busy / (t1 - t0),
        "records_per_call": added / max(calls, 1),
        "commit_wait_s": {
            "mean": sum(waits) / max(len(waits), 1),
            "p99": waits[int(0.99 * (len(waits) - 1))] if waits else 0.0,
            "max": waits[-1] if waits else 0.0,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--mode", choices=("chat", "embedding"), default="chat")
    parser.add_argument("--gpus", type=int, default=20)
    parser.add_argument("--rate", type=float, default=25.0, help="prompts/s per GPU")
    parser.add_argument("--per-request", type=int, default=64, help="texts per embeddings request")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--sequential", action="store_true")
    parser.add_argument("--batch", type=int, default=1000, help="texts per embeddings batch")
    parser.add_argument("--window", type=float, help="the writer's window_s (default: the tree's)")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
