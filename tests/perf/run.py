"""`python -m tests.perf`: run the performance suite, print the table, write results/perf/.

    python -m tests.perf                          # everything (~25 min on 2 cores, figure 11 ~15)
    python -m tests.perf --only saturation        # figures 1-3 only
    python -m tests.perf --only saturation --worker-env FLEETGEN_BATCH_CONCURRENCY=16
    python -m tests.perf --s3                     # figure 4 also with an S3 output
    python -m tests.perf --only parquet           # figure 4b: enqueue from Parquet, local and S3
    python -m tests.perf --only export --export-baseline main   # figure 7, before and after
    python -m tests.perf --only timings           # figure 8: how soon things happen
    python -m tests.perf --only short --short-pairs 3   # figure 9: short answers, 3 pairs
    python -m tests.perf --only engines           # figure 10: vLLM and strict servers, no setting
    python -m tests.perf --only flow              # figure 11: a server under stress (~15 min)
    python -m tests.perf --only door              # figure 12: the worker's door under faults
    python -m tests.perf --only rollouts          # figure 13: programs per prompt (~4 min)
    python -m tests.perf real-engine --mode dry         # a real server (real_engine.py)
    python -m tests.perf replay                   # the reference run, hands-off (replay.py)

Each benchmark starts its own processes (Valkey once for the suite; SeaweedFS with --s3) on
free ports of 127.0.0.1 and stops them; a benchmark that fails is reported as failed in the
table and the others still run.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from launcher.services import RedisServer, S3Server
from tests.perf import (
    capacity,
    crash,
    door,
    engines,
    enqueue_cost,
    export_cost,
    flow,
    overhead,
    real_engine,
    replay,
    report,
    rollouts,
    saturation,
    short,
    timings,
)
from tests.perf.workload import Workload
from tests.stack import ROOT

log = logging.getLogger("tests.perf")
BENCHMARKS = ("saturation", "enqueue", "parquet", "overhead", "crash", "capacity", "export", "timings",
              "short", "engines", "flow", "door", "rollouts")
# Commands beside the suite, each with its own flags, processes and results folder:
# `python -m tests.perf real-engine --help`.
COMMANDS: dict[str, Callable[[list[str]], int]] = {"real-engine": real_engine.main,
                                                   "replay": replay.main}


@dataclass(frozen=True)
class PerfConfig:
    """The suite's settings (flags only: benchmarks take no environment variables)."""

    out: Path = ROOT / "results" / "perf"
    only: tuple[str, ...] = BENCHMARKS
    prompts: int = 5000
    speed: float = 15.0
    enqueue_prompts: int = 1_000_000
    overhead_prompts: int = 20_000
    overhead_runs: int = 3
    export_mb: int = 500
    export_baseline: str | None = None
    s3: bool = False
    profile: bool = True
    worker_env: dict[str, str] = field(default_factory=dict)
    batch_size: int | None = None
    keep: bool = False
    short_pairs: int = 1
    flow_scenarios: tuple[str, ...] = flow.SCENARIOS
    door_scenarios: tuple[str, ...] = door.SCENARIOS
    rollout_scenarios: tuple[str, ...] = rollouts.SCENARIOS

    def __post_init__(self) -> None:
        unknown = set(self.only) - set(BENCHMARKS)
        if unknown:
            raise ValueError(f"unknown benchmark(s) {sorted(unknown)}; choose from {BENCHMARKS}")


def parse_args(argv: list[str] | None) -> PerfConfig:
    p = argparse.ArgumentParser(prog="python -m tests.perf", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:7]))
    p.add_argument("--out", type=Path, default=PerfConfig.out)
    p.add_argument("--only", action="append", choices=BENCHMARKS, help="repeatable")
    p.add_argument("--prompts", type=int, default=PerfConfig.prompts, help="figures 1-3")
    p.add_argument("--speed", type=float, default=PerfConfig.speed, help="simulator time factor")
    p.add_argument("--enqueue-prompts", type=int, default=PerfConfig.enqueue_prompts)
    p.add_argument("--overhead-prompts", type=int, default=PerfConfig.overhead_prompts)
    p.add_argument("--overhead-runs", type=int, default=PerfConfig.overhead_runs,
                   help="measured runs of figure 5; the median run is the figure")
    p.add_argument("--export-mb", type=int, default=PerfConfig.export_mb,
                   help="figure 7: MB of results in the synthetic job")
    p.add_argument("--export-baseline", metavar="REV",
                   help="figure 7: also export with this git revision's code (e.g. main)")
    p.add_argument("--s3", action="store_true", help="figure 4 with an S3 output as well")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy run of figure 5")
    p.add_argument("--worker-env", action="append", default=[], metavar="FLEETGEN_X=V",
                   help="worker setting for figures 1-3 (try a change without editing code)")
    p.add_argument("--batch-size", type=int, help="enqueue --batch-size for figures 1-3")
    p.add_argument("--keep", action="store_true", help="keep the run folders (logs, requests)")
    p.add_argument("--short-pairs", type=int, default=PerfConfig.short_pairs,
                   help="figure 9: runs of each pipeline, alternating")
    p.add_argument("--flow-scenario", action="append", choices=flow.SCENARIOS,
                   help="figure 11: this scenario only (repeatable)")
    p.add_argument("--door-scenario", action="append", choices=door.SCENARIOS,
                   help="figure 12: this scenario only (repeatable)")
    p.add_argument("--rollout-scenario", action="append", choices=rollouts.SCENARIOS,
                   help="figure 13: this scenario only (repeatable)")
    a = p.parse_args(argv)
    env = dict(item.split("=", 1) for item in a.worker_env)
    return PerfConfig(out=a.out, only=tuple(a.only or BENCHMARKS), prompts=a.prompts,
                      speed=a.speed, enqueue_prompts=a.enqueue_prompts,
                      overhead_prompts=a.overhead_prompts,
                      overhead_runs=a.overhead_runs, export_mb=a.export_mb,
                      export_baseline=a.export_baseline, s3=a.s3, profile=not a.no_profile,
                      worker_env=env, batch_size=a.batch_size, keep=a.keep,
                      short_pairs=a.short_pairs,
                      flow_scenarios=tuple(a.flow_scenario or flow.SCENARIOS),
                      door_scenarios=tuple(a.door_scenario or door.SCENARIOS),
                      rollout_scenarios=tuple(a.rollout_scenario or rollouts.SCENARIOS))


class Suite:
    """Runs the chosen benchmarks against one Valkey; collects results and errors."""

    def __init__(self, cfg: PerfConfig, tmp: Path, redis: RedisServer) -> None:
        self.cfg, self.tmp, self.redis = cfg, tmp, redis
        self.results: dict[str, Any] = {"machine": report.machine(), "config": _jsonable(cfg),
                                         "errors": {}}
        self.runs: list[saturation.Run] = []

    def run(self) -> None:
        steps: dict[str, Callable[[], None]] = {
            "saturation": self.saturation, "enqueue": self.enqueue, "parquet": self.parquet,
            "overhead": self.overhead,
            "crash": self.crash, "capacity": self.capacity, "export": self.export,
            "timings": self.timings, "short": self.short, "engines": self.engines,
            "flow": self.flow, "door": self.door, "rollouts": self.rollouts}
        for name in self.cfg.only:
            started = time.monotonic()
            print(f"== {name} ...", flush=True)
            self.redis.client().flushall()
            try:
                steps[name]()
            except Exception as exc:  # noqa: BLE001 (one broken benchmark must not hide the others)
                traceback.print_exc()
                self.results["errors"][name] = f"{type(exc).__name__}: {exc}"
            print(f"== {name} took {time.monotonic() - started:.0f}s", flush=True)

    def saturation(self) -> None:
        wl = Workload(prompts=self.cfg.prompts, speed=self.cfg.speed)
        folder = self.tmp / "saturation"
        folder.mkdir()
        prompts = wl.write_prompts(folder / "prompts.jsonl")
        extra = ["--batch-size", str(self.cfg.batch_size)] if self.cfg.batch_size else []
        fg = saturation.run_fleetgen(wl, prompts, folder / "fleetgen", self.redis.url,
                                     self.cfg.worker_env, extra)
        self.redis.client().flushall()
        # The script keeps exactly the in-flight count the fleetgen workers derived.
        sc = saturation.run_script(wl, prompts, folder / "script", self.redis.url,
                                   fg.in_flight_limit or wl.slots)
        self.runs = [fg, sc]
        f, s = fg.figures, sc.figures
        self.results["saturation"] = {
            "workload": asdict(wl), "ideal_tokens_per_s": wl.ideal_rate,
            "in_flight_limit": fg.in_flight_limit, "fleetgen": f.as_dict(), "script": s.as_dict(),
            "makespan_ratio": f.wall_s / s.wall_s if f.wall_s and s.wall_s else None,
            "server_makespan_ratio": f.server_makespan_s / s.server_makespan_s,
            "notes": fg.notes}

    def enqueue(self) -> None:
        folder = self.tmp / "enqueue"
        folder.mkdir()
        path, made_s = enqueue_cost.input_file(self.cfg.out / "cache", self.cfg.enqueue_prompts)
        costs = [enqueue_cost.run_enqueue(path, self.cfg.enqueue_prompts, folder, self.redis.url,
                                          "folder", str(folder / "out"))]
        enqueue_cost.remove_output(folder / "out")
        if self.cfg.s3:
            with S3Server(data_dir=folder / "s3") as s3:
                costs.append(enqueue_cost.run_enqueue(
                    path, self.cfg.enqueue_prompts, folder, self.redis.url, "s3",
                    f"s3://{s3.bucket}/perf", s3.env()))
        self.results["enqueue"] = [c.as_dict() for c in costs]
        self.results["enqueue_input_generated_s"] = made_s

    def parquet(self) -> None:
        """Figure 4b: the million prompts from one Parquet file, local and from S3 (read from
        the embedded SeaweedFS, written to a folder), and a fifth of them, to show the peak
        memory does not grow with the input."""
        folder = self.tmp / "parquet"
        folder.mkdir()
        n = self.cfg.enqueue_prompts
        path, made_s = enqueue_cost.parquet_file(self.cfg.out / "cache", n)
        small, _ = enqueue_cost.parquet_file(self.cfg.out / "cache", n // 5)
        costs = []
        for source, count, target in ((small, n // 5, "folder"), (path, n, "folder")):
            costs.append(enqueue_cost.run_enqueue(source, count, folder, self.redis.url,
                                                  f"parquet {target}", str(folder / "out")))
            enqueue_cost.remove_output(folder / "out")
        with S3Server(data_dir=folder / "s3") as s3:
            s3.client().upload_file(str(path), s3.bucket, "in/bulk.parquet")
            costs.append(enqueue_cost.run_enqueue(
                path, n, folder, self.redis.url, "parquet from s3", str(folder / "out"),
                s3.env(), source=f"s3://{s3.bucket}/in/bulk.parquet"))
        enqueue_cost.remove_output(folder / "out")
        self.results["parquet"] = [c.as_dict() for c in costs]
        self.results["parquet_input_generated_s"] = made_s

    def overhead(self) -> None:
        folder = self.tmp / "overhead"
        folder.mkdir()
        pid = self.redis.pid
        assert pid is not None
        result = overhead.run_overhead(folder, self.redis.url, pid, self.cfg.overhead_prompts,
                                       slots=40, profile=self.cfg.profile,
                                       runs=self.cfg.overhead_runs)
        self.results["overhead"] = result.as_dict()

    def crash(self) -> None:
        folder = self.tmp / "crash"
        folder.mkdir()
        self.results["crash"] = crash.run_crash(folder, self.redis.url).as_dict()

    def capacity(self) -> None:
        folder = self.tmp / "capacity"
        folder.mkdir()
        self.results["capacity"] = capacity.run_capacity(folder, self.redis.url).as_dict()

    def export(self) -> None:
        folder = self.tmp / "export"
        folder.mkdir()
        self.results["export"] = export_cost.run_export_cost(
            folder, self.redis.url, self.cfg.export_mb, self.cfg.export_baseline)

    def timings(self) -> None:
        folder = self.tmp / "timings"
        folder.mkdir()
        self.results["timings"] = timings.run_timings(folder, self.redis.url).as_dict()


    def engines(self) -> None:
        self.results["engines"] = engines.run_engines(self.tmp / "engines", self.redis.url)

    def short(self) -> None:
        self.results["short"] = short.run_pairs(self.tmp / "short", self.redis.url,
                                                self.cfg.short_pairs)

    def flow(self) -> None:
        self.results["flow"] = flow.run_flow(self.tmp / "flow", self.redis.url,
                                             self.cfg.flow_scenarios)

    def door(self) -> None:
        self.results["door"] = door.run_door(self.tmp / "door", self.redis.url,
                                             self.cfg.door_scenarios)

    def rollouts(self) -> None:
        self.results["rollouts"] = rollouts.run_rollouts(self.tmp / "rollouts", self.redis.url,
                                                         self.cfg.rollout_scenarios)


def main(argv: list[str] | None = None) -> int:
    """Run the suite (or a command of COMMANDS); exit 0 when every figure met its target, 1
    otherwise."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in COMMANDS:
        return COMMANDS[args[0]](args[1:])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    started = time.monotonic()
    cfg.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="run-", dir=cfg.out))
    try:
        with RedisServer(data_dir=tmp / "redis") as redis:
            suite = Suite(cfg, tmp, redis)
            suite.run()
        suite.results["duration_s"] = time.monotonic() - started
        suite.results["machine"]["loadavg_end"] = list(os.getloadavg())
        paths = report.write(cfg.out, suite.results, suite.runs)
        if "flow" in suite.results:
            paths.append(flow.write(cfg.out, suite.results))
        if "door" in suite.results:
            paths.append(door.write(cfg.out, suite.results))
        if "rollouts" in suite.results:
            paths.append(rollouts.write(cfg.out, suite.results))
    finally:
        if not cfg.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = (report.rows(suite.results) + flow.rows(suite.results) + door.rows(suite.results)
            + rollouts.rows(suite.results))
    print(report.table(rows))
    print("\nwrote " + ", ".join(str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
                                 for p in paths) + (f"; run folder {tmp}" if cfg.keep else ""))
    return 0 if all(r.ok is not False for r in rows) else 1


def _jsonable(cfg: PerfConfig) -> dict[str, Any]:
    data = asdict(cfg)
    data["out"] = str(cfg.out)
    return data


if __name__ == "__main__":
    sys.exit(main())
