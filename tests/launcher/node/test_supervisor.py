"""The launcher's supervisor, replayed on scripted histories in virtual time.

A `World` plays the processes: each spawn takes the next `Script` for that process name
(when to answer /health, when to die and with what log lines, how it takes SIGTERM). A
`FakeClock` runs virtual time, so a 10-minute crash window passes in milliseconds. The
argv, profile and flag-adaptation tests below are plain functions on strings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fleetgen.ports import ephemeral_range, port_is_free
from fleetgen.servers import ServerInfo, parse_server_info
from launcher.node._args import (
    Profile,
    adapt_flags,
    flag_value,
    load_profile,
    merge_args,
    profile_from_mapping,
)
from launcher.node._commands import EXIT_FAILED, EXIT_USAGE, main, render_status
from launcher.node._errors import GpuSpecError, NoGpuError, ProfileError
from launcher.node._gpus import discover_gpus, parse_gpu_line, parse_gpu_spec, select_gpus
from launcher.node._kind import build_argv
from launcher.node._plan import DEFAULT_BASE_PORT, NodePlan, Parallel, read_request, render_dry_run
from launcher.node._process import LaunchSpec
from launcher.node._rundir import REQUEST_FILE, NodeState, Rejected, RestartRequest, write_atomic
from launcher.node._supervisor import Child, Order, OrderError, Policy, Slot, Supervisor
from launcher.node._watch import LogFollower, limits_reading
from launcher.sim import info as sim_info
from launcher.sim.config import SimConfig
from launcher.sim.simulator import Simulator

OOM_LINES = [
    "[2026-10-10 11:58:19] Scheduler hit an exception: Traceback (most recent call last):",
    '  File "scheduler.py", line 6368, in run_scheduler_process',
    "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
    ("[2026-10-10 11:58:19] Received sigquit from a child process. It usually means the child "
     "failed."),
]
SERVING_OOM = [
    "[2026-10-10 12:00:00] Scheduler hit an exception: Traceback (most recent call last):",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.15 GiB.",
    ("[2026-10-10 12:00:00] SIGQUIT received. signum=3, frame=None. It usually means one child "
     "failed."),
]


class FakeClock:
    """Virtual time: `sleep` parks the caller until `drive` advances time to its wake-up."""

    def __init__(self) -> None:
        self.t = 0.0
        self._seq = 0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        return 1_800_000_000.0 + self.t

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._sleepers, (self.t + seconds, self._seq, future))
        await future

    async def until(self, predicate: Callable[[], bool], limit_s: float = 600.0) -> None:
        """Sleep in virtual time until `predicate()`; fail after `limit_s` virtual seconds."""
        deadline = self.t + limit_s
        while not predicate():
            assert self.t < deadline, f"condition not met within {limit_s} virtual seconds"
            # As often as the supervisor polls (Policy.poll_s): finer only costs CPU, each
            # check being a round of every task on the loop (a 20-minute scenario took 20 s).
            await self.sleep(0.25)

    def drive(self, scenario: Coroutine[Any, Any, Any]) -> Any:
        """Run `scenario`, advancing time whenever every task is parked in `sleep`."""

        async def main() -> Any:
            task = asyncio.ensure_future(scenario)
            while not task.done():
                for _ in range(30):  # let every runnable task reach its next sleep
                    await asyncio.sleep(0)
                if task.done() or not self._sleepers:
                    continue
                wake = self._sleepers[0][0]
                self.t = max(self.t, wake)
                while self._sleepers and self._sleepers[0][0] <= wake:
                    future = heapq.heappop(self._sleepers)[2]
                    if not future.done():
                        future.set_result(None)
            return task.result()

        return asyncio.run(main())


@dataclass
class Script:
    """How one started process behaves, in seconds since its start."""

    ready_after: float | None = 1.0  # /health is 200 from then on (None: never)
    exit_after: float | None = None  # it dies by itself then
    exit_code: int = -9
    lines: Sequence[tuple[float, str]] = ()  # appended to its log at those times
    drain_s: float | None = 0.5  # exits 0 this long after SIGTERM; None: ignores SIGTERM
    unhealthy_after: float | None = None  # /health fails from then on (a hung server)
    info: Mapping[str, object] | None = None  # its /server_info body


@dataclass
class FakeProcess:
    spec: LaunchSpec
    script: Script
    clock: FakeClock
    pid: int
    started: float = 0.0
    returncode: int | None = None
    term_at: float | None = None
    signals: list[str] = field(default_factory=list)
    killed_alive: bool = False
    _written: int = 0

    def age(self) -> float:
        return self.clock.t - self.started

    def poll(self) -> int | None:
        due = [line for at, line in self.script.lines if at <= self.age()]
        with open(self.spec.log_path, "a") as log:
            log.writelines(line + "\n" for line in due[self._written:])
        self._written = max(self._written, len(due))
        if self.returncode is None:
            s = self.script
            if s.exit_after is not None and self.age() >= s.exit_after:
                self.returncode = s.exit_code
            elif self.term_at is not None and s.drain_s is not None \
                    and self.clock.t - self.term_at >= s.drain_s:
                self.returncode = 0
        return self.returncode

    def terminate(self) -> None:
        self.signals.append("TERM")
        self.term_at = self.clock.t if self.term_at is None else self.term_at

    def send_signal(self, sig: int) -> None:
        self.signals.append(signal.Signals(sig).name.removeprefix("SIG"))

    def kill_group(self) -> None:
        self.signals.append("KILL")
        if self.poll() is None:
            self.returncode, self.killed_alive = -9, True

    def healthy(self) -> bool:
        s, age = self.script, self.age()
        return (self.poll() is None and self.term_at is None and s.ready_after is not None
                and age >= s.ready_after
                and (s.unhealthy_after is None or age < s.unhealthy_after))


class World:
    """Spawns FakeProcesses from per-name scripts and answers probes for them."""

    def __init__(self, clock: FakeClock, scripts: Mapping[str, Sequence[Script]]) -> None:
        self.clock = clock
        self.scripts = {name: list(s) for name, s in scripts.items()}
        self.procs: list[FakeProcess] = []

    def spawn(self, spec: LaunchSpec) -> FakeProcess:
        queue = self.scripts[spec.name]
        script = queue.pop(0) if len(queue) > 1 else queue[0]
        proc = FakeProcess(spec, script, self.clock, 1000 + len(self.procs), self.clock.t)
        self.procs.append(proc)
        return proc

    def of(self, name: str) -> list[FakeProcess]:
        return [p for p in self.procs if p.spec.name == name]

    def _live(self, url: str) -> FakeProcess | None:
        live = [p for p in self.procs if p.spec.url == url and p.poll() is None]
        return live[-1] if live else None

    async def healthy(self, url: str) -> bool:
        proc = self._live(url)
        return proc is not None and proc.healthy()

    async def server_info(self, url: str) -> ServerInfo | None:
        proc = self._live(url)
        info = proc.script.info if proc else None
        return parse_server_info(info) if info is not None else None


class History:
    """Every published (time, GPU, state, reason) transition."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.events: list[tuple[float, int, str, str | None]] = []
        self.last: dict[str, Any] = {}

    def __call__(self, snapshot: NodeState) -> None:
        self.last = json.loads(snapshot.to_json())  # as node.json says it
        for g in self.last["gpus"]:
            event = (self.clock.t, g["gpu"], g["state"], g["last_reason"])
            previous = [e for e in self.events if e[1] == g["gpu"]]
            if not previous or previous[-1][2:] != event[2:]:
                self.events.append(event)

    def states(self, gpu: int = 0) -> list[str]:
        return [state for _, g, state, _ in self.events if g == gpu]

    def gpu(self, gpu: int = 0) -> dict[str, Any]:
        """The GPU's latest published entry ({"state": None} before the first publish)."""
        return next((g for g in self.last.get("gpus", []) if g["gpu"] == gpu), {"state": None})

    def all_ready(self) -> bool:
        gpus = self.last.get("gpus", [])
        return bool(gpus) and all(g["state"] == "ready" for g in gpus)


def node_state(data: Mapping[str, Any]) -> NodeState:
    """node.json as the supervisor would write `data` (fields left out read as defaults)."""
    return NodeState.from_json(json.dumps(data))


def spec(tmp_path: Path, gpu: int = 0, args: Sequence[str] = ()) -> LaunchSpec:
    argv = build_argv(["sglang", "serve"], "m", 30000 + gpu, 31000 + gpu, args)
    return LaunchSpec(f"gpu{gpu}", tuple(argv), {}, tmp_path / f"sglang_gpu{gpu}.log",
                      30000 + gpu)


def longest(low: float, high: float) -> float:
    """The backoff's random source for replayed histories: always the longest wait it allows."""
    return high


def make(tmp_path: Path, scripts: Mapping[str, Sequence[Script]], gpus: int = 1,
         workers: bool = False, uniform: Callable[[float, float], float] = longest,
         **policy: Any) -> tuple[Supervisor, World, History, FakeClock]:
    clock = FakeClock()
    world, history = World(clock, scripts), History(clock)
    slots = []
    for g in range(gpus):
        server = spec(tmp_path, g)
        worker = LaunchSpec(f"worker{g}", ("celery",), {}, tmp_path / f"worker{g}.log")
        slots.append(Slot(g, Child(server), Child(worker) if workers else None))
    supervisor = Supervisor(slots, Policy(**policy), probe=world, spawn=world.spawn,
                            clock=clock, publish=history, uniform=uniform)
    return supervisor, world, history, clock


def run_until(supervisor: Supervisor, clock: FakeClock, done: Callable[[], bool],
              then: Callable[[], Coroutine[Any, Any, None]] | None = None,
              limit_s: float = 600.0) -> int:
    """Run the supervisor until `done()`, optionally do `then()`, stop it; its exit code."""

    async def scenario() -> int:
        running = asyncio.create_task(supervisor.run(install_signals=False))
        try:
            await clock.until(lambda: done() or running.done(), limit_s)
            if then is not None:
                await then()
        finally:  # also when an assertion failed: shut down while virtual time still runs
            supervisor.stop.set()
            code = await running
        return code

    return int(clock.drive(scenario()))


def test_crashed_server_is_restarted_after_the_initial_backoff(tmp_path: Path) -> None:
    crash = Script(ready_after=2, exit_after=10, lines=[(9.9, line) for line in SERVING_OOM])
    sup, world, history, clock = make(tmp_path, {"gpu0": [crash, Script()]}, backoff_initial_s=1)

    run_until(sup, clock, lambda: len(world.of("gpu0")) == 2 and history.gpu()["state"] == "ready")

    first, second = world.of("gpu0")
    assert 1.0 <= second.started - (first.started + 10) <= 1.0 + sup.policy.poll_s * 2
    assert history.states()[:5] == ["starting", "ready", "restarting", "starting", "ready"]
    crashed = next(reason for _, _, state, reason in history.events if state == "restarting")
    assert crashed is not None and "cuda_oom" in crashed and "while serving" in crashed
    assert history.gpu()["restarts"] == 1


def test_backoff_doubles_with_each_recent_crash(tmp_path: Path) -> None:
    dies = Script(ready_after=None, exit_after=0.1)
    sup, world, _, clock = make(tmp_path, {"gpu0": [dies]}, backoff_initial_s=1,
                                crash_loop_count=5)

    run_until(sup, clock, lambda: len(world.of("gpu0")) == 4)

    starts = [p.started for p in world.of("gpu0")]
    gaps = [later - earlier - 0.1 for earlier, later in itertools.pairwise(starts)]
    assert [round(g) for g in gaps] == [1, 2, 4]


def test_a_restart_waits_the_random_draw_up_to_the_doubled_backoff(tmp_path: Path) -> None:
    bounds: list[float] = []

    def half(low: float, high: float) -> float:
        bounds.append(high)
        return (low + high) / 2

    dies = Script(ready_after=None, exit_after=0.1)
    sup, world, _, clock = make(tmp_path, {"gpu0": [dies]}, uniform=half, backoff_initial_s=1,
                                crash_loop_count=5)

    run_until(sup, clock, lambda: len(world.of("gpu0")) == 4)

    starts = [p.started for p in world.of("gpu0")]
    gaps = [later - earlier - 0.1 for earlier, later in itertools.pairwise(starts)]
    assert bounds[:3] == [1, 2, 4]
    drawn = [0.5, 1.0, 2.0]  # what `half` returned: the waits, give or take the poll
    assert all(d <= g <= d + 2 * sup.policy.poll_s for g, d in zip(gaps, drawn, strict=True))


def test_the_restart_backoff_is_jittered_and_capped() -> None:
    policy = Policy(backoff_initial_s=1, backoff_max_s=60)
    third = [policy.backoff(3) for _ in range(200)]
    assert all(0 <= wait <= 4 for wait in third)
    assert len(set(third)) > 1  # GPUs that crashed together do not restart in lockstep
    assert all(0 <= policy.backoff(n) <= 60 for n in (7, 40, 5000))


def test_crash_loop_stops_the_gpu_with_the_reason(tmp_path: Path) -> None:
    dies = Script(ready_after=None, exit_after=0.5, lines=[(0.2, line) for line in OOM_LINES])
    sup, world, history, clock = make(tmp_path, {"gpu0": [dies]}, crash_loop_count=3,
                                      crash_loop_window_s=600)

    code = run_until(sup, clock, lambda: False)  # returns by itself: every GPU stopped

    assert code == 1
    assert len(world.of("gpu0")) == 3
    gpu = history.gpu()
    assert gpu["state"] == "stopped"
    assert gpu["last_reason"].startswith("crash loop: 3 crashes in 10 min; last: killed by SIGKILL")
    assert "kv_no_memory" in gpu["last_reason"]


def test_crashes_outside_the_window_do_not_make_a_loop(tmp_path: Path) -> None:
    long_lived = Script(ready_after=1, exit_after=400)
    sup, world, history, clock = make(tmp_path, {"gpu0": [long_lived]}, crash_loop_count=2,
                                      crash_loop_window_s=300)

    run_until(sup, clock, lambda: len(world.of("gpu0")) == 4, limit_s=3600)

    reasons = [r or "" for _, _, _, r in history.events]
    assert reasons.count("launcher stopped") == 1
    assert not [r for r in reasons if r.startswith("crash loop")]


def test_fatal_log_line_during_start_is_reported_within_seconds(tmp_path: Path) -> None:
    # The process logs SGLang's start-up OOM, then hangs instead of exiting.
    hangs = Script(ready_after=None, lines=[(1.0, line) for line in OOM_LINES], drain_s=None)
    sup, world, history, clock = make(tmp_path, {"gpu0": [hangs]}, fatal_grace_s=5,
                                      ready_timeout_s=1800, crash_loop_count=1)

    run_until(sup, clock, lambda: history.gpu()["state"] == "stopped")

    failed_at = next(t for t, _, state, _ in history.events if state == "crashed")
    assert failed_at < 10  # fatal at 1 s + 5 s grace, not the 1800 s ready deadline
    assert "kv_no_memory: RuntimeError: Not enough memory" in history.gpu()["last_reason"]
    assert "raise --mem-fraction-static" in history.gpu()["last_reason"]
    assert world.of("gpu0")[0].killed_alive


def test_server_that_never_gets_ready_fails_at_its_deadline(tmp_path: Path) -> None:
    loading = "[2026-10-10 11:58:05] Load weight begin. avail mem=78.50 GB"
    silent = Script(ready_after=None, lines=[(1, loading)])
    sup, _, history, clock = make(tmp_path, {"gpu0": [silent]}, ready_timeout_s=60,
                                  crash_loop_count=1)

    run_until(sup, clock, lambda: history.gpu()["state"] == "stopped")

    assert "not ready after 60 s; last log line: [2026-10-10 11:58:05] Load weight begin" in \
        history.gpu()["last_reason"]


def test_bad_arguments_stop_the_gpu_without_retrying(tmp_path: Path) -> None:
    usage = Script(ready_after=None, exit_after=0.3, exit_code=2, lines=[
        (0.1, "usage: sglang serve [-h] ..."),
        (0.1, "sglang serve: error: unrecognized arguments: --cuda-graph-max-bs 16")])
    sup, world, history, clock = make(tmp_path, {"gpu0": [usage]}, crash_loop_count=5)

    assert run_until(sup, clock, lambda: False) == 1

    assert len(world.of("gpu0")) == 1
    reason = history.gpu()["last_reason"]
    assert "exited with code 2 (bad arguments)" in reason
    assert "unrecognized arguments: --cuda-graph-max-bs 16" in reason


def test_hung_server_is_restarted_when_health_fails_long_enough(tmp_path: Path) -> None:
    hangs = Script(ready_after=1, unhealthy_after=20)
    sup, world, history, clock = make(tmp_path, {"gpu0": [hangs, Script()]},
                                      unhealthy_restart_s=60, health_interval_s=5)

    run_until(sup, clock, lambda: len(world.of("gpu0")) == 2)

    reason = next(r for _, _, state, r in history.events if state == "restarting")
    assert reason is not None and reason.startswith("/health failed for 6")
    assert world.of("gpu0")[0].signals[0] == "TERM"


def test_stop_drains_then_kills_a_server_that_ignores_sigterm(tmp_path: Path) -> None:
    stubborn = Script(drain_s=None)
    sup, world, history, clock = make(tmp_path, {"gpu0": [stubborn]}, stop_timeout_s=30)

    code = run_until(sup, clock, lambda: history.gpu()["state"] == "ready")

    proc = world.of("gpu0")[0]
    assert code == 0
    assert proc.signals == ["TERM", "KILL"] and proc.killed_alive
    assert clock.t - proc.term_at >= 30  # type: ignore[operator]
    assert history.gpu()["state"] == "stopped"


def test_stop_lets_a_draining_server_exit_before_sweeping_its_group(tmp_path: Path) -> None:
    sup, world, history, clock = make(tmp_path, {"gpu0": [Script(drain_s=3)]})

    run_until(sup, clock, lambda: history.gpu()["state"] == "ready")

    proc = world.of("gpu0")[0]
    assert proc.returncode == 0 and not proc.killed_alive
    assert proc.signals == ["TERM", "KILL"]  # the sweep of leftovers in its process group


def test_sigterm_to_the_launcher_stops_every_server(tmp_path: Path) -> None:
    sup, world, history, clock = make(tmp_path, {"gpu0": [Script()], "gpu1": [Script()]},
                                      gpus=2)

    async def scenario() -> int:
        running = asyncio.create_task(sup.run(install_signals=True))
        await clock.until(history.all_ready)
        os.kill(os.getpid(), signal.SIGTERM)
        return await running

    assert clock.drive(scenario()) == 0
    assert all(p.returncode == 0 and p.signals[0] == "TERM" for p in world.procs)
    assert [g["state"] for g in history.last["gpus"]] == ["stopped", "stopped"]


def test_rolling_restart_restarts_one_gpu_at_a_time(tmp_path: Path) -> None:
    sup, world, history, clock = make(tmp_path, {"gpu0": [Script()], "gpu1": [Script()]},
                                      gpus=2)
    new = {g: spec(tmp_path, g, ["--max-running-requests", "8"]) for g in (0, 1)}

    async def roll() -> None:
        sup.submit(Order("r1", new, rolling=True))
        await clock.until(lambda: sup.rollout is not None and sup.rollout.state != "running")

    run_until(sup, clock, history.all_ready, roll)

    assert sup.rollout is not None and sup.rollout.state == "done"
    old0, new0 = world.of("gpu0")
    old1, new1 = world.of("gpu1")
    assert new0.spec == new[0] and new1.spec == new[1]
    assert old1.term_at is not None and old1.term_at >= new0.started + 1  # gpu0 ready first
    assert old0.returncode == 0 and not old0.killed_alive  # drained, not killed


def test_rolling_restart_stops_at_a_gpu_whose_new_args_fail(tmp_path: Path) -> None:
    bad = Script(ready_after=None, exit_after=0.5, lines=[(0.2, line) for line in OOM_LINES])
    sup, world, history, clock = make(
        tmp_path, {"gpu0": [Script(), bad, Script()], "gpu1": [Script()]}, gpus=2)
    new = {g: spec(tmp_path, g, ["--mem-fraction-static", "0.99"]) for g in (0, 1)}

    async def roll() -> None:
        sup.submit(Order("r2", new, rolling=True))
        await clock.until(lambda: sup.rollout is not None and sup.rollout.state != "running")
        await clock.until(lambda: history.gpu(0)["state"] == "ready")

    run_until(sup, clock, history.all_ready, roll)

    assert sup.rollout is not None and sup.rollout.state == "failed"
    assert "GPU 0: killed by SIGKILL: kv_no_memory" in sup.rollout.reason
    assert "GPU [1] not restarted" in sup.rollout.reason
    assert world.of("gpu0")[-1].spec == spec(tmp_path, 0)  # back on its previous arguments
    assert len(world.of("gpu1")) == 1


def test_a_restart_with_its_own_drain_tells_the_worker_and_cuts_the_server_then(
        tmp_path: Path) -> None:
    # The server would take 100 s to drain; the order allows 3, after telling its worker.
    scripts = {"gpu0": [Script(drain_s=100), Script()], "worker0": [Script()]}
    sup, world, history, clock = make(tmp_path, scripts, workers=True, drain_timeout_s=300)
    new = {0: spec(tmp_path, 0, ["--max-running-requests", "8"])}

    async def restart() -> None:
        sup.submit(Order("r6", new, rolling=False, drain_s=3.0))
        await clock.until(lambda: sup.rollout is not None and sup.rollout.state != "running")

    run_until(sup, clock, lambda: history.all_ready() and bool(world.of("worker0")), restart)

    assert sup.rollout is not None and sup.rollout.state == "done"
    old, fresh = world.of("gpu0")
    worker = world.of("worker0")[0]
    assert worker.signals[0] == "USR2" and len(world.of("worker0")) == 1  # told, not restarted
    assert old.signals == ["TERM", "KILL"] and old.killed_alive  # cut at its drain
    assert old.term_at is not None and 3 <= fresh.started - old.term_at <= 3 + 4 * sup.policy.poll_s
    assert fresh.spec == new[0]
    assert "draining for a restart (up to 3 s)" in [r for _, _, _, r in history.events]


def test_restart_without_rolling_drains_every_gpu_at_once(tmp_path: Path) -> None:
    scripts = {"gpu0": [Script(drain_s=2)], "gpu1": [Script(drain_s=2)]}
    sup, world, history, clock = make(tmp_path, scripts, gpus=2)
    new = {g: spec(tmp_path, g, ["--max-running-requests", "8"]) for g in (0, 1)}

    async def restart() -> None:
        sup.submit(Order("r4", new, rolling=False))
        sup.submit(Order("r5", new, rolling=True))  # one restart at a time
        await clock.until(lambda: sup.rollout is not None and sup.rollout.state != "running")

    run_until(sup, clock, history.all_ready, restart)

    assert sup.rollout is not None and sup.rollout.state == "done"
    assert sup.rollout.rejected == Rejected("r5", "restart r4 is still running")
    first0, first1 = world.of("gpu0")[0], world.of("gpu1")[0]
    assert first0.term_at is not None and first1.term_at is not None
    assert abs(first0.term_at - first1.term_at) <= sup.policy.poll_s
    assert [p.spec for p in (world.of("gpu0")[1], world.of("gpu1")[1])] == [new[0], new[1]]


def test_restart_order_brings_a_stopped_gpu_back(tmp_path: Path) -> None:
    usage = Script(ready_after=None, exit_after=0.3, exit_code=2)
    sup, _, history, clock = make(tmp_path, {"gpu0": [usage, Script()], "gpu1": [Script()]},
                                  gpus=2)

    async def fix() -> None:
        sup.submit(Order("r3", {0: spec(tmp_path, 0, ["--log-level", "info"])}))
        await clock.until(lambda: history.gpu(0)["state"] == "ready")

    run_until(sup, clock, lambda: history.gpu(0)["state"] == "stopped", fix)

    assert history.states(0)[-3:] == ["starting", "ready", "stopped"]


def test_ready_server_is_read_from_server_info_and_log(tmp_path: Path) -> None:
    sim = Simulator(SimConfig.from_argv(["--model-arch", "mamba-hybrid",
                                         "--max-running-requests", "128",
                                         "--speculative-algorithm", "NEXTN"]))
    graph = ("[2026-10-10 11:58:29] Capture target decode CUDA graph end. bs=[1, 2, 4, 8, 16], "
             "elapsed=9.12 s, mem usage=0.61 GB, avail mem=4.49 GB.")
    script = Script(info=sim_info.server_info(sim), lines=[(0.5, graph)])
    sup, _, history, clock = make(tmp_path, {"gpu0": [script]})

    run_until(sup, clock, lambda: history.gpu()["state"] == "ready")

    cap = history.gpu()["capacity"]
    assert (cap["requested"], cap["effective"], cap["binding"]) == (128, 16, "mamba")
    assert cap["reason"].startswith("asked 128, got 16: 80 Mamba slots / 5 per request")
    assert cap["mamba_slots"] == 80 and cap["cuda_graph_max_bs"] == 16
    assert cap["weights_gb"] == pytest.approx(51.14) and cap["context_length"] is None


def test_dead_worker_is_restarted_and_waits_for_its_server(tmp_path: Path) -> None:
    scripts = {"gpu0": [Script(ready_after=5)],
               "worker0": [Script(exit_after=3, exit_code=1, lines=[(2, "boom: lost broker")]),
                           Script()]}
    sup, world, history, clock = make(tmp_path, scripts, workers=True, backoff_initial_s=1)

    run_until(sup, clock, lambda: len(world.of("worker0")) == 2)

    first, _ = world.of("worker0")
    assert first.started >= 5  # not before the server was ready
    assert history.last["gpus"][0]["worker"]["restarts"] == 1
    assert world.of("worker0")[-1].signals[0] == "TERM"  # stopped with the node


NAME_TAKEN = ("error: worker name gpu0@node7 is taken by a live worker on host node7 (pid 4242); "
              "stop it, or start this one with another name (-n gpuN@%h)")


def test_a_worker_stopped_by_a_crash_loop_starts_again_once_a_restart_made_its_server_ready(
        tmp_path: Path) -> None:
    refused = Script(exit_after=0.5, exit_code=78, lines=[(0.2, NAME_TAKEN)])
    scripts = {"gpu0": [Script(), Script(ready_after=3)],
               "worker0": [refused, refused, Script()]}
    sup, world, history, clock = make(tmp_path, scripts, workers=True, backoff_initial_s=1,
                                      crash_loop_count=2)

    def worker() -> dict[str, Any]:
        return history.gpu().get("worker") or {"state": None}

    async def restart() -> None:
        stopped_at = clock.t
        await clock.until(lambda: clock.t >= stopped_at + 30)
        assert len(world.of("worker0")) == 2 and worker()["state"] == "stopped"  # stays so
        sup.submit(Order("r1", {0: spec(tmp_path, 0)}))
        await clock.until(lambda: worker()["state"] == "running")

    run_until(sup, clock, lambda: worker()["state"] == "stopped", restart)

    second_server, third_worker = world.of("gpu0")[1], world.of("worker0")[2]
    assert third_worker.started >= second_server.started + 3  # its server ready again first
    assert worker()["restarts"] == 2


def test_argv_has_ports_defaults_and_the_user_args_last() -> None:
    argv = build_argv(["sglang", "serve"], "/m", 30001, 31001, ["--mem-fraction-static", "0.9"])
    assert argv == ["sglang", "serve", "--model-path", "/m", "--port", "30001", "--nccl-port",
                    "31001", "--host", "127.0.0.1", "--log-level", "info", "--enable-metrics",
                    "--mem-fraction-static", "0.9"]


def test_a_command_with_placeholders_gets_the_model_port_and_host_and_no_sglang_flag() -> None:
    argv = build_argv(["transformers", "serve", "{model}", "--host", "{host}", "--port", "{port}"],
                      "/m", 30002, 31002, ["--continuous-batching"])
    assert argv == ["transformers", "serve", "/m", "--host", "127.0.0.1", "--port", "30002",
                    "--continuous-batching"]


def test_argv_keeps_the_users_host_log_level_and_model() -> None:
    argv = build_argv(["x"], "/m", 1, 2, ["--host=0.0.0.0", "--log-level", "debug",
                                          "--model", "/other"])
    assert argv.count("--host") + argv.count("--host=0.0.0.0") == 1
    assert "info" not in argv and "/m" not in argv


@pytest.mark.parametrize("args", [["--port", "1"], ["--nccl-port=2"], ["--base-gpu-id", "2"]])
def test_argv_refuses_what_the_launcher_decides_per_server(args: list[str]) -> None:
    with pytest.raises(ProfileError):
        build_argv(["x"], "/m", 1, 2, args)


# Placement: servers over GPU groups (SGLang's --tp-size, --dp-size, --pp-size).

def group_plan(tmp_path: Path, gpus: Sequence[int], *args: str,
               profile: Profile | None = None) -> NodePlan:
    return NodePlan(tuple(gpus), True, True, None, profile or Profile(), args, 30000,
                         tmp_path, {})


def test_tp_2_places_one_server_and_one_worker_on_each_pair_of_gpus(tmp_path: Path) -> None:
    plan = group_plan(tmp_path, range(4), "--tp-size", "2")
    assert plan.servers == {0: (0, 1), 2: (2, 3)}
    server = plan.server_spec(2)
    assert server.name == "gpu2-3" and server.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert server.port == 30002 and server.log_path == tmp_path / "sglang_gpu2-3.log"
    assert server.argv[server.argv.index("--nccl-port") + 1] == "31002"
    worker = plan.worker_spec(2, server)
    assert worker.argv[worker.argv.index("-Q") + 1:worker.argv.index("-n") + 2] == (
        "gpu2-3", "-n", "gpu2-3@%h")
    assert worker.env["FLEETGEN_SERVER_URL"] == "http://127.0.0.1:30002"
    assert worker.env["FLEETGEN_METRICS_PORT"] == "20002"
    assert worker.log_path == tmp_path / "worker_gpu2-3.log"


def test_tp_4_on_eight_gpus_gives_two_servers_and_one_gpu_servers_keep_their_names(
        tmp_path: Path) -> None:
    plan = group_plan(tmp_path, range(8), "--tensor-parallel-size", "4")
    assert plan.servers == {0: (0, 1, 2, 3), 4: (4, 5, 6, 7)}
    assert plan.server_spec(4).env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    single = group_plan(tmp_path, [3])
    assert single.servers == {3: (3,)} and single.server_spec(3).name == "gpu3"
    assert single.server_spec(3).log_path == tmp_path / "sglang_gpu3.log"


def test_group_servers_on_gpus_that_are_not_one_range_name_each_run(tmp_path: Path) -> None:
    plan = group_plan(tmp_path, [0, 2, 4, 6], "--tp-size", "2")
    assert [plan.server_spec(g).name for g in plan.servers] == ["gpu0_2", "gpu4_6"]


@pytest.mark.parametrize(("args", "gpus", "flags"), [
    (("--tp-size", "2"), [0, 1, 2], "--tp-size 2"),
    (("--tp-size", "4"), [0, 1, 2, 3, 4, 5], "--tp-size 4"),
    (("--tp-size", "2", "--dp-size", "2"), [0, 1], "--tp-size 2 --dp-size 2"),
])
def test_gpus_that_do_not_divide_into_servers_are_refused_naming_the_flags(
        tmp_path: Path, args: tuple[str, ...], gpus: list[int], flags: str) -> None:
    with pytest.raises(GpuSpecError, match=f"^{flags}: each server holds"):
        _ = group_plan(tmp_path, gpus, *args).servers


def test_data_parallel_ranks_take_gpus_unless_they_share_them_with_dp_attention(
        tmp_path: Path) -> None:
    assert Parallel.from_args(["--dp-size", "2"]).width == 2
    assert Parallel.from_args(["--tp-size", "2", "--dp-size", "2"]).width == 4
    assert Parallel.from_args(["--tp", "2", "--pp-size", "2"]).width == 4
    shared = Parallel.from_args(["--tp-size", "4", "--dp-size", "4",
                                      "--enable-dp-attention"])
    assert shared.width == 4 and shared.one_nccl_port
    with pytest.raises(ProfileError, match="--dp-size must divide --tp-size"):
        Parallel.from_args(["--tp-size", "4", "--dp-size", "3", "--enable-dp-attention"])
    with pytest.raises(ProfileError, match="--tp-size 'two'"):
        Parallel.from_args(["--tp-size", "two"])


def test_a_dp_server_leaves_its_nccl_ports_to_sglang_one_per_rank(tmp_path: Path) -> None:
    plan = group_plan(tmp_path, range(4), "--dp-size", "2")
    server = plan.server_spec(0)
    assert "--nccl-port" not in server.argv and server.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    shared = group_plan(tmp_path, range(2), "--tp-size", "2", "--dp-size", "2",
                        "--enable-dp-attention")
    assert "--nccl-port" in shared.server_spec(0).argv


def test_a_profile_section_of_a_gpu_inside_a_server_is_refused(tmp_path: Path) -> None:
    follower = profile_from_mapping({"gpu": {"1": {"args": ["--max-running-requests", "8"]}}})
    with pytest.raises(ProfileError, match=r"\[gpu.1\]: GPU 1 is part of server gpu0-1"):
        group_plan(tmp_path, range(2), "--tp-size", "2", profile=follower).server_spec(0)
    wider = profile_from_mapping({"gpu": {"0": {"args": ["--dp-size", "2"]}}})
    with pytest.raises(ProfileError, match="change how server gpu0-1 spreads over GPUs"):
        group_plan(tmp_path, range(2), "--tp-size", "2", profile=wider).server_spec(0)


def test_a_restart_of_any_gpu_of_a_server_restarts_that_server(tmp_path: Path) -> None:
    plan = group_plan(tmp_path, range(4), "--tp-size", "2")
    write_atomic(tmp_path / REQUEST_FILE, RestartRequest("r1", args=("--a", "1"), gpus=(1, 3),
                                                         rolling=True).to_json())
    order, _ = read_request(tmp_path, plan)
    assert order is not None and sorted(order.specs) == [0, 2]
    assert order.specs[0].env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_a_restart_of_gpus_own_arguments_leaves_the_nodes_arguments(tmp_path: Path) -> None:
    plan = group_plan(tmp_path, range(3), "--max-running-requests", "128")
    request = RestartRequest("t1", rolling=False, drain_s=5.0,
                             gpu_args={0: ("--max-mamba-cache-size", "230"),
                                       2: ("--max-mamba-cache-size", "235")})
    write_atomic(tmp_path / REQUEST_FILE, request.to_json())
    order, new_plan = read_request(tmp_path, plan)
    assert order is not None and sorted(order.specs) == [0, 2] and order.drain_s == 5.0
    assert order.specs[0].argv[-4:] == ("--max-running-requests", "128",
                                        "--max-mamba-cache-size", "230")
    assert order.specs[2].argv[-2:] == ("--max-mamba-cache-size", "235")
    assert new_plan.cli_args == plan.cli_args


def test_a_restart_that_would_regroup_the_gpus_is_rejected(tmp_path: Path) -> None:
    plan = group_plan(tmp_path, range(4), "--tp-size", "2")
    write_atomic(tmp_path / REQUEST_FILE, RestartRequest("r2", args=("--tp-size", "4")).to_json())
    with pytest.raises(OrderError, match="stop the node and start it again"):
        read_request(tmp_path, plan)


def test_the_dry_run_shows_each_server_with_its_gpus_and_worker(tmp_path: Path) -> None:
    plan = group_plan(tmp_path, range(4), "--tp-size", "2")
    specs = {g: plan.server_spec(g) for g in plan.servers}
    text = render_dry_run(plan, specs, {g: plan.worker_spec(g, specs[g]) for g in specs})
    lines = text.splitlines()
    assert "4 GPU(s) in 2 server(s) of 2 (--tp-size 2)" in lines[0]
    assert lines[1].startswith("gpu0-1: http http://127.0.0.1:30000, nccl port 31000")
    assert "CUDA_VISIBLE_DEVICES=0,1" in lines[2] and "-Q gpu0-1 -n gpu0-1@%h" in lines[4]
    assert lines[5].startswith("gpu2-3: http http://127.0.0.1:30002, nccl port 31002")


def test_the_dry_run_of_another_engine_checks_no_sglang_flag_and_names_its_command(
        tmp_path: Path) -> None:
    profile = Profile(model="/m", args=("--continuous-batching",),
                      command=("transformers", "serve", "{model}", "--port", "{port}"))
    plan = NodePlan((0,), False, True, None, profile, (), 30000, tmp_path, {})
    specs = {0: plan.server_spec(0)}
    text = render_dry_run(plan, specs, {0: plan.worker_spec(0, specs[0])})
    assert text.startswith("transformers serve (the profile's command), 1 GPU(s)")
    assert "no NCCL port (another engine)" in text and "warning" not in text
    assert "argv transformers serve /m --port 30000 --continuous-batching" in text


def test_status_names_a_group_server_by_its_gpus() -> None:
    state: dict[str, Any] = {
        "supervisor_pid": os.getpid(), "supervisor_alive": True, "updated_at": 100.0,
        "rollout": None,
        "gpus": [{"gpu": 2, "gpus": [2, 3], "name": "gpu2-3", "port": 30002, "pid": None,
                  "state": "starting", "since": 90.0, "restarts": 0, "last_reason": None,
                  "capacity": None, "worker": {"name": "worker2-3", "pid": None,
                                               "state": "starting", "since": 90.0}}]}
    lines = render_status(node_state(state), now=100.0).splitlines()
    assert lines[2].split()[:2] == ["2-3", "30002"]
    assert lines[3].split()[0] == "w2-3"


def test_status_shows_what_a_dp_server_runs_at_once_over_its_ranks(tmp_path: Path) -> None:
    sim = Simulator(SimConfig.from_argv(["--dp-size", "2", "--max-running-requests", "24"]))
    (tmp_path / "x.log").write_text("")
    reading = limits_reading(parse_server_info(sim_info.server_info(sim)),
                          LogFollower(tmp_path / "x.log").report)
    assert (reading.effective, reading.concurrency) == (24, 48)
    state: dict[str, Any] = {
        "supervisor_pid": os.getpid(), "supervisor_alive": True, "updated_at": 100.0,
        "rollout": None,
        "gpus": [{"gpu": 0, "gpus": [0, 1], "name": "gpu0-1", "port": 30000, "pid": None,
                  "state": "ready", "since": 90.0, "restarts": 0, "last_reason": None,
                  "capacity": dataclasses.asdict(reading), "worker": None}]}
    assert "48 (24 per DP rank, asked 24)" in render_status(node_state(state), now=100.0)


def test_profile_gpu_override_replaces_the_same_flag_only(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('model = "/dev/shm/Qwen3.6-27B"\n'
                    'args = ["--mem-fraction-static", "0.93", "--max-running-requests", "64"]\n'
                    '[gpu.3]\nargs = ["--max-running-requests", "32"]\n')
    profile = load_profile(path)
    assert profile.for_gpu(3) == ("/dev/shm/Qwen3.6-27B",
                                  ["--mem-fraction-static", "0.93", "--max-running-requests", "32"])
    assert profile.for_gpu(0)[1] == ["--mem-fraction-static", "0.93",
                                     "--max-running-requests", "64"]


def test_command_line_args_override_the_profile_flag_by_flag() -> None:
    profile = profile_from_mapping({"args": ["--a", "1", "--flag"],
                                    "gpu": {"1": {"args": ["--b=2"]}}})
    assert profile.for_gpu(1, ["--a", "5", "--b", "3"], cli_model="/m") == (
        "/m", ["--flag", "--a", "5", "--b", "3"])


def test_merge_treats_either_spelling_of_a_renamed_flag_as_one() -> None:
    assert merge_args(["--cuda-graph-max-bs", "8"], ["--cuda-graph-max-bs-decode", "16"]) == [
        "--cuda-graph-max-bs-decode", "16"]


@pytest.mark.parametrize("table, names", [
    ({"modle": "x"}, "'modle'"), ({"gpu": {"x": {}}}, "[gpu.x]"), ({"args": "--a 1"}, "list"),
    ({"gpu": {"2": {"port": 1}}}, "'port'")])
def test_bad_profile_is_refused_naming_the_problem(table: dict[str, Any], names: str) -> None:
    with pytest.raises(ProfileError, match=names.replace("[", r"\[").replace("]", r"\]")):
        profile_from_mapping(table)


def test_yaml_profile_without_pyyaml_says_how_to_fix_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` fail
    path = tmp_path / "node.yaml"
    path.write_text("model: /m\n")
    with pytest.raises(ProfileError, match="PyYAML"):
        load_profile(path)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text("args = [\n")
    with pytest.raises(ProfileError, match="node.toml: invalid TOML"):
        load_profile(path)


@pytest.mark.parametrize("version, given, expected", [
    ("0.5.23", ["--cuda-graph-max-bs", "16"], ["--cuda-graph-max-bs-decode", "16"]),
    ("0.5.23", ["--mamba-scheduler-strategy=no_buffer"],
     ["--mamba-radix-cache-strategy=no_buffer"]),
    ("0.5.10.post1", ["--cuda-graph-max-bs-decode", "16"], ["--cuda-graph-max-bs", "16"]),
    ("0.5.10", ["--mamba-radix-cache-strategy", "x"], ["--mamba-scheduler-strategy", "x"]),
    (None, ["--cuda-graph-max-bs", "16"], ["--cuda-graph-max-bs-decode", "16"]),
    ("0.5.23", ["--cuda-graph-max-bs-decode", "16"], ["--cuda-graph-max-bs-decode", "16"]),
])
def test_flags_are_renamed_for_the_installed_version(
        version: str | None, given: list[str], expected: list[str]) -> None:
    args, notes = adapt_flags(given, version)
    assert args == expected
    assert len(notes) == (given != expected)


def test_gpu_spec_accepts_ranges_and_lists() -> None:
    assert parse_gpu_spec("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_gpu_spec("1,0,1") == [0, 1]
    for bad in ("a", "3-1", "1-", ""):
        with pytest.raises(GpuSpecError):
            parse_gpu_spec(bad)


def test_gpu_discovery_without_nvidia_smi_suggests_the_simulator() -> None:
    def missing(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(argv[0])

    with pytest.raises(NoGpuError, match="--sim"):
        discover_gpus(missing)


def test_gpu_discovery_reports_a_failing_driver() -> None:
    def failing(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(list(argv), 9, "", "NVIDIA-SMI has failed because it "
                                           "couldn't communicate with the NVIDIA driver.\n")

    with pytest.raises(NoGpuError, match="exit 9.*couldn't communicate"):
        discover_gpus(failing)


def test_gpu_lines_are_read_and_a_missing_index_is_named() -> None:
    gpus = [parse_gpu_line("0, NVIDIA H100 80GB HBM3, 81559 MiB"),
            parse_gpu_line("1, NVIDIA H100 80GB HBM3, 81559 MiB")]
    assert gpus[0].name == "NVIDIA H100 80GB HBM3" and gpus[0].memory_mib == 81559
    assert select_gpus([1], gpus) == [gpus[1]]
    with pytest.raises(NoGpuError, match="GPU 4 not found"):
        select_gpus([1, 4], gpus)


def test_log_follower_waits_for_complete_lines_and_splits_carriage_returns(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("old line\n")
    follower = LogFollower(log)
    with open(log, "a") as f:
        f.write("Capturing batches (bs=1)\rCapturing batches (bs=2)\nRuntimeError: Not enough me")
    follower.poll()
    assert list(follower.tail) == ["Capturing batches (bs=1)", "Capturing batches (bs=2)"]
    with open(log, "a") as f:
        f.write("mory. Please try to increase --mem-fraction-static.")
    follower.poll(final=True)
    assert follower.fatal is not None and follower.fatal.kind == "kv_no_memory"


def test_read_server_falls_back_to_the_log_without_server_info(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("[2026-10-10 11:58:00] server_args={'max_running_requests': 128}\n"
                   "[2026-10-10 11:58:19] KV Cache is allocated. #tokens: 20000, K size: 1 GB, "
                   "V size: 1 GB\n[2026-10-10 11:58:30] max_total_num_tokens=20000, "
                   "chunked_prefill_size=8192, max_prefill_tokens=16384, "
                   "max_running_requests=128, context_len=40960, available_gpu_mem=4.49 GB\n")
    follower = LogFollower(log, offset=0)
    follower.poll()
    reading = limits_reading(None, follower.report)
    assert (reading.kv_tokens, reading.effective, reading.binding) == (20000, 128, "request")


def test_up_refuses_a_busy_port_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        for port in random.sample(range(21700, 30700), 100):  # below the ephemeral range
            if port_is_free(port + 1000):
                try:
                    busy.bind(("127.0.0.1", port))
                except OSError:
                    continue
                break
        busy.listen()
        code = main(["up", "--sim", "--gpus", "0", "--base-port", str(port),
                          "--run-dir", str(tmp_path)])
    assert code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"launcher up: GPU 0: HTTP port {port} is in use by pid {os.getpid()} (")
    assert err.endswith("; stop what holds it, or pass another --base-port (it moves every port "
                        "of this node)\n")


def test_up_refuses_a_base_that_puts_a_port_in_the_ephemeral_range_naming_the_good_bases(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, last = ephemeral_range()
    code = main(["up", "--sim", "--gpus", "0-1", "--base-port", str(first - 1001),
                      "--run-dir", str(tmp_path)])
    assert code == EXIT_USAGE
    err = capsys.readouterr().err
    assert (f"GPU 1: NCCL port {first} is in the kernel's ephemeral range {first}-{last}, where "
            "outgoing connections take their local ports at random; pass a --base-port from "
            f"1024 to {first - 1002}") in err
    assert not (tmp_path / "node.json").exists()


def test_a_base_under_the_default_puts_the_workers_metrics_beside_its_servers(
        tmp_path: Path) -> None:
    # 20000+(BASE-30000)+N would give 11000 here, and 12010 for 22010: among other services.
    plan = NodePlan((0, 1), True, True, None, Profile(), (), 21000, tmp_path, {})
    assert [plan.metrics_port(g) for g in (0, 1)] == [23000, 23001]
    assert [plan.server_spec(g).port for g in (0, 1)] == [21000, 21001]


def test_every_default_port_of_a_node_lies_below_the_ephemeral_range(tmp_path: Path) -> None:
    plan = NodePlan(tuple(range(8)), True, True, None, Profile(), (),
                         DEFAULT_BASE_PORT, tmp_path, {})
    for gpu in range(8):
        spec = plan.server_spec(gpu)
        nccl = flag_value(spec.argv, "--nccl-port")
        ports = [spec.port, int(nccl or 0), plan.metrics_port(gpu)]
        assert all(p is not None and 1024 <= p < 32768 for p in ports), ports


def test_status_marks_processes_that_are_gone() -> None:
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    state: dict[str, Any] = {
        "supervisor_pid": int(dead_pid), "updated_at": 100.0, "rollout": None,
        "gpus": [{"gpu": 0, "port": 30000, "pid": int(dead_pid), "state": "ready", "since": 40.0,
                  "restarts": 2, "last_reason": None, "worker": None,
                  "capacity": {"effective": 16, "requested": 128, "reason": "asked 128, got 16"}},
                 {"gpu": 1, "port": 30001, "pid": None, "state": "stopped", "since": 50.0,
                  "restarts": 5, "last_reason": "crash loop: 5 crashes", "worker": None,
                  "capacity": None}]}
    text = render_status(node_state(state).with_liveness(), now=100.0)
    assert "NOT running" in text
    lines = text.splitlines()
    assert lines[1].split()[:6] == ["GPU", "PORT", "PID", "STATE", "UPTIME", "RESTARTS"]
    assert f"{dead_pid} (gone)" in lines[2] and "ready?" in lines[2]
    assert "16 (asked 128)" in lines[2] and lines[2].endswith("asked 128, got 16")
    assert lines[3].endswith("crash loop: 5 crashes")


def write_node(run_dir: Path, worker: dict[str, Any], server_state: str = "ready") -> None:
    """node.json of a live supervisor (this process) with GPUs 0 and 1, ready, and GPU 1's
    worker as given."""
    def gpu(index: int, state: str, worker: dict[str, Any]) -> dict[str, Any]:
        return {"gpu": index, "port": 30000 + index, "pid": os.getpid(), "state": state,
                "since": 40.0, "restarts": 0, "last_reason": None, "capacity": None,
                "worker": {"name": f"worker{index}", "pid": os.getpid(), "state": "running",
                           "since": 50.0, **worker}}
    write_atomic(run_dir / "node.json", node_state({
        "supervisor_pid": os.getpid(), "updated_at": 100.0, "rollout": None, "workers": True,
        "gpus": [gpu(0, "ready", {}), gpu(1, server_state, worker)]}).to_json())


def test_status_exits_1_naming_the_gpu_whose_worker_is_stopped_and_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    why = f"crash loop: 5 crashes in 10 min; last: exited with code 78; last log line: {NAME_TAKEN}"
    write_node(tmp_path, {"pid": None, "state": "stopped", "restarts": 4, "last_reason": why})

    assert main(["status", "--run-dir", str(tmp_path)]) == EXIT_FAILED

    out, err = capsys.readouterr()
    assert "stopped" in out.splitlines()[-1]  # the table shows it too
    assert err == (f"status: GPU 1: its worker is stopped ({why}): GPU 1 takes no work; fix "
                   "that, then `launcher restart --gpus 1` starts it again\n")
    assert main(["status", "--run-dir", str(tmp_path), "--json"]) == EXIT_FAILED


def test_status_exits_0_when_every_server_is_ready_and_every_worker_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_node(tmp_path, {})
    assert main(["status", "--run-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""


def test_status_names_a_starting_server_once_not_its_worker_waiting_for_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_node(tmp_path, {"pid": None, "state": "starting"}, server_state="starting")
    assert main(["status", "--run-dir", str(tmp_path)]) == EXIT_FAILED
    assert capsys.readouterr().err == "status: GPU 1: its server is starting\n"


def test_restart_request_overrides_args_flag_by_flag(tmp_path: Path) -> None:
    plan = NodePlan((0, 1), True, False, None, Profile(), ("--speed", "100", "--a", "1"),
                    30000, tmp_path, {})
    write_atomic(tmp_path / REQUEST_FILE, RestartRequest("r9", args=("--a", "2"), gpus=(1,),
                                                         rolling=True).to_json())
    order, new_plan = read_request(tmp_path, plan)
    assert order is not None and list(order.specs) == [1] and order.id == "r9"
    assert new_plan.cli_args == ("--speed", "100", "--a", "2")
    assert order.specs[1].argv[-4:] == ("--speed", "100", "--a", "2")
    assert order.specs[1].port == 30001 and order.specs[1].env["CUDA_VISIBLE_DEVICES"] == "1"
    assert not (tmp_path / REQUEST_FILE).exists()


def test_up_host_binds_the_servers_there_and_points_each_worker_at_its_server(
    tmp_path: Path,
) -> None:
    plan = NodePlan((0,), True, True, None, Profile(), (), 30000, tmp_path, {},
                         host="10.213.0.11")
    server = plan.server_spec(0)
    assert server.argv[server.argv.index("--host") + 1] == "10.213.0.11"
    assert plan.worker_spec(0, server).env["FLEETGEN_SERVER_URL"] == "http://10.213.0.11:30000"
    # Every interface: the worker still reaches its server over loopback.
    wide = dataclasses.replace(plan, host="0.0.0.0").server_spec(0)
    assert wide.argv[wide.argv.index("--host") + 1] == "0.0.0.0"
    assert plan.worker_spec(0, wide).env["FLEETGEN_SERVER_URL"] == "http://127.0.0.1:30000"


def test_api_keys_stay_out_of_logs_and_the_state_file(tmp_path: Path) -> None:
    secret = spec(tmp_path, 0, ["--api-key", "s3cret", "--admin-api-key=t0p"])
    sup, _, history, clock = make(tmp_path, {"gpu0": [Script()]})
    sup.slots[0].server.spec = secret

    run_until(sup, clock, lambda: history.gpu()["state"] == "ready")

    assert "s3cret" not in str(history.last) and "t0p" not in str(history.last)
    assert history.gpu()["argv"][-3:] == ["--api-key", "***", "--admin-api-key=***"]


def test_up_help_names_every_port_the_base_moves(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "BASE+N (HTTP)" in text and "BASE+1000+N (NCCL)" in text
    assert ("20000+(BASE-30000)+N (metrics; BASE+2000+N for a BASE under 30000; "
            "FLEETGEN_METRICS_PORT=0: none)") in text
    assert "(default: 30000)" in text
