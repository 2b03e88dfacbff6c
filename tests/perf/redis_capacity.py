"""How many GPUs one Redis carries: Redis CPU, command latency and memory for N GPUs.

A Python process on a 2-core machine cannot send the traffic of 1,000 GPUs at 25 prompts/s
(25,000 checkpoint calls a second), so the benchmark measures what each unit of a GPU's Redis
traffic costs Redis, with fleetgen's own calls (fleetgen/ledger/, fleetgen/checkpoints.py,
the lease renewal script, the registry entry, `producer status`), and adds the units up for N
GPUs. The units, per GPU:

- a prompt: its share of one RECORD_GROUP call, the group the worker's CheckpointWriter
  gathers at this rate over the settings' `checkpoint_window_s` (at most GROUP_RECORDS), with a
  result record of `record_bytes`;
- a batch of the job's mean batch size (a large job's default size with its taper): its
  message (LPUSH; BRPOP + kombu's unacked bookkeeping; ack), the ledger's reads (manifest,
  state, done?), acquire, checkpoint load, finish, release;
- a lease renewal every `lease_renew_s` per batch held (`held`): the heartbeat's renewal
  script and its read of the job's state;
- a registry entry every REGISTRY_BEAT_S;
- a reconciler round every `reconcile_interval_s` in every worker (its turn, the active and
  finished jobs its metrics keep), and fleet-wide the round that runs (CLIENT LIST over three
  connections per GPU, the registry, each running batch's lease holder); one `producer status`
  every 2 s.

Redis CPU comes from `INFO cpu` (used_cpu_user + used_cpu_sys) around each unit's repetitions;
latency from `INFO latencystats` (server-side p99 per command, Valkey's own histograms);
memory from `INFO memory` (bytes per checkpointed prompt; bytes per queued prompt is figure 4).
A real-time run at a load this machine can drive checks the sum against a measured CPU share.

    python -m tests.perf.redis_capacity                # table + results/perf/redis_capacity.*
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import redis

from fleetgen import keys
from fleetgen.checkpoints import GROUP_RECORDS, RECORD_GROUP, Entry, group_arguments
from fleetgen.fleet import REGISTRY_BEAT_S, ServerHealth, WorkerEntry
from fleetgen.job import TAPER, GenerationParams, InputInfo, JobManifest, batch_sizes
from fleetgen.jobview import job_status
from fleetgen.ledger import RENEW_LEASE, Ledger
from fleetgen.readings import ServerReading
from fleetgen.settings import Settings
from launcher.services import RedisServer
from producer.enqueue import default_batch_size

JOB = "perf-redis"
OUT = Path("results/perf")
DEFAULTS = Settings()
RENEW_S = DEFAULTS.lease_renew_s
RECONCILE_S = DEFAULTS.reconcile_interval_s
STATUS_S = 2.0
CONNECTIONS_PER_GPU = 3
# A fleet of hundreds of GPUs runs jobs of millions of prompts: their default batch size.
LARGE_JOB = 1_000_000
# Prompts per checkpoint call, beside the default window's group: 1 is a window of 0 on an idle
# Redis (it answers before the next prompt ends), 64 a full group.
GROUPS = (1, 16, GROUP_RECORDS)  # broker, ledger, the engine's asyncio client


def mean_batch(prompts: int = LARGE_JOB) -> float:
    """Mean prompts per batch of a job of `prompts` at the default size, tapered as new jobs are."""
    sizes = batch_sizes(prompts, default_batch_size(prompts), taper=TAPER)
    return prompts / len(sizes)


@dataclass
class Rate:
    prompts_per_s: float
    record_bytes: int  # one checkpointed result line
    batch: float = field(default_factory=mean_batch)
    held: int = 2

    @property
    def group(self) -> int:
        """Prompts per checkpoint call: what the default window gathers at this rate."""
        return max(1, min(GROUP_RECORDS, round(self.prompts_per_s
                                               * DEFAULTS.checkpoint_window_s)))


RATES = (Rate(1.5, 8_000), Rate(25.0, 1_000))


def cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def cost(r: redis.Redis, unit: Callable[[int], None], repeats: int) -> float:
    """Redis CPU seconds per call of `unit(i)`, over `repeats` calls."""
    began = cpu(r)
    for i in range(repeats):
        unit(i)
    return (cpu(r) - began) / repeats


class Units:
    """One of each unit of a GPU's traffic, on fleetgen's own calls."""

    def __init__(self, ledger: Ledger, batches: int, rate: Rate) -> None:
        self.ledger, self.r, self.rate = ledger, ledger.r, rate
        self.record = orjson.dumps({"id": "x", "content": "y" * rate.record_bytes})
        self.script = self.r.register_script(RECORD_GROUP)
        self.renew = self.r.register_script(RENEW_LEASE)
        self.batches = batches
        self.prompt_no = 0

    def prompt(self, i: int, group: int = 1) -> None:
        """One RECORD_GROUP call carrying `group` finished prompts."""
        batch = keys.batch_id(int(i * group // self.rate.batch) % self.batches)
        entries = []
        for _ in range(group):
            self.prompt_no += 1
            entries.append(Entry(JOB, batch, f"p{self.prompt_no}", self.record,
                                 {"prompts_done": 1, "output_tokens": self.rate.record_bytes / 4,
                                  "input_tokens": 200}, b"{}"))
        script_keys, args = group_arguments(JOB, entries, "gpu0@node", int(time.time() // 60), 0)
        self.script(keys=script_keys, args=args)

    def batch(self, i: int) -> None:
        ledger, batch, token = self.ledger, keys.batch_id(i % self.batches), f"gpu0@node/{i}"
        message = orjson.dumps({"job": JOB, "batch": batch, "pad": "m" * 600})
        self.r.lpush("fleetgen", message)  # the producer's or the reconciler's publish
        raw = self.r.brpop(["gpu0", "fleetgen"], timeout=1)
        assert raw is not None
        with self.r.pipeline() as p:  # kombu's unacked bookkeeping, then its ack
            p.zadd("unacked_index", {f"tag{i}": time.time()})
            p.hset("unacked", f"tag{i}", raw[1])
            p.execute()
        ledger.jobs.load(JOB)
        ledger.jobs.state(JOB)
        ledger.batches.is_done(JOB, batch)
        ledger.r.delete(keys.lease(JOB, batch))
        ledger.leases.acquire(JOB, batch, token, 30.0)
        ledger.batches.checkpoint(JOB, batch)
        ledger.batches.finish_and_settle(JOB, batch, {"prompts_done": int(self.rate.batch)},
                                         "gpu0@node", [])
        ledger.r.srem(keys.job_part(JOB, "done"), batch)  # so the next round finishes it again
        ledger.leases.release(JOB, batch, token, refund=False)
        with self.r.pipeline() as p:
            p.zrem("unacked_index", f"tag{i}")
            p.hdel("unacked", f"tag{i}")
            p.execute()

    def hold_leases(self) -> None:
        """Leases for the renewals to extend (taken once: a renewal does not take one)."""
        for b in range(self.batches):
            self.r.set(keys.lease(JOB, keys.batch_id(b)), "gpu0@node/t", px=600_000)

    def renewal(self, i: int) -> None:
        """The heartbeat's calls for one held batch (workers/heartbeat.py)."""
        batch = keys.batch_id(i % self.batches)
        self.renew(keys=[keys.lease(JOB, batch)], args=["gpu0@node/t", 30_000])
        self.r.hget(keys.job(JOB), keys.JOB_STATE)

    def registry(self, i: int) -> None:
        reading = ServerReading("up", running=70.0, queue=2.0, token_usage=0.5, mamba_usage=0.5,
                                gen_throughput=3000.0, accept_length=2.5, effective_max=72,
                                requested_max=72, version="0.5.9")
        entry = WorkerEntry(
            worker=f"gpu{i % 8}@node{i % 1000}", host="node", pid=1, queues=["gpu0", "fleetgen"],
            last_error=None, server="http://x",
            local_server="http://127.0.0.1:30000", reading=reading, state="ready",
            server_kind="sglang 0.5.9, model 'm'", effective_max_running_requests=72,
            requested_max_running_requests=72, capacity_source="internal_states", limit=72,
            in_flight=70, updated=time.time(), health=ServerHealth.quiet(72))
        self.r.hset(keys.WORKERS, entry.worker, entry.to_json())

    def status(self, i: int) -> None:
        job_status(self.ledger, JOB)

    def reconcile(self, i: int) -> None:
        """The round that runs: CLIENT LIST and the registry (per client: see measure)."""
        self.r.client_list()
        self.r.hgetall(keys.WORKERS)

    def reconcile_worker(self, i: int) -> None:
        """A worker's own share of each round: its try for the turn, the jobs its metrics keep,
        and the running batches' lease holders read in the round that runs (`held` of them)."""
        self.ledger.registry.take_reconciler_turn(f"gpu{i}@node", 9_000)
        self.ledger.jobs.active()
        self.ledger.jobs.finished(since=time.time() - 180)
        self.ledger.leases.tokens(JOB, [keys.batch_id((i + b) % self.batches)
                                        for b in range(self.rate.held)])


def new_job(ledger: Ledger, batches: int, rate: Rate) -> None:
    size = round(rate.batch)
    prompts = batches * size
    manifest = JobManifest(
        name=JOB, output="/tmp/perf-redis", input=InputInfo("in.jsonl", "0" * 64, prompts, 1000),
        prompts=prompts, batch_size=size, batches=batches, queue=keys.SHARED_QUEUE,
        params=GenerationParams(), created_at=time.time())
    ledger.jobs.save(manifest)
    ledger.jobs.activate(manifest)


@dataclass
class UnitCosts:
    """Redis CPU µs per unit, at one rate's record size."""

    prompt: float
    batch: float
    renewal: float
    registry: float
    status: float
    reconcile_per_client: float  # CLIENT LIST + registry read, per connected client
    reconcile_per_gpu: float  # a worker's own share of a round
    checkpoint_bytes: float  # Redis memory per checkpointed prompt
    # µs per prompt when one checkpoint call carries this many prompts
    prompt_in_groups: dict[int, float] = field(default_factory=dict)

    def per_gpu_s(self, rate: Rate) -> float:
        """Redis CPU seconds per second of one GPU's traffic."""
        return 1e-6 * (rate.prompts_per_s * self.prompt
                       + rate.prompts_per_s / rate.batch * self.batch
                       + rate.held / RENEW_S * self.renewal + self.registry / REGISTRY_BEAT_S
                       + self.reconcile_per_gpu / RECONCILE_S)

    def fixed_s(self, gpus: int) -> float:
        """Fleet-wide Redis CPU seconds per second: reconciler round and one status watcher."""
        clients = gpus * CONNECTIONS_PER_GPU
        return 1e-6 * (clients * self.reconcile_per_client / RECONCILE_S + self.status / STATUS_S)

    def core_share(self, gpus: int, rate: Rate) -> float:
        return gpus * self.per_gpu_s(rate) + self.fixed_s(gpus)


def measure(server: RedisServer, rate: Rate, repeats: int) -> tuple[UnitCosts, dict[str, float]]:
    r = server.client()
    r.flushall()
    ledger = Ledger(r)
    batches = 200
    new_job(ledger, batches, rate)
    units = Units(ledger, batches, rate)
    r.config_set("latency-tracking", "yes")
    r.config_resetstat()
    group = rate.group
    # Warms the script and fills the checkpoints whose memory is read next.
    cost(r, partial(units.prompt, group=group), max(50, repeats // group))
    held = sum(int(r.memory_usage(k) or 0)
               for k in r.scan_iter(match=keys.checkpoint(JOB, "*"), count=1000))
    checkpoint_bytes = held / units.prompt_no
    costs = UnitCosts(
        prompt=0.0,  # below, beside the other group sizes
        batch=1e6 * cost(r, units.batch, repeats // 10),
        renewal=0.0,
        registry=1e6 * cost(r, units.registry, repeats),
        status=1e6 * cost(r, units.status, max(20, repeats // 50)),
        reconcile_per_client=0.0,
        reconcile_per_gpu=1e6 * cost(r, units.reconcile_worker, repeats // 10),
        checkpoint_bytes=checkpoint_bytes,
    )
    units.hold_leases()
    costs.renewal = 1e6 * cost(r, units.renewal, repeats)
    p99 = latency_p99(r)
    for g in sorted({*GROUPS, group}):
        costs.prompt_in_groups[g] = 1e6 * cost(r, partial(units.prompt, group=g),
                                               max(50, repeats // g)) / g
    costs.prompt = costs.prompt_in_groups[group]
    # CLIENT LIST is linear in connected clients: measure it with a few hundred open.
    extra = [server.client() for _ in range(300)]
    for c in extra:
        c.ping()
    clients = len(r.client_list())
    costs.reconcile_per_client = 1e6 * cost(r, units.reconcile, 50) / clients
    for c in extra:
        c.close()
    r.close()
    return costs, p99


def realtime_check(server: RedisServer, rate: Rate, gpus: int, seconds: float,
                   costs: UnitCosts) -> tuple[float, float, float]:
    """Send `gpus` GPUs' prompt, batch, renewal and registry traffic in real time for `seconds`
    (one thread per GPU); return (measured Redis core share above an idle Redis's, the sum's
    prediction, achieved share of the offered prompt rate)."""
    r0 = server.client()
    r0.flushall()
    new_job(Ledger(r0), 200, rate)
    Units(Ledger(r0), 200, rate).hold_leases()
    idle_cpu, idle_began = cpu(r0), time.monotonic()
    time.sleep(seconds / 2)
    idle = (cpu(r0) - idle_cpu) / (time.monotonic() - idle_began)
    stop = threading.Event()
    sent = [0] * gpus

    def gpu(index: int) -> None:
        ledger = Ledger(server.client())
        units = Units(ledger, 200, rate)
        period, began, n = 1.0 / rate.prompts_per_s, time.monotonic(), 0
        group, every_batch = rate.group, max(1, round(rate.batch))
        while not stop.is_set():
            if n % group == 0:  # the group's call, once its last prompt is in
                units.prompt(n // group + index * 100_000, group)
            if n % every_batch == 0:
                units.batch(n // every_batch + index * 1000)
            if n % max(1, int(rate.prompts_per_s * RENEW_S / rate.held)) == 0:
                units.renewal(n)
            if n % max(1, int(rate.prompts_per_s * REGISTRY_BEAT_S)) == 0:
                units.registry(index)
            n += 1
            sent[index] = n
            wait = began + n * period - time.monotonic()
            if wait > 0:
                stop.wait(wait)
        ledger.r.close()

    threads = [threading.Thread(target=gpu, args=(i,), daemon=True) for i in range(gpus)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # past the threads' start
    began_cpu, began, first = cpu(r0), time.monotonic(), sum(sent)
    time.sleep(seconds)
    share = (cpu(r0) - began_cpu) / (time.monotonic() - began)
    achieved = (sum(sent) - first) / (time.monotonic() - began) / (gpus * rate.prompts_per_s)
    stop.set()
    for t in threads:
        t.join(5)
    r0.close()
    predicted = gpus * achieved * costs.per_gpu_s(rate)
    return share - idle, predicted, achieved


def latency_p99(r: redis.Redis) -> dict[str, float]:
    """Server-side p99 per command since the last CONFIG RESETSTAT, in µs."""
    out = {}
    for name, value in r.info("latencystats").items():
        if isinstance(value, dict) and "p99" in value:
            out[name.removeprefix("latency_percentiles_usec_")] = float(value["p99"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.perf.redis_capacity")
    parser.add_argument("--gpus", default="10,100,300,1000")
    parser.add_argument("--repeats", type=int, default=3000)
    parser.add_argument("--check-gpus", type=int, default=20,
                        help="GPUs of the real-time check at 25 prompts/s each")
    parser.add_argument("--check-seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    fleet = [int(x) for x in args.gpus.split(",")]
    results: dict[str, Any] = {"rates": [], "table": []}
    with tempfile.TemporaryDirectory() as tmp, \
            RedisServer(data_dir=Path(tmp) / "redis") as server:
        measured = {}
        for rate in RATES:
            costs, p99 = measure(server, rate, args.repeats)
            measured[rate.prompts_per_s] = costs
            results["rates"].append({"rate": asdict(rate), "costs_us": asdict(costs),
                                     "server_p99_us": p99})
            for gpus in fleet:
                grouped = {g: round(replace(costs, prompt=us).core_share(gpus, rate), 4)
                           for g, us in costs.prompt_in_groups.items()}
                results["table"].append({
                    "gpus": gpus, "prompts_per_s_per_gpu": rate.prompts_per_s,
                    "prompts_per_call": rate.group,
                    "redis_core_share": round(costs.core_share(gpus, rate), 4),
                    "core_share_by_group": grouped,
                    # ~80 answers in flight per GPU are checkpointed until their batch ends
                    "checkpoint_mb_in_flight": round(
                        gpus * 80 * costs.checkpoint_bytes / 1e6, 1)})
        fast = RATES[1]
        share, predicted, achieved = realtime_check(
            server, fast, args.check_gpus, args.check_seconds, measured[fast.prompts_per_s])
        results["realtime_check"] = {"gpus": args.check_gpus, "rate": fast.prompts_per_s,
                                     "achieved_share_of_rate": round(achieved, 3),
                                     "measured_core_share": round(share, 4),
                                     "predicted_core_share": round(predicted, 4)}
        for rate in RATES:
            costs = measured[rate.prompts_per_s]
            results.setdefault("gpus_at_half_a_core", {})[
                f"{rate.prompts_per_s} prompts/s, {rate.group} per call"] = max(
                    n for n in range(1, 20_001) if costs.core_share(n, rate) <= 0.5)
    (OUT / "redis_capacity.json").write_text(json.dumps(results, indent=2))
    print(render(results))
    _plot(results)
    return 0


def render(results: dict[str, Any]) -> str:
    groups = " | ".join(f"{g} per call" for g in results["table"][0]["core_share_by_group"])
    lines = [f"| GPUs | prompts/s per GPU | Redis CPU, % of a core, at the default window "
             f"(prompts per call) | the same at: {groups} | checkpoints held (MB) |",
             "|---:|---:|---:|" + "---:|" * len(results["table"][0]["core_share_by_group"])
             + "---:|"]
    for row in results["table"]:
        shares = " | ".join(f"{100 * v:.1f}%" for v in row["core_share_by_group"].values())
        lines.append(f"| {row['gpus']:,} | {row['prompts_per_s_per_gpu']} | "
                     f"{100 * row['redis_core_share']:.1f}% ({row['prompts_per_call']}) | "
                     f"{shares} | {row['checkpoint_mb_in_flight']} |")
    for entry in results["rates"]:
        c, p99, rate = entry["costs_us"], entry["server_p99_us"], entry["rate"]
        top = ", ".join(f"{k} {v:.0f}" for k, v in sorted(p99.items(), key=lambda kv: -kv[1])[:4])
        lines.append(f"\n{rate['prompts_per_s']} prompts/s, {rate['record_bytes']} B records, "
                     f"{rate['batch']:.0f}-prompt batches: µs of Redis CPU per prompt "
                     f"{c['prompt']:.1f} (by prompts per call: {_rounded(c['prompt_in_groups'])}),"
                     f" per batch {c['batch']:.0f}, per renewal {c['renewal']:.1f}, per "
                     f"registry beat {c['registry']:.1f}, per status {c['status']:.0f}, "
                     f"reconciler per client {c['reconcile_per_client']:.2f} and per worker "
                     f"{c['reconcile_per_gpu']:.0f}; {c['checkpoint_bytes']:.0f} B per "
                     f"checkpointed prompt; server p99 µs: {top}")
        per_s = {"checkpoints": rate["prompts_per_s"] * c["prompt"],
                 "batches": rate["prompts_per_s"] / rate["batch"] * c["batch"],
                 "renewals": rate["held"] / RENEW_S * c["renewal"],
                 "registry": c["registry"] / REGISTRY_BEAT_S,
                 "reconciler": c["reconcile_per_gpu"] / RECONCILE_S}
        lines.append("  µs of Redis CPU per GPU-second: " + ", ".join(
            f"{k} {v:.0f}" for k, v in per_s.items()) + f" (total {sum(per_s.values()):.0f})")
    check = results["realtime_check"]
    lines.append(f"\nreal-time check: {check['gpus']} GPUs x {check['rate']} prompts/s "
                 f"({100 * check['achieved_share_of_rate']:.0f}% of it sent): Redis at "
                 f"{100 * check['measured_core_share']:.1f}% of a core, the sum predicts "
                 f"{100 * check['predicted_core_share']:.1f}%")
    lines.append(f"GPUs at <= 50% of a core: {results['gpus_at_half_a_core']}")
    return "\n".join(lines)


def _rounded(by_group: dict[Any, float]) -> dict[Any, float]:
    return {k: round(v, 1) for k, v in by_group.items()}


def _plot(results: dict[str, Any]) -> None:
    from tests.perf.plot import COLORS, Line, Panel, write_plot

    lines = []
    for i, rate in enumerate(RATES):
        rows = [row for row in results["table"] if row["prompts_per_s_per_gpu"] == rate.prompts_per_s]
        lines.append(Line(f"{rate.prompts_per_s} prompts/s per GPU, {rate.group} per call",
                          [(float(row["gpus"]), 100 * row["redis_core_share"]) for row in rows],
                          COLORS[i]))
        lines.append(Line(f"{rate.prompts_per_s} prompts/s per GPU, 1 per call",
                          [(float(row["gpus"]), 100 * row["core_share_by_group"][1])
                           for row in rows], COLORS[i], dashed=True))
    write_plot(OUT / "redis_capacity", [Panel("Redis CPU (% of a core) by GPUs", lines, slots=50,
                                              y_label="% of a core")])


if __name__ == "__main__":
    raise SystemExit(main())
