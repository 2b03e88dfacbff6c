"""Figure 7: `python -m producer export` of a large job: peak RSS, wall and CPU.

A synthetic job is written straight into a folder sink in the layout enqueue and the workers
leave (inputs/, results/, errors/ per batch, manifest.json, and the manifest in Redis): results
of about 7.5 KB a prompt (3 KB of content, 4 KB of reasoning, like the job that exported 743 MB
in 1.15 GB of RSS), 1% of prompts failed, a `requeue --failed` round that answers two thirds
of them, and a second round that answers a few again (late duplicates). The export runs as a
child process; its peak RSS is `os.wait4`'s rusage of that child (see MEASURE).

With a baseline revision (`--export-baseline main`), the same job is also exported by that
revision's producer and workers (a `git archive` in a temporary folder), for a before/after
figure. The manifest is stored without `complete`, as older revisions cannot read it.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

from fleetgen import keys
from fleetgen.job import GenerationParams, InputInfo, JobManifest
from fleetgen.records import Origin, error_record, result_record
from tests.stack import PYTHON, ROOT

JOB = "perf-export"
BATCH = 256
RESULT_BYTES = 7_500  # per prompt, about
FAIL_EVERY = 100  # one prompt in this many fails first
ORIGIN = Origin("http://127.0.0.1:30000", "gpu0@perf", 1)


@dataclass
class SyntheticJob:
    folder: Path  # the sink: {folder}/{JOB}/...
    prompts: int
    batches: int
    requeue_batches: int
    result_bytes: int  # of results/ and errors/ objects, all rounds
    build_s: float


@dataclass
class ExportCost:
    code: str  # "this tree" or the baseline revision
    fmt: str
    result_mb: float
    wall_s: float
    peak_rss_mb: float
    cpu_s: float
    output_mb: float
    reconcile: str
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_job(folder: Path, redis_url: str, result_mb: int, seed: int = 7) -> SyntheticJob:
    """Write a job of about `result_mb` MB of results into `folder` and its manifest to Redis."""
    started = time.monotonic()
    rng = random.Random(seed)
    words = [("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
             for _ in range(4000)]
    text = " ".join(rng.choice(words) for _ in range(40_000))
    prompts = max(BATCH, result_mb * 2**20 // RESULT_BYTES)
    ids = [f"q{i:08d}" for i in range(prompts)]
    root = folder / JOB
    for part in ("inputs", "results", "errors"):
        (root / part).mkdir(parents=True, exist_ok=True)
    written = 0

    def put(part: str, batch: str, rows: list[dict[str, Any]]) -> int:
        data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
        (root / part / f"{batch}.jsonl").write_bytes(data)
        return len(data)

    def answer(pid: str, batch: str) -> dict[str, Any]:
        at = rng.randrange(0, len(text) - 8000)
        response = {"choices": [{"finish_reason": "stop", "message": {
            "content": f"{pid} {text[at:at + 3000]}",
            "reasoning_content": f"{batch} {text[at + 3000:at + 7000]}"}}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 1500, "reasoning_tokens": 900}}
        return result_record(pid, 1, response, 1.0, ORIGIN)

    def run(batch: str, chunk: list[str], fail: set[str]) -> int:
        put("inputs", batch, [{"id": p, "line": 1, "body": {"messages": [
            {"role": "user", "content": f"Write about {p}."}]}} for p in chunk])
        bad = [error_record(p, 1, "maximum context length is 40960", 400, ORIGIN, 1)
               for p in chunk if p in fail]
        out = put("errors", batch, bad) if bad else 0
        return out + put("results", batch, [answer(p, batch) for p in chunk if p not in fail])

    failed: list[str] = []
    batches = 0
    for start in range(0, prompts, BATCH):
        batches += 1
        chunk = ids[start:start + BATCH]
        fail = {p for i, p in enumerate(chunk, start) if i % FAIL_EVERY == FAIL_EVERY // 2}
        failed += [p for p in chunk if p in fail]
        written += run(keys.batch_id(batches), chunk, fail)
    # Round 1 answers two thirds of the failed prompts; round 2 re-runs a few of those again.
    still = {p for i, p in enumerate(failed) if i % 3 == 0}
    rounds = [("r01", failed, still), ("r02", failed[1::7], set())]
    requeue = 0
    for name, again, fail in rounds:
        for start in range(0, len(again), BATCH):
            requeue += 1
            written += run(f"{name}-{start // BATCH + 1:06d}", again[start:start + BATCH], fail)
    manifest = JobManifest(
        name=JOB, output=str(folder), input=InputInfo("perf-export.jsonl", "0" * 64, prompts, 0),
        prompts=prompts, batch_size=BATCH, batches=batches, queue=keys.SHARED_QUEUE,
        params=GenerationParams())
    raw = orjson.loads(manifest.to_json())
    raw.pop("complete", None)  # older revisions (the baseline) cannot read it; absent = True
    (root / "manifest.json").write_bytes(orjson.dumps(raw))
    client = redis.Redis.from_url(redis_url)
    client.hset(keys.job(JOB), mapping={"manifest": orjson.dumps(raw), "state": "running"})
    client.sadd(keys.JOBS, JOB)
    client.close()
    return SyntheticJob(folder, prompts, batches, requeue, written, time.monotonic() - started)


def checkout(revision: str, dest: Path) -> Path:
    """`producer` and `workers` of `revision` in `dest` (run with cwd=dest, they are imported
    before the installed tree)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", revision, "producer", "fleetgen", "workers"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


# Linux starts a child's ru_maxrss at its parent's RSS (subprocess spawns with vfork, and exec
# keeps the old mm's high-water mark), so the export is started by this small process, whose
# few MB are below any export's, and its wait4 rusage is the export's own.
MEASURE = """
import os, subprocess, sys
with open(sys.argv[1], "wb") as log:
    child = subprocess.Popen(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(child.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss, usage.ru_utime + usage.ru_stime)
"""


def run_export(job: SyntheticJob, redis_url: str, to: Path, fmt: str, *,
               tree: Path | None = None, code: str = "this tree") -> ExportCost:
    """Export `job` with the producer in `tree` (default: this one) and measure the child."""
    log_path = to.with_suffix(".log")
    started = time.monotonic()
    measured = subprocess.run(
        [PYTHON, "-c", MEASURE, str(log_path), PYTHON, "-m", "producer", "export", JOB,
         "--to", str(to), "--format", fmt], cwd=tree or ROOT,
        env={**os.environ, "REDIS_URL": redis_url}, capture_output=True, text=True, check=True)
    wall = time.monotonic() - started
    exit_code, maxrss_kb, cpu_s = measured.stdout.split()
    output = log_path.read_text()
    if exit_code != "0":
        raise RuntimeError(f"export ({code}, {fmt}) exited {exit_code}: {output[-2000:]}")
    reconcile = next((line.removeprefix("reconcile: ") for line in output.splitlines()
                      if line.startswith("reconcile: ")), "")
    size = to.stat().st_size
    to.unlink()
    return ExportCost(code=code, fmt=fmt, result_mb=job.result_bytes / 2**20, wall_s=wall,
                      peak_rss_mb=int(maxrss_kb) / 1024, cpu_s=float(cpu_s),
                      output_mb=size / 2**20, reconcile=reconcile)


def run_export_cost(folder: Path, redis_url: str, result_mb: int,
                    baseline: str | None = None) -> dict[str, Any]:
    """Exports of a job of `result_mb` MB and of one a fifth of it (the peak must not grow
    with the job), in jsonl and parquet; with `baseline`, that revision's exports of the large
    one."""
    costs: list[ExportCost] = []
    jobs: list[SyntheticJob] = []
    for mb in (max(1, result_mb // 5), result_mb):
        sink = folder / f"sink-{mb}"
        job = build_job(sink, redis_url, mb)
        jobs.append(job)
        for fmt in ("jsonl", "parquet"):
            costs.append(run_export(job, redis_url, folder / f"out-{mb}.{fmt}", fmt))
        if baseline and mb == result_mb:
            tree = checkout(baseline, folder / "baseline")
            for fmt in ("jsonl", "parquet"):
                costs.append(run_export(job, redis_url, folder / f"base-{mb}.{fmt}", fmt,
                                        tree=tree, code=baseline))
        shutil.rmtree(sink, ignore_errors=True)
    return {"jobs": [{k: v for k, v in asdict(j).items() if k != "folder"} for j in jobs],
            "exports": [c.as_dict() for c in costs]}
