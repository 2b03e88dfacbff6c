"""`producer status`: figures from the ledger, the live per-GPU table, --json, --watch, jobs,
and progress.json. Counters are written by the workers' own Lua script, so status reads exactly
what workers write."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from fleetgen import keys, progress
from fleetgen.fleet import (
    FETCH_DEADLINE_S,
    LOST_AFTER_S,
    FleetRow,
    ServerHealth,
    fleet_rows,
    read_fleet,
    read_servers,
    registry,
)
from fleetgen.jobview import job_status
from fleetgen.ledger import STATE_CANCELLED, STATE_PAUSED, Ledger
from fleetgen.poll import wait_until
from fleetgen.ports import free_port
from fleetgen.readings import ServerReading
from fleetgen.records import written_counts
from producer.cli import main
from producer.status import render, render_fleet
from tests.job_figures import (
    FLEET_FIELDS,
    MINUTE,
    NOW,
    STABLE_FIELDS,
    Worker,
    answer_taking,
    half_done_job,
    ledger_time,
    register,
)
from tests.sim_helpers import VirtualClockLoop
from tests.stack import PYTHON, ROOT, Stack, chat_rows, make_job, python_stacks, write_jsonl


def test_render_shows_every_figure_readably(ledger: Ledger) -> None:
    half_done_job(ledger)
    text = render(job_status(ledger, "half", NOW))
    assert ("64/100 (64.0%)  done 58  failed 2  checkpointed 4  in flight 0  in hand 6  "
            "queued 30") in text
    assert ("last 1m00s 0.40 prompts/s, 37 out tok/s;  overall 0.11 prompts/s, 10 out tok/s "
            "(all GPUs)") in text
    assert "elapsed 10m00s   ETA 1m31s" in text
    assert "avg out 100  reasoning share 60%" in text
    assert "finish    length 3, stop 59" in text and "context_length_exceeded 2" in text
    assert "written   6.0 KB" in text
    assert "gpu0@a" in text and "gpu1@b" in text


def test_a_job_finished_within_seconds_reports_seconds_not_minutes(ledger: Ledger) -> None:
    manifest = make_job(ledger, "quick", "/tmp/out", prompts=10, created_at=NOW - 30)
    ledger.jobs.activate(manifest)  # enqueue finished now: the job's clock starts here
    started = float(ledger.r.hget(keys.job("quick"), "started_at"))
    w = Worker(ledger, "gpu0@a")
    for _ in range(10):
        w.answer("quick", "b000001", MINUTE)
    ledger.batches.finish_and_settle("quick", "b000001", written_counts(w.records.pop("b000001")),
                                     "gpu0@a", [], now=started + 7.5)
    s = job_status(ledger, "quick", started + 3600)
    assert s.state == "done" and s.elapsed_s == 7.5
    assert s.rate.prompts_per_s_all == pytest.approx(10 / 7.5, abs=1e-3)
    assert "elapsed 0m07s" in render(s)


def test_a_paused_job_holds_its_remaining_prompts_and_has_no_eta(ledger: Ledger) -> None:
    half_done_job(ledger)
    ledger.jobs.set_state("half", STATE_PAUSED, "paused by user")
    s = job_status(ledger, "half", NOW)
    assert (s.state, s.reason, s.eta_s) == ("paused", "paused by user", None)
    assert (s.in_hand, s.queued, s.held) == (6, 0, 30)
    text = render(s)
    assert "[paused]  paused by user" in text and "held 30 (paused)" in text and "ETA paused" in text


def test_status_of_a_job_paused_by_the_canary_shows_reason_examples_and_how_to_go_on(
    ledger: Ledger,
) -> None:
    half_done_job(ledger)
    reason = "quality: 100% of the last 200 answers have an empty content (threshold 20%)"
    examples = [{"id": "p1", "content": "", "output_tokens": 64, "length": True},
                {"id": "p2", "content": "", "output_tokens": 64, "length": True}]
    # What workers/batch.py `_watch_quality` writes when it pauses a job.
    ledger.r.hset(keys.job("half"), mapping={
        "state": STATE_PAUSED, "reason": reason, "quality_examples": orjson.dumps(examples),
        "quality_seen": 200})
    s = job_status(ledger, "half", NOW)
    assert s.reason == reason
    assert s.quality is not None
    assert asdict(s.quality) == {"examples": examples, "detected_after": 200, "accepted": False}
    text = render(s)
    assert reason in text
    assert "canary fired after 200 answers" in text
    assert "p1: '' (64 tokens, cut at max_tokens)" in text
    assert "python -m producer resume half --accept-quality" in text


def test_the_canary_line_says_how_many_answers_it_has_seen(ledger: Ledger) -> None:
    half_done_job(ledger)
    ledger.r.hset(keys.job("half"), "canary_seen", 64)
    # 100 prompts, fewer than the 200 the canary judges from: it judges them at the job's end.
    assert ("canary    watching: 64 answers seen (the job is smaller than 200: judged at its end)"
            in render(job_status(ledger, "half", NOW)))
    make_job(ledger, "big", "/tmp/out", prompts=1000)
    ledger.r.hset(keys.job("big"), "canary_seen", 64)
    assert "canary    watching: 64 answers seen (judges from 200)" in render(job_status(ledger, "big", NOW))


def test_a_small_job_judged_healthy_at_its_end_says_so(ledger: Ledger) -> None:
    half_done_job(ledger)
    ledger.r.hset(keys.job("half"), "canary_end",
                  orjson.dumps({"answers": 98, "judged": True, "verdict": None}))
    assert "canary    judged all 98 answers at the job's end: healthy" in render(
        job_status(ledger, "half", NOW))


def test_work_queued_with_nothing_moving_is_stalled_with_the_last_error_a_worker_met(
    ledger: Ledger,
) -> None:
    make_job(ledger, "stuck", "/tmp/out", created_at=NOW - 600)
    ledger.batches.mark_queued_and_settle("stuck", [keys.batch_id(i) for i in range(1, 11)])
    error = ("cannot use the output of job stuck with this worker's credentials: s3://b at "
             "http://s3:8333: access denied")
    register(ledger, "gpu5@host", "http://127.0.0.1:30005", updated=NOW - 2, host="host",
             queues=["gpu5", keys.SHARED_QUEUE],
             last_error={"error": error, "job": "stuck", "at": NOW - 40})
    status = job_status(ledger, "stuck", NOW)
    assert status.stalled is not None and status.stalled.last_error is not None
    assert status.stalled.reason == "no_progress"
    assert status.stalled.last_error.worker == "gpu5@host"
    assert [asdict(e) for e in status.worker_errors] == [{"worker": "gpu5@host", "host": "host", "job": "stuck",
                                        "error": error, "age_s": 40.0}]
    text = render(status)
    assert (f"  stalled: no batch finished for 10 min; last error on gpu5@host (40 s ago): {error}"
            in text)
    assert f"  gpu5@host                  40 s ago  job stuck: {error}" in text
    # A job with a batch running is moving, whatever errors a worker met.
    half_done_job(ledger)
    assert job_status(ledger, "half", NOW).stalled is None
    # One waiting its turn behind another job's work is not stuck either.
    register(ledger, "gpu6@host", "http://127.0.0.1:30006", updated=NOW - 2, in_flight=12,
             queues=["gpu6", keys.SHARED_QUEUE])
    assert job_status(ledger, "stuck", NOW).stalled is None


def test_a_stall_with_no_error_to_show_names_the_workers_whose_server_is_down(
    ledger: Ledger,
) -> None:
    make_job(ledger, "waits", "/tmp/out", created_at=NOW - 120)
    ledger.batches.mark_queued_and_settle("waits", [keys.batch_id(i) for i in range(1, 11)])
    register(ledger, "gpu0@a", "http://127.0.0.1:30000", updated=NOW - 1, state="server-down",
             queues=["gpu0", keys.SHARED_QUEUE])
    assert ("  stalled: no batch finished for 2 min; servers not ready for gpu0@a"
            in render(job_status(ledger, "waits", NOW)))


def test_a_job_pinned_to_a_queue_no_live_worker_consumes_is_stalled_at_once(
    ledger: Ledger,
) -> None:
    manifest = make_job(ledger, "pinned", "/tmp/out", created_at=NOW)
    ledger.jobs.save(dataclasses.replace(manifest, queue="gpu99"))
    ledger.batches.mark_queued_and_settle("pinned", [keys.batch_id(i) for i in range(1, 11)])
    register(ledger, "gpu0@a", "http://127.0.0.1:30000", updated=NOW - 1,
             queues=["gpu0", keys.SHARED_QUEUE])
    # A lost worker that consumed gpu99 consumes nothing now.
    register(ledger, "gpu99@gone", "http://127.0.0.1:30099", updated=NOW - 300,
             queues=["gpu99", keys.SHARED_QUEUE])
    status = job_status(ledger, "pinned", NOW)
    assert status.stalled is not None
    assert asdict(status.stalled) == {"reason": "no_consumer", "queue": "gpu99",
                                 "live_queues": ["fleetgen", "gpu0"], "idle_s": None,
                                 "last_error": None, "not_ready": []}
    assert ("  stalled: no worker consumes queue gpu99 (live workers consume fleetgen, gpu0)"
            in render(status))


@contextlib.contextmanager
def hung_server() -> Iterator[str]:
    """A port that accepts connections and never answers; its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A hung server for one test."""
    with hung_server() as url:
        yield url


@pytest.mark.e2e
def test_the_fleet_table_reads_servers_live_and_shows_a_dead_or_hung_one_down(
    stack: Stack, ledger: Ledger, black_hole: str,
) -> None:
    # No warm-up request: its tokens would show in gen throughput at the first Decode tick
    # after it, a moment that a loaded machine can move past any wait.
    _, url = stack.sim("sim0", "--max-running-requests", "24", "--model-arch", "mamba-hybrid",
                       "--speculative-algorithm", "EAGLE", "--speculative-accept-length", "2.5",
                       "--skip-server-warmup")
    register(ledger, "gpu0@n", url)
    register(ledger, "gpu1@n", f"http://127.0.0.1:{free_port()}", state="server-down")
    register(ledger, "gpu2@n", black_hole)
    register(ledger, "gpu3@n", url, age_s=LOST_AFTER_S + 5)
    # Lost and never part of this job (an earlier demo's worker): not listed.
    register(ledger, "gpu4@old", url, age_s=LOST_AFTER_S + 5)
    rows = {r.worker: r for r in read_fleet(
        ledger, {"gpu0@n": {"prompts_done": 30, "output_tokens": 6000},
                   "gpu3@n": {"prompts_done": 0}}, elapsed_s=60.0)}
    assert "gpu4@old" not in rows
    live = rows["gpu0@n"]
    assert set(asdict(live)) == FLEET_FIELDS
    assert (live.worker_state, live.server_state) == ("ready", "up")
    # As on the reference GPU, 80 Mamba slots run fewer than asked: /server_info says 16 of 24.
    assert (live.effective_max, live.requested_max) == (16, 24)
    assert (live.running, live.queue, live.token_usage, live.mamba_usage) == (0, 0, 0, 0)
    assert live.accept_length == 2.5 and live.version == "0.5.23"
    assert (live.job_prompts_done, live.job_output_tokens_per_s) == (30, 100.0)
    assert (rows["gpu1@n"].worker_state, rows["gpu1@n"].server_state) == ("server-down", "down")
    assert rows["gpu1@n"].server_error == "connection refused"
    assert rows["gpu2@n"].server_state == "down"
    assert rows["gpu2@n"].server_error == "no answer in time"
    assert rows["gpu3@n"].worker_state == "lost"
    table = {line.split()[0]: line.split()[1:] for line in render_fleet(list(rows.values()))[1:]}
    host = url.removeprefix("http://")
    assert table["gpu0@n"] == ["ready", host, "0/16", "24", "0", "0%", "0%", "0", "2.50", "|", "30", "100"]
    assert table["gpu1@n"][0] == "server-down" and table["gpu1@n"][2:] == ["down", "|", "0", "0"]
    assert table["gpu3@n"][:3] == ["lost", host, "0/16"]
    register(ledger, "gpu0@n", url, server_kind="sglang 0.5.23, model 'm'")
    rows = {r.worker: r for r in read_fleet(ledger, {}, elapsed_s=60.0)}
    assert ("  gpu0@n: sglang 0.5.23, model 'm'; worker in-flight limit 11 "
            "(internal_states[0].effective_max_running_requests_per_dp)"
            in render_fleet(list(rows.values())))


def test_hung_servers_are_read_side_by_side_and_each_costs_the_deadline_at_most() -> None:
    # On simulated time: three hung servers read one after another would end at 3 x 2 s.
    loop = VirtualClockLoop()
    with hung_server() as a, hung_server() as b, hung_server() as c:
        try:
            readings = loop.run_until_complete(read_servers([a, b, c]))
            took = loop.time()
        finally:
            loop.close()
    assert {(r.state, r.error) for r in readings.values()} == {("down", "no answer in time")}
    assert len(readings) == 3 and took == pytest.approx(FETCH_DEADLINE_S, abs=0.01)


@pytest.mark.e2e
def test_other_nodes_servers_show_what_their_workers_published_not_this_nodes_server(
    stack: Stack, ledger: Ledger,
) -> None:
    # Both workers name 127.0.0.1:PORT; on their own node that is their server, here it is
    # this node's simulator (running 0 of 8), which must not be shown for them.
    _, url = stack.sim("sim0", "--max-running-requests", "8")
    published = asdict(ServerReading("up", running=33, queue=2, effective_max=40,
                                     requested_max=40, gen_throughput=3400.0))
    register(ledger, "gpu0@far", url, host="far-node", reading=published)
    register(ledger, "gpu1@far", url, host="far-node",
             reading=asdict(ServerReading("down", error="connection refused")))
    register(ledger, "gpu0@here", url, host=socket.gethostname())
    rows = {r.worker: r for r in read_fleet(ledger, {}, elapsed_s=60.0)}
    far = rows["gpu0@far"]
    assert (far.server_state, far.running, far.effective_max) == ("up", 33, 40)
    assert (rows["gpu1@far"].server_state, rows["gpu1@far"].server_error) == (
        "down", "connection refused")
    here = rows["gpu0@here"]
    assert (here.server_state, here.running, here.effective_max) == ("up", 0, 8)


@pytest.mark.e2e
def test_a_running_job_shows_its_gpu_busy_in_status(stack: Stack, tmp_path: Path, ledger: Ledger) -> None:
    # A job of about three minutes (400 answers of ~3.75 s on 8 slots): still running when
    # `status` reads it however loaded the machine is. The test ends long before the job.
    _, url = stack.sim("sim0", "--max-running-requests", "8", "--decode-tps", "80",
                       "--mean-output-tokens", "300", "--speed", "1")
    stack.worker(0, url)
    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(400))
    stack.producer("enqueue", str(src), "--job", "busy", "--output", str(tmp_path / "out"),
                   "--batch-size", "10", "--max-tokens", "600")

    def busy() -> bool:
        rows = job_status(ledger, "busy", live=True).fleet
        return any(r.running and r.job_prompts_done for r in rows)

    wait_until(busy, 60, what="gpu0 running prompts of the job")
    out = stack.producer("status", "busy").stdout
    assert "job busy  [running]" in out
    row = next(line for line in out.splitlines() if "gpu0@test" in line)
    assert " ready " in row and url.removeprefix("http://") in row and "/8" in row
    data = orjson.loads(stack.producer("status", "busy", "--json").stdout)
    assert set(data) == STABLE_FIELDS
    assert data["fleet"][0]["worker"] == "gpu0@test" and data["fleet"][0]["effective_max"] == 8
    # The worker publishes its server's reading for `status` on other nodes.
    entry = orjson.loads(ledger.r.hget(keys.WORKERS, "gpu0@test"))
    assert entry["host"] == socket.gethostname()
    assert (entry["reading"]["state"], entry["reading"]["effective_max"]) == ("up", 8)
    assert "cancelled" in stack.producer("cancel", "busy").stdout


def test_status_json_prints_the_stable_fields(ledger: Ledger, cli_env: None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    half_done_job(ledger)
    assert main(["status", "half", "--json"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert set(data) == STABLE_FIELDS
    assert (data["done"], data["failed"]) == (58, 2)
    # Workers that did this job's work but are not registered (any more) are shown as lost.
    assert [(r["worker"], r["worker_state"], r["job_prompts_done"]) for r in data["fleet"]] == [
        ("gpu0@a", "lost", 34), ("gpu1@b", "lost", 28)]


def test_status_of_an_unknown_job_is_an_error(ledger: Ledger, cli_env: None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "nope"]) == 1
    assert "no job named 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "why"), [
    (["--interval", "5"], "--interval sets how often --watch redraws: add --watch"),
    (["--watch", "--interval", "0"], "--interval must be more than 0 seconds"),
    (["--watch", "--interval", "-1"], "--interval must be more than 0 seconds"),
], ids=["without-watch", "zero", "negative"])
def test_an_interval_that_cannot_pace_a_watch_is_refused(
    ledger: Ledger, cli_env: None, capsys: pytest.CaptureFixture[str], flags: list[str], why: str,
) -> None:
    half_done_job(ledger)
    assert main(["status", "half", *flags]) == 2
    captured = capsys.readouterr()
    assert f"error: {why}" in captured.err and captured.out == ""


def test_jobs_lists_each_job_with_state_progress_and_reason(
    ledger: Ledger, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    half_done_job(ledger)
    make_job(ledger, "later", "/tmp/out", prompts=50, created_at=NOW - 600)
    ledger.jobs.set_state("later", STATE_PAUSED, "paused by user")
    assert main(["jobs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["job", "state", "done", "failed"]
    half = next(line for line in lines if line.startswith("half "))
    later = next(line for line in lines if line.startswith("later "))
    assert half.split()[1:6] == ["running", "58", "2", "100", "64.0%"]
    assert later.split()[1:6] == ["paused", "0", "0", "50", "0.0%"] and "paused by user" in later


@pytest.mark.e2e
def test_status_watch_redraws_until_ctrl_c_and_exits_0(ledger: Ledger, redis_url: str) -> None:
    half_done_job(ledger)
    proc = subprocess.Popen(
        [PYTHON, "-m", "producer", "status", "half", "--watch", "--interval", "0.2"],
        cwd=ROOT, env={**os.environ, "REDIS_URL": redis_url}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    assert proc.stdout is not None
    seen = b""
    try:
        while seen.count(b"\x1b[2J") < 2:
            chunk = proc.stdout.read1(4096)  # type: ignore[attr-defined]
            assert chunk, f"status --watch exited early: {proc.wait()}"
            seen += chunk
        proc.send_signal(signal.SIGINT)
        try:
            rest, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            alive = proc.poll() is None
            where = python_stacks(proc.pid) if alive else "(it ended; a child holds its pipes)"
            pytest.fail(f"status --watch did not end within 10 s of Ctrl-C:\n{where}")
        seen += rest
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert b"job half  [running]" in seen and b"Ctrl-C to stop" in seen


def test_progress_json_is_written_next_to_the_output_at_most_once_a_minute(
    ledger: Ledger, tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    half_done_job(ledger, output=str(out))
    assert progress.write_progress(ledger, "half", NOW)
    written = orjson.loads((out / "half" / "progress.json").read_bytes())
    assert set(written) == STABLE_FIELDS and written["done"] == 58
    assert [r["worker"] for r in written.pop("fleet")] == ["gpu0@a", "gpu1@b"]
    expected = orjson.loads(job_status(ledger, "half", NOW).to_json())
    del expected["fleet"]
    assert written == expected
    Worker(ledger, "gpu0@a").answer("half", "b000007", MINUTE)
    assert not progress.write_progress(ledger, "half", NOW + 10)
    assert orjson.loads((out / "half" / "progress.json").read_bytes())["done"] == 58


def test_a_stopped_job_gets_one_last_progress_json_then_no_more(ledger: Ledger, tmp_path: Path) -> None:
    out = tmp_path / "out"
    half_done_job(ledger, output=str(out))
    ledger.jobs.set_state("half", STATE_PAUSED, "paused by user")
    assert progress.write_progress(ledger, "half", NOW)
    ledger.r.delete(keys.job_part("half", "progress_due"))  # a minute later
    assert not progress.write_progress(ledger, "half", NOW + 60)
    Worker(ledger, "gpu0@a").answer("half", "b000007", MINUTE)  # a running batch finishes
    ledger.r.delete(keys.job_part("half", "progress_due"))
    assert progress.write_progress(ledger, "half", NOW + 120)
    written = orjson.loads((out / "half" / "progress.json").read_bytes())
    assert (written["done"], written["checkpointed"]) == (58, 5)


def test_a_failing_progress_write_is_logged_and_never_raises(
    ledger: Ledger, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    half_done_job(ledger, output=str(blocker / "out"))
    assert not progress.write_progress(ledger, "half", NOW)
    assert "job half: progress.json not written" in caplog.text


def test_a_worker_publishes_its_loopback_server_under_the_nodes_address_on_the_route_to_redis(
) -> None:
    from fleetgen.advertise import advertised_url, route_address
    from fleetgen.settings import Settings, SettingsError

    local = "http://127.0.0.1:30001"
    assert advertised_url(local, Settings(advertise_host="10.213.0.11")) == "http://10.213.0.11:30001"
    assert advertised_url("http://10.0.0.5:30001", Settings(advertise_host="x")) == (
        "http://10.0.0.5:30001")
    assert advertised_url(local, Settings(advertise_url="http://gw:9")) == "http://gw:9"
    # Redis on this machine: no other node exists to publish for, the URL stays as it is.
    assert advertised_url(local, Settings(redis_url="redis://127.0.0.1:6389/0")) == local
    assert route_address("127.0.0.1", 6389) == "127.0.0.1"
    with pytest.raises(SettingsError, match="FLEETGEN_ADVERTISE_URL must not carry"):
        Settings.from_env({"FLEETGEN_ADVERTISE_URL": "http://u:secret@gw:9"})


@pytest.mark.e2e
def test_other_nodes_servers_are_read_live_at_their_published_address_and_grouped_by_node(
    stack: Stack, ledger: Ledger,
) -> None:
    # The far node's server listens on an address this node reaches: read live, not published.
    # 127.0.0.2 is loopback too, but no `127.0.0.1`: as another node's address would be.
    _, url = stack.sim("sim0", "--max-running-requests", "8", "--host", "0.0.0.0")
    far_url = url.replace("127.0.0.1", "127.0.0.2")
    published = asdict(ServerReading("up", running=33, effective_max=40, requested_max=40))
    register(ledger, "gpu0@far", far_url, host="far-node", reading=published,
             local_server="http://127.0.0.1:1")
    register(ledger, "gpu1@far", f"http://127.0.0.1:{free_port()}", host="far-node",
             reading=published)
    rows = {r.worker: r for r in read_fleet(ledger, {}, elapsed_s=60.0)}
    assert (rows["gpu0@far"].server_state, rows["gpu0@far"].effective_max) == ("up", 8)
    assert rows["gpu0@far"].host == "far-node"
    # Its published URL names the far node's loopback: what its worker published.
    assert rows["gpu1@far"].effective_max == 40
    register(ledger, "gpu0@here", url, host=socket.gethostname(),
             local_server=url, reading=published)
    lines = render_fleet(read_fleet(ledger, {}, elapsed_s=60.0))
    nodes = [line.split()[1] for line in lines if line.split()[0] == "node"]
    assert sorted(nodes) == sorted(["far-node", socket.gethostname()])


def test_eta_is_never_zero_while_answered_prompts_wait_for_their_batch(ledger: Ledger) -> None:
    # As users saw it: 8 batches written, 4 running with 49 of 50 answered each. The 4 left
    # are the slow ones, in flight; the old ETA (4 unanswered / 20 prompts/s) read 0m00s.
    make_job(ledger, "tail", "/tmp/out", prompts=600, batch_size=50, created_at=NOW - 30)
    w = Worker(ledger, "gpu0@a")
    for i in range(1, 13):
        batch = keys.batch_id(i)
        if i > 8:
            ledger.leases.acquire("tail", batch, "gpu0@a/lease", 30)
            ledger.r.zadd(keys.job_part("tail", "running"), {batch: NOW - 3})  # taken 3 s ago
        for _ in range(50 if i <= 8 else 49):
            answer_taking(w, "tail", batch, MINUTE - 1, latency_s=6.0)
        if i <= 8:
            w.finish_batch("tail", batch, MINUTE - 1)
    register(ledger, "gpu0@a", "http://127.0.0.1:30000", updated=NOW - 1, in_flight=4)
    s = job_status(ledger, "tail", NOW)
    assert (s.done, s.checkpointed, s.in_flight) == (400, 196, 4)
    assert (s.rate.window_s, s.rate.mean_answer_s) == (30, 6.0)
    assert s.rate.prompts_per_s_5m == pytest.approx(596 / 30, abs=1e-3)
    # Nothing left to send, the last 4 sent less than a mean answer time ago: they need about
    # one mean answer time, then their batches are written. The formula of docs/guides/status.md:
    assert s.eta_s == math.ceil((600 - 400 - 196 - 4) / (596 / 30) + 6.0) == 6
    assert "ETA 0m06s" in render(s)
    # Still in flight after more than a mean answer time: the long tail, whose end no mean of
    # the answers back tells. No ETA, and why.
    s = job_status(ledger, "tail", NOW + 5)
    assert (s.eta_s, s.eta_reason) == (
        None, "finishing: the last 4 in flight, longer than the mean answer so far")
    assert "ETA unknown (finishing: the last 4 in flight" in render(s)
    # All answered, 4 batches not written yet: still not 0 until they are.
    for i in range(9, 13):
        answer_taking(w, "tail", keys.batch_id(i), MINUTE, latency_s=6.0)
    s = job_status(ledger, "tail", NOW + 1)
    assert (s.done, s.checkpointed, s.eta_s) == (400, 200, 1)
    for i in range(9, 13):
        w.finish_batch("tail", keys.batch_id(i), MINUTE)
    assert job_status(ledger, "tail", NOW + 61).eta_s == 0


def test_a_job_sent_whole_has_no_eta_from_its_first_answers_but_says_why(ledger: Ledger) -> None:
    # As seen on a real GPU: 280 prompts all in flight from the start; the first answers back
    # are the short ones (8 s), the job took two minutes. One mean answer time would read 8 s.
    make_job(ledger, "whole", "/tmp/out", prompts=280, batch_size=28, created_at=NOW - 30)
    w = Worker(ledger, "gpu0@a")
    for i in range(1, 11):
        batch = keys.batch_id(i)
        ledger.leases.acquire("whole", batch, "gpu0@a/lease", 30)
        ledger.r.zadd(keys.job_part("whole", "running"), {batch: NOW - 25})
        for _ in range(2):
            answer_taking(w, "whole", batch, MINUTE, latency_s=8.0)
    register(ledger, "gpu0@a", "http://127.0.0.1:30000", updated=NOW - 1, in_flight=260)
    s = job_status(ledger, "whole", NOW)
    assert (s.checkpointed, s.in_flight, s.queued) == (20, 260, 0)
    assert (s.eta_s, s.eta_reason) == (
        None, "finishing: the last 260 in flight, longer than the mean answer so far")


def test_after_an_outage_the_rate_and_eta_count_from_the_minute_work_went_on(
    ledger: Ledger,
) -> None:
    make_job(ledger, "back", "/tmp/out", prompts=1000, batch_size=50, created_at=NOW - 1200)
    w = Worker(ledger, "gpu0@a")
    # 200 answers in the job's first minute, then nothing for 18 minutes.
    for i in range(1, 5):
        for _ in range(50):
            w.answer("back", keys.batch_id(i), MINUTE - 20)
        w.finish_batch("back", keys.batch_id(i), MINUTE - 20)
    # Back, nothing answered yet: unknown, not 800 prompts at the lifetime 0.17 prompts/s.
    s = job_status(ledger, "back", NOW + 5)
    assert (s.rate.prompts_per_s_5m, s.eta_s) == (0, None)
    assert "ETA unknown" in render(s)
    # 60 answers in the 30 s since: 2 prompts/s, not 60 over the 5 min window (0.18/s, ETA 68 min).
    for i in (5, 6):
        ledger.leases.acquire("back", keys.batch_id(i), "gpu0@a/lease", 30)
        for _ in range(30):
            w.answer("back", keys.batch_id(i), MINUTE)
    s = job_status(ledger, "back", NOW + 30)
    assert (s.rate.window_s, s.rate.prompts_per_s_5m) == (30, 2.0)
    assert s.eta_s == math.ceil(740 / 2.0 + 0.5) == 371
    # The overall rate is since the job started, the outage included.
    assert s.rate.prompts_per_s_all == pytest.approx(260 / 1230, abs=1e-3)
    assert "last 0m30s 2.00 prompts/s" in render(s)


def test_a_cancelled_jobs_rate_does_not_drift_after_it_stopped(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from producer.control import cancel

    half_done_job(ledger)  # started at NOW - 600, its last batch written at NOW
    with ledger_time(monkeypatch, NOW + 100):
        cancel(ledger, "half")
    at_stop, later = job_status(ledger, "half", NOW + 100), job_status(ledger, "half", NOW + 7200)
    assert at_stop.elapsed_s == later.elapsed_s == 700
    assert (later.rate.prompts_per_s_all, later.rate.output_tokens_per_s_all) == (
        at_stop.rate.prompts_per_s_all, at_stop.rate.output_tokens_per_s_all)
    assert later.rate.prompts_per_s_all == pytest.approx(64 / 700, abs=1e-3)
    assert later.rate.clock_end == NOW + 100 and later.eta_s is None
    assert "elapsed 11m40s (stopped)   ETA cancelled" in render(later)


def test_exporting_a_cancelled_job_the_canary_held_says_the_canary_held_it(
    ledger: Ledger, cli_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    from producer.cli import main

    half_done_job(ledger, output=str(tmp_path / "out"))
    ledger.r.hset(keys.job("half"), mapping={
        "state": "cancelled", "reason": "cancelled by user", "quality_seen": 200,
        "quality_examples": orjson.dumps([{"id": "p1", "content": "", "output_tokens": 3,
                                           "length": False}])})
    assert main(["export", "half", "--to", str(tmp_path / "half.jsonl")]) != 0
    err = capsys.readouterr().err
    assert "failed its quality check (the canary paused it after 200 answers; it is " \
           "cancelled now: cancelled by user)" in err, err


def test_status_names_a_sick_server_an_overloaded_one_and_one_out_of_rotation(
    ledger: Ledger,
) -> None:
    url = "http://127.0.0.1:9"  # nothing listens: the published figures are what status shows
    sick = ServerHealth(window_s=300.0, answered=683, failed={"HTTP 500": 317}, refused={},
                        overloaded={}, in_rotation=True, out_since=None, out_reason=None,
                        ejections=0, limit=20, limit_reason=None)
    full = ServerHealth(window_s=300.0, answered=900, failed={}, refused={},
                        overloaded={"HTTP 429": 150}, in_rotation=True, out_since=None,
                        out_reason=None, ejections=0, limit=8,
                        limit_reason="cut to 8 after HTTP 429 (server full)")
    out = ServerHealth(window_s=300.0, answered=10, failed={"HTTP 502": 5}, refused={},
                       overloaded={}, in_rotation=False, out_since=NOW - 20,
                       out_reason="5 requests in a row failed (HTTP 502)", ejections=1, limit=20,
                       limit_reason=None)
    fine = ServerHealth(window_s=300.0, answered=990, failed={"HTTP 500": 10}, refused={},
                        overloaded={}, in_rotation=True, out_since=None, out_reason=None,
                        ejections=0, limit=20, limit_reason=None)
    for name, health in (("gpu0@a", sick), ("gpu1@a", full), ("gpu2@a", out), ("gpu3@a", fine)):
        register(ledger, name, url, health=asdict(health),
                 state="out-of-rotation" if health is out else "ready")
    lines = render_fleet(read_fleet(ledger, {}, elapsed_s=60.0))
    said = "\n".join(lines)
    assert "gpu0@a: 32% of requests failed in the last 5 min (HTTP 500: 317)" in said, said
    assert ("gpu1@a: server full: 30.0 refusals/min (HTTP 429: 150); in flight up to 8 "
            "(cut to 8 after HTTP 429 (server full))") in said, said
    assert ("gpu2@a: out of rotation: 5 requests in a row failed (HTTP 502); probing it, "
            "batches go to the other workers") in said, said
    assert "gpu2@a: 33% of requests failed" in said, said
    # A server failing one request in a hundred is not called out.
    assert not any(line.startswith("  gpu3@a: ") and "failed" in line for line in lines), said
    row = next(r for r in read_fleet(ledger, {}, elapsed_s=60.0) if r.worker == "gpu2@a")
    assert row.worker_state == "out-of-rotation" and row.health == out


def test_a_finished_jobs_recent_rate_is_the_one_it_ended_at_however_late_it_is_read(
    ledger: Ledger,
) -> None:
    # 360 answers at 2 a second over its last three minutes, the last batch written at NOW.
    make_job(ledger, "ran", "/tmp/out", prompts=360, batch_size=120, created_at=NOW - 200)
    w = Worker(ledger, "gpu0@a")
    for i, minute in enumerate((MINUTE - 3, MINUTE - 2, MINUTE - 1), start=1):
        for _ in range(120):
            w.answer("ran", keys.batch_id(i), minute)
        w.finish_batch("ran", keys.batch_id(i), minute)
    # As users saw it: read again and again after the end, the rate kept falling (to 0 once
    # the window had passed the end).
    for later in (5, 60, 600, 7200):
        s = job_status(ledger, "ran", NOW + later)
        assert s.state == "done"
        assert (s.rate.window_s, s.rate.prompts_per_s_5m) == (180, 2.0), later
        assert "last 3m00s before it stopped 2.00 prompts/s" in render(s)


def fleet_row(**fields: Any) -> FleetRow:
    """A live worker's row: its server up, running `running` of `effective_max`."""
    base: dict[str, Any] = {name: None for name in FLEET_FIELDS}
    base.update(worker="gpu0@a", host="a", server="http://127.0.0.1:30000", worker_state="ready",
                server_state="up", job_prompts_done=0, job_prompts_failed=0, job_output_tokens=0)
    return FleetRow(**{**base, **fields})


def test_the_fleet_table_says_whose_limit_each_is_the_servers_max_running_or_the_workers(
) -> None:
    # As a new user saw it: `run/max 0/4,096` over `4,505 in flight at most`, two limits side
    # by side and nothing saying which is which.
    row = fleet_row(running=0, effective_max=4096, requested_max=4096, queue=0, limit=4505,
                    in_flight=0, server_kind="sglang 0.5.23, model 'm'",
                    capacity_source="probe: no wait at 4096 in flight; growing to 4505")
    header, line, *under = render_fleet([row])
    assert "srv run/max" in header and " run/max" not in header.replace("srv run/max", "")
    assert line.split()[3] == "0/4,096"
    assert under == ["  gpu0@a: sglang 0.5.23, model 'm'; worker in-flight limit 4,505 (probe: "
                     "no wait at 4096 in flight; growing to 4505)"]


class Slept(Exception):
    """`status --watch` went to sleep for another round."""


def watch_rounds(monkeypatch: pytest.MonkeyPatch, *rounds: Any) -> list[int]:
    """`status --watch` runs each of `rounds` (something that moves the job on) where it would
    sleep, and raises Slept where it sleeps once more; returns the list of rounds run."""
    import producer.cli

    ran: list[int] = []

    def sleep(_: float) -> None:
        if len(ran) == len(rounds):
            raise Slept
        rounds[len(ran)]()
        ran.append(len(ran))

    monkeypatch.setattr(producer.cli, "time", SimpleNamespace(
        time=time.time, monotonic=time.monotonic, strftime=time.strftime, sleep=sleep))
    return ran


def finish_job(ledger: Ledger, job: str, batches: int) -> None:
    w = Worker(ledger, "gpu0@a")
    minute = int(time.time() // 60)
    for i in range(1, batches + 1):
        for _ in range(10):
            w.answer(job, keys.batch_id(i), minute)
        w.finish_batch(job, keys.batch_id(i), minute)


def test_a_watch_started_before_the_enqueue_waits_for_the_job_and_ends_when_it_is_done(
    ledger: Ledger, cli_env: None, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ran = watch_rounds(
        monkeypatch,
        lambda: None,  # its enqueue has not started yet
        lambda: make_job(ledger, "soon", "/tmp/out", prompts=20),  # enqueued, running
        lambda: finish_job(ledger, "soon", 2))  # both batches written: done
    assert main(["status", "soon", "--watch", "--no-servers"]) == 0
    out, err = capsys.readouterr()
    assert len(ran) == 3
    assert err.count("waiting for job soon to be enqueued … (Ctrl-C to stop)") == 1
    screens = out.split("\x1b[2J\x1b[H")[1:]
    assert [screen.splitlines()[0].split("  ")[1] for screen in screens] == ["[running]", "[done]"]
    assert "Ctrl-C to stop" in screens[0] and screens[1].rstrip().endswith(
        "job done: the watch ends here")
    # Without --watch a job Redis does not hold is still an error.
    assert main(["status", "never", "--no-servers"]) == 1
    assert "no job named 'never'" in capsys.readouterr().err


@pytest.mark.parametrize("json", [False, True], ids=["screen", "json"])
def test_a_watch_ends_with_a_cancelled_job_and_watches_a_paused_one_on(
    ledger: Ledger, cli_env: None, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], json: bool,
) -> None:
    half_done_job(ledger)
    flags = ["--watch", "--no-servers", *(["--json"] if json else [])]
    ledger.jobs.set_state("half", STATE_CANCELLED, "cancelled by user")
    watch_rounds(monkeypatch)
    assert main(["status", "half", *flags]) == 0
    out = capsys.readouterr().out
    if json:
        assert [orjson.loads(line)["state"] for line in out.splitlines()] == ["cancelled"]
    else:
        assert out.rstrip().endswith("job cancelled: the watch ends here")
    # A paused job may be resumed: its watch goes on.
    ledger.jobs.set_state("half", STATE_PAUSED, "paused by user")
    with pytest.raises(Slept):
        main(["status", "half", *flags])
    out = capsys.readouterr().out
    if not json:
        assert out.rstrip().endswith(
            "every 2s, until the job is resumed and done, or cancelled; Ctrl-C to stop")


@pytest.mark.e2e
def test_a_watch_started_before_the_enqueue_follows_the_job_and_exits_0_when_it_is_done(
    ledger: Ledger, redis_url: str,
) -> None:
    proc = subprocess.Popen(
        [PYTHON, "-m", "producer", "status", "later", "--watch", "--interval", "0.2",
         "--no-servers"],
        cwd=ROOT, env={**os.environ, "REDIS_URL": redis_url}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        said = proc.stderr.readline()
        assert b"waiting for job later to be enqueued" in said, said + proc.stderr.read()
        make_job(ledger, "later", "/tmp/out", prompts=20)
        seen = b""
        while b"job later  [running]" not in seen:
            chunk = proc.stdout.read1(4096)  # type: ignore[attr-defined]
            assert chunk, f"status --watch exited early: {proc.wait()}"
            seen += chunk
        finish_job(ledger, "later", 2)
        try:
            rest, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"status --watch went on after the job was done:\n"
                        f"{python_stacks(proc.pid)}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    last = (seen + rest).split(b"\x1b[2J\x1b[H")[-1]
    assert b"job later  [done]" in last and b"job done: the watch ends here" in last


def test_an_output_out_of_reach_is_said_once_then_every_half_hour_and_its_end_is_said(
    ledger: Ledger, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    half_done_job(ledger, output=str(blocker / "out"))
    warnings = progress.ProgressWarnings()

    def minute(at: float) -> bool:
        ledger.r.delete(keys.job_part("half", "progress_due"))
        return progress.write_progress(ledger, "half", at, warnings=warnings)

    for k in range(5):
        assert not minute(NOW + 60 * k)
    said = [r.getMessage() for r in caplog.records if "progress.json" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("job half: progress.json not written (")
    assert not minute(NOW + 1800)
    said = [r.getMessage() for r in caplog.records if "progress.json" in r.getMessage()]
    assert len(said) == 2 and "still not written after 30 min" in said[1]
    blocker.unlink()
    assert minute(NOW + 1860)
    assert "progress.json written again after 31 min" in caplog.records[-1].getMessage()


def test_a_finished_jobs_rows_are_the_workers_that_did_it_not_later_ones_of_the_same_name(
    ledger: Ledger, tmp_path: Path,
) -> None:
    # Three workers did a 30-prompt job that ended at the end of MINUTE - 1. gpu0@a still runs
    # as the same process; gpu1@b stopped since; gpu2@c was restarted after the end (a new
    # process under the old name, its server busy with another job).
    out = tmp_path / "out"
    make_job(ledger, "over", str(out), prompts=30, batch_size=10, created_at=NOW - 300)
    for i, name in enumerate(("gpu0@a", "gpu1@b", "gpu2@c"), start=1):
        worker = Worker(ledger, name)
        for _ in range(10):
            worker.answer("over", keys.batch_id(i), MINUTE - 1)
        worker.finish_batch("over", keys.batch_id(i), MINUTE - 1, size=10)
    ended = MINUTE * 60.0
    beat = {"updated": NOW + 59}
    register(ledger, "gpu0@a", "http://127.0.0.1:30000", started=ended - 400, **beat)
    register(ledger, "gpu2@c", "http://127.0.0.1:30002", started=ended + 30, in_flight=9, **beat)
    register(ledger, "gpu3@d", "http://127.0.0.1:30003", started=ended + 30, **beat)  # not its
    status = job_status(ledger, "over", NOW + 60)
    assert status.state == "done" and status.rate.clock_end == ended
    assert progress.write_progress(ledger, "over", NOW + 60)
    written = orjson.loads((out / "over" / "progress.json").read_bytes())
    rows = {r["worker"]: r for r in written["fleet"]}
    assert {n: rows[n]["worker_state"] for n in ("gpu0@a", "gpu1@b", "gpu2@c")} == {
        "gpu0@a": "ready", "gpu1@b": "finished", "gpu2@c": "finished"}
    assert (rows["gpu2@c"]["server"], rows["gpu2@c"]["in_flight"]) == (None, None)
    assert [rows[n]["job_prompts_done"] for n in ("gpu0@a", "gpu1@b", "gpu2@c")] == [10, 10, 10]
    # While a job may go on, a worker gone is lost and a new process is the worker.
    ledger.r.delete(keys.job_part("over", "progress_due"))
    running = fleet_rows(registry(ledger, NOW + 60), {}, status.workers, 60.0, NOW + 60)
    assert {r.worker: r.worker_state for r in running}["gpu1@b"] == "lost"
    assert {r.worker: r.in_flight for r in running}["gpu2@c"] == 9
