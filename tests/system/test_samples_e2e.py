"""A job of four answers per prompt, end to end on the embedded S3, Redis, the simulator and real
workers: a worker SIGKILLed mid-batch and a `requeue --failed` later, the export holds exactly
four answers per prompt, each (id, index) once, in JSONL and grouped by prompt. The simulator
takes `n` as SGLang does, so a prompt's answers go as one request."""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from fleetgen import keys
from fleetgen.ledger import Ledger
from launcher.services import S3Server
from tests.stack import Stack, chat_rows, iter_ids, wait_job_done, write_jsonl

pytestmark = pytest.mark.e2e

PROMPTS, SAMPLES = 30, 4
POISON = "POISON-PILL"
POISONED = {"s00004", "s00017", "s00023"}
# Slow enough that a batch of 12 answers is still running when the worker is killed.
SIM = ("--max-running-requests", "4", "--decode-tps", "30", "--mean-output-tokens", "150",
       "--speed", "4")


def rows() -> list[dict[str, Any]]:
    out = []
    for row in chat_rows(PROMPTS, prefix="s"):
        pid = row.get("id") or row["custom_id"]
        out.append({"id": pid, "prompt": f"This carries the {POISON} ({pid})."}
                   if pid in POISONED else row)
    return out


def export(stack: Stack, tmp_path: Path, name: str, *flags: str) -> list[dict[str, Any]]:
    to = tmp_path / name
    stack.producer("export", "four", "--to", str(to), *flags)
    return [orjson.loads(line) for line in to.read_bytes().splitlines()]


def test_four_answers_per_prompt_survive_a_worker_kill_and_a_requeue_each_exported_once(
    stack: Stack, s3_server: S3Server, tmp_path: Path,
) -> None:
    src = write_jsonl(tmp_path / "four.jsonl", rows())
    _, poisoned_url = stack.sim("sim0", *SIM, "--fail-prompt", POISON)
    worker = stack.worker(0, poisoned_url)
    stack.producer("enqueue", str(src), "--job", "four", "--output",
                   f"s3://{s3_server.bucket}/runs", "--samples", str(SAMPLES),
                   "--batch-size", "12", "--max-tokens", "400", "--no-canary")
    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])
    manifest = ledger.jobs.load("four")
    assert (manifest.prompts, manifest.answers) == (PROMPTS, PROMPTS * SAMPLES)

    def answered() -> float:
        stats = ledger.r.hmget(keys.job_part("four", "stats"), "prompts_done", "prompts_failed")
        return sum(float(x or 0) for x in stats)

    deadline = time.monotonic() + 120
    while answered() < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ledger.batches.running("four"), "the kill must land while a batch runs"
    worker.kill()
    stack.worker(0, poisoned_url, name="gpu0b")
    status = wait_job_done(stack, "four", timeout=300)
    poisoned_answers = len(POISONED) * SAMPLES
    assert (status.total, status.prompts) == (PROMPTS * SAMPLES, PROMPTS)
    assert (status.done, status.failed) == (status.total - poisoned_answers, poisoned_answers)
    # The simulator is found to be SGLang, which takes `n`: a prompt's answers in one batch
    # went as one request, so it received far fewer requests than answers.
    received = httpx.get(poisoned_url + "/sim/stats").json()["requests"]
    assert received < PROMPTS * SAMPLES // 2, received

    # The poison is gone from the next server: the requeued answers succeed there.
    _, clean_url = stack.sim("sim1", *SIM)
    stack.worker(1, clean_url)
    for proc in stack.procs:
        if proc.name == "gpu0b":
            proc.kill()
    requeued = stack.producer("requeue", "four", "--failed")
    assert f"requeued {poisoned_answers}" in requeued.stdout, requeued.stdout
    status = wait_job_done(stack, "four", timeout=300)
    assert (status.done, status.failed) == (PROMPTS * SAMPLES, 0)

    lines = export(stack, tmp_path, "four.out.jsonl")
    keys_seen = collections.Counter((r["id"], r["sample"]) for r in lines)
    assert len(lines) == PROMPTS * SAMPLES and set(keys_seen.values()) == {1}
    ids = list(iter_ids(rows()))
    assert {pid for pid, _ in keys_seen} == set(ids)
    assert all("error" not in r and r["finish_reason"] for r in lines)
    grouped = export(stack, tmp_path, "four.grouped.jsonl", "--group-answers")
    assert [g["id"] for g in grouped] == ids
    assert all([a["sample"] for a in g["answers"]] == list(range(SAMPLES)) for g in grouped)
    # Different seeds gave different answers to one prompt.
    assert all(len({(a["reasoning_content"], a["content"]) for a in g["answers"]}) == SAMPLES
               for g in grouped)
