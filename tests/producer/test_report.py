"""`producer report JOB`: one self-contained HTML page, looked at in headless Chromium.

A real job (a simulated server, a worker, one poisoned prompt that fails) runs to the end;
the report is written, then rendered by Chromium: its DOM must show the job's own numbers and
a screenshot of it must not be blank. The page must need nothing but itself (plots embedded).
Its rates are `status`'s, labelled, and its per-GPU chart agrees with them (a fast test on the
ledger alone).
"""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

import fleetgen.ledger._jobs
from fleetgen.checkpoints import RECORD_GROUP, Entry, group_arguments
from fleetgen.ledger import Ledger
from fleetgen.records import Origin, counters, result_record, written_counts
from producer.report import build_report, throughput_series
from tests.browser import Browser
from tests.stack import Stack, chat_rows, make_job, wait_job_done, write_jsonl

FAST = ("--max-running-requests", "8", "--decode-tps", "80", "--mean-output-tokens", "200",
        "--speed", "50")
POISON = "NEEDS-A-LONGER-CONTEXT"
PROMPTS = 30


def summary(dom: str) -> dict[str, str]:
    """The summary table's rows as Chromium rendered them: label -> value."""
    table = re.search(r'<table id="summary">(.*?)</table>', dom, re.DOTALL)
    assert table, dom[:2000]
    return {html.unescape(k): html.unescape(v) for k, v in
            re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", table.group(1))}


@pytest.mark.e2e
def test_the_report_is_one_html_page_that_shows_the_jobs_numbers_in_a_browser(
    stack: Stack, chromium: Browser, tmp_path: Path, redis_client: Any
) -> None:
    _, url = stack.sim("sim0", *FAST, "--fail-prompt", POISON)
    stack.worker(0, url)
    rows = chat_rows(PROMPTS, prefix="r")
    rows[4] = {"id": "r00004", "prompt": f"This one carries {POISON}."}
    src = write_jsonl(tmp_path / "pictured.jsonl", rows)
    stack.producer("enqueue", str(src), "--job", "pictured", "--output", str(tmp_path / "out"),
                   "--batch-size", "8", "--no-canary")
    status = wait_job_done(stack, "pictured", 180)
    assert (status.done, status.failed) == (PROMPTS - 1, 1)

    page = tmp_path / "pictured.html"
    result = stack.producer("report", "pictured", "--to", str(page))
    assert f"{PROMPTS - 1} done, 1 failed of {PROMPTS}" in result.stdout
    text = page.read_text()
    # Self-contained: every image is inline, nothing is fetched from anywhere.
    assert len(re.findall(r'<img alt="plot" src="data:image/png;base64,', text)) == 4
    assert not re.search(r'(src|href)="(https?:|//|/)', text)

    dom = chromium.dom(page.as_uri())
    figures = summary(dom)
    assert figures["prompts"] == str(PROMPTS)
    assert figures["done"] == str(PROMPTS - 1)
    assert figures["failed"] == "1"
    assert figures["state"] == "done"
    assert figures["batches"] == "4 of 4 written"
    assert "context_length_exceeded" in dom  # failures by reason, with the server's message
    assert "gpu0@test" in dom  # the worker's row
    assert "The quality canary was off for this job" in dom
    shot = chromium.screenshot(page.as_uri(), tmp_path / "report.png")
    shutil.copy(shot, "/tmp/fleetgen-report.png")  # for a human to look at


@pytest.mark.e2e
def test_the_report_of_a_job_no_worker_took_yet_refuses_to_replace_a_file_without_force(
    stack: Stack, tmp_path: Path, redis_client: Any
) -> None:
    src = write_jsonl(tmp_path / "small.jsonl", chat_rows(3))
    stack.producer("enqueue", str(src), "--job", "small", "--output", str(tmp_path / "out"),
                   "--no-canary")
    page = tmp_path / "kept.html"
    page.write_text("mine")
    refused = stack.producer("report", "small", "--to", str(page), check=False)
    assert refused.returncode == 1
    assert "exists; pass --force" in refused.stderr
    assert page.read_text() == "mine"
    made = stack.producer("report", "small", "--to", str(page), "--force")
    assert "job small [running], 0 done, 0 failed of 3" in made.stdout
    assert "<h1>Job small</h1>" in page.read_text()


def answer_batch(ledger: Ledger, job: str, batch: str, worker: str, minute: int,
                 prompts: int) -> list[dict[str, Any]]:
    """`prompts` answers of 100 output tokens checkpointed by `worker` in `minute` (the workers'
    own script, so every counter moves as a worker moves it); their records."""
    origin, records = Origin("http://127.0.0.1:30000", worker, 1), []
    response = {"choices": [{"finish_reason": "stop", "message": {"content": "An answer."}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 100}}
    for i in range(prompts):
        record = result_record(f"{batch}-{i}", i, response, 0.5, origin)
        entry = Entry(job, batch, record["id"], orjson.dumps(record),
                      counters(record, thinking=False), b"")
        script_keys, args = group_arguments(job, [entry], worker, minute, window=0)
        ledger.r.register_script(RECORD_GROUP)(keys=script_keys, args=args)
        records.append(record)
    return records


def test_the_report_header_and_chart_show_the_same_rate_labelled_total_and_per_gpu(
    redis_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As users saw it: a job of 2.5 s on two GPUs read 1,600 tok/s in the header and 33 per
    # GPU in the chart (each minute's tokens over 60 s, though the job ran 2.5 s of it).
    ledger = Ledger(redis_client)
    manifest = make_job(ledger, "brief", str(tmp_path / "out"), prompts=40, batch_size=20)
    started = 1_800_000_010.0  # 10 s into a minute
    with monkeypatch.context() as m:
        m.setattr(fleetgen.ledger._jobs, "time", SimpleNamespace(time=lambda: started))
        ledger.jobs.activate(manifest)
    for batch, worker in (("b000001", "gpu0@a"), ("b000002", "gpu1@b")):
        records = answer_batch(ledger, "brief", batch, worker, int(started // 60), 20)
        ledger.batches.finish_and_settle("brief", batch, written_counts(records), worker, [],
                            now=started + 2.5)
    report = build_report(ledger, "brief", now=started + 3600)
    status, rate = report.status, report.status.rate
    assert (status.state, status.elapsed_s) == ("done", 2.5)
    assert rate.output_tokens_per_s_all == 40 * 100 / 2.5
    # The chart: per GPU, the minute over the 2.5 s the job ran in it; together, the total.
    series = throughput_series(ledger.counters.worker_minutes("brief"), rate)
    assert series == {"gpu0@a": [(0, 8.0, 800.0)], "gpu1@b": [(0, 8.0, 800.0)]}
    assert sum(points[0][2] for points in series.values()) == rate.output_tokens_per_s_all
    rows = summary(report.html)
    assert rows["elapsed"] == "2.5 s (the clock stopped)"
    assert rows["output tokens/s"] == ("1,600 total of 2 GPUs over the job's 2.5 s = 800 per "
                                       "GPU on average; 1,600 total over the last 2.5 s before it stopped")
    assert rows["prompts/s"] == ("16.00 total over the job's 2.5 s; 16.00 total over the last 2.5 s "
                                 "before it stopped")
    assert "A minute&#x27;s rates of all GPUs add up to the job&#x27;s total rate." in report.html
    # The workers table: each GPU's rate over the job's clock, as `status` shows it.
    assert report.html.count("<td class=num>800</td>") == 2
