"""Figure 5: what one worker process costs per prompt against an instant simulator, and why.

The simulator answers at once (`--instant`), so the figures are the pipeline's own cost: the
worker's CPU per prompt (HTTP client, checkpoint script, canary, metrics) and the rate it
sustains while Redis and the simulator share this machine's cores. Measured without a profiler
`runs` times (the median run is the figure: on a shared 2-core box one run's CPU figures move by
up to ±20% with the machine, the simulator's as much as the worker's), then once under py-spy
for the top items, if py-spy is installed: `--gil` (the worker is bound by one core's worth of Python, so
what holds the GIL is what costs), pausing it for each sample so stacks are whole
(`--nonblocking` tore most of them).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetgen.ledger import Ledger
from tests.perf.fleet import Fleet, dump_stacks, stuck_batches, wait_job
from tests.perf.sampler import SIM_FAMILIES, Sampler, Tick
from tests.perf.workload import Workload
from tests.stack import PYTHON

JOB = "perf-overhead"
PY_SPY = Path(PYTHON).with_name("py-spy")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
REQUESTS = "sglang:num_requests_total"


@dataclass
class Overhead:
    prompts: int
    rate: float  # prompts/s between 10% and 90% of the job, server-side
    wall_rate: float  # prompts / (last answer - first request)
    cpu_us_per_prompt: dict[str, float]
    slots: int
    profile_self: list[tuple[str, float]] = field(default_factory=list)
    profile_total: list[tuple[str, float]] = field(default_factory=list)
    profile_samples: int = 0
    # Batches still leased when the job should have ended (see stuck-worker-stacks.txt).
    hung_batches: list[str] = field(default_factory=list)
    # Every measured run's worker CPU µs per prompt, simulator CPU µs per prompt and rate.
    runs: list[dict[str, float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def run_overhead(folder: Path, redis_url: str, redis_pid: int, prompts: int, slots: int,
                 profile: bool, runs: int = 3) -> Overhead:
    """Measure one worker on an instant simulator `runs` times (the median run is the result);
    profile one more run if asked."""
    wl = Workload(prompts=prompts, servers=1, slots=slots)
    source = wl.write_prompts(folder / "prompts.jsonl")
    measured = [_one_run(folder / f"measured-{n}", source, redis_url, redis_pid, wl, profile=False)
                for n in range(1, max(1, runs) + 1)]
    result = sorted(measured, key=lambda r: r.cpu_us_per_prompt["worker"])[len(measured) // 2]
    result.runs = [{"worker": r.cpu_us_per_prompt["worker"],
                    "simulator": r.cpu_us_per_prompt["simulator"], "rate": r.rate}
                   for r in measured]
    result.hung_batches = [b for r in measured for b in r.hung_batches]
    if profile and PY_SPY.exists():
        profiled = _one_run(folder / "profiled", source, redis_url, redis_pid, wl, profile=True)
        result.profile_self = profiled.profile_self
        result.profile_total = profiled.profile_total
        result.profile_samples = profiled.profile_samples
        result.hung_batches += profiled.hung_batches
    return result


def _one_run(folder: Path, source: Path, redis_url: str, redis_pid: int, wl: Workload,
             profile: bool) -> Overhead:
    ledger = Ledger.from_url(redis_url)
    ledger.r.flushall()
    flags = ["--instant", "--max-running-requests", str(wl.slots), "--log-level", "warning"]
    with Fleet(folder, redis_url) as fleet:
        sim = fleet.sim("gpu0", flags, record=False)
        worker = fleet.worker(0, sim.url)
        pids = {"worker": worker.proc.pid, "simulator": sim.proc.pid, "redis": redis_pid}
        with Sampler({"gpu0": f"{sim.url}/metrics"}, SIM_FAMILIES) as sampler:
            cpu_before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
            fleet.producer("enqueue", str(source), "--job", JOB, "--output", str(folder / "out"))
            spy = _start_py_spy(worker.proc.pid, folder / "profile.txt") if profile else None
            # At the target rate (report.WORKER_RATE) a run takes prompts / 500 s; five
            # times that, and a batch is hung, not slow.
            finished = wait_job(ledger, JOB, timeout_s=wl.prompts / 100 + 30)
            cpu = {name: _cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
            hung = [] if finished else stuck_batches(ledger, JOB)
            if hung:
                dump_stacks(worker.proc.pid, folder / "stuck-worker-stacks.txt")
            if spy is not None:
                _stop_py_spy(spy)
    rate, wall_rate = _rates(sampler.ticks, wl.prompts)
    result = Overhead(prompts=wl.prompts, rate=rate, wall_rate=wall_rate, slots=wl.slots,
                      cpu_us_per_prompt={k: 1e6 * v / wl.prompts for k, v in cpu.items()},
                      hung_batches=hung)
    if spy is not None and (folder / "profile.txt").exists():
        samples, own, total = top_items((folder / "profile.txt").read_text())
        result.profile_samples = samples
        result.profile_self, result.profile_total = own, total
    return result


def _rates(ticks: list[Tick], prompts: int) -> tuple[float, float]:
    """Steady rate (10% to 90% done) and overall rate, from the simulator's request counter."""
    points = [(t.t, t.values["gpu0"][REQUESTS]) for t in ticks if t.values.get("gpu0")]
    base = points[0][1]
    done = [(t, n - base) for t, n in points]

    def when(share: float) -> tuple[float, float]:
        return next(((t, n) for t, n in done if n >= share * prompts), done[-1])

    (t10, n10), (t90, n90) = when(0.1), when(0.9)
    (t0, _), (t100, n100) = when(1 / prompts), when(1.0)
    return (n90 - n10) / max(t90 - t10, 1e-9), n100 / max(t100 - t0, 1e-9)


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / CLOCK_TICKS


def _start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([str(PY_SPY), "record", "--pid", str(pid), "--format", "raw",
                             "--rate", "200", "--gil", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_py_spy(spy: subprocess.Popen[bytes]) -> None:
    # SIGINT makes py-spy write what it sampled and exit.
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(30)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()


def top_items(collapsed: str, n: int = 15) -> tuple[int, list[tuple[str, float]],
                                                    list[tuple[str, float]]]:
    """From py-spy's raw (collapsed) stacks: samples, top self shares, top inclusive shares.

    A frame is `function (file:line)`; lines are dropped so a function is one item.
    """
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        samples += count
        # `--threads` puts a `thread (ID): NAME` frame first; items are per function.
        frames = [_frame_name(f) for f in stack.split(";") if not f.startswith("thread (")]
        if not frames:
            continue
        own[frames[-1]] += count
        for name in set(frames):
            total[name] += count
    share = max(samples, 1)
    return (samples, [(k, v / share) for k, v in own.most_common(n)],
            [(k, v / share) for k, v in total.most_common(n * 3) if not _is_root(k)][:n])


def _frame_name(frame: str) -> str:
    func, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    for marker in ("site-packages/", "/work/main/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{func} ({path})"


def _is_root(name: str) -> bool:
    """Frames every sample of a thread shares (thread bootstrap, event loop runner)."""
    return any(word in name for word in ("_bootstrap", "run_forever", "_run_once", "run (threading",
                                         "<module>", "_run (asyncio/events"))
