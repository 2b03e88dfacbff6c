"""The commands a new operator types first, run as they type them.

- `celery worker -Q gpu0` without `-A`, from a folder that is not the repository, in an
  environment that sets CELERY_APP as `.env` and the images do; it says when it is ready.
- `celery flower` outside the repository still loads fleetgen's Flower settings.
- the embedded services' and the demo's ports: `--help` says which they take, and the demo
  runs on a non-default `--port-base`, exports its job to a local file and says what to do
  next without the stack it stopped.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen.poll import wait_until
from fleetgen.ports import free_port, port_is_free
from launcher import cli as launcher_cli
from launcher.demo import DemoPorts
from tests.stack import (
    CELERY,
    FAST_WORKER_ENV,
    Proc,
    Stack,
    chat_rows,
    wait_job_done,
    write_jsonl,
    write_parquet,
)

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"worker (\S+) ready: queues (\S+), server (\S+), requests in flight up to (\d+)")


def help_of(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    """`python -m launcher COMMAND --help` (some commands exit, some return 0)."""
    try:
        assert launcher_cli.main([command, "--help"]) == 0
    except SystemExit as exc:
        assert exc.code == 0
    return " ".join(capsys.readouterr().out.split())


# --- the Celery commands ---------------------------------------------------------------


def test_every_configured_environment_names_the_celery_app() -> None:
    assert re.search(r"^CELERY_APP=workers$", (ROOT / ".env").read_text(), re.MULTILINE)
    procfile = (ROOT / "Procfile").read_text()
    assert re.findall(r"^gpu\d: .*\bcelery worker -Q gpu\d", procfile, re.MULTILINE)
    assert re.search(r"^flower: celery flower ", procfile, re.MULTILINE)
    assert "CELERY_APP=workers" in (ROOT / "docker/Dockerfile").read_text()
    assert "CELERY_APP: workers" in (ROOT / "docker/compose.yaml").read_text()


@pytest.mark.e2e
def test_celery_worker_without_dash_a_serves_from_any_folder_and_says_when_it_is_ready(
    stack: Stack, tmp_path: Path
) -> None:
    _, url = stack.sim("sim0", "--speed", "50")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # No --loglevel: the default (WARNING) must still show the ready line.
    argv = [CELERY, "worker", "-Q", "gpu0", "-n", "gpu0@test", "--without-mingle",
            "--without-gossip"]
    env = stack.env({**FAST_WORKER_ENV, "FLEETGEN_SERVER_URL": url, "CELERY_APP": "workers"})
    worker = Proc("gpu0", argv, env, tmp_path / "gpu0.log", cwd=elsewhere).start()
    stack.procs.append(worker)
    wait_until(lambda: READY.search(worker.log()) is not None or not worker.alive(), 60,
               what="the worker's ready line")
    ready = READY.search(worker.log())
    assert ready, worker.log()
    assert ready.groups()[:3] == ("gpu0@test", "gpu0,fleetgen", url)
    assert int(ready.group(4)) >= 1
    assert "amqp://" not in worker.log()
    src = write_jsonl(tmp_path / "anywhere.jsonl", chat_rows(4))
    stack.producer("enqueue", str(src), "--job", "anywhere", "--output", str(tmp_path / "out"),
                   "--no-canary")
    assert wait_job_done(stack, "anywhere", 120).done == 4


@pytest.mark.e2e
def test_the_producer_runs_from_the_clones_parent_folder(
        redis_url: str, redis_client: Any, tmp_path: Path) -> None:
    """Run from the folder holding the clone, named `fleetgen` as a clone of it is, the clone
    stands in for the `fleetgen` package (a folder without __init__.py on the path); what
    fleetgen loads beside its modules (the Lua scripts) is still found."""
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "fleetgen").symlink_to(ROOT)
    env = {**os.environ, "REDIS_URL": redis_url}
    src = write_jsonl(parent / "prompts.jsonl", chat_rows(3))
    for argv in (["jobs"], ["enqueue", str(src), "--job", "beside", "--output",
                            str(tmp_path / "out"), "--no-canary"], ["status", "beside"]):
        result = subprocess.run([sys.executable, "-m", "producer", *argv], cwd=parent, env=env,
                                capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
    assert redis_client.exists("fg:job:beside")


@pytest.mark.parametrize("argv", [["-A", "workers", "flower"], ["flower"]], ids=["-A", "CELERY_APP"])
def test_flower_loads_fleetgens_settings_from_the_package_in_any_folder(
    argv: list[str], tmp_path: Path, redis_url: str
) -> None:
    """The settings refuse an open address without a login: that refusal shows they loaded
    (Flower's own defaults would listen on 0.0.0.0 without a word)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWER_", "CELERY_"))}
    env.update(REDIS_URL=redis_url, CELERY_APP="workers", PYTHONUNBUFFERED="1")
    flower = subprocess.Popen(
        [CELERY, *argv, "--address=0.0.0.0", f"--port={free_port()}"], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = flower.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(flower.pid, 9)
        out, _ = flower.communicate()
        pytest.fail(f"Flower started without fleetgen's settings:\n{out[-2000:]}")
    assert flower.returncode != 0
    assert "refusing to listen on '0.0.0.0' without a login" in out


def test_flower_on_a_taken_port_names_its_holder_and_the_flag_in_one_line(
    tmp_path: Path, redis_url: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWER_", "CELERY_"))}
    env.update(REDIS_URL=redis_url, PYTHONUNBUFFERED="1")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run([CELERY, "-A", "workers", "flower", f"--port={port}"], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=60, check=False)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "Traceback" not in out and "Errno 98" not in out, out
    assert f"flower: port {port} is in use by pid {os.getpid()} (" in out
    assert f"--port={port + 1}" in out
# --- ports -----------------------------------------------------------------------------


def test_the_embedded_services_help_says_which_ports_they_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "P+1..P+8 and P+10008" in help_of("s3", capsys)
    assert "ports 8333-8341, 18341" in help_of("s3", capsys)
    assert "the only port Redis takes (default 6389)" in help_of("redis", capsys)
    demo = help_of("demo", capsys)
    assert "--port-base B take the ports from B: B Redis, B+1 and B+2 the simulated servers" in demo
    assert "B+10..B+18 and B+10018 S3" in demo
    assert "Default: Redis 6389, S3 8333-8341 and 18341, servers 30000-30001, Flower 5555" in demo


def test_a_port_base_whose_ports_do_not_fit_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        launcher_cli.main(["demo", "--port-base", "60000"])
    assert refused.value.code == 2
    assert "--port-base 60000: use 1024..55517" in capsys.readouterr().err


def test_a_port_base_gives_each_process_its_own_ports() -> None:
    taken = DemoPorts.from_base(21000).taken()
    flat = [port for ports in taken.values() for port in ports]
    assert len(flat) == len(set(flat)) == 16
    assert taken["redis"] == [21000] and taken["flower"] == [21003]
    assert taken["s3"] == [*range(21010, 21019), 31018]


def free_base() -> int:
    """A port base whose every port is free now."""
    for _ in range(50):
        base = random.randrange(10000, 22700, 20)  # B+10018 stays below the ephemeral range
        if all(port_is_free(p) for ports in DemoPorts.from_base(base).taken().values()
               for p in ports):
            return base
    pytest.skip("no free block of demo ports")


# --- the demo -------------------------------------------------------------------------------


@pytest.mark.e2e
def test_the_demo_runs_on_a_port_base_and_leaves_an_export_that_outlives_the_stack(
    tmp_path: Path,
) -> None:
    base = free_base()
    # A Parquet input with two answers per prompt: the demo runs any input enqueue reads.
    prompts = write_parquet(tmp_path / "mine.parquet", {
        "id": [f"d{i:05d}" for i in range(6)],
        "messages": [[{"role": "user", "content": f"question {i}"}] for i in range(6)]})
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FLEETGEN_"))}
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "demo", "--input", str(prompts), "--job", "d1",
         "--samples", "2", "--port-base", str(base), "--state-dir", str(state),
         "--timeout", "240"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400, check=False)
    log = (state / "demo.log").read_text(errors="replace") if (state / "demo.log").exists() else ""
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{log[-4000:]}"
    # Every process listened where the base put it.
    assert f"redis: serving redis://127.0.0.1:{base}/0" in log
    assert f"s3: serving http://127.0.0.1:{base + 10} (ports {base + 10}-{base + 18}, " \
           f"{base + 10018})" in log
    assert f"Visit me at http://127.0.0.1:{base + 3}" in log
    assert f"server http://127.0.0.1:{base + 1}" in log and f"server http://127.0.0.1:{base + 2}" in log
    assert f"metrics on http://127.0.0.1:{base + 4}/metrics" in log
    # The export is a local file that outlives the stack, with every answer once.
    exported = tmp_path / "demo-output" / "d1.jsonl"
    answers = [orjson.loads(line) for line in exported.read_bytes().splitlines()]
    assert sorted((a["id"], a["sample"]) for a in answers) == [
        (f"d{i:05d}", k) for i in range(6) for k in (0, 1)]
    tail = done.stdout.splitlines()[-6:]
    assert tail[0] == f"exported: {exported}"
    assert tail[1].startswith("what next")
    assert tail[2].strip().startswith(f"head -n 2 {exported}")
    hints = "\n".join(tail[2:5])
    assert "producer status" not in hints and "s3://" not in hints
    # The stack is gone: its ports are free again.
    wait_until(lambda: all(port_is_free(p) for ports in DemoPorts.from_base(base).taken().values()
                           for p in ports), 20, what="the demo's ports free after it exits")
