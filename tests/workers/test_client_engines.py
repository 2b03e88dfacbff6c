"""Engines that are not SGLang, met as a new user meets them: no fleetgen setting, no --model.

A strict OpenAI-schema server (like `transformers serve`: it refuses unknown fields and any
other model name, and states no capacity) and a vLLM server (its queue gauges, its error
bodies, its own aborts) each run a job to the end: every prompt exactly once, every one an
answer, aborted generations sent again. How busy each is kept is a figure of tests/perf
(engines.py), not an assertion here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from fleetgen.servers import KINDS, Server
from tests.sim_helpers import running_sim
from tests.stack import Stack, chat_rows, iter_ids, wait_job_done, write_jsonl
from workers.client import ServerClient

PROMPTS = 120
SIM = ("--max-running-requests", "6", "--mean-output-tokens", "200", "--log-level", "warning")
# The vLLM server is slow enough (about 0.5 s a request, 6 at a time: ~10 s for the job) that
# several of its gauge readings, one a second, catch requests waiting.
STRICT_SPEED, VLLM_SPEED = "20", "5"


def test_a_strict_server_refusing_an_added_field_is_sent_the_request_without_it() -> None:
    async def run(url: str) -> None:
        client = ServerClient(url, request_timeout_s=30)
        try:
            found = await client.detect()
            assert (found.kind.name, found.model, found.info) == ("openai", "sim/strict", None)
            # As if the server had been taken for SGLang: its fields are refused once, learned,
            # and the same prompt goes through without them.
            server = Server(KINDS["sglang"], found.models)
            stored = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
            body = server.prepare(stored, thinking=True)
            try:
                await client.chat(body)
            except Exception as exc:  # noqa: BLE001 - the refusal is what is tested
                learned = server.learn(getattr(exc, "status", None), str(exc), body, stored)
            assert learned == "refuses separate_reasoning: no longer sent"
            answer = await client.chat(server.prepare(stored, thinking=True))
            assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        finally:
            await client.aclose()

    with running_sim("--flavor", "strict", "--model-path", "sim/strict", "--instant") as url:
        asyncio.run(run(url))


@pytest.mark.e2e
def test_a_strict_server_and_a_vllm_server_answer_every_prompt_with_no_setting(
    stack: Stack, tmp_path: Path,
) -> None:
    _, strict = stack.sim("strict", "--flavor", "strict", "--speed", STRICT_SPEED, *SIM)
    _, vllm = stack.sim("vllm", "--flavor", "vllm", "--abort-rate", "0.2", "--speed", VLLM_SPEED,
                        *SIM)
    # No FLEETGEN_MAX_IN_FLIGHT, no kind: the tests' fast-failure settings only.
    stack.worker(0, strict)
    stack.worker(1, vllm)
    for gpu, job in ((0, "strict"), (1, "vllm")):
        rows = write_jsonl(tmp_path / f"{job}.jsonl", chat_rows(PROMPTS, prefix=job))
        stack.producer("enqueue", str(rows), "--job", job, "--output", str(tmp_path / "out"),
                       "--queue", f"gpu{gpu}", "--batch-size", "10", "--no-canary")
    for job in ("strict", "vllm"):
        status = wait_job_done(stack, job, timeout=240)
        exported = tmp_path / f"{job}-export.jsonl"
        stack.producer("export", job, "--to", str(exported))
        lines = [orjson.loads(x) for x in exported.read_bytes().splitlines()]
        ids = [x.get("custom_id") or x["id"] for x in lines]
        assert sorted(ids) == sorted(iter_ids(chat_rows(PROMPTS, prefix=job)))
        answers = [x for x in lines if "error" not in x]
        failures = [x for x in lines if "error" in x]
        assert all(x["finish_reason"] in ("stop", "length") for x in answers), \
            "an aborted generation was exported as an answer"
        # A prompt aborted on every try (a fifth of tries abort) fails with the abort as its
        # reason; the strict server fails none.
        assert all(x["error"]["code"] == "aborted" and "aborted the generation"
                   in x["error"]["message"] for x in failures), failures
        assert (status.done, status.failed) == (len(answers), len(failures))
        assert job == "vllm" or not failures
    strict_log, vllm_log = ((tmp_path / f"gpu{n}.log").read_text() for n in (0, 1))
    assert "(openai, model 'sim/Qwen3.6-27B') does not state how many requests it runs at " \
           "once; finding it by timing a one-token probe a second" in strict_log
    assert "(vllm 0.11.0, model 'sim/Qwen3.6-27B') does not state" in vllm_log
    assert "finding it from its queue gauges" in vllm_log and "running while" in vllm_log
    assert "server aborted the generation (finish_reason 'abort')" in vllm_log
    table = stack.producer("status", "vllm").stdout
    assert "gpu1@test: vllm 0.11.0" in table and "/metrics:" in table, table
