"""`python -m launcher demo`: the whole system on one machine, start to finish.

Starts the Procfile stack under honcho (embedded Valkey, SeaweedFS, two simulated GPU servers,
two GPU workers, Flower), enqueues the bundled sample of ~200 mixed prompts, waits for the job,
prints its summary, exports it to a local file (./demo-output/JOB.jsonl), then stops everything
and says what to do next with that file: nothing it suggests needs the stopped stack. With
--keep the stack outlives the demo (honcho in its own session, its pid in STATE/demo.pid) and
the demo says where Flower is and how to stop it.

Ports: the Procfile's defaults, or a block from --port-base (DemoPorts). Data: .fleetgen/demo, or
--state-dir; never the .fleetgen/redis and .fleetgen/s3 of a stack the user runs by hand.

The embedded servers are locked (docs/security.md): their password and keys are generated in
their data dirs before the stack starts, and every process reads them from the files `.env`
names, so none is typed, printed or passed on a command line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fleetgen.commandline import CommandParser
from fleetgen.keys import METRICS_BASE_PORT
from fleetgen.poll import poll, wait_until
from fleetgen.ports import (
    HOST,
    busy_reason,
    ephemeral_range,
    ephemeral_text,
    in_ephemeral_range,
    port_is_free,
)
from launcher.child import ChildProcess
from launcher.errors import LauncherError
from launcher.services import (
    S3Ports,
    data_dir_holder,
    redis_password,
    s3_credentials,
)

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "producer" / "samples" / "sample.jsonl"
# Where .env's relative paths point: the data dir of the Procfile run by hand, and of the
# walkthrough's `launcher redis|s3` (docs/getting-started/own-data.md).
ENV_STATE = Path(".fleetgen")
# The demo's own data dir (--state-dir moves it): apart from ENV_STATE, so that its jobs never
# show in a stack the user runs next, where a worker without the demo's S3 would keep warning
# about their output.
DEFAULT_STATE = ENV_STATE / "demo"
EXPORT_DIR = Path("demo-output")
# A kept stack's honcho pid, in the state dir: how to stop it, and who holds the ports.
PID_FILE = "demo.pid"
# The files .env names for the embedded servers' secrets (relative to the clone).
SECRET_FILES = ("FLEETGEN_REDIS_PASSWORD_FILE", "AWS_SHARED_CREDENTIALS_FILE")
# S3 sits at base+10: SeaweedFS takes 9 ports from there (and one 10008 above), the rest below.
S3_OFFSET = 10
MAX_PORT = 65535


@dataclass(frozen=True)
class DemoPorts:
    """Every port the demo's stack listens on (all on 127.0.0.1)."""

    redis: int = 6389
    s3: int = 8333
    sim0: int = 30000
    sim1: int = 30001
    flower: int = 5555
    gpu0_metrics: int = METRICS_BASE_PORT
    gpu1_metrics: int = METRICS_BASE_PORT + 1

    @classmethod
    def from_base(cls, base: int) -> DemoPorts:
        """B Redis, B+1 and B+2 the simulators, B+3 Flower, B+4 and B+5 the workers' metrics,
        B+10..B+18 and B+10018 S3 (SeaweedFS)."""
        ports = cls(redis=base, sim0=base + 1, sim1=base + 2, flower=base + 3,
                    gpu0_metrics=base + 4, gpu1_metrics=base + 5, s3=base + S3_OFFSET)
        if base < 1024 or S3Ports(ports.s3).grpc["admin"] > MAX_PORT:
            raise ValueError(f"--port-base {base}: use 1024..{MAX_PORT - S3Ports(S3_OFFSET).grpc['admin']}"
                             " (the stack takes B..B+18 and B+10018)")
        if inside := in_ephemeral_range(ports.all()):
            highest = ephemeral_range()[0] - 1 - S3Ports(S3_OFFSET).grpc["admin"]
            raise ValueError(
                f"--port-base {base}: the stack's ports {', '.join(map(str, inside))} lie in "
                f"{ephemeral_text()}: a server there fails at random. Use a base from 1024 to "
                f"{highest} (the stack takes B..B+18 and B+10018)")
        return ports

    def all(self) -> list[int]:
        """Every port of the stack."""
        return sorted(port for ports in self.taken().values() for port in ports)

    def taken(self) -> dict[str, list[int]]:
        """Each process's ports."""
        return {"redis": [self.redis], "s3": S3Ports(self.s3).all(), "sim0": [self.sim0],
                "sim1": [self.sim1], "flower": [self.flower],
                "gpu0 metrics": [self.gpu0_metrics], "gpu1 metrics": [self.gpu1_metrics]}

    def env(self) -> dict[str, str]:
        """The Procfile's STACK_* variables and the clients' URLs for these ports."""
        return {
            "STACK_REDIS_PORT": str(self.redis), "STACK_S3_PORT": str(self.s3),
            "STACK_SIM0_PORT": str(self.sim0), "STACK_SIM1_PORT": str(self.sim1),
            "STACK_FLOWER_PORT": str(self.flower),
            "STACK_GPU0_METRICS_PORT": str(self.gpu0_metrics),
            "STACK_GPU1_METRICS_PORT": str(self.gpu1_metrics),
            "REDIS_URL": f"redis://{HOST}:{self.redis}/0",
            "AWS_ENDPOINT_URL": f"http://{HOST}:{self.s3}",
        }


PORTS_HELP = ("take the ports from B: B Redis, B+1 and B+2 the simulated servers, B+3 Flower, "
              "B+4 and B+5 the workers' metrics, B+10..B+18 and B+10018 S3 (SeaweedFS). "
              "Default: Redis 6389, S3 8333-8341 and 18341, servers 30000-30001, Flower 5555, "
              f"metrics {METRICS_BASE_PORT}-{METRICS_BASE_PORT + 1}. B+10018 must stay below "
              "the kernel's ephemeral range (32768 on most Linux systems)")
# The developer's own AWS identity must neither configure nor reach the embedded S3.
FOREIGN_AWS = ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def read_env_file(path: Path) -> dict[str, str]:
    """`.env` as honcho reads it."""
    from honcho.environ import parse

    return dict(parse(path.read_text()))


def stack_env(ports: DemoPorts | None = None, state: Path | None = None) -> dict[str, str]:
    """The environment of the Procfile's processes: .env values with `ports` and the data dir
    `state` (secret files made absolute), this venv's tools first on PATH."""
    state = (state or ROOT / DEFAULT_STATE).resolve()
    inherited = {k: v for k, v in os.environ.items() if k not in FOREIGN_AWS}
    env = {**inherited, **read_env_file(ROOT / ".env"), **(ports or DemoPorts()).env(),
           "STACK_DIR": str(state)}
    for name in SECRET_FILES:
        if env.get(name):
            env[name] = str(state / Path(env[name]).relative_to(ENV_STATE))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def make_secrets(env: dict[str, str]) -> None:
    """Generate the embedded servers' password and keys where `.env` says, if not there yet:
    every process of the stack starts at once, and each must find them."""
    redis_password(Path(env["FLEETGEN_REDIS_PASSWORD_FILE"]).parent)
    s3_credentials(Path(env["AWS_SHARED_CREDENTIALS_FILE"]).parent)


def build_parser() -> CommandParser:
    p = CommandParser(prog="python -m launcher demo", description=__doc__,
                      epilog="examples:\n  python -m launcher demo\n"
                      "  python -m launcher demo --input my-prompts.jsonl --port-base 21000")
    p.add_argument("--input", default=str(SAMPLE),
                   help="prompts to run, any input `producer enqueue` reads: a JSONL or Parquet "
                   "file, a folder of shards, a saved Hugging Face dataset, s3://bucket/key in "
                   "the demo's S3 (default: the bundled sample of 200 mixed prompts)")
    p.add_argument("--samples", type=int, default=None, metavar="N",
                   help="answers per prompt whose line asks no sampling.n (default: 1)")
    p.add_argument("--job", default=None, help="job name (default: demo-<timestamp>)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.add_argument("--keep", action="store_true", help="leave the stack running at the end")
    p.add_argument("--port-base", type=int, default=None, metavar="B", help=PORTS_HELP)
    p.add_argument("--state-dir", type=Path, default=None,
                   help="the embedded Redis' and S3's data, secrets and the stack's log "
                   f"(default: {DEFAULT_STATE} in the clone)")
    p.add_argument("--export-dir", type=Path, default=EXPORT_DIR,
                   help="where the finished job is exported to, as JOB.jsonl")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (ROOT / "Procfile").exists():
        print(f"demo: no Procfile in {ROOT}; run the demo from a clone of fleetgen", file=sys.stderr)
        return 2
    # Before the stack starts: a typo in the path must not cost a minute of start-up.
    if not args.input.startswith("s3://") and not Path(args.input).exists():
        print(f"demo: --input {args.input}: no such file or folder", file=sys.stderr)
        return 2
    try:
        ports = DemoPorts() if args.port_base is None else DemoPorts.from_base(args.port_base)
    except ValueError as exc:
        parser.error(str(exc))
    state = (args.state_dir or ROOT / DEFAULT_STATE).resolve()
    if (shared := state_in_use(state)) is not None:
        print(f"demo: {shared}", file=sys.stderr)
        return 2
    busy = [f"{name}: port {port} is {busy_reason(port)}"
            for name, numbers in ports.taken().items() for port in numbers
            if not port_is_free(port)]
    if busy:
        kept = kept_stack(state)
        print("demo: " + "; ".join(busy) + "; "
              + (f"a stack kept by `demo --keep` runs (honcho pid {kept}): stop it with "
                 f"`kill {kept}`, or --port-base B moves them all" if kept else
                 "is another stack running? (--port-base B moves them all)"), file=sys.stderr)
        return 2
    env = stack_env(ports, state)
    make_secrets(env)
    for name in FOREIGN_AWS:
        os.environ.pop(name, None)
    os.environ.update({k: v for k, v in env.items() if k != "PATH"})
    started = time.monotonic()
    log_path = state / "demo.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    honcho = _start_stack(env, log_path, state, keep=args.keep)
    # SIGTERM (e.g. from `timeout`) must still stop the stack: turn it into an exception.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    keep = args.keep
    try:
        _wait_ready(honcho, log_path)
        print(f"stack up in {time.monotonic() - started:.1f}s  "
              f"(Flower: http://{HOST}:{ports.flower}, log: {log_path})")
        code = _run_job(args, honcho.pid if keep else None)
    except StackExited as exc:
        print(f"demo: {exc}\nthe whole log: {_shown_path(log_path)}", file=sys.stderr)
        code = 1
    except (TimeoutError, RuntimeError) as exc:
        print(f"demo: {exc}\n--- last lines of {log_path} ---\n{_tail(log_path)}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("demo: interrupted; stopping the stack", file=sys.stderr)
        code, keep = 130, False
    finally:
        if not keep:
            _stop(honcho)
            (state / PID_FILE).unlink(missing_ok=True)
    if keep and honcho.alive():
        print(kept_text(honcho.pid, ports, state))
    print(f"demo wall time {time.monotonic() - started:.1f}s")
    return code


def state_in_use(state: Path) -> str | None:
    """Why the demo must not start on the state folder `state`, or None: an embedded Redis or
    S3 (another stack's, a `launcher redis|s3`) runs on one of its data dirs. Two stacks on one
    folder rewrite each other's AOF and join each other's SeaweedFS."""
    for part in ("redis", "s3"):
        holder = data_dir_holder(state / part)
        if holder is None:
            continue
        kept = kept_stack(state)
        pid = kept or (holder.split()[1] if holder.startswith("pid ") else None)
        stop = (f"stop it (`kill {kept}`: the honcho of a `demo --keep`)" if kept else
                f"stop it (`kill {pid}`)" if pid else "stop it")
        return (f"{_shown_path(state / part)} is in use by {holder}: another stack uses the state "
                f"folder {_shown_path(state)}, and two stacks must never share one; {stop}, or "
                "give this demo its own with --state-dir DIR (and --port-base B if its ports "
                "are taken too)")
    return None


def kept_stack(state: Path) -> int | None:
    """The pid of the honcho a `demo --keep` left running with this state dir, if it runs."""
    try:
        pid = int((state / PID_FILE).read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def kept_text(pid: int, ports: DemoPorts, state: Path) -> str:
    """What a kept stack offers, and how to stop it."""
    python, env_file = python_command(), shlex.quote(_shown_path(state / "demo.env"))
    return "\n".join([
        f"\nthe stack keeps running (honcho pid {pid}, log {_shown_path(state / 'demo.log')}):",
        f"  Flower: http://{HOST}:{ports.flower}",
        f"  set -a; . {env_file}; set +a   # then {python} -m producer status JOB",
        f"  stop it: kill {pid}   # honcho stops every process of the stack",
    ])


def again_command(args: argparse.Namespace) -> str:
    """The demo on the user's own prompts, on the ports and state folder of this run."""
    flags = ["--input", "my-prompts.jsonl"]
    if args.port_base is not None:
        flags += ["--port-base", str(args.port_base)]
    if args.state_dir is not None:
        flags += ["--state-dir", _shown_path(args.state_dir)]
    return f"{python_command()} -m launcher demo {shlex.join(flags)}"


def python_command() -> str:
    """This interpreter as the user would type it: relative to the working directory when it
    lies below it (`.venv/bin/python`), else its absolute path; a bare `python` may be another
    one, without fleetgen."""
    shown = _shown_path(Path(sys.executable))
    return shlex.quote(shown if "/" in shown else f"./{shown}")


def _shown_path(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.absolute().relative_to(Path.cwd()))
    return str(path)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _start_stack(env: dict[str, str], log_path: Path, state: Path, keep: bool) -> ChildProcess:
    """honcho on the Procfile with `env` as its env file: honcho lets an env file override the
    environment it was given, and the repository's .env names the default ports. `keep`: it
    outlives the demo (no parent-death signal), its pid written to STATE/demo.pid."""
    honcho = str(Path(sys.executable).with_name("honcho"))
    env_file = state / "demo.env"
    env_file.write_text("".join(f"{k}={_quoted(v)}\n" for k, v in env.items()
                                if k.startswith("STACK_") or k in read_env_file(ROOT / ".env")
                                or k in DemoPorts().env()))
    log_path.unlink(missing_ok=True)  # this run's output only
    child = ChildProcess([honcho, "start", "-f", str(ROOT / "Procfile"), "-e", str(env_file)],
                         log_path, env=env, cwd=ROOT, with_parent=not keep)
    if keep:
        (state / PID_FILE).write_text(f"{child.pid}\n")
    return child


def _wait_ready(honcho: ChildProcess, log_path: Path) -> None:
    """Both servers warmed up and both workers consuming, or the reason they are not."""

    def ready() -> bool:
        if honcho.poll() is not None:
            raise StackExited(stack_failure(log_path.read_text(errors="replace"))
                              or f"the stack exited (code {honcho.returncode})")
        text = log_path.read_text(errors="replace")
        return text.count("fired up and ready to roll") >= 2 and text.count(" ready.") >= 2

    wait_until(ready, 180, what="servers and workers ready")


class StackExited(LauncherError):
    """honcho ended before the stack was ready: one of its processes died."""


# A honcho log line: `12:00:01 redis.1  | text`; honcho's own lines come from `system`.
_HONCHO_LINE = re.compile(r"^\S+ (?P<name>[\w-]+?)(?:\.\d+)?\s+\| ?(?P<text>.*)$")
_STOPPED = re.compile(r"^(?P<name>[\w-]+?)\.\d+ stopped \(rc=(?P<rc>-?\d+)\)")
# A line that says why a process died: Go's glog fatal and error lines (SeaweedFS), a taken
# port, then anything naming an error; the last such line of the process wins.
_CAUSE = (re.compile(r"^[FE]\d{4} |address already in use|not available"),
          re.compile(r"(?i)error|fatal|panic|abort|failed|exception|refused|denied"))
CULPRIT_LINES = 10


def stack_failure(log: str) -> str | None:
    """Which process of honcho's `log` ended the stack, with its exit code, the line that says
    why and its own last lines (not the others' shutdown); None if no process had stopped."""
    lines: list[tuple[str, str]] = []
    for raw in log.splitlines():
        if match := _HONCHO_LINE.match(raw):
            lines.append((match["name"], match["text"]))
    stopped = next((m for name, text in lines if name == "system"
                    and (m := _STOPPED.match(text))), None)
    if stopped is None:
        return None
    name = stopped["name"]
    own = [text for who, text in lines if who == name]
    cause = next((text for pattern in _CAUSE for text in reversed(own) if pattern.search(text)),
                 own[-1] if own else "(it wrote nothing)")
    last = "\n".join(f"  {name} | {text}" for text in own[-CULPRIT_LINES:])
    return (f"the stack stopped: {name} exited (code {stopped['rc']}): {cause.strip()}\n"
            f"--- the last lines of {name} ---\n{last}")


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _run_job(args: argparse.Namespace, kept: int | None) -> int:
    """Enqueue, follow and export the job; `kept` is the kept stack's honcho pid."""
    from fleetgen.jobview import JobStatus, job_status
    from fleetgen.ledger import Ledger
    from fleetgen.settings import Settings
    from producer.cli import main as producer_main
    from producer.status import render

    job = args.job or time.strftime("demo-%Y%m%d-%H%M%S")
    output = Settings.from_env().output or "s3://fleetgen/runs"
    samples = [] if args.samples is None else ["--samples", str(args.samples)]
    code = producer_main(["enqueue", args.input, "--job", job, "--output", output, *samples])
    if code != 0:
        return code
    ledger = Ledger.connect(Settings.from_env())
    shown = [0.0]  # when progress was last printed

    def ended() -> JobStatus | None:
        """The job's status once it is done or stopped; progress every 2 s until then."""
        status = job_status(ledger, job)
        if status.state == "done" or (status.state in ("paused", "cancelled")
                                       and not status.in_flight):
            return status
        if time.monotonic() - shown[0] > 2:
            shown[0] = time.monotonic()
            unit = "answers" if status.total > status.prompts else "prompts"
            print(f"  {status.done + status.failed}/{status.total} {unit}, "
                  f"{status.in_flight} in flight, {status.rate.prompts_per_s_all:.1f}/s")
        return None

    status = poll(ended, args.timeout, 0.25)
    if status is None:
        raise TimeoutError(f"job {job} not done after {args.timeout:.0f}s")
    if status.state != "done":
        print(render(status))
        print(f"\njob {job} is {status.state}: {status.reason}", file=sys.stderr)
        return 1
    print(render(status))
    exported = (args.export_dir / f"{job}.jsonl").resolve()
    exported.parent.mkdir(parents=True, exist_ok=True)
    code = producer_main(["export", job, "--to", str(exported)])
    if code != 0:
        return code
    print(f"\nexported: {exported}")
    print("what next (" + ("the stack stops now" if kept is None else f"the stack keeps "
                          f"running: kill {kept} stops it") + "; these need only that file):")
    print(f"  head -n 2 {exported}   # an answer per line, each "
          + ("(id, sample) once" if status.total > status.prompts else "input id once"))
    print(f"  {again_command(args)}   # the same with your own prompts")
    print("  docs/getting-started/own-data.md: run the stack yourself and keep it running")
    return 0 if status.failed == 0 else 1


def _stop(honcho: ChildProcess) -> None:
    # honcho passes SIGTERM on to every process of the Procfile and waits for them.
    honcho.stop(grace=20)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
