"""The reference run, replayed hands-off: `python -m tests.perf replay`.

fleetgen was born from a ~902K-prompt regeneration on 7 GPUs: a 27B hybrid Mamba-attention
thinking model with speculative decoding, ~2,374 output tokens per answer. Started with
`--max-running-requests 128`, each server ran 16 at a time (Mamba slots), ~2,300 tokens/s per
GPU, ETA 41 h; a person re-tuned it by hand after 11 minutes (40 running, ~3,455 tokens/s, ETA
29.6 h). This replays that start with no person:

1. A Redis primary, its replica and three Sentinels; seven simulated GPUs started exactly like
   the reference (`REFERENCE_SIM`: mamba-hybrid, 128 asked, NEXTN, the step-cost decode model),
   answers lognormal with the reference mean, time compressed by `--speed`; `launcher up --sim
   --workers --tune`, and one `producer enqueue` of a slice of prompts, canary on.
2. Nothing is typed after that. `up --tune` advises and tunes by itself; once it is done, the
   tuned steady rate is measured beside one more simulator started with a sweep's best flags
   (the ideal), driven as full as the workers keep theirs.
3. Faults: every server and worker of the node SIGKILLed (the supervisor restarts them), then
   the Redis primary SIGKILLed (the Sentinels promote the replica).
4. The job ends; `producer export` is checked exactly once.

Every figure is printed in the simulator's clock (wall seconds x speed). A fault's time lost is
the node's tokens it did not generate over a window after it, in seconds of the tuned node's
steady rate. The projection of the whole job is the slice's own time plus the prompts left at
the tuned rate; the ideal's, every prompt at the sweep's best rate from the start.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from fleetgen.jobview import job_status
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from launcher.node import read_state as read_node_state
from launcher.node._tune import drain_seconds
from launcher.services import valkey_binary
from tests.launcher.node.test_node import (
    REFERENCE_SIM,
    free_base,
    modelled_tokens_per_s,
    sweep_best,
)
from tests.perf.fleet import Fleet
from tests.perf.sampler import SIM_FAMILIES, Sampler, Tick
from tests.perf.workload import Workload
from tests.stack import PYTHON, ROOT, Proc
from tests.system.test_sentinel import MASTER, sentinel_group


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """node.json as plain JSON, the form this report keeps (None before the first publish)."""
    state = read_node_state(run_dir)
    return orjson.loads(state.to_json()) if state else None


JOB = "replay"
GPUS = 7
FULL_JOB_PROMPTS = 902_000
MEAN_OUTPUT_TOKENS = 2374.0
# The reference run's own figures: the ETA untuned, and after the hand re-tune at 11 minutes.
REFERENCE_UNTUNED_H, REFERENCE_HAND_TUNED_H = 41.0, 29.6
# The reference model's answers: lognormal, as the suite's workload (tests/perf/workload.py).
SERVER_ARGS = (*REFERENCE_SIM, "--mean-output-tokens", str(MEAN_OUTPUT_TOKENS),
               "--output-sigma", "0.8")
TOKENS = "sglang:generation_tokens_total"  # counts an answer's tokens once it is finished
INPUT_TOKENS = Workload.input_tokens


@dataclass(frozen=True)
class ReplayConfig:
    """The replay's knobs; the windows are in the simulator's clock (seconds)."""

    out: Path = ROOT / "results" / "perf" / "replay"
    speed: float = 10.0
    prompts: int = 60_000
    tune_window_s: float = 60.0
    # The node's own drain, as the reference ran it; a tuning restart drains for its own
    # `tune_drain_s` (infinite: waits for the longest answer, up to the node's).
    drain_s: float = 300.0
    tune_drain_s: float = 30.0
    after_s: float = 300.0  # the tuned steady window, ideal beside it
    fault_window_s: float = 600.0  # a fault's cost is counted over this much after it
    keep: bool = False

    def wall(self, sim_s: float) -> float:
        return sim_s / self.speed


@dataclass
class Replay:
    """What one replay measured (simulator seconds; tokens/s per GPU)."""

    speed: float
    prompts: int
    tuned_after_s: float | None = None
    tune_done_s: float | None = None
    chosen: list[str] = field(default_factory=list)
    before_tps: float | None = None
    after_tps: float | None = None
    ideal_tps: float | None = None
    ideal_flags: list[str] = field(default_factory=list)
    modelled: dict[str, float] = field(default_factory=dict)
    lost_s: dict[str, float] = field(default_factory=dict)
    cut_tokens: float = 0.0
    tune_drain_s: float | None = None
    slice_s: float | None = None
    mean_tokens: float | None = None
    export: dict[str, Any] = field(default_factory=dict)
    status_lines: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def projected_h(self, tps: float | None) -> float | None:
        """The full job at `tps` per GPU after this slice (None without figures)."""
        if tps is None or self.slice_s is None:
            return None
        rest = (FULL_JOB_PROMPTS - self.prompts) * MEAN_OUTPUT_TOKENS / (GPUS * tps)
        return (self.slice_s + rest) / 3600

    @property
    def ideal_h(self) -> float | None:
        if self.ideal_tps is None:
            return None
        return FULL_JOB_PROMPTS * MEAN_OUTPUT_TOKENS / (GPUS * self.ideal_tps) / 3600


def parse_args(argv: Sequence[str]) -> ReplayConfig:
    p = argparse.ArgumentParser(prog="python -m tests.perf replay",
                                description=__doc__.splitlines()[0])
    d = ReplayConfig()
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--speed", type=float, default=d.speed, help="simulator time compression")
    p.add_argument("--prompts", type=int, default=d.prompts, help="the slice replayed")
    p.add_argument("--tune-window", type=float, default=d.tune_window_s,
                   help="simulator seconds per tune measure")
    p.add_argument("--tune-drain", type=drain_seconds, default=d.tune_drain_s,
                   help="simulator seconds a tuning restart lets answers finish, or `wait`")
    p.add_argument("--keep", action="store_true", help="keep the run folder (logs)")
    a = p.parse_args(list(argv))
    return ReplayConfig(out=a.out, speed=a.speed, prompts=a.prompts,
                        tune_window_s=a.tune_window, tune_drain_s=a.tune_drain, keep=a.keep)


def main(argv: Sequence[str]) -> int:
    """Run the replay, print its table; 0 when it meets the issue's targets."""
    cfg = parse_args(argv)
    cfg.out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="replay-", dir=cfg.out))
    started = time.monotonic()
    try:
        result = run_replay(cfg, folder)
    finally:
        if not cfg.keep:
            shutil.rmtree(folder, ignore_errors=True)
    result.notes.append(f"wall {time.monotonic() - started:.0f} s"
                        + (f", run folder {folder}" if cfg.keep else ""))
    (cfg.out / "replay.json").write_text(json.dumps(result.__dict__, indent=1, default=str))
    rows = table(result)
    print(render(rows))
    print("\n".join(result.status_lines + result.notes))
    return 0 if all(ok is not False for _, _, _, ok in rows) else 1


def run_replay(cfg: ReplayConfig, folder: Path) -> Replay:
    """Everything of the module docstring, in order."""
    result = Replay(speed=cfg.speed, prompts=cfg.prompts,
                    tune_drain_s=None if math.isinf(cfg.tune_drain_s) else cfg.tune_drain_s)
    best_tps, best = sweep_best(SERVER_ARGS, INPUT_TOKENS)
    result.ideal_flags = list(best)
    result.modelled = {"start": modelled_tokens_per_s(SERVER_ARGS, [], INPUT_TOKENS),
                       "sweep_best": best_tps}
    wl = Workload(prompts=cfg.prompts, servers=GPUS, mean_output_tokens=MEAN_OUTPUT_TOKENS,
                  speed=cfg.speed)
    source = wl.write_prompts(folder / "prompts.jsonl")
    speed = ["--speed", str(cfg.speed)]
    # A worker re-reads its server's cap every 30 s of a real clock; tune waits for that after
    # each restart, so it is compressed with the rest.
    env = {"FLEETGEN_REDIS_MASTER_NAME": MASTER,
           "FLEETGEN_CAPACITY_REFRESH_S": str(cfg.wall(30.0))}
    with sentinel_group(valkey_binary(), folder / "redis") as redis, \
            Fleet(folder, redis.url, env) as fleet:
        ideal = fleet.sim("ideal", [*SERVER_ARGS, *best, *speed], record=False)
        run_dir = folder / "node"
        base = free_base(GPUS)
        up = Proc("up", [PYTHON, "-m", "launcher", "up", "--sim", "--workers", "--tune",
                         "--tune-window", str(cfg.wall(cfg.tune_window_s)),
                         "--tune-drain", "wait" if math.isinf(cfg.tune_drain_s)
                         else str(cfg.wall(cfg.tune_drain_s)),
                         "--drain-timeout", str(cfg.wall(cfg.drain_s)),
                         "--gpus", f"0-{GPUS - 1}", "--base-port", str(base),
                         "--run-dir", str(run_dir), "--", *SERVER_ARGS, *speed],
                  fleet.env(), folder / "up.log").start()
        fleet.procs.append(up)
        wait_until(lambda: _workers_ready(run_dir) or not up.alive(), 300, interval=0.5,
                   what="seven servers and workers ready")
        if not up.alive():
            raise RuntimeError(f"launcher up exited:\n{up.log()}")
        urls = {f"gpu{g['gpu']}": f"{g['url']}/metrics"
                for g in (read_state(run_dir) or {}).get("gpus") or []}
        ledger = Ledger.from_url(redis.url, master_name=MASTER)
        with Sampler({**urls, "ideal": f"{ideal.url}/metrics"}, SIM_FAMILIES,
                     interval_s=0.5) as sampler:
            fleet.producer("enqueue", str(source), "--job", JOB, "--output",
                           str(folder / "out"))
            job_at = time.time()
            tune = _wait_tuned(run_dir, job_at + 1800, lambda: _while_rolling(fleet, result))
            result.steps = tune.get("steps") or []
            result.chosen = list(tune.get("chosen") or [])
            result.modelled["tuned"] = modelled_tokens_per_s(SERVER_ARGS, result.chosen,
                                                             INPUT_TOKENS)
            tuned_at = result.steps[-1]["at"] if result.steps else time.time()
            # The node runs its final flags once the last winner is rolled out; the experiments
            # after it only lost.
            rolled = [s["at"] for s in result.steps if s["kind"] == "rolled-out"]
            result.tuned_after_s = (max(rolled, default=tuned_at) - job_at) * cfg.speed
            result.tune_done_s = (tuned_at - job_at) * cfg.speed
            # Tune's own baseline window: full batches, just before its first restart.
            measured = max((s["at"] for s in result.steps if s["kind"] == "baseline"),
                           default=tuned_at)
            result.before_tps = _per_gpu(sampler.ticks, urls,
                                         measured - cfg.wall(cfg.tune_window_s),
                                         measured) / cfg.speed
            with _drive(ideal.url, wl, slots=60):
                settle = time.time() + cfg.wall(120)
                time.sleep(max(0.0, settle - time.time()) + cfg.wall(cfg.after_s))
                result.after_tps = _per_gpu(sampler.ticks, urls, settle,
                                            settle + cfg.wall(cfg.after_s)) / cfg.speed
                result.ideal_tps = _per_gpu(sampler.ticks, {"ideal": ""}, settle,
                                            settle + cfg.wall(cfg.after_s)) / cfg.speed
            steady = (result.after_tps or 0.0) * GPUS * cfg.speed  # node tokens/wall s
            _tuning_lost(result, sampler.ticks, urls, job_at, cfg, steady)
            killed_at = _kill_node(run_dir)
            time.sleep(cfg.wall(cfg.fault_window_s))
            result.lost_s["node killed"] = _lost(sampler.ticks, urls, killed_at,
                                                 cfg.wall(cfg.fault_window_s), steady) * cfg.speed
            failed_at = time.time()
            redis.primary.kill()
            time.sleep(cfg.wall(cfg.fault_window_s))
            result.lost_s["Redis failover"] = _lost(sampler.ticks, urls, failed_at,
                                                    cfg.wall(cfg.fault_window_s),
                                                    steady) * cfg.speed
            ended = _wait_done(ledger, 1800)
            result.slice_s = (ended - job_at) * cfg.speed
        answers = sum(_last(sampler.ticks, u, "sglang:num_requests_total") for u in urls)
        result.status_lines += _status_lines(run_dir, fleet)
        result.export = _export(fleet, folder, cfg.prompts)
        result.mean_tokens = result.export.get("mean_tokens") or (
            sum(_last(sampler.ticks, u, TOKENS) for u in urls) / max(1, answers))
    return result


def _workers_ready(run_dir: Path) -> bool:
    gpus = (read_state(run_dir) or {}).get("gpus") or []
    if len(gpus) != GPUS or any(g.get("state") != "ready" for g in gpus):
        return False
    for g in gpus:
        log = Path((g.get("worker") or {}).get("log") or "/nonexistent")
        if not log.exists() or " ready." not in log.read_text(errors="replace"):
            return False
    return True


def _wait_tuned(run_dir: Path, deadline: float,
                rolling: Callable[[], None]) -> dict[str, Any]:
    """node.json's tune log once `up --tune` is done (or its last state at the deadline);
    `rolling()` is called while a winner is being rolled out."""
    while time.time() < deadline:
        tune = (read_state(run_dir) or {}).get("tune") or {}
        if tune.get("state") == "done":
            return dict(tune)
        if (tune.get("steps") or [{}])[-1].get("kind") in ("won", "rolling-out"):
            rolling()
        time.sleep(0.5)
    return dict((read_state(run_dir) or {}).get("tune") or {})


def _while_rolling(fleet: Fleet, result: Replay) -> None:
    """`producer status` once while the first winner rolls out (the servers' caps differ)."""
    if not any(line.startswith("producer status") for line in result.status_lines):
        found = [x.strip() for x in fleet.producer("status", JOB).stdout.splitlines()
                 if "tuning" in x]
        result.status_lines += [f"producer status (rolling out): {x}" for x in found]


def _kill_node(run_dir: Path) -> float:
    """SIGKILL every server and worker of the node (their process groups), as a node failure
    would; the supervisor brings them back."""
    at = time.time()
    for g in (read_state(run_dir) or {}).get("gpus") or []:
        for pid in (g.get("pid"), (g.get("worker") or {}).get("pid")):
            if isinstance(pid, int):
                with suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
    return at


def _wait_done(ledger: Ledger, timeout_s: float) -> float:
    def done() -> bool:
        try:
            return bool(job_status(ledger, JOB).state == "done")
        except Exception:  # noqa: BLE001 (Redis mid-failover: ask again)
            return False

    wait_until(done, timeout_s, interval=0.5, what="the job done")
    return time.time()


@contextmanager
def _drive(url: str, wl: Workload, slots: int) -> Iterator[None]:
    """Keep `slots` chat requests of the workload's shape in flight on `url`."""
    stop = threading.Event()

    def one(k: int) -> None:
        n = 10_000_000 + k
        with httpx.Client(timeout=600, trust_env=False) as client:
            while not stop.is_set():
                body = orjson.loads(wl.line(n))
                n += slots
                try:
                    client.post(f"{url}/v1/chat/completions", json={
                        "model": "default", "messages": body["messages"],
                        "max_tokens": wl.max_tokens})
                except httpx.HTTPError:
                    time.sleep(0.2)

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(slots)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()


def _clock_offset() -> float:
    return time.time() - time.monotonic()


def _series(ticks: Sequence[Tick], name: str, family: str) -> list[tuple[float, float]]:
    off = _clock_offset()
    return [(t.t + off, t.values[name][family]) for t in ticks
            if name in t.values and family in t.values[name]]


def _made(ticks: Sequence[Tick], name: str) -> list[tuple[float, float, float]]:
    """(time, output tokens generated by `name` so far, those of its running answers) at each
    scrape, running answers included: every prompt has the workload's exact input size
    (tests/perf/workload.py)."""
    off = _clock_offset()
    out = []
    for t in ticks:
        v = t.values.get(name)
        if v and TOKENS in v:
            running = v["sglang:num_used_tokens"] - INPUT_TOKENS * v["sglang:num_running_reqs"]
            out.append((t.t + off, v[TOKENS] + running, running))
    return out


def _generated(ticks: Sequence[Tick], name: str, start: float,
               end: float) -> tuple[float, float, float]:
    """Useful tokens generated on `name` between two wall times, the seconds between the
    first and the last scrape in them, and the tokens cut: a server that restarts counts from
    zero again, and the answers it was running when it went (killed, or cut at the end of a
    drain) are generated again elsewhere, so their tokens so far count as lost."""
    total, cut, prev, first, last = 0.0, 0.0, None, None, None
    for t, value, running in _made(ticks, name):
        if t < start or t > end:
            continue
        if prev is not None:
            if value >= prev[0]:
                total += value - prev[0]
            else:
                total += value - prev[1]
                cut += prev[1]
        prev, first, last = (value, running), first if first is not None else t, t
    return total, (last - first) if first is not None and last is not None else 0.0, cut


def _per_gpu(ticks: Sequence[Tick], names: Mapping[str, str], start: float,
             end: float) -> float:
    """Mean tokens/s (wall) per server of `names` over [start, end], over the scraped time
    (a short window loses up to one scrape interval at each end)."""
    made = [_generated(ticks, n, start, end) for n in names]
    covered = sum(span for _, span, _ in made)
    return sum(tokens for tokens, _, _ in made) / covered if covered > 0 else 0.0


def _lost(ticks: Sequence[Tick], names: Mapping[str, str], start: float, window: float,
          steady: float) -> float:
    """Wall seconds of the whole node lost after `start`: the tokens the steady node would
    have generated over the window and did not."""
    if steady <= 0:
        return 0.0
    made = [_generated(ticks, n, start, start + window) for n in names]
    covered = sum(span for _, span, _ in made) / len(made)
    if covered <= 0:
        return window
    return max(0.0, window * (1 - sum(tokens for tokens, _, _ in made) / covered / steady))


def _tuning_lost(r: Replay, ticks: Sequence[Tick], names: Mapping[str, str], job_at: float,
                 cfg: ReplayConfig, steady: float) -> None:
    """The node's time lost from the job's start until every GPU runs the chosen flags and
    has refilled, against the tuned steady node, split in two: each GPU's time on the old
    flags at their lower rate, and the rest (drains, starts, refills, answers cut)."""
    if r.tuned_after_s is None or not r.before_tps or not r.after_tps:
        return
    window = r.tuned_after_s / cfg.speed + cfg.wall(cfg.tune_window_s)
    total = _lost(ticks, names, job_at, window, steady) * cfg.speed
    moved: dict[int, float] = {}
    for step in r.steps:
        if step["kind"] in ("trying", "rolling-out"):
            gpus = step["gpu"] if isinstance(step["gpu"], list) else [step["gpu"]]
            for g in gpus:
                moved.setdefault(g, step["at"])
    slower = 1 - r.before_tps / r.after_tps
    flags = sum((moved.get(g, job_at + window) - job_at) * cfg.speed * slower
                for g in range(GPUS)) / GPUS
    r.lost_s["tuning: old flags until restarted"] = flags
    r.lost_s["tuning: restarts (drain, start, refill, answers cut)"] = max(0.0, total - flags)
    r.cut_tokens = sum(_generated(ticks, n, job_at, job_at + window)[2] for n in names)


def _last(ticks: Sequence[Tick], name: str, family: str) -> float:
    found = _series(ticks, name, family)
    return found[-1][1] if found else 0.0


def _status_lines(run_dir: Path, fleet: Fleet) -> list[str]:
    """What `launcher status` and `producer status` say about the tuning at the end."""
    import subprocess

    lines: list[str] = []
    node = subprocess.run([PYTHON, "-m", "launcher", "status", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    lines += [f"launcher status: {x}" for x in node.stdout.splitlines() if "tune" in x]
    job = fleet.producer("status", JOB)
    lines += [f"producer status: {x.strip()}" for x in job.stdout.splitlines() if "tun" in x]
    return lines


def _export(fleet: Fleet, folder: Path, prompts: int) -> dict[str, Any]:
    target = folder / "export.jsonl"
    done = fleet.producer("export", JOB, "--to", str(target))
    ids: collections.Counter[str] = collections.Counter()
    tokens = answers = 0
    for line in target.read_bytes().splitlines():
        row = orjson.loads(line)
        ids[row.get("custom_id") or row.get("id")] += 1
        usage = row.get("usage") or {}
        if usage.get("completion_tokens"):
            tokens, answers = tokens + usage["completion_tokens"], answers + 1
    expected = {f"p{n:06d}" for n in range(prompts)}
    return {"rows": sum(ids.values()), "distinct": len(ids),
            "twice": sum(1 for c in ids.values() if c > 1),
            "missing": len(expected - set(ids)), "unexpected": len(set(ids) - expected),
            "exactly_once": set(ids) == expected and max(ids.values(), default=0) == 1,
            "summary": done.stdout.strip().splitlines()[-1:],
            "mean_tokens": tokens / answers if answers else None}


def table(r: Replay) -> list[tuple[str, str, str, bool | None]]:
    """(figure, measured, target, ok) rows."""
    def h(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} h"

    def tps(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    proj = r.projected_h(r.after_tps)
    ratio = proj / r.ideal_h if proj and r.ideal_h else None
    share = r.after_tps / r.ideal_tps if r.after_tps and r.ideal_tps else None
    ex = r.export
    rows: list[tuple[str, str, str, bool | None]] = [
        ("time until every GPU ran the chosen flags", "-" if r.tuned_after_s is None else
         f"{r.tuned_after_s / 60:.1f} min (`{' '.join(r.chosen)}`; tune done at "
         f"{(r.tune_done_s or 0) / 60:.1f} min)", "≤ 11 min (the reference, by hand)",
         None if r.tuned_after_s is None else r.tuned_after_s <= 11 * 60),
        ("steady tokens/s per GPU, before", tps(r.before_tps),
         f"reference ~2,300 (model {r.modelled.get('start', 0):,.0f})", None),
        ("steady tokens/s per GPU, tuned", tps(r.after_tps) +
         f" (model {r.modelled.get('tuned', 0):,.0f})", "reference ~3,455 by hand", None),
        ("steady tokens/s per GPU, sweep's best from the start (ideal)", tps(r.ideal_tps) +
         f" (`{' '.join(r.ideal_flags)}`, model {r.modelled.get('sweep_best', 0):,.0f})",
         "-", None),
        ("tuned ÷ ideal", "-" if share is None else f"{share:.3f}", "≥ 0.99",
         None if share is None else share >= 0.99),
    ]
    drain = "wait for the longest" if r.tune_drain_s is None else f"cut at {r.tune_drain_s:.0f} s"
    for cause, lost in r.lost_s.items():
        extra = ""
        if cause.startswith("tuning: restarts"):
            extra = f"; drain: {drain}, {r.cut_tokens:,.0f} tokens cut"
        rows.append((f"time lost: {cause}", f"{lost:.0f} s = {lost / 3600:.3f} h{extra}", "-",
                     None))
    rows += [
        ("export exactly once", f"{ex.get('distinct', 0):,} ids, {ex.get('twice', '-')} twice, "
         f"{ex.get('missing', '-')} missing", "every id once", bool(ex.get("exactly_once"))),
        ("slice", f"{r.prompts:,} prompts in {h((r.slice_s or 0) / 3600)}" + (
            "" if r.ideal_tps is None or r.slice_s is None else
            f", {((r.slice_s - r.prompts * MEAN_OUTPUT_TOKENS / (GPUS * r.ideal_tps)) / 60):.1f}"
            " min beyond the ideal's rate (tuning, faults, the last answers)"), "-", None),
        ("projected full job (902K prompts)", h(proj),
         f"< {REFERENCE_HAND_TUNED_H} h (reference {REFERENCE_UNTUNED_H} h untuned)",
         None if proj is None else proj < REFERENCE_HAND_TUNED_H),
        ("ideal full job (sweep's best from the start, no faults)", h(r.ideal_h), "-", None),
        ("projected ÷ ideal", "-" if ratio is None else f"{ratio:.3f}", "≤ 1.015",
         None if ratio is None else ratio <= 1.015),
    ]
    return rows


def render(rows: Sequence[tuple[str, str, str, bool | None]]) -> str:
    lines = ["| figure (simulator clock) | measured | target | |", "|---|---|---|---|"]
    for name, value, target, ok in rows:
        mark = "" if ok is None else ("pass" if ok else "MISS")
        lines.append(f"| {name} | {value} | {target} | {mark} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
