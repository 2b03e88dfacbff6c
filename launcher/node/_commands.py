"""`python -m launcher up|status|restart`: bring a GPU node up, read it, restart it.

    python -m launcher up --gpus 0-6 --model /dev/shm/Qwen3.6-27B -- --mem-fraction-static 0.93
    python -m launcher up --gpus 0,1 --sim --workers
    python -m launcher status
    python -m launcher restart --rolling -- --max-running-requests 64
    python -m launcher up --gpus 0-6 --profile node.toml --dry-run   # print argv and env, exit
    python -m launcher advise [--json]   # what binds each GPU, flags to try, predictions
    python -m launcher advise --url http://10.0.0.5:30000   # any SGLang server
    python -m launcher tune [--dry-run]  # try candidates side by side while a job runs

`up` runs in the foreground until SIGTERM/SIGINT and keeps `{run_dir}/node.json` current;
`status` reads that file and prints it as a table; `restart` writes `{run_dir}/restart.json`
and sends the supervisor SIGHUP, then follows the rollout in node.json (docs/guides/gpu-nodes.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from fleetgen.commandline import CommandParser
from fleetgen.keys import METRICS_BASE_PORT
from fleetgen.ports import HOST
from launcher.errors import LauncherError, PortBusyError
from launcher.node._advise import Observed, advice_json, advise, entry_for_url, observe
from launcher.node._args import Profile, flag_value, load_profile
from launcher.node._errors import NodeError, NoGpuError
from launcher.node._gpus import discover_gpus, parse_gpu_spec, select_gpus
from launcher.node._plan import (
    DEFAULT_BASE_PORT,
    NodePlan,
    check_ports,
    read_request,
    render_dry_run,
)
from launcher.node._restart import follow_restart, new_request_id, send_restart
from launcher.node._rundir import (
    DEFAULT_RUN_DIR,
    REQUEST_FILE,
    STATE_FILE,
    TUNE_FILE,
    NodeState,
    ProcessEntry,
    RestartRequest,
    Rollout,
    ServerEntry,
    pid_alive,
    read_state,
    read_tune,
    write_atomic,
)
from launcher.node._supervisor import Child, Order, Policy, Slot, Supervisor
from launcher.node._tune import MARGIN_HELP, TuneSettings, Tuning, cmd_tune, drain_seconds
from launcher.node._watch import HttpProbe, Reading

log = logging.getLogger("launcher.node")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    """`up`, `status`, `restart`, `advise` or `tune`, named by the first argument; returns the
    exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands = {"up": cmd_up, "status": cmd_status, "restart": cmd_restart,
                "advise": cmd_advise, "tune": cmd_tune}
    if not args or args[0] not in commands:
        print(f"usage: python -m launcher {{{','.join(commands)}}} ...", file=sys.stderr)
        return EXIT_USAGE
    try:
        return commands[args[0]](args[1:])
    except LauncherError as exc:  # a NodeError, or a busy port
        print(f"launcher {args[0]}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _split(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """Launcher flags before `--`, server arguments after it (None when no `--`)."""
    if "--" in argv:
        cut = list(argv).index("--")
        return list(argv[:cut]), list(argv[cut + 1:])
    return list(argv), None


def up_parser() -> CommandParser:
    p = CommandParser(
        prog="python -m launcher up",
        description="Start one SGLang server per GPU (per group of GPUs with --tp-size, "
                    "--pp-size or --dp-size after --) and keep them running until SIGTERM.",
        epilog="examples:\n  python -m launcher up --gpus 0-6 --model /dev/shm/Qwen3.6-27B -- "
        "--speculative-algorithm NEXTN --mem-fraction-static 0.93\n"
        "  python -m launcher up --gpus 0,1 --sim --workers\n"
        "  python -m launcher up --profile node.toml")
    p.add_argument("--gpus", help="indices and ranges, e.g. 0-6 or 0,1 (default: all; sim: 0)")
    p.add_argument("--model", help="model path (overrides the profile's `model`)")
    p.add_argument("--profile", type=Path, help="TOML (or YAML) file: model, args, [gpu.N]")
    p.add_argument("--sim", action="store_true", help="run the SGLang simulator (no GPU needed)")
    p.add_argument("--workers", action="store_true",
                   help="also run one Celery worker per server")
    p.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT,
                   help="the server on GPU N (or led by it) takes BASE+N (HTTP) and "
                        f"BASE+1000+N (NCCL), its worker {METRICS_BASE_PORT}+(BASE-30000)+N "
                        "(metrics; BASE+2000+N for a BASE under 30000; FLEETGEN_METRICS_PORT=0: "
                        "none); all must lie from 1024 to below the ephemeral range (default: "
                        "%(default)s)")
    p.add_argument("--host", default=HOST,
                   help="address the servers listen on: 0.0.0.0 or this node's address lets "
                        "`producer status` on other nodes read them live")
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="node.json lives here")
    p.add_argument("--log-dir", type=Path, help="server logs (default: RUN_DIR/logs)")
    policy = Policy()
    p.add_argument("--ready-timeout", type=float, default=policy.ready_timeout_s,
                   help="seconds a server may take to answer /health after its start")
    p.add_argument("--backoff", type=float, default=policy.backoff_initial_s,
                   help="longest first restart delay in s (a random wait up to it), doubled per "
                        "recent crash")
    p.add_argument("--max-crashes", type=int, default=policy.crash_loop_count,
                   help="crashes within --crash-window that stop a GPU")
    p.add_argument("--crash-window", type=float, default=policy.crash_loop_window_s / 60,
                   help="minutes")
    p.add_argument("--stop-timeout", type=float, default=policy.stop_timeout_s,
                   help="seconds between SIGTERM and SIGKILL when a server stops")
    p.add_argument("--drain-timeout", type=float, default=policy.drain_timeout_s,
                   help="seconds a restart waits for a server's running requests to finish")
    p.add_argument("--tune", action="store_true",
                   help="once the servers are loaded and work waits, run `launcher tune` by "
                        "itself where a limit binds: candidates side by side, kept where one "
                        "wins")
    p.add_argument("--tune-window", type=float, default=TuneSettings.window_s,
                   help="seconds of samples per --tune measure (default: %(default)s)")
    p.add_argument("--tune-drain", type=drain_seconds,
                   help="seconds a --tune restart lets running answers finish before it cuts "
                        "the rest (handed back, generated again elsewhere), or `wait` for the "
                        "longest one, up to --drain-timeout (default: half --tune-window, "
                        f"{TuneSettings.drain_s:g} at the default window)")
    p.add_argument("--tune-margin", type=float, default=TuneSettings.margin,
                   help=f"{MARGIN_HELP}, as `launcher tune --margin` (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="print each GPU's argv, environment and ports, start nothing")
    return p


def cmd_up(argv: Sequence[str]) -> int:
    """Bring the node up and supervise it until SIGTERM/SIGINT."""
    flags, server_args = _split(argv)
    args = up_parser().parse_args(flags)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, datefmt="%H:%M:%S",
                        format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health probe otherwise
    run_dir: Path = args.run_dir
    try:
        policy = Policy(ready_timeout_s=args.ready_timeout, backoff_initial_s=args.backoff,
                        crash_loop_count=args.max_crashes,
                        crash_loop_window_s=args.crash_window * 60,
                        stop_timeout_s=args.stop_timeout, drain_timeout_s=args.drain_timeout)
    except ValueError as exc:
        raise NodeError(str(exc)) from None
    if not args.dry_run:
        _refuse_second_supervisor(run_dir)
    profile = load_profile(args.profile) if args.profile else Profile()
    if args.sim:
        gpus = parse_gpu_spec(args.gpus or "0")
    else:
        wanted = parse_gpu_spec(args.gpus) if args.gpus else None
        try:
            found = discover_gpus()
        except NoGpuError:
            if not (args.dry_run and wanted):  # a dry run may plan for another machine's GPUs
                raise
            gpus = wanted
        else:
            gpus = [g.index for g in select_gpus(wanted, found)]
    plan = NodePlan(tuple(gpus), args.sim, args.workers, args.model, profile,
                    tuple(server_args or ()), args.base_port, args.log_dir or run_dir / "logs",
                    dict(os.environ), assume_command=args.dry_run, host=args.host)
    servers = plan.servers  # each server's GPUs, by its lead GPU
    specs = {lead: plan.server_spec(lead) for lead in servers}
    metrics = {g: plan.metrics_port(g) for g in servers} if args.workers else {}
    if args.dry_run:
        workers = {g: plan.worker_spec(g, specs[g]) for g in servers} if args.workers else {}
        print(render_dry_run(plan, specs, workers))
        try:
            check_ports(specs, metrics)
        except PortBusyError as exc:
            print(f"warning: {exc}")
        return EXIT_OK
    check_ports(specs, metrics)
    slots = [Slot(g, Child(specs[g]), Child(plan.worker_spec(g, specs[g])) if args.workers
                  else None, gpus=servers[g]) for g in servers]
    # SGLang logs its own --api-key (upstream): a new run dir is private to this user.
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (run_dir / REQUEST_FILE).unlink(missing_ok=True)
    log.info("node: %d GPU(s) %s%s%s, run dir %s, logs %s", len(gpus), list(gpus),
             f" in {len(servers)} servers ({plan.parallel.text()})"
             if plan.parallel.width > 1 else "",
             " (simulator)" if args.sim else f" (sglang {plan.version})", run_dir, plan.log_dir)
    tune = TuneSettings.for_window(args.tune_window, args.tune_drain, args.tune_margin) \
        if args.tune else None
    return asyncio.run(_supervise(plan, slots, policy, run_dir, flag_value(
        specs[gpus[0]].argv, "--api-key"), tune))


async def _supervise(plan: NodePlan, slots: list[Slot], policy: Policy, run_dir: Path,
                     api_key: str | None, tune: TuneSettings | None = None) -> int:
    header = NodeState(run_dir=str(run_dir), log_dir=str(plan.log_dir), sim=plan.sim,
                       workers=plan.workers, started_at=time.time(),
                       sglang_version=plan.version)
    holder = {"plan": plan}

    def load_order() -> Order | None:
        order, holder["plan"] = read_request(run_dir, holder["plan"])
        return order

    probe = HttpProbe(api_key=api_key)
    supervisor = Supervisor(
        slots, policy, probe=probe, load_order=load_order, header=header,
        publish=lambda snapshot: write_atomic(run_dir / STATE_FILE, dataclasses.replace(
            snapshot, tune=read_tune(run_dir)).to_json()))
    if tune is not None:
        (run_dir / TUNE_FILE).unlink(missing_ok=True)  # a former run's log is not this node's
    tuning = _start_tuning(supervisor, run_dir, tune) if tune is not None else None
    try:
        return await supervisor.run()
    finally:
        if tuning is not None:
            tuning.cancel()
        await probe.aclose()


def _start_tuning(supervisor: Supervisor, run_dir: Path,
                  settings: TuneSettings) -> asyncio.Task[None]:
    """`up --tune`: `Tuning.auto` in a daemon thread (it blocks on windows of samples and on
    rollouts, which it asks of this supervisor by SIGHUP); stopped with the node."""
    stop = threading.Event()

    def tune() -> None:
        try:
            Tuning.of_node(run_dir, settings, stop).auto()
        except Exception:  # a failed tuning must not take the node down
            log.exception("node: tuning failed")

    threading.Thread(target=tune, name="tune", daemon=True).start()

    async def stop_with_node() -> None:
        try:
            await supervisor.stop.wait()
        finally:
            stop.set()

    return asyncio.create_task(stop_with_node())


def _refuse_second_supervisor(run_dir: Path) -> None:
    state = read_state(run_dir)
    pid = state.supervisor_pid if state else None
    if pid is not None and pid_alive(pid):
        raise NodeError(f"a supervisor (pid {pid}) already runs with run dir {run_dir}; "
                        "stop it first or pass another --run-dir")


def cmd_status(argv: Sequence[str]) -> int:
    """Print the node table; 0 when the supervisor runs and every GPU is ready, else 1."""
    p = CommandParser(prog="python -m launcher status",
                      description="Show each GPU's server as the supervisor sees it.",
                      epilog="examples:\n  python -m launcher status\n"
                      "  python -m launcher status --json --run-dir /var/run/fleetgen")
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR,
                   help="the run dir `launcher up` was given")
    p.add_argument("--json", action="store_true", help="print node.json with liveness added")
    args = p.parse_args(list(argv))
    state = read_state(args.run_dir)
    if state is None:
        print(f"status: no {STATE_FILE} in {args.run_dir}: `launcher up` has not run here "
              "(or pass --run-dir)", file=sys.stderr)
        return EXIT_USAGE
    state = state.with_liveness()
    print(state.to_json() if args.json else render_status(state))
    problems = status_problems(state)
    for problem in problems:
        print(f"status: {problem}", file=sys.stderr)
    return EXIT_FAILED if problems else EXIT_OK


def status_problems(state: NodeState) -> list[str]:
    """Why the node is not healthy, one line per process that keeps its GPU from work (none
    when every server is ready and every worker runs): which GPU, which process, its state and
    why."""
    if not state.supervisor_alive:
        return [f"the supervisor (pid {state.supervisor_pid}) is not running: nothing is kept "
                "up and the table is stale; start the node again with `launcher up`"]
    problems = []
    for g in state.gpus:
        server_up = _up(g.server, "ready")
        if not server_up:
            problems.append(_problem(g, "server", g.server))
        worker = g.worker
        # A worker is first started once its server is ready: until then the server says why.
        if worker is not None and not _up(worker, "running") \
                and not (worker.state == "starting" and not server_up):
            problems.append(_problem(g, "worker", worker))
    return problems


def _up(p: ProcessEntry, state: str) -> bool:
    return p.state == state and p.pid_alive is not False


def _problem(g: ServerEntry, role: str, p: ProcessEntry) -> str:
    gpu = f"GPU {_gpus_text(g)}"
    if p.state != "stopped" and p.pid is not None and p.pid_alive is False:
        return f"{gpu}: its {role} (pid {p.pid}) is gone"
    text = f"{gpu}: its {role} is {p.state}" + (f" ({p.last_reason})" if p.last_reason else "")
    if p.state == "stopped":
        text += (f": {gpu} takes no work; fix that, then `launcher restart --gpus {g.gpu}` "
                 "starts it again")
    return text


def cmd_advise(argv: Sequence[str]) -> int:
    """Sample each ready GPU's server (or each --url) over a window and say what binds it and
    what to try."""
    from fleetgen.settings import setting  # here: launcher.node loads no settings reader

    p = CommandParser(
        prog="python -m launcher advise",
        description="Per GPU, or per SGLang server given by --url: the limit that binds it, how "
                    "full its pools are, and the flags to try with the predicted running "
                    "requests and tokens/s.",
        epilog="examples:\n  python -m launcher advise\n  python -m launcher advise --gpus 0,1 "
               "--window 60 --json\n  python -m launcher advise --url http://10.0.0.5:30000 "
               "--window 10")
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR,
                   help="the launcher's run directory (node.json)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpus", help="only the servers holding these GPUs (default: all)")
    where.add_argument("--url", action="append", metavar="URL",
                       help="an SGLang server started without the launcher (repeatable); "
                            "node.json is not read")
    p.add_argument("--api-key", default=setting("server_api_key"),
                   help="the servers' API key (default: $FLEETGEN_SERVER_API_KEY or the older "
                        "$FLEETGEN_SERVER_API_KEY, which keeps it out of ps)")
    p.add_argument("--window", type=float, default=30.0, help="seconds of /metrics samples")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--json", action="store_true", help="one JSON object per server, in a list")
    args = p.parse_args(list(argv))
    if args.url:
        urls = [_base_url(u) for u in args.url]

        async def read_urls() -> list[ServerEntry]:
            return list(await asyncio.gather(*(entry_for_url(u, args.api_key) for u in urls)))

        entries = asyncio.run(read_urls())
    else:
        entries = _ready_entries(args.run_dir, args.gpus)

    async def sample_all() -> list[Observed]:
        return list(await asyncio.gather(*(
            observe(g.url, args.window, args.interval, args.api_key) for g in entries)))

    advice = [advise(g, o) for g, o in zip(entries, asyncio.run(sample_all()), strict=True)]
    for a in advice:
        if a.samples == 0:
            print(f"advise: {a.name}: no /metrics sample answered in {args.window:g} s (SGLang "
                  "serves it with --enable-metrics): the advice is from its capacity alone",
                  file=sys.stderr)
    if args.json:
        print(advice_json(advice))
    else:
        print("\n".join(a.line() for a in advice))
    return EXIT_OK


def _ready_entries(run_dir: Path, gpus: str | None) -> list[ServerEntry]:
    """node.json's ready servers (only those holding one of `gpus` when given)."""
    state = read_state(run_dir)
    if state is None:
        raise NodeError(f"no {STATE_FILE} in {run_dir}: `launcher up` has not run here "
                        "(or pass --run-dir, or --url for a server started without it)")
    wanted = set(parse_gpu_spec(gpus)) if gpus else None
    entries = [g for g in state.ready if wanted is None or wanted & set(g.held)]
    if not entries:
        raise NodeError("no ready GPU to advise on (see `launcher status`)")
    return entries


def _base_url(url: str) -> str:
    """`host:port` or a URL, as the base URL the endpoints hang from."""
    return (url if "://" in url else f"http://{url}").rstrip("/")


def cmd_restart(argv: Sequence[str]) -> int:
    """Ask the running supervisor to restart servers (drain first); follow until done."""
    flags, server_args = _split(argv)
    p = CommandParser(
        prog="python -m launcher restart",
        description="Drain and restart servers, one GPU at a time with --rolling.",
        epilog="Server arguments after `--` override, flag by flag, those given to `up` after "
        "`--` (--replace-args: replace them all).\nexample:\n"
        "  python -m launcher restart --rolling -- --max-running-requests 64")
    p.add_argument("--rolling", action="store_true",
                   help="one server at a time, each ready before the next (else all at once)")
    p.add_argument("--gpus", help="only the servers holding these GPUs (default: all)")
    p.add_argument("--profile", type=Path, help="reload this profile file")
    p.add_argument("--replace-args", action="store_true",
                   help="the arguments after `--` replace the old ones instead of overriding")
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR,
                   help="the run dir `launcher up` was given")
    p.add_argument("--timeout", type=float, default=3 * 3600.0,
                   help="seconds to follow the restart before giving up waiting")
    p.add_argument("--no-wait", action="store_true", help="return once the supervisor accepts")
    p.add_argument("--drain", type=float, help="seconds each server's running requests may "
                   "finish before the rest are cut and handed back to the queue (default: "
                   "the node's --drain-timeout)")
    args = p.parse_args(flags)
    if args.drain is not None and args.drain < 0:
        p.error(f"--drain must be >= 0, got {args.drain:g}")
    request = RestartRequest(
        new_request_id("r"), rolling=args.rolling,
        args=tuple(server_args) if server_args is not None else None,
        replace=args.replace_args,
        gpus=tuple(parse_gpu_spec(args.gpus)) if args.gpus else None,
        profile=str(args.profile.resolve()) if args.profile else None, drain_s=args.drain)
    send_restart(args.run_dir, request)
    return follow(args.run_dir, request.id, args.timeout, args.no_wait)


def follow(run_dir: Path, request_id: str, timeout_s: float, no_wait: bool = False) -> int:
    """Print a restart's progress from node.json until it is done, failed or rejected."""
    shown: list[str] = []

    def show(rollout: Rollout) -> None:
        text = _rollout_text(dataclasses.replace(rollout, rejected=None))
        if not shown or text != shown[-1]:
            print(text, flush=True)
            shown.append(text)

    outcome = follow_restart(run_dir, request_id, timeout_s, show, until_accepted=no_wait)
    if outcome.state == "rejected":
        print(f"restart {request_id}: rejected: {outcome.reason}")
    elif outcome.state in ("unacknowledged", "timed-out"):
        print(f"restart {request_id}: {outcome.reason}", file=sys.stderr)
    return EXIT_OK if outcome.state in ("done", "running") else EXIT_FAILED


# The `status` table: node.json with liveness, rendered as text.

def render_status(state: NodeState, now: float | None = None) -> str:
    """The status table: GPU, port, pid, state, uptime, restarts, capacity, why (liveness as
    `NodeState.with_liveness` says; a state without it counts as alive)."""
    now = time.time() if now is None else now
    head = f"supervisor pid {state.supervisor_pid} " + (
        "running" if state.supervisor_alive else "NOT running: the state below is stale")
    head += f"; updated {_ago(now - (state.updated_at or now))} ago"
    rows: list[tuple[str, ...]] = [
        ("GPU", "PORT", "PID", "STATE", "UPTIME", "RESTARTS", "CAPACITY", "WHY")]
    for g in state.gpus:
        rows.append(_row(g.server, _gpus_text(g), str(g.port), g.capacity, now))
        if g.worker:
            rows.append(_row(g.worker, f"  w{_gpus_text(g)}", "-", None, now))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1]
                      for r in rows]
    if state.rollout:
        lines.append(_rollout_text(state.rollout))
    if state.tune:
        lines.append(state.tune.describe())
    # One line of advice per ready GPU with flags to try, from its capacity and the running
    # peak its log showed (no HTTP: `launcher advise` samples the live figures first); a server
    # that never ran anything gets none.
    for g in state.ready:
        if g.capacity and g.peak_running:
            tip = advise(g, Observed(samples=0, peak_running=float(g.peak_running)))
            if tip.flags:
                lines.append(f"advice {tip.line()} (check: launcher advise)")
    return "\n".join(line.rstrip() for line in lines)


def _row(p: ProcessEntry, gpu: str, port: str, cap: Reading | None,
         now: float) -> tuple[str, ...]:
    alive, state = p.pid_alive is not False, str(p.state)
    pid = "-" if p.pid is None or state == "stopped" else str(p.pid)
    if pid != "-" and not alive:
        pid, state = f"{pid} (gone)", f"{state}?"
    up = _ago(now - p.since) if p.state in ("ready", "running") and alive else "-"
    capacity = "-"
    if cap is not None and cap.effective is not None:
        asked = cap.requested or "auto"
        capacity = f"{cap.effective} (asked {asked})"
        whole = cap.concurrency
        if whole is not None and whole != cap.effective:  # a server of several DP ranks
            capacity = f"{whole} ({cap.effective} per DP rank, asked {asked})"
    # A ready server explains its capacity; any other state explains itself.
    why = (cap.reason if cap else None) if p.state in ("ready", "running") else p.last_reason
    return (gpu, port, pid, state, up, str(p.restarts), capacity, why or "")


def _gpus_text(g: ServerEntry) -> str:
    """The GPU column: `3` for a one-GPU server, `0-1` for one over GPUs 0 and 1 (its queue's
    name without `gpu`)."""
    name = g.server.name
    return name.removeprefix("gpu") if len(g.gpus) > 1 and name else str(g.gpu)


def _rollout_text(r: Rollout) -> str:
    text = f"restart {r.id}: {r.state}, done GPU {list(r.done)}"
    if r.current is not None:
        text += f", now GPU {r.current}"
    if r.reason:
        text += f": {r.reason}"
    if r.rejected:
        text += f"\nrestart {r.rejected.id}: rejected: {r.rejected.reason}"
    return text


def _ago(seconds: float) -> str:
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
