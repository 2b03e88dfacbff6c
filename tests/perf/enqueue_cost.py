"""Figure 4: `python -m producer enqueue` of a million ~1 KB prompts from one JSONL file;
figure 4b: the same prompts from one Parquet file, local and in S3 (SeaweedFS).

Measured on the producer process alone: wall time, peak RSS (`os.wait4`'s rusage of that
child) and CPU; on Redis, `used_memory` after minus before, per prompt, with the largest keys.
The input is generated once by producer/samples/generate_sample.py and kept in the cache
folder (it is deterministic); a local-folder output, and S3 (SeaweedFS) when asked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from fleetgen import keys
from tests.stack import PYTHON, ROOT, queue_depth

JOB = "perf-enqueue"


@dataclass
class EnqueueCost:
    target: str  # "folder" or "s3"
    prompts: int
    input_bytes: int
    wall_s: float
    peak_rss_mb: float
    cpu_s: float
    redis_bytes: int
    batches: int
    top_keys: list[tuple[str, int]] = field(default_factory=list)

    @property
    def redis_bytes_per_prompt(self) -> float:
        return self.redis_bytes / max(1, self.prompts)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "redis_bytes_per_prompt": self.redis_bytes_per_prompt}


def input_file(cache: Path, prompts: int) -> tuple[Path, float]:
    """The generated input (made now if missing) and the seconds spent making it."""
    path = cache / f"bulk-{prompts}.jsonl"
    done = path.with_suffix(".complete")
    if path.exists() and done.exists():
        return path, 0.0
    cache.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    subprocess.run([PYTHON, "-m", "producer.samples.generate_sample", "--lines", str(prompts),
                    "--out", str(path)], check=True, cwd=ROOT, capture_output=True)
    done.write_text(str(prompts))
    return path, time.monotonic() - started


def parquet_file(cache: Path, prompts: int) -> tuple[Path, float]:
    """The bulk prompts as one Parquet table (made now if missing) and the seconds spent making
    it: `id`, `messages` (a list of structs) and `sampling` (a struct) columns; a line without
    an id keeps none, an OpenAI Batch line's body becomes messages and sampling."""
    import orjson
    import pyarrow as pa
    import pyarrow.parquet as pq

    from producer.samples.generate_sample import bulk_lines

    path = cache / f"bulk-{prompts}.parquet"
    done = path.with_suffix(".parquet-complete")
    if path.exists() and done.exists():
        return path, 0.0
    cache.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([("id", pa.string()), ("messages", pa.list_(message)),
                        ("sampling", pa.struct([("max_tokens", pa.int64())]))])
    columns: dict[str, list[Any]] = {name: [] for name in schema.names}
    with pq.ParquetWriter(path, schema) as writer:
        for n, raw in enumerate(bulk_lines(prompts)):
            line = orjson.loads(raw)
            body = line.get("body") or {}
            columns["id"].append(line.get("id") or line.get("custom_id"))
            columns["messages"].append(line.get("messages") or body.get("messages")
                                       or [{"role": "user", "content": line.get("prompt")}])
            cap = (line.get("sampling") or {}).get("max_tokens") or body.get("max_tokens")
            columns["sampling"].append({"max_tokens": cap} if cap else None)
            if (n + 1) % 50_000 == 0 or n + 1 == prompts:
                writer.write_table(pa.table(columns, schema=schema), row_group_size=50_000)
                columns = {name: [] for name in schema.names}
    done.write_text(str(prompts))
    return path, time.monotonic() - started


def run_enqueue(path: Path, prompts: int, folder: Path, redis_url: str, target: str,
                output: str, extra_env: Mapping[str, str] | None = None,
                source: str | None = None) -> EnqueueCost:
    """Enqueue `path` (or `source`, the same bytes elsewhere: an s3:// URI) into an empty Redis
    and measure the producer and Redis."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    before = int(client.info("memory")["used_memory"])
    env = {**os.environ, "REDIS_URL": redis_url, **(extra_env or {})}
    log = (folder / f"enqueue-{target}.log").open("wb")
    started = time.monotonic()
    child = subprocess.Popen([PYTHON, "-m", "producer", "enqueue", source or str(path), "--job", JOB,
                              "--output", output], cwd=ROOT, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
    # wait4 returns this child's own rusage: its peak RSS, not the largest of all children.
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - started
    log.close()
    if child.returncode != 0:
        raise RuntimeError(f"enqueue exited {child.returncode}: "
                           f"{(folder / f'enqueue-{target}.log').read_text()[-2000:]}")
    after = int(client.info("memory")["used_memory"])
    sizes = [(k.decode(), int(client.memory_usage(k) or 0)) for k in client.scan_iter(count=1000)]
    sizes.sort(key=lambda kv: -kv[1])
    batches = queue_depth(client, keys.SHARED_QUEUE)  # over its priority lists
    client.flushall()
    client.close()
    return EnqueueCost(target=target, prompts=prompts, input_bytes=path.stat().st_size,
                       wall_s=wall, peak_rss_mb=usage.ru_maxrss / 1024,
                       cpu_s=usage.ru_utime + usage.ru_stime, redis_bytes=after - before,
                       batches=batches, top_keys=sizes[:5])


def remove_output(folder: Path) -> None:
    """Delete a local output folder (a million prompts' batch inputs: about 1 GB)."""
    shutil.rmtree(folder, ignore_errors=True)
