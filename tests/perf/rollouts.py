"""Figure 13: programs per prompt (rollouts; fleetgen/rollouts, workers/rollouts.py). How busy
fleetgen keeps the servers when each prompt is a small program of several calls, next to the
same program written by hand in plain asyncio + httpx.

Each scenario runs both pipelines at once, each against its own recording simulators
(`tests.perf.recsim`) with the same flags and the same prompts (figure 11's side by side):

- fleetgen: one Celery worker per server with production settings and nothing else set but
  PYTHONPATH (the workers import tests/rollout_flows.py), `producer enqueue --no-canary
  --rollout tests.rollout_flows:NAME`, then `producer export` checked for every prompt exactly
  once, none failed, and each record's calls;
- plain: every prompt started at once as a task, pinned to server i mod servers, each call
  through an `asyncio.Semaphore` of that server holding as many requests as the worker keeps in
  flight (its ready line, "requests in flight up to N"); tools run through `asyncio.to_thread`
  on a default executor of FLEETGEN_ROLLOUT_THREADS threads, the worker's pool size. The
  bodies are the ones fleetgen sends: the messages, the job's default sampling
  (fleetgen/job.py), the tools' schemas as `ToolLoop` builds them.

Answers decode at DECODE_TPS with natural lengths (lognormal, MEAN_TOKENS), drawn from the
messages: both pipelines get the same answers, so the same tokens (checked beside the figure).
No `--speed`: the worker's controllers tick in wall time.

Slot use of a server = slot-time it held a request ÷ slot-time it had, from its request log:
busy(t) = min(requests at the server at t, slots) / slots, averaged over a window (figure 10's
`busy_share`; a simulator queues only when its slots are full, so this is its running share).
The figure is the mean over a pipeline's servers in the steady window (from the first 10% of its
calls answered to the first 80%, as figures 10 and 11); the same over the whole run (its first
request to its last answer, ramp and drain included) is shown beside it.

1. `revise`: tests.rollout_flows:revise (draft, critique, revise: 3 calls) over 2 servers of
   SLOTS slots, REVISE_PROMPTS prompts: slot use fleetgen ÷ plain (target >= 0.97), the wall
   of each (fleetgen: enqueue to the job done; plain: start to its last answer) and the calls
   the servers received (`/sim/stats` requests; = 3 × prompts).
2. `tool-loop`: tests.rollout_flows:slow_tools (a `ToolLoop` whose tool sleeps 0.5 s, run in the
   worker's pool by `generate.run`) on 1 server, the simulator calling a tool in every answer
   until the conversation holds TOOL_TURNS results (`--tool-call-rate 1 --max-tool-turns 2`):
   3 calls and 2 tool runs a prompt. Slot use fleetgen ÷ the same loop by hand (target >=
   0.97: fleetgen keeps the server as busy), walls, calls.

    python -m tests.perf --only rollouts                               # both (~4 min)
    python -m tests.perf --only rollouts --rollout-scenario tool-loop  # one
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from fleetgen.job import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from fleetgen.ledger import Ledger
from fleetgen.settings import Settings
from tests import rollout_flows
from tests.perf.analysis import Requests
from tests.perf.engines import STEADY, busy_share
from tests.perf.fleet import Fleet, Sim, Worker
from tests.perf.flow import (
    JOB_TIMEOUT_S,
    MODEL,
    Ending,
    Prompts,
    finish,
    sim_stats,
    worker_lines,
)
from tests.perf.report import Row, table
from tests.perf.sampler import Sampler, Tick
from tests.perf.workload import Workload
from tests.stack import ROOT

SCENARIOS = ("revise", "tool-loop")
SLOTS = 16
# An answer of MEAN_TOKENS at DECODE_TPS: calls of ~1.2 s, lognormal around it.
DECODE_TPS = 20.0
MEAN_TOKENS = 24
OUTPUT_SIGMA = 0.5
# About 105 s of full servers each: 2,700 calls on 2 × 16 slots, and 900 tool-loop calls on 16
# slots (answers that call a tool run longer: thinking, then the call's JSON).
REVISE_PROMPTS = 900
TOOL_PROMPTS = 300
TOOL_TURNS = 2
TARGET_BUSY_RATIO = 0.97
# What each call carries beyond its messages: the job's defaults, as fleetgen stores them.
SAMPLING = {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": DEFAULT_TEMPERATURE,
            "top_p": DEFAULT_TOP_P}
# The worker imports the tests' rollouts from the repository, as the producer does (its cwd).
FLOWS_ENV = {"PYTHONPATH": str(ROOT)}
ROLLOUTS_RUNNING = "fleetgen_rollouts_running"
IN_FLIGHT = "fleetgen_requests_in_flight"
ROLLOUT_WORDS = ("in flight up to", "rollout", "rotation", "Traceback", "ERROR")

Completion = dict[str, Any]
Call = Callable[[dict[str, Any]], Awaitable[Completion]]
Program = Callable[[dict[str, Any], Call], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Side:
    """One pipeline's figures over its servers."""

    wall_s: float  # fleetgen: enqueue → job done; plain: its start → its last answer
    span_s: float  # first request received → last answer sent, at its servers
    busy: float  # slot use in the steady window, the mean of its servers'
    busy_run: float  # slot use from its first request to its last answer
    per_server: list[float]  # steady slot use of each server
    requests: int  # chat requests its servers received (/sim/stats)
    completion_tokens: int  # answered tokens, from the request logs


@dataclass(frozen=True)
class Versus:
    """One scenario: fleetgen beside the plain program, each on its own servers."""

    scenario: str
    rollout: str
    servers: int
    slots: int
    prompts: int
    calls_per_prompt: int
    in_flight: int  # per server: the worker's limit, the plain program's semaphore
    fleetgen: Side
    plain: Side
    busy_ratio: float
    busy_run_ratio: float
    # fleetgen's workers over the steady window, summed over them: rollouts running (at the
    # server, waiting for a slot or in their own code) and requests in flight.
    rollouts_running: float | None
    requests_in_flight: float | None
    wrong: list[str]  # records that did not make the program's calls, both pipelines
    log: list[str]
    ending: Ending


def sim_flags(*extra: str) -> list[str]:
    """One simulated server of SLOTS slots whose answers have natural lengths."""
    return ["--flavor", "sglang", "--max-running-requests", str(SLOTS), "--decode-tps",
            str(DECODE_TPS), "--mean-output-tokens", str(MEAN_TOKENS), "--output-sigma",
            str(OUTPUT_SIGMA), "--log-level", "warning", *extra]


def write_prompts(path: Path, n: int) -> Prompts:
    """`n` chat prompts whose text carries their id (the request logs find it in every call)."""
    wl = Workload(prompts=n)
    lines = [orjson.loads(wl.line(i)) for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    wl.write_prompts(path)
    return Prompts(path, lines)


def in_flight_limit(worker: Worker) -> int:
    """The worker's cap on requests in flight, from its ready line."""
    text = worker.proc.log_path.read_text(errors="replace")
    return int(text.split("requests in flight up to ", 1)[1].split(" ", 1)[0])


def _text(completion: Completion) -> str:
    return str((completion["choices"][0]["message"] or {}).get("content") or "")


async def revise_by_hand(line: dict[str, Any], call: Call) -> dict[str, Any]:
    """tests.rollout_flows:revise as a plain program writes it."""
    messages = line["messages"]
    draft = _text(await call({"messages": messages, **SAMPLING}))
    ask = [*messages, {"role": "assistant", "content": draft}]
    critique = _text(await call({"messages": [
        *ask, {"role": "user", "content": "Critique that answer."}], **SAMPLING}))
    final = await call({"messages": [
        *ask, {"role": "user", "content": f"Revise it given this critique: {critique}"}],
        **SAMPLING})
    return {"content": _text(final), "calls": 3, "tool_calls": 0}


async def tool_loop_by_hand(line: dict[str, Any], call: Call) -> dict[str, Any]:
    """tests.rollout_flows:slow_tools as a plain program writes it: ask with the tools, run
    each tool the answer calls in a thread, give the results back, until an answer calls none."""
    loop = rollout_flows.slow_tools
    messages: list[dict[str, Any]] = list(line["messages"])
    calls = ran = 0
    while calls < loop.turns:
        completion = await call({"messages": list(messages), "tools": loop.tool_schemas,
                                 **SAMPLING})
        calls += 1
        message = completion["choices"][0]["message"] or {}
        requested = message.get("tool_calls") or []
        turn: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if requested:
            turn["tool_calls"] = requested
        messages.append(turn)
        if not requested or calls == loop.turns:
            break
        for k, tool_call in enumerate(requested):
            arguments = json.loads(tool_call["function"]["arguments"] or "{}")
            result = await asyncio.to_thread(rollout_flows.slow_lookup, **arguments)
            ran += 1
            messages.append({"role": "tool", "tool_call_id": tool_call.get("id")
                             or f"call_{calls}_{k}", "content": result})
    return {"content": _text(completion), "calls": calls, "tool_calls": ran}


async def run_plain(urls: list[str], lines: list[dict[str, Any]], in_flight: int,
                    program: Program, threads: int) -> tuple[float, list[dict[str, Any]]]:
    """Every prompt's program at once, prompt i on server i mod servers, each server's calls
    through a semaphore of `in_flight`; the wall from start to the last answer, the results."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(threads))
    timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    answered: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            base_url=url, limits=limits, timeout=timeout)) for url in urls]
        gates = [asyncio.Semaphore(in_flight) for _ in urls]

        def caller(server: int) -> Call:
            async def call(body: dict[str, Any]) -> Completion:
                async with gates[server]:
                    response = await clients[server].post("/v1/chat/completions",
                                                          json={"model": MODEL, **body})
                answered.append(time.monotonic())
                response.raise_for_status()
                completion: Completion = response.json()
                return completion
            return call

        calls = [caller(server) for server in range(len(urls))]
        started = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(
            *(program(line, calls[i % len(urls)]) for i, line in enumerate(lines))),
            timeout=JOB_TIMEOUT_S)
    return max(answered, default=started) - started, list(results)


def _logs(sims: list[Sim]) -> dict[str, Path]:
    return {f"gpu{i}": sim.record for i, sim in enumerate(sims) if sim.record is not None}


def steady_window(reqs: Requests) -> tuple[float, float]:
    """From the first 10% of the calls answered to the first 80% (figure 10's window)."""
    answers = sorted(t for t, pid, _, status, _ in reqs.answered if status == 200 and pid != "-")
    return answers[int(len(answers) * STEADY[0])], answers[int(len(answers) * STEADY[1])]


def side_figures(sims: list[Sim], wall_s: float) -> Side:
    """A pipeline's slot use, span, requests and tokens, from its simulators."""
    logs = _logs(sims)
    every = Requests.load(logs)
    steady = steady_window(every)
    whole = (every.received[0][0], every.answered[-1][0])
    per = [Requests.load({name: path}) for name, path in logs.items()]
    busy = [busy_share(reqs, SLOTS, steady) for reqs in per]
    run = [busy_share(reqs, SLOTS, whole) for reqs in per]
    return Side(wall_s=round(wall_s, 1), span_s=round(whole[1] - whole[0], 1),
                busy=round(sum(busy) / len(busy), 4), busy_run=round(sum(run) / len(run), 4),
                per_server=[round(b, 4) for b in busy],
                requests=sum(int(sim_stats(sim)["requests"]) for sim in sims),
                completion_tokens=sum(tokens for *_, tokens in every.answered))


def _mean_in(ticks: list[Tick], family: str, window: tuple[float, float]) -> float | None:
    """A worker family summed over the workers, averaged over the ticks in `window`."""
    inside = [sum(v.get(family, 0.0) for v in t.values.values()) for t in ticks
              if window[0] <= t.t <= window[1] and all(t.values.values())]
    return round(sum(inside) / len(inside), 1) if inside else None


def _wrong(records: Iterable[dict[str, Any]], calls: int, tools: int) -> list[str]:
    """Records (exported or the plain program's) that did not make `calls` calls and `tools`
    tool runs, or failed."""
    out = []
    for record in records:
        result = record.get("result", record)
        made = record.get("calls", result.get("calls"))
        if "error" in record or made != calls or result.get("tool_calls", 0) != tools:
            out.append(orjson.dumps(record).decode()[:300])
    return out


def versus(folder: Path, redis_url: str, scenario: str, rollout: str, program: Program,
           servers: int, prompts: int, flags: list[str], calls: int, tools: int) -> Versus:
    """fleetgen and the plain program at once, each against its own `servers` simulators."""
    job = f"rollouts-{scenario}"
    source = write_prompts(folder / "prompts.jsonl", prompts)
    threads = Settings().rollout_threads
    with Fleet(folder / "plain", redis_url) as plain_fleet, \
            Fleet(folder / "fleetgen", redis_url) as fleet:
        plain_sims = [plain_fleet.sim(f"gpu{i}", flags) for i in range(servers)]
        sims = [fleet.sim(f"gpu{i}", flags) for i in range(servers)]
        workers = [fleet.worker(i, sim.url, FLOWS_ENV) for i, sim in enumerate(sims)]
        limit = in_flight_limit(workers[0])
        targets = {f"w{i}": w.metrics_url for i, w in enumerate(workers)}
        with ThreadPoolExecutor(1) as pool, \
                Sampler(targets, (ROLLOUTS_RUNNING, IN_FLIGHT)) as sampler:
            plain = pool.submit(lambda: asyncio.run(run_plain(
                [s.url for s in plain_sims], source.lines, limit, program, threads)))
            fleet.producer("enqueue", str(source.path), "--job", job, "--output",
                           str(folder / "out"), "--no-canary", "--rollout", rollout)
            ending = finish(fleet, folder, job, prompts)
            plain_wall, plain_results = plain.result(timeout=JOB_TIMEOUT_S)
            fg = side_figures(sims, ending.wall_s)
            pl = side_figures(plain_sims, plain_wall)
        lines = [line for w in workers for line in worker_lines(w, *ROLLOUT_WORDS)]
    exported = [orjson.loads(x) for x in (folder / f"{job}.jsonl").read_bytes().splitlines() if x]
    steady = steady_window(Requests.load(_logs(sims)))
    return Versus(
        scenario=scenario, rollout=rollout, servers=servers, slots=SLOTS, prompts=prompts,
        calls_per_prompt=calls, in_flight=limit, fleetgen=fg, plain=pl,
        busy_ratio=round(fg.busy / pl.busy, 4), busy_run_ratio=round(fg.busy_run / pl.busy_run, 4),
        rollouts_running=_mean_in(sampler.ticks, ROLLOUTS_RUNNING, steady),
        requests_in_flight=_mean_in(sampler.ticks, IN_FLIGHT, steady),
        wrong=(_wrong(exported, calls, tools) + _wrong(plain_results, calls, tools))[:5],
        log=lines[-20:], ending=ending)


def revise(folder: Path, redis_url: str, prompts: int = REVISE_PROMPTS) -> Versus:
    """Scenario 1: draft, critique, revise over two servers."""
    return versus(folder, redis_url, "revise", "tests.rollout_flows:revise", revise_by_hand,
                  2, prompts, sim_flags(), calls=3, tools=0)


def tool_loop(folder: Path, redis_url: str, prompts: int = TOOL_PROMPTS) -> Versus:
    """Scenario 2: a tool loop whose tool sleeps 0.5 s, TOOL_TURNS tool calls a prompt."""
    flags = sim_flags("--tool-call-rate", "1", "--max-tool-turns", str(TOOL_TURNS))
    return versus(folder, redis_url, "tool-loop", "tests.rollout_flows:slow_tools",
                  tool_loop_by_hand, 1, prompts, flags, calls=TOOL_TURNS + 1, tools=TOOL_TURNS)


RUNS: dict[str, Callable[[Path, str], Versus]] = {"revise": revise, "tool-loop": tool_loop}


def run_rollouts(folder: Path, redis_url: str, only: Iterable[str] = SCENARIOS) -> dict[str, Any]:
    """Every chosen scenario on a flushed Redis; one that fails is reported and the rest run."""
    results: dict[str, Any] = {"scenarios": {}, "errors": {}, "took_s": {}}
    ledger = Ledger.from_url(redis_url)
    for name in only:
        ledger.r.flushall()
        started = time.monotonic()
        print(f"   rollouts {name} ...", flush=True)
        try:
            results["scenarios"][name] = asdict(RUNS[name](folder / name, redis_url))
        except Exception as exc:  # noqa: BLE001 (one broken scenario must not hide the others)
            results["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
        results["took_s"][name] = round(time.monotonic() - started, 1)
        print(f"   rollouts {name} took {results['took_s'][name]:.0f}s", flush=True)
    return results


def rows(results: dict[str, Any]) -> list[Row]:
    """Figure 13's lines of the suite's table."""
    figure = results.get("rollouts")
    if not figure:
        return []
    out: list[Row] = []
    labels = {"revise": "13.1 revise (3 calls), 2 × 16 slots",
              "tool-loop": "13.2 tool loop (2 tools of 0.5 s, 3 calls), 16 slots"}
    for name, label in labels.items():
        s = figure["scenarios"].get(name)
        if not s:
            continue
        fg, pl, e = s["fleetgen"], s["plain"], s["ending"]
        expected = s["calls_per_prompt"] * s["prompts"]
        clean = (e["state"] == "done" and not e["paused"] and e["failed"] == 0
                 and e["duplicates"] == 0 and e["exported"] == e["prompts"] and not s["wrong"])
        out.append(Row(f"{label}: slot use fleetgen ÷ plain",
                       f"{s['busy_ratio']:.3f}  ({fg['busy']:.3f} / {pl['busy']:.3f} steady; "
                       f"whole run {fg['busy_run']:.3f} / {pl['busy_run']:.3f} = "
                       f"{s['busy_run_ratio']:.3f}; {s['in_flight']} in flight a server)",
                       f"≥ {TARGET_BUSY_RATIO}", s["busy_ratio"] >= TARGET_BUSY_RATIO))
        out.append(Row("     wall fleetgen / plain (at the servers); calls; exported",
                       f"{fg['wall_s']:.1f}s / {pl['wall_s']:.1f}s ({fg['span_s']:.1f}s / "
                       f"{pl['span_s']:.1f}s); {fg['requests']} calls (plain {pl['requests']}) "
                       f"for {s['prompts']} prompts; {e['exported']} once, {e['failed']} failed, "
                       f"{len(s['wrong'])} wrong", f"calls = {s['calls_per_prompt']} × prompts",
                       clean and fg["requests"] == pl["requests"] == expected))
    for name, error in figure["errors"].items():
        out.append(Row(f"13 {name}: failed", error.splitlines()[0][:90], "-", False))
    return out


def write(out: Path, results: dict[str, Any]) -> Path:
    """`rollouts.md`: figure 13's table, then each scenario's tokens, workers and log lines."""
    figure = results["rollouts"]
    parts = [f"# Figure 13: programs per prompt\n\n{table(rows(results))}\n"]
    for name, s in figure["scenarios"].items():
        fg, pl = s["fleetgen"], s["plain"]
        parts.append(f"## {name} ({figure['took_s'][name]:.0f} s)\n\n"
                     f"Answered tokens fleetgen {fg['completion_tokens']:,}, plain "
                     f"{pl['completion_tokens']:,}; steady slot use per server fleetgen "
                     f"{fg['per_server']}, plain {pl['per_server']}; fleetgen's workers in the "
                     f"steady window: {s['rollouts_running']} rollouts running, "
                     f"{s['requests_in_flight']} requests in flight.\n")
        if s["wrong"]:
            parts.append("Records without the program's calls:\n\n```\n"
                         + "\n".join(s["wrong"]) + "\n```\n")
        if s["log"]:
            parts.append("The workers' log:\n\n```\n" + "\n".join(s["log"]) + "\n```\n")
    path = out / "rollouts.md"
    path.write_text("\n".join(parts))
    return path


__all__ = ["SCENARIOS", "rows", "run_rollouts", "write"]
