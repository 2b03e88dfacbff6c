"""What a short request costs: Redis CPU per chat answer and per embedding, worker CPU per
embedding, this tree beside a baseline revision's.

1. **Redis per record at 25 prompts/s per GPU.** `tests/perf/checkpoint_load.py` drives N
   simulated GPUs' checkpoints through the tree's own CheckpointWriter (its defaults) in real
   time: chat answers end one by one; an embeddings request's 64 vectors end together (a
   baseline from before the grouped add, whose worker awaited them one after another:
   `--baseline-sequential`), or, where the tree's embeddings batch is their group, are noted
   by number and recorded with their batch. Redis CPU from `INFO cpu`, less an idle Redis's.
2. **A real worker on an embeddings job** (`celery -A workers worker` of the tree) against
   `launcher sim --is-embedding` at its full rate: the worker's and Redis's CPU per embedding
   (/proc), with a small and the default `--embedding-dim`.

Both on the embedded Valkey (AOF, appendfsync everysec). `--baseline REV` runs the same with
REV's `fleetgen` and `workers` (git archive into the run's folder).

    python -m tests.perf.checkpoint_cost --baseline main     # ~8 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from launcher.services import RedisServer
from tests.perf.export_cost import checkout
from tests.perf.fleet import PRODUCTION_WORKER_ENV, Fleet, wait_job
from tests.perf.overhead import _cpu_seconds
from tests.stack import CELERY, PYTHON, ROOT, Proc

OUT = Path("results/perf")
LOAD = ROOT / "tests" / "perf" / "checkpoint_load.py"
JOB = "perf-embed"


def redis_per_record(url: str, tree: Path, gpus: int, seconds: float,
                     sequential: bool) -> list[dict[str, Any]]:
    """Redis CPU per chat answer and per embedding (1024 and 64 dims) at 25/s per GPU."""
    runs = [["--mode", "chat"], ["--mode", "embedding", "--dim", "1024"],
            ["--mode", "embedding", "--dim", "64"]]
    out = []
    for run in runs:
        flags = [*run, "--gpus", str(gpus), "--seconds", str(seconds)]
        if sequential and "embedding" in run:
            flags.append("--sequential")
        done = subprocess.run([PYTHON, str(LOAD), url, *flags], cwd=tree,
                              env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, check=True, timeout=300)
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def worker_per_embedding(folder: Path, server: RedisServer, tree: Path, dim: int,
                         texts: int) -> dict[str, Any]:
    """One worker of `tree` embedding `texts` short texts against an embedding simulator."""
    ledger = Ledger.from_url(server.url)
    ledger.r.flushall()
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "texts.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"id": f"e{n:07d}", "text": f"text {n} of a short"
                                             " document about rivers"}) + b"\n"
                                for n in range(texts)))
    with Fleet(folder, server.url) as fleet:
        sim = fleet.sim("gpu0", ["--is-embedding", "--embedding-dim", str(dim),
                                 "--max-running-requests", "256", "--log-level", "warning"],
                        record=False)
        env = fleet.env({**PRODUCTION_WORKER_ENV, "FLEETGEN_SERVER_URL": sim.url,
                         "FLEETGEN_METRICS_PORT": "0", "PYTHONPATH": str(tree)})
        worker = Proc("worker0", [CELERY, "-A", "workers", "worker", "-Q", "gpu0", "-n",
                                  "gpu0@perf", "--without-mingle", "--without-gossip",
                                  "--loglevel", "INFO"], env, folder / "worker0.log",
                      cwd=tree).start()
        fleet.procs.append(worker)
        wait_until(lambda: "ready." in worker.log(), 90, what="worker ready")
        pids = {"worker": worker.pid, "redis": int(server.pid or 0)}
        before = {k: _cpu_seconds(p) for k, p in pids.items()}
        fleet.producer("enqueue", str(source), "--job", JOB, "--endpoint", "embeddings",
                       "--output", str(folder / "out"), "--batch-size", "1000")
        began = time.monotonic()
        finished = wait_job(ledger, JOB, timeout_s=texts / 50 + 60)
        cpu = {k: _cpu_seconds(p) - before[k] for k, p in pids.items()}
    return {"dim": dim, "texts": texts, "finished": finished is not None,
            "seconds": round((finished or time.monotonic()) - began, 1),
            "worker_us_per_embedding": round(1e6 * cpu["worker"] / texts, 1),
            "redis_us_per_embedding": round(1e6 * cpu["redis"] / texts, 1)}


def measure(folder: Path, server: RedisServer, tree: Path, label: str, args: argparse.Namespace,
            sequential: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"code": label}
    out["redis_at_25_per_gpu"] = redis_per_record(server.url, tree, args.gpus, args.seconds,
                                                  sequential)
    out["worker"] = [worker_per_embedding(folder / f"{label}-{dim}", server, tree, dim,
                                          args.texts) for dim in (64, 1024)]
    return out


def render(results: list[dict[str, Any]]) -> str:
    lines = ["| code | Redis µs per chat answer (per call) | per embedding 1024 / 64 dims "
             "(per call) | commit wait p99 s (chat) | worker µs per embedding 64 / 1024 dims "
             "| Redis µs per embedding, real worker 64 / 1024 |", "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        chat, e1024, e64 = r["redis_at_25_per_gpu"]
        w64, w1024 = r["worker"]
        lines.append(
            f"| {r['code']} | {chat['redis_us_per_record']:.1f} ({chat['records_per_call']:.1f}) "
            f"| {e1024['redis_us_per_record']:.1f} / {e64['redis_us_per_record']:.1f} "
            f"({e1024['records_per_call']:.1f}) | {chat['commit_wait_s']['p99']:.2f} "
            f"| {w64['worker_us_per_embedding']:.0f} / {w1024['worker_us_per_embedding']:.0f} "
            f"| {w64['redis_us_per_embedding']:.0f} / {w1024['redis_us_per_embedding']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.perf.checkpoint_cost")
    parser.add_argument("--baseline", help="a revision to measure beside this tree")
    parser.add_argument("--baseline-sequential", action="store_true",
                        help="the baseline's worker awaits an embeddings request's records one "
                             "after another (a revision before the grouped add)")
    parser.add_argument("--gpus", type=int, default=20, help="simulated GPUs at 25 prompts/s")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--texts", type=int, default=20_000, help="texts of the worker's job")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp, \
            RedisServer(data_dir=Path(tmp) / "redis") as server:
        if args.baseline:
            tree = checkout(args.baseline, Path(tmp) / "baseline")
            results.append(measure(Path(tmp), server, tree, args.baseline, args,
                                   sequential=args.baseline_sequential))
        results.append(measure(Path(tmp), server, ROOT, "this tree", args, sequential=False))
    (OUT / "checkpoint_cost.json").write_text(json.dumps(results, indent=2))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
