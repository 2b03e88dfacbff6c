"""`producer report JOB`: one self-contained HTML page, looked at in headless Chromium.

A real job (a simulated server, a worker, one poisoned prompt that fails) runs to the end;
the report is written, then rendered by Chromium: its DOM must show the job's own numbers and
a screenshot of it must not be blank. The page must need nothing but itself (plots embedded).
"""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.browser import Browser
from tests.stack import Stack, chat_rows, wait_job_done, write_jsonl

pytestmark = pytest.mark.e2e

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
    assert (status["done"], status["failed"]) == (PROMPTS - 1, 1)

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
