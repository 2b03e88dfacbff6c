"""Re-drive and export on real parts: requeue --failed, cancel/resume, every export format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.stack import Stack, chat_rows, iter_ids, wait_job_done, write_jsonl

pytestmark = pytest.mark.e2e

FAST = ("--max-running-requests", "8", "--decode-tps", "80", "--mean-output-tokens", "200",
        "--speed", "50")
POISON = "NEEDS-A-LONGER-CONTEXT"


def _rows() -> list[dict[str, Any]]:
    rows = chat_rows(60)
    rows[7] = {"id": "p00007", "prompt": f"This one carries {POISON}."}
    return rows


def test_requeue_failed_sends_failed_prompts_again_and_export_keeps_the_latest_outcome(
    stack: Stack, tmp_path: Path
) -> None:
    rows = _rows()
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    sim, url = stack.sim("sim0", *FAST, "--fail-prompt", POISON)
    worker = stack.worker(0, url)
    stack.producer("enqueue", str(src), "--job", "redrive", "--output", str(out),
                   "--batch-size", "10", "--no-canary")
    status = wait_job_done(stack, "redrive", timeout=120)
    assert (status.done, status.failed) == (59, 1)
    partial = stack.producer("export", "redrive", "--to", str(tmp_path / "a.jsonl"))
    assert "done 59  failed 1  missing 0" in partial.stdout
    _assert_export_agrees_with_status(stack, "redrive", tmp_path / "a2.jsonl")

    # The server gets a longer context (here: restarted without the injected failure).
    worker.stop()
    sim.stop()
    _, url = stack.sim("sim0b", *FAST)
    stack.worker(0, url, name="gpu0b")
    requeued = stack.producer("requeue", "redrive", "--failed")
    assert "requeued 1 failed prompts in 1 batches" in requeued.stdout
    status = wait_job_done(stack, "redrive", timeout=120)
    assert (status.done, status.failed) == (60, 0)
    assert "Nothing to do" in stack.producer("requeue", "redrive", "--failed").stdout

    report = stack.producer("export", "redrive", "--to", str(tmp_path / "b.jsonl"))
    assert "input 60  done 60  failed 0  missing 0  duplicates dropped 0" in report.stdout
    _assert_export_agrees_with_status(stack, "redrive", tmp_path / "b2.jsonl")
    lines = [orjson.loads(x) for x in (tmp_path / "b.jsonl").read_bytes().splitlines()]
    assert [x["id"] for x in lines] == list(iter_ids(rows))
    stack.producer("export", "redrive", "--to", str(tmp_path / "c.jsonl"), "--format", "openai")
    openai = [orjson.loads(x) for x in (tmp_path / "c.jsonl").read_bytes().splitlines()]
    assert {x["response"]["status_code"] for x in openai} == {200}
    assert openai[7]["custom_id"] == "p00007" and openai[7]["error"] is None
    assert openai[7]["response"]["body"]["choices"][0]["message"]["reasoning_content"]
    stack.producer("export", "redrive", "--to", str(tmp_path / "d.parquet"), "--format", "parquet")
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "d.parquet")
    assert table.num_rows == 60 and set(table.column("status").to_pylist()) == {"ok"}


def _assert_export_agrees_with_status(stack: Stack, job: str, to: Path) -> None:
    """The export's reconcile (read from the sink) and status (Redis's written counters) count
    the same prompts."""
    exported = orjson.loads(stack.producer("export", job, "--to", str(to), "--json").stdout)
    status = orjson.loads(stack.producer("status", job, "--json", "--no-servers").stdout)
    assert {k: exported[k] for k in ("total", "done", "failed")} == {
        k: status[k] for k in ("total", "done", "failed")}
    assert exported["missing"] == status["total"] - status["done"] - status["failed"] == 0
    # `requeue --failed` takes its prompts off their error code, which may leave a 0.
    assert exported["failed_by_code"] == {k: n for k, n in status["errors"].items() if n}


def test_cancel_stops_the_job_and_resume_finishes_it_without_duplicates(
    stack: Stack, tmp_path: Path
) -> None:
    rows = chat_rows(200)
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    slow = ("--max-running-requests", "4", "--decode-tps", "80", "--mean-output-tokens", "300",
            "--speed", "5")
    _, url = stack.sim("sim0", *slow)
    stack.worker(0, url)
    stack.producer("enqueue", str(src), "--job", "stop", "--output", str(out),
                   "--batch-size", "20", "--no-canary")
    early = stack.producer("export", "stop", "--to", str(tmp_path / "early.jsonl"), check=False)
    assert early.returncode == 1 and "is not finished" in early.stderr
    assert "cancelled" in stack.producer("cancel", "stop").stdout
    from fleetgen.jobview import job_status
    from fleetgen.ledger import Ledger
    from fleetgen.poll import wait_until

    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])
    wait_until(lambda: not ledger.batches.running("stop"), 60, what="running batches stopped")
    held = job_status(ledger, "stop")
    assert held.state == "cancelled" and held.done < 200
    resumed = stack.producer("resume", "stop")
    assert "re-dispatched" in resumed.stdout
    wait_job_done(stack, "stop", timeout=240)
    report = stack.producer("export", "stop", "--to", str(tmp_path / "all.jsonl"))
    assert "input 200  done 200  failed 0  missing 0  duplicates dropped 0" in report.stdout
