"""`python -m launcher demo`: the whole system on one machine, start to finish.

Starts the Procfile stack under honcho (embedded Valkey, SeaweedFS, two simulated GPU servers,
two GPU workers, Flower), enqueues the bundled sample of ~200 mixed prompts, waits for the job,
prints its summary and where the output is, then stops everything.

The embedded servers are locked (docs/security.md): their password and keys are generated in
their data dirs before the stack starts, and every process reads them from the files `.env`
names, so none is typed, printed or passed on a command line.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launcher.embedded import port_is_free, wait_until
from launcher.services import redis_password, s3_credentials

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "producer" / "samples" / "sample.jsonl"
PORTS = {"redis": 6389, "s3": 8333, "sim0": 30000, "sim1": 30001, "flower": 5555}
FLOWER_URL = f"http://127.0.0.1:{PORTS['flower']}"
# The files .env names for the embedded servers' secrets (relative to the clone).
SECRET_FILES = ("FLEETGEN_REDIS_PASSWORD_FILE", "AWS_SHARED_CREDENTIALS_FILE")
# The developer's own AWS identity must neither configure nor reach the embedded S3.
FOREIGN_AWS = ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def read_env_file(path: Path) -> dict[str, str]:
    """`.env` as honcho reads it."""
    from honcho.environ import parse

    return dict(parse(path.read_text()))


def stack_env() -> dict[str, str]:
    """The environment of the Procfile's processes: .env values (secret files made absolute),
    this venv's tools first on PATH."""
    inherited = {k: v for k, v in os.environ.items() if k not in FOREIGN_AWS}
    env = {**inherited, **read_env_file(ROOT / ".env")}
    for name in SECRET_FILES:
        if env.get(name):
            env[name] = str(ROOT / env[name])
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def make_secrets(env: dict[str, str]) -> None:
    """Generate the embedded servers' password and keys where `.env` says, if not there yet:
    every process of the stack starts at once, and each must find them."""
    redis_password(Path(env["FLEETGEN_REDIS_PASSWORD_FILE"]).parent)
    s3_credentials(Path(env["AWS_SHARED_CREDENTIALS_FILE"]).parent)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launcher demo", description=__doc__)
    p.add_argument("--input", type=Path, default=SAMPLE, help="prompts to run (default: the sample)")
    p.add_argument("--job", default=None, help="job name (default: demo-<timestamp>)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.add_argument("--keep", action="store_true", help="leave the stack running at the end")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not (ROOT / "Procfile").exists():
        print(f"demo: no Procfile in {ROOT}; run the demo from a clone of fleetgen", file=sys.stderr)
        return 2
    busy = [f"{name} ({port})" for name, port in PORTS.items() if not port_is_free(port)]
    if busy:
        print(f"demo: ports in use: {', '.join(busy)}; is another stack running?", file=sys.stderr)
        return 2
    env = stack_env()
    make_secrets(env)
    for name in FOREIGN_AWS:
        os.environ.pop(name, None)
    os.environ.update({k: v for k, v in env.items() if k != "PATH"})
    started = time.monotonic()
    log_path = ROOT / ".fleetgen" / "demo.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    honcho = _start_stack(env, log_path)
    # SIGTERM (e.g. from `timeout`) must still stop the stack: turn it into an exception.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        _wait_ready(honcho, log_path)
        print(f"stack up in {time.monotonic() - started:.1f}s  (Flower: {FLOWER_URL}, log: {log_path})")
        code = _run_job(args, started)
    except (TimeoutError, RuntimeError) as exc:
        print(f"demo: {exc}\n--- last lines of {log_path} ---\n{_tail(log_path)}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("demo: interrupted; stopping the stack", file=sys.stderr)
        code = 130
    finally:
        if not args.keep:
            _stop(honcho)
    print(f"demo wall time {time.monotonic() - started:.1f}s")
    return code


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _start_stack(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    honcho = str(Path(sys.executable).with_name("honcho"))
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [honcho, "start", "-f", str(ROOT / "Procfile"), "-e", str(ROOT / ".env")],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _wait_ready(honcho: subprocess.Popen[bytes], log_path: Path) -> None:
    """Both servers warmed up and both workers consuming, or the reason they are not."""

    def ready() -> bool:
        if honcho.poll() is not None:
            raise RuntimeError(f"the stack exited (code {honcho.returncode})")
        text = log_path.read_text(errors="replace")
        return text.count("fired up and ready to roll") >= 2 and text.count(" ready.") >= 2

    wait_until(ready, 180, what="servers and workers ready")


def _run_job(args: argparse.Namespace, started: float) -> int:
    from producer.cli import main as producer_main
    from producer.status import job_status, render
    from workers.ledger import Ledger
    from workers.settings import Settings

    job = args.job or time.strftime("demo-%Y%m%d-%H%M%S")
    output = os.environ.get("FLEETGEN_OUTPUT", "s3://fleetgen/runs")
    code = producer_main(["enqueue", str(args.input), "--job", job, "--output", output])
    if code != 0:
        return code
    ledger = Ledger.from_url(Settings.from_env().redis_url)
    deadline = time.monotonic() + args.timeout
    last = 0.0
    while True:
        status = job_status(ledger, job)
        if status["state"] == "done":
            break
        if status["state"] in ("paused", "cancelled") and not status["in_flight"]:
            print(render(status))
            print(f"\njob {job} is {status['state']}: {status['reason']}", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job} not done after {args.timeout:.0f}s")
        if time.monotonic() - last > 2:
            last = time.monotonic()
            print(f"  {status['done'] + status['failed']}/{status['total']} prompts, "
                  f"{status['in_flight']} in flight, {status['rate']['prompts_per_s_all']:.1f}/s")
        time.sleep(0.25)
    print(render(status))
    print(f"\noutput: {output}/{job}/results/*.jsonl (errors/ holds failed prompts)")
    print(f"status: python -m producer status {job}    export: see README 'Output format'")
    return 0 if status["failed"] == 0 else 1


def _stop(honcho: subprocess.Popen[bytes]) -> None:
    if honcho.poll() is None:
        os.killpg(honcho.pid, signal.SIGTERM)
        try:
            honcho.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(honcho.pid, signal.SIGKILL)
            honcho.wait(5)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
