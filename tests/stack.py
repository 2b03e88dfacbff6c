"""Real processes for end-to-end tests: simulated SGLang servers and Celery GPU workers.

Each is started the way a user starts it (`python -m launcher sim`, `celery -A workers worker
-Q gpuN`), with its output in a log file the failing test prints.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from fleetgen import broker, keys
from fleetgen.job import GenerationParams, InputInfo, JobManifest
from fleetgen.jobview import JobStatus
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from fleetgen.ports import free_port
from fleetgen.retry import REDIS_ERRORS
from launcher.child import ChildProcess

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
CELERY = str(Path(sys.executable).with_name("celery"))

# Whether the running test is marked `e2e` (tests/conftest.py sets it per test). A simulator,
# worker or producer process started by a test that is not fails it: `-m "not e2e"` must stay the fast
# layer. True outside pytest (tests/perf).
running_e2e = True


def require_e2e(what: str) -> None:
    if not running_e2e:
        raise AssertionError(f"this test starts {what}: mark it `pytest.mark.e2e`")


# Fast-failure settings for tests: a dead worker's batch is back in a few seconds.
FAST_WORKER_ENV = {
    "FLEETGEN_LEASE_TTL_S": "4",
    "FLEETGEN_LEASE_RENEW_S": "1",
    "FLEETGEN_RECONCILE_INTERVAL_S": "1",
    "FLEETGEN_LOST_MESSAGE_GRACE_S": "6",
    "FLEETGEN_RETRY_BACKOFF_S": "0.05",
    "FLEETGEN_RETRY_BACKOFF_MAX_S": "0.2",
    "FLEETGEN_SERVER_DOWN_WAIT_S": "30",
    "FLEETGEN_SINK_RETRY_DEADLINE_S": "60",
    "FLEETGEN_CAPACITY_REFRESH_S": "2",
    "FLEETGEN_METRICS_PORT": "0",
}


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    child: ChildProcess | None = None
    cwd: Path = ROOT

    def start(self) -> Proc:
        # Not tied to the starting thread: chaos tests start workers from helper threads.
        self.child = ChildProcess(self.argv, self.log_path, env=self.env, cwd=self.cwd,
                                  with_parent=False)
        return self

    @property
    def popen(self) -> subprocess.Popen[bytes] | None:
        return self.child.popen if self.child else None

    @property
    def pid(self) -> int:
        assert self.child is not None
        return self.child.pid

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    def kill(self) -> None:
        """SIGKILL the whole process group: no goodbye, as in a node failure."""
        if self.child is not None and self.child.alive():
            self.child.kill_group()

    def stop(self, grace: float = 15.0) -> None:
        if self.child is not None and self.child.alive():
            self.child.stop(grace)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""


@dataclass
class Stack:
    """A fleet on one machine: Redis and S3 come from fixtures, sims and workers start here."""

    tmp: Path
    base_env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {**os.environ, **self.base_env, "PYTHONUNBUFFERED": "1"}
        env.update(extra or {})
        return env

    def sim(self, name: str, *flags: str, port: int | None = None) -> tuple[Proc, str]:
        require_e2e("a simulator process")
        port = port or free_port()
        argv = [PYTHON, "-m", "launcher", "sim", "--port", str(port), *flags]
        proc = Proc(name, argv, self.env(), self.tmp / f"{name}.log").start()
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: healthy(url) or not proc.alive(), 30, what=f"{name} healthy")
        assert proc.alive(), proc.log()
        return proc, url

    def router(self, name: str, backends: list[str], *flags: str) -> tuple[Proc, str]:
        """A simulated router (launcher/sim/router.py) in front of `backends`."""
        require_e2e("a router process")
        port = free_port()
        argv = [PYTHON, "-m", "launcher.sim.router", "--port", str(port), *flags,
                *(arg for url in backends for arg in ("--backend", url))]
        proc = Proc(name, argv, self.env(), self.tmp / f"{name}.log").start()
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: healthy(url) or not proc.alive(), 30, what=f"{name} healthy")
        assert proc.alive(), proc.log()
        return proc, url

    def worker(self, gpu: int, server_url: str, extra_env: Mapping[str, str] | None = None,
               name: str | None = None) -> Proc:
        require_e2e("a worker process")
        name = name or f"gpu{gpu}"
        argv = [CELERY, "-A", "workers", "worker", "-Q", f"gpu{gpu}", "-n", f"{name}@test",
                "--without-mingle", "--without-gossip", "--loglevel", "INFO"]
        env = self.env({**FAST_WORKER_ENV, "FLEETGEN_SERVER_URL": server_url, **(extra_env or {})})
        proc = Proc(name, argv, env, self.tmp / f"{name}.log").start()
        self.procs.append(proc)
        wait_until(lambda: "ready." in proc.log() or not proc.alive(), 60, what=f"{name} ready")
        assert proc.alive(), proc.log()
        return proc

    def producer(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        require_e2e("a producer process")
        result = subprocess.run(
            [PYTHON, "-m", "producer", *args], env=self.env(), cwd=ROOT,
            capture_output=True, text=True, timeout=300, check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"producer {args} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(grace=10)

    def logs(self) -> str:
        return "\n".join(f"==== {p.name} ====\n{p.log()}" for p in self.procs)


def start_flower(stack: Stack, *flags: str, env: dict[str, str] | None = None,
                 name: str = "flower") -> tuple[Proc, str]:
    """Start `celery -A workers flower` on a free loopback port; return it and its base URL."""
    port = free_port()
    argv = [CELERY, "-A", "workers", "flower", "--conf=workers/flowerconfig.py",
            "--address=127.0.0.1", f"--port={port}", *flags]
    # FLOWER_* variables from the developer's shell would change what these tests check.
    clean = {k: v for k, v in stack.env(env).items()
             if not k.startswith("FLOWER_") or k in (env or {})}
    proc = Proc(name, argv, clean, stack.tmp / f"{name}.log").start()
    stack.procs.append(proc)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: Proc, base: str, timeout: float = 30) -> None:
    """Until Flower's (unauthenticated) /healthcheck answers, or its process has ended."""
    wait_until(lambda: _ok(f"{base}/healthcheck") or not proc.alive(), timeout,
               what=f"{proc.name} up")
    assert proc.alive(), proc.log()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def healthy(url: str) -> bool:
    """Whether the server at `url` answers /health with 200 now."""
    return _ok(f"{url}/health")


def python_stacks(pid: int) -> str:
    """Every thread's Python stack of a live process (py-spy, from the `perf` extra), to say
    where a process that should have ended is; a note instead when py-spy cannot tell."""
    spy = Path(PYTHON).with_name("py-spy")
    if not spy.exists():
        return "(no py-spy in this environment: no stacks)"
    dump = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True,
                          timeout=60, check=False)
    return dump.stdout + dump.stderr


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def chat_rows(n: int, prefix: str = "p") -> list[dict[str, Any]]:
    """n prompts in the three accepted shapes, with stable ids."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        pid = f"{prefix}{i:05d}"
        if i % 3 == 0:
            rows.append({"id": pid, "prompt": f"Explain topic number {i} in two sentences."})
        elif i % 3 == 1:
            rows.append({"id": pid, "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": f"What is {i} squared?"},
                {"role": "assistant", "content": "Let me think."},
                {"role": "user", "content": "Go on."}]})
        else:
            rows.append({"custom_id": pid, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": f"Write a haiku {i}."}],
                                  "max_tokens": 3000}})
    return rows


def read_results(folder: Path, job: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    results = [orjson.loads(line) for f in sorted((folder / job / "results").glob("*.jsonl"))
               for line in f.read_bytes().splitlines() if line]
    errors = [orjson.loads(line) for f in sorted((folder / job / "errors").glob("*.jsonl"))
              for line in f.read_bytes().splitlines() if line] if (folder / job / "errors").exists() else []
    return results, errors


def wait_job_done(stack: Stack, job: str, timeout: float,
                  on_tick: Callable[[JobStatus], None] | None = None) -> JobStatus:
    from fleetgen.jobview import job_status

    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])
    deadline = time.monotonic() + timeout
    status: JobStatus | None = None
    while time.monotonic() < deadline:
        try:
            status = job_status(ledger, job)
        except REDIS_ERRORS:  # a chaos test may be restarting Redis right now
            time.sleep(0.5)
            continue
        if on_tick:
            on_tick(status)
        if status.state == "done":
            return status
        time.sleep(0.2)
    raise AssertionError(f"job {job} not done in {timeout}s: {status}\n{stack.logs()}")


def iter_ids(rows: list[dict[str, Any]]) -> Iterator[str]:
    for r in rows:
        yield r.get("id") or r["custom_id"]


def queue_depth(r: Any, queue: str) -> int:
    """Messages waiting in a broker queue, over all its priority lists."""

    return sum(int(r.llen(name)) for name in broker.queue_lists(queue))


def make_job(ledger: Ledger, name: str, output: str, *, prompts: int = 100, batch_size: int = 10,
             created_at: float | None = None) -> JobManifest:
    """A running job's manifest in the ledger, as enqueue leaves it (no taper: batches of
    `batch_size`), without storing any input."""
    manifest = JobManifest(
        name=name, output=output, input=InputInfo("in.jsonl", "0" * 64, prompts, 1000),
        prompts=prompts, batch_size=batch_size, batches=-(-prompts // batch_size),
        queue=keys.SHARED_QUEUE, params=GenerationParams(),
        created_at=time.time() if created_at is None else created_at)
    ledger.jobs.save(manifest)
    return manifest


def write_parquet(path: Path, columns: dict[str, list[Any]], row_group_rows: int = 1000) -> Path:
    """A Parquet file of these columns (pyarrow infers the types: lists of dicts are lists of
    structs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path, row_group_size=row_group_rows)
    return path


def save_dataset(folder: Path, columns: dict[str, list[Any]], shards: int = 2,
                 splits: dict[str, dict[str, list[Any]]] | None = None) -> Path:
    """A folder laid out as Hugging Face `Dataset.save_to_disk` writes it: Arrow IPC stream
    shards `data-0000i-of-0000n.arrow`, `state.json` listing them, `dataset_info.json`. With
    `splits`, a DatasetDict instead: `dataset_dict.json` and one such folder per split."""
    import pyarrow as pa

    folder.mkdir(parents=True)
    if splits is not None:
        (folder / "dataset_dict.json").write_bytes(orjson.dumps({"splits": list(splits)}))
        for name, split_columns in splits.items():
            save_dataset(folder / name, split_columns, shards)
        return folder
    table = pa.table(columns)
    size = -(-table.num_rows // shards)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for i, name in enumerate(names):
        with pa.OSFile(str(folder / name), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(i * size, size), max_chunksize=7)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0" * 16,
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    (folder / "state.json").write_bytes(orjson.dumps(state))
    (folder / "dataset_info.json").write_bytes(orjson.dumps({"features": {}, "citation": ""}))
    return folder
