"""What a new user hit from a fresh clone, each as they met it, and what they see now.

1. `launcher demo --keep` stopped the stack anyway (honcho got the demo's parent-death signal).
2. The relative password file of `.env` was looked for in the working directory only: from
   another folder Flower and `producer` had no Redis password.
3. A simulator on a taken port printed its whole start-up, then `[Errno 98]`.
6. The generator's bulk file made jobs the quality canary paused.
8. The demo's hints said a bare `python`; a missing `--input` was found after the stack started.
9. The report printed `judged_at_end: False`; a job within one minute was one dot per GPU.
10. `up --dry-run` claimed SGLang 0.5.23 where none is installed; `demo-output/` and
    `fleetgen-output/` showed as untracked files.
11. Two `launcher up` on one host gave their workers the same metrics ports.
12. On a GPU node NVIDIA's DCGM exporter held 9400, the first worker's metrics port: `up`
    refused with a guess, naming no process and only the first taken port.
13. The demo and the walkthrough shared `.fleetgen`: the walkthrough's worker warned every
    minute about the demo's old job (its output on an S3 it could not reach); the demo's
    "what next" line dropped the `--port-base` it ran with; Flower's taken port.
(The documentation items are checked by tests/system/test_docs.py.)
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

import fleetgen.settings
from fleetgen import canary
from fleetgen.job import GenerationParams
from fleetgen.jobview import Canary
from fleetgen.keys import METRICS_BASE_PORT
from fleetgen.ledger import EndVerdict
from fleetgen.poll import wait_until
from fleetgen.ports import port_is_free
from fleetgen.settings import Settings, SettingsError
from launcher import demo
from launcher.demo import DemoPorts
from launcher.errors import PortBusyError
from launcher.node import main as node_main
from launcher.node._args import NEWEST_SGLANG, Profile, sglang_version
from launcher.node._plan import NodePlan, check_ports
from launcher.services import RedisServer
from producer import report
from producer.inputs import read_prompts
from producer.samples import generate_sample
from tests.sim_helpers import running_sim
from tests.stack import chat_rows, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
PASSWORD_FILE = ".fleetgen/redis/password"


def free_base() -> int:
    """A demo port base whose every port is free now."""
    for _ in range(50):
        base = random.randrange(10000, 22700, 20)  # B+10018 stays below the ephemeral range
        if all(port_is_free(p) for ports in DemoPorts.from_base(base).taken().values()
               for p in ports):
            return base
    pytest.skip("no free block of demo ports")


def stack_ports_free(base: int) -> bool:
    return all(port_is_free(p) for ports in DemoPorts.from_base(base).taken().values()
               for p in ports)


# --- 1. demo --keep ----------------------------------------------------------------------------


@pytest.mark.e2e
def test_demo_keep_leaves_the_stack_running_and_says_where_flower_is_and_how_to_stop_it(
    tmp_path: Path,
) -> None:
    base = free_base()
    state = tmp_path / "state"
    prompts = write_jsonl(tmp_path / "mine.jsonl", chat_rows(4, prefix="k"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FLEETGEN_"))}
    argv = [sys.executable, "-m", "launcher", "demo", "--input", str(prompts), "--job", "k1",
            "--port-base", str(base), "--state-dir", str(state), "--timeout", "240"]
    pid = None
    try:
        done = subprocess.run([*argv, "--keep"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=400, check=False)
        log = (state / "demo.log").read_text(errors="replace")
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{log[-4000:]}"
        pid = int((state / "demo.pid").read_text())
        assert f"the stack keeps running (honcho pid {pid}" in done.stdout
        assert f"  Flower: http://127.0.0.1:{base + 3}" in done.stdout
        assert f"  stop it: kill {pid}" in done.stdout
        assert f"what next (the stack keeps running: kill {pid} stops it;" in done.stdout
        # The hints name this interpreter, not whatever `python` is on PATH.
        # ... with the ports and state folder of this run (below the working directory: shown
        # relative to it).
        assert (f"  {sys.executable} -m launcher demo --input my-prompts.jsonl --port-base "
                f"{base} --state-dir state   # the same with your own prompts") in done.stdout
        # After the demo exited: honcho and every process of the stack still serve.
        os.kill(pid, 0)
        assert httpx.get(f"http://127.0.0.1:{base + 3}/healthcheck", timeout=10).status_code in (
            200, 401)
        assert not port_is_free(base) and not port_is_free(base + 1)
        # A second demo on this state folder names the kept stack and how to stop it.
        again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=120, check=False)
        assert again.returncode == 2
        assert again.stderr.startswith("demo: state/redis is in use by pid ")
        assert f"stop it (`kill {pid}`: the honcho of a `demo --keep`)" in again.stderr
        assert "--state-dir DIR" in again.stderr
        # On another state folder, its ports are what it names.
        elsewhere = subprocess.run([*argv, "--state-dir", str(tmp_path / "other")], cwd=tmp_path,
                                   env=env, capture_output=True, text=True, timeout=120,
                                   check=False)
        assert elsewhere.returncode == 2
        assert f"redis: port {base} is in use by pid " in elsewhere.stderr
        assert "is another stack running?" in elsewhere.stderr
        # Meanwhile honcho stopped nothing (it logs `NAME stopped (rc=...)` for each).
        os.kill(pid, 0)
        assert "stopped (rc=" not in (state / "demo.log").read_text(errors="replace")
        # As it says: kill PID stops the whole stack.
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: stack_ports_free(base), 60, what="the kept stack's ports free")
    finally:
        if pid is not None and not stack_ports_free(base):
            # SIGTERM, as the demo says: honcho stops its processes (SIGKILL would orphan them).
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            wait_until(lambda: stack_ports_free(base), 60, what="the kept stack's ports free")


# --- 2. the password file from any directory ---------------------------------------------------


@pytest.fixture
def clone_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                    redis_server: RedisServer) -> Path:
    """A clone with `.env` and the embedded Redis' password file, and a working directory
    somewhere else (`cd ~`)."""
    clone = tmp_path / "clone"
    (clone / ".fleetgen" / "redis").mkdir(parents=True)
    (clone / ".env").write_text(f"FLEETGEN_REDIS_PASSWORD_FILE={PASSWORD_FILE}\n")
    shutil.copy(redis_server.credentials_file, clone / PASSWORD_FILE)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setattr(fleetgen.settings, "PROJECT_DIR", clone)
    monkeypatch.chdir(home)
    return clone


def test_the_env_files_relative_password_file_is_found_from_any_directory(
    clone_elsewhere: Path, redis_server: RedisServer,
) -> None:
    """`set -a; . ./.env; set +a; cd ~; celery -A workers flower` said "Authentication
    required" forever: `.fleetgen/redis/password` was looked for in ~."""
    settings = Settings.from_env({"REDIS_URL": redis_server.address,
                                  "FLEETGEN_REDIS_PASSWORD_FILE": PASSWORD_FILE})
    client = redis.Redis.from_url(settings.redis_url)
    try:
        assert client.ping()
    finally:
        client.close()


def test_a_bare_command_in_another_directory_finds_the_embedded_redis_password(
    clone_elsewhere: Path, redis_server: RedisServer,
) -> None:
    """`producer status mine` from another folder, with no .env loaded: the embedded
    default password of the clone, not none (`needs a password and none was given`)."""
    settings = Settings.from_env({})
    assert f":{redis_server.password}@127.0.0.1:6389/0" in settings.redis_url


def test_a_password_file_found_nowhere_is_named_by_its_full_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fleetgen.settings, "PROJECT_DIR", tmp_path / "no-clone")
    monkeypatch.setattr(fleetgen.settings, "PASSWORD_FILE_WAIT_S", 0.0)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SettingsError, match="no such secret file") as missing:
        Settings.from_env({"FLEETGEN_REDIS_PASSWORD_FILE": PASSWORD_FILE})
    assert str(missing.value).startswith(f"{tmp_path / PASSWORD_FILE}:")


# --- 3. the simulator on a taken port ----------------------------------------------------------


def test_a_simulator_on_a_taken_port_says_who_holds_it_in_one_line_before_starting() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "launcher", "sim", "--port", str(port),
                               "--speed", "100"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, check=False)
    assert done.returncode == 3
    assert done.stdout == ""  # not one start-up line
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"error: port {port} on 127.0.0.1 is in use by pid "
                                  f"{os.getpid()} (")
    assert "pass another --port" in done.stderr
    assert "FLEETGEN_SERVER_URL=http://127.0.0.1:PORT" in done.stderr


# --- 6. the sample generator -------------------------------------------------------------------


def canary_verdict(path: Path) -> canary.Verdict | None:
    """The canary's verdict on answers to every line of `path`, as a worker asks for them (job
    defaults under the line's values, thinking on), from a simulator sized like the demo's."""
    samples: list[list[Any]] = []
    with running_sim("--instant", "--mean-output-tokens", "2400",
                     "--max-running-requests", "64") as url, httpx.Client(base_url=url,
                                                                          timeout=60) as client:
        for record in read_prompts(path):
            body = {**GenerationParams().request_body(record.body), "separate_reasoning": True}
            answer = client.post("/v1/chat/completions", json=body).json()
            choice = answer["choices"][0]
            message = choice["message"]
            samples.append(canary.sample({
                "id": record.id, "content": message.get("content"),
                "reasoning_content": message.get("reasoning_content"),
                "tool_calls": message.get("tool_calls"),
                "finish_reason": choice["finish_reason"], "usage": answer["usage"]},
                thinking=True))
    return canary.evaluate(samples, canary.Thresholds())


def test_the_generated_bulk_file_makes_a_job_the_canary_finds_healthy(tmp_path: Path) -> None:
    """`generate_sample.py --lines 5000` capped 80% of its lines at 512/256 tokens: the job
    stopped `[paused] quality: 44% ... empty content`."""
    path = tmp_path / "bulk.jsonl"
    assert generate_sample.main(["--lines", "200", "--out", str(path)]) == 0
    assert canary_verdict(path) is None


def test_the_canary_demo_file_says_so_and_is_paused_by_the_canary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "capped.jsonl"
    assert generate_sample.main(["--lines", "200", "--out", str(path), "--canary-demo"]) == 0
    assert "the quality canary pauses the job (--canary-demo" in capsys.readouterr().out
    verdict = canary_verdict(path)
    assert verdict is not None and verdict.check == "empty_content"


# --- 8. the demo's hints and its input ---------------------------------------------------------


def test_the_demo_refuses_a_missing_input_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    state = tmp_path / "state"
    code = demo.main(["--input", str(tmp_path / "my-prompts.jsonl"), "--state-dir", str(state)])
    assert code == 2
    assert capsys.readouterr().err == f"demo: --input {tmp_path / 'my-prompts.jsonl'}: no such file or folder\n"
    assert not state.exists()  # no secrets made, no stack started


def test_the_demos_hints_name_this_interpreter_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    venv = Path(sys.executable).parent.parent
    monkeypatch.chdir(venv.parent)
    assert demo.python_command() == f"{venv.name}/bin/{Path(sys.executable).name}"
    monkeypatch.chdir(tmp_path)
    assert demo.python_command() == sys.executable


# --- 9. the report page ------------------------------------------------------------------------


def canary_html(judged_at_end: bool, end_verdict: EndVerdict | None) -> str:
    """The report's canary section for a job the canary watched and never paused."""
    canary = Canary(enabled=True, answers_seen=12, min_completions=200,
                    judged_at_end=judged_at_end, end_verdict=end_verdict)
    return report.canary_html(canary, None)


def test_the_reports_canary_section_speaks_words_not_field_names() -> None:
    waiting = canary_html(judged_at_end=True, end_verdict=None)
    assert "judged_at_end" not in waiting and "None" not in waiting
    assert "fewer than 200 prompts: it is judged once, at its end" in waiting
    healthy = canary_html(judged_at_end=True, end_verdict=EndVerdict(12, judged=True, verdict=None))
    assert "It judged all 12 answers at the job&#x27;s end: healthy." in healthy
    too_few = canary_html(judged_at_end=True, end_verdict=EndVerdict(3, judged=False, verdict=None))
    assert "it had 3 answers, too few to judge" in too_few
    large = canary_html(judged_at_end=False, end_verdict=None)
    assert "False" not in large and "end_verdict" not in large


def test_a_job_within_one_minute_gets_one_bar_per_gpu_not_one_dot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import matplotlib.axes

    drawn: list[tuple[str, list[Any]]] = []
    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda ax, x, height, **kw: drawn.append(("bar", list(height))))
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda ax, *args, **kw: drawn.append(("plot", list(args))))
    image = report.throughput_plot({"gpu0@a": [(0, 8.0, 800.0)], "gpu1@b": [(0, 6.0, 500.0)]})
    assert image.startswith('<img alt="plot" src="data:image/png;base64,')
    assert drawn == [("bar", [8.0, 6.0]), ("bar", [800.0, 500.0])]


# --- 10. small ones ----------------------------------------------------------------------------


def test_a_dry_run_without_sglang_says_it_is_not_installed(tmp_path: Path) -> None:
    if sglang_version() is not None:
        pytest.skip("SGLang is installed here")
    done = subprocess.run([sys.executable, "-m", "launcher", "up", "--dry-run", "--gpus", "0",
                           "--model", "/m", "--run-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith(f"SGLang is not installed here: flags spelled and checked for "
                            f"sglang {NEWEST_SGLANG}, the newest release the flags table")
    profiled = NodePlan((0,), False, False, "/m", Profile(sglang_version="0.5.10"), (),
                             30000, tmp_path, {})
    assert profiled.version_text() == "sglang 0.5.10 (the profile's sglang_version)"


def test_what_the_demo_and_the_producer_write_in_the_clone_is_ignored_by_git() -> None:
    done = subprocess.run(["git", "check-ignore", "demo-output/d1.jsonl",
                           "fleetgen-output/mine/manifest.json"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert done.stdout.split() == ["demo-output/d1.jsonl", "fleetgen-output/mine/manifest.json"]


# --- 11. two nodes' launchers on one host ------------------------------------------------------


def worker_metrics(base: int, tmp_path: Path, gpus: tuple[int, ...] = (0, 1)) -> list[str]:
    plan = NodePlan(gpus, True, True, None, Profile(), (), base, tmp_path, {})
    return [plan.worker_spec(g, plan.server_spec(g)).env["FLEETGEN_METRICS_PORT"] for g in gpus]


def test_the_workers_metrics_ports_move_with_the_base_port(tmp_path: Path) -> None:
    assert worker_metrics(30000, tmp_path) == ["20000", "20001"]
    assert worker_metrics(31000, tmp_path) == ["21000", "21001"]
    # Under the default base, beside the server's ports: not down among well-known services.
    assert worker_metrics(22010, tmp_path) == ["24010", "24011"]
    off = NodePlan((0,), True, True, None, Profile(), (), 31000, tmp_path,
                        {"FLEETGEN_METRICS_PORT": "0"})
    assert off.worker_spec(0, off.server_spec(0)).env["FLEETGEN_METRICS_PORT"] == "0"


def free_node_block() -> int:
    """A --base-port whose GPU 0 ports (HTTP, NCCL, its worker's metrics) are free now."""
    for _ in range(100):
        base = random.randrange(30000, 31700)
        if all(port_is_free(p) for p in (base, base + 1000, base - 30000 + METRICS_BASE_PORT)):
            return base
    pytest.skip("no free block of node ports")


def test_the_workers_default_metrics_ports_stay_clear_of_the_exporters_on_a_gpu_node(
    tmp_path: Path,
) -> None:
    """9400 was NVIDIA's DCGM exporter's port: `launcher up --workers` on a real GPU node was
    refused at once."""
    for base in (30000, 31000, 31760):
        plan = NodePlan(tuple(range(8)), True, True, None, Profile(), (), base, tmp_path, {})
        ports = [plan.metrics_port(g) for g in range(8)]
        assert all(p is not None and 20000 <= p < 22000 for p in ports), (base, ports)
    assert worker_metrics(30000, tmp_path, tuple(range(8)))[0] == "20000"


def test_up_names_every_taken_port_with_its_holder_and_each_way_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """It guessed `another node's launcher on this host?`, named the first taken port alone
    and offered only --base-port."""
    base = free_node_block()
    metrics = base - 30000 + METRICS_BASE_PORT
    argv = ["up", "--sim", "--workers", "--gpus", "0", "--base-port", str(base),
            "--run-dir", str(tmp_path)]
    with socket.create_server(("127.0.0.1", metrics)), socket.create_server(("127.0.0.1", base)):
        code = node_main(argv)
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another node" not in err
    assert err.startswith(f"launcher up: GPU 0: its worker's metrics port {metrics}, GPU 0: "
                          f"HTTP port {base} are in use by pid {os.getpid()} (")
    assert err.endswith("; stop what holds them, pass another --base-port (it moves every port "
                        "of this node), or set FLEETGEN_METRICS_PORT=0 to run the workers "
                        "without metrics\n")
    assert not (tmp_path / "node.json").exists()  # nothing started


def test_metrics_off_leaves_a_taken_metrics_port_alone(tmp_path: Path) -> None:
    base = free_node_block()
    plan = NodePlan((0,), True, True, None, Profile(), (), base, tmp_path,
                    {"FLEETGEN_METRICS_PORT": "0"})
    with socket.create_server(("127.0.0.1", base - 30000 + METRICS_BASE_PORT)):
        check_ports({0: plan.server_spec(0)}, {0: plan.metrics_port(0)})  # nothing raised
        with_metrics = NodePlan((0,), True, True, None, Profile(), (), base, tmp_path, {})
        with pytest.raises(PortBusyError, match="FLEETGEN_METRICS_PORT=0"):
            check_ports({0: with_metrics.server_spec(0)}, {0: with_metrics.metrics_port(0)})


# --- 13. the demo's own state folder, its hints, Flower's port ---------------------------------


def test_the_demo_keeps_its_data_apart_from_the_stack_a_user_runs_by_hand() -> None:
    env = demo.stack_env(DemoPorts(), ROOT / demo.DEFAULT_STATE)
    state = ROOT / ".fleetgen" / "demo"
    assert env["STACK_DIR"] == str(state)
    assert env["FLEETGEN_REDIS_PASSWORD_FILE"] == str(state / "redis" / "password")
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == str(state / "s3" / "credentials")
    # The walkthrough's `launcher redis` keeps its data, and its password, elsewhere.
    walkthrough = ROOT / fleetgen.settings.EMBEDDED_REDIS_PASSWORD_FILE.parent
    assert not state.is_relative_to(walkthrough) and not walkthrough.is_relative_to(state)


def test_the_demos_hint_for_your_own_prompts_keeps_the_ports_and_folder_it_ran_with(
    tmp_path: Path,
) -> None:
    python = demo.python_command()
    plain = demo.build_parser().parse_args([])
    assert demo.again_command(plain) == f"{python} -m launcher demo --input my-prompts.jsonl"
    moved = demo.build_parser().parse_args(["--port-base", "21000",
                                            "--state-dir", str(tmp_path / "my state")])
    assert demo.again_command(moved) == (f"{python} -m launcher demo --input my-prompts.jsonl "
                                         f"--port-base 21000 --state-dir '{tmp_path}/my state'")


def test_the_demo_names_what_holds_flowers_port_and_the_flag_that_moves_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    base = free_base()
    with socket.create_server(("127.0.0.1", base + 3)):
        code = demo.main(["--port-base", str(base), "--state-dir", str(tmp_path / "state")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"demo: flower: port {base + 3} is in use by pid {os.getpid()} (")
    assert err.endswith("(--port-base B moves them all)\n")
