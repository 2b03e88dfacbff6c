"""fleetgen against a real engine: `transformers serve --continuous-batching` on the CPU, serving
a tiny random-weight Qwen3 made on the spot (tests/engine_model.py), and a real worker.

Everywhere else the simulator (launcher/sim/) stands in for SGLang; here the answers come from a
real model's forward passes, through a server fleetgen did not write. The worker gets only
FLEETGEN_SERVER_URL, as a user would start it: what it makes of this server on its own (its kind, the
model it is pinned to, the fields it refuses) is part of what is tested.

The engine comes with the `engine` extra (torch, transformers[serving]), part of `test`. Without
it the test is skipped, except under CI=true, where it fails.
"""

from __future__ import annotations

import collections
import importlib.util
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen.poll import wait_until
from fleetgen.ports import free_port
from launcher.services import S3Server
from tests.conftest import unavailable
from tests.engine_model import serve_argv, serve_env
from tests.stack import (
    PYTHON,
    ROOT,
    Proc,
    Stack,
    healthy,
    iter_ids,
    wait_job_done,
    write_jsonl,
)

pytestmark = pytest.mark.e2e

ENGINE_MODULES = ("torch", "transformers", "tokenizers")
# A thousand tokens learnt from two thousand lines: the tokenizer trains in a fraction of a
# second, and the embedding stays as small as the model's two layers of width 64.
VOCAB, CORPUS_LINES = 1_000, 2_000
PROMPTS = 40
# Starting the server imports torch and transformers: ~30 s on two idle cores, a few times
# that on a busy CI machine.
SERVER_START_S = 240
JOB = "real-engine"


@pytest.fixture(scope="session")
def engine_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random-weight model and its tokenizer, made once per session by a child process (the
    test process never imports torch)."""
    missing = [name for name in ENGINE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        unavailable(f"the real engine needs {', '.join(missing)}: install the `engine` extra "
                    "(pip install -c constraints.txt -e '.[test]')")
    model = tmp_path_factory.mktemp("engine") / "model"
    made = subprocess.run(
        [PYTHON, "-m", "tests.engine_model", str(model), "--size", "micro",
         "--vocab", str(VOCAB), "--corpus-lines", str(CORPUS_LINES)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert made.returncode == 0, f"making the model failed:\n{made.stdout}{made.stderr[-4000:]}"
    return model


@pytest.fixture
def engine_url(stack: Stack, engine_model: Path) -> str:
    """`transformers serve` on the CPU with continuous batching, on a free loopback port,
    answering /health; one of the stack's processes, so a failing test prints its log."""
    port = free_port()
    argv = serve_argv(PYTHON, str(engine_model), device="cpu", dtype="float32",
                      host="127.0.0.1", port=str(port))
    env = stack.env(serve_env(stack.tmp / "hf-cache"))
    server = Proc("transformers-serve", argv, env, stack.tmp / "transformers-serve.log").start()
    stack.procs.append(server)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: healthy(url) or not server.alive(), SERVER_START_S, interval=0.5,
               what="transformers serve answering /health")
    assert server.alive(), server.log()
    return url


def prompt_rows(n: int) -> list[dict[str, Any]]:
    """`n` prompts in the three accepted shapes, each with its own small max_tokens (8..24):
    random weights seldom say EOS, so nearly every answer runs to it."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        pid, max_tokens = f"r{i:03d}", 8 + i % 17
        if i % 3 == 0:
            rows.append({"id": pid, "prompt": f"Explain topic number {i} in two sentences.",
                         "sampling": {"max_tokens": max_tokens}})
        elif i % 3 == 1:
            rows.append({"id": pid, "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": f"What is {i} squared?"}],
                "sampling": {"max_tokens": max_tokens, "temperature": 1.0}})
        else:
            rows.append({"custom_id": pid, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": f"Write a haiku {i}."}],
                                  "max_tokens": max_tokens}})
    return rows


def max_tokens_of(row: dict[str, Any]) -> int:
    return int(row["body"]["max_tokens"] if "body" in row else row["sampling"]["max_tokens"])


@pytest.mark.timeout(600)
def test_forty_prompts_through_a_real_engine_are_exported_exactly_once_as_answers(
    stack: Stack, engine_url: str, s3_server: S3Server, tmp_path: Path
) -> None:
    rows = prompt_rows(PROMPTS)
    src = write_jsonl(tmp_path / "prompts.jsonl", rows)
    stack.worker(0, engine_url)
    stack.producer("enqueue", str(src), "--job", JOB, "--output",
                   f"s3://{s3_server.bucket}/{JOB}", "--batch-size", "10", "--no-canary")
    status = wait_job_done(stack, JOB, timeout=300)
    export = tmp_path / "export.jsonl"
    stack.producer("export", JOB, "--to", str(export))

    lines = [orjson.loads(line) for line in export.read_bytes().splitlines() if line]
    failures = [line for line in lines if "custom_id" in line]
    assert failures == [], f"{len(failures)} failed, the first: {failures[0]}\n{stack.logs()}"
    counts = collections.Counter(line["id"] for line in lines)
    assert sorted(counts) == sorted(iter_ids(rows))
    assert max(counts.values()) == 1
    assert status.done == PROMPTS and status.failed == 0
    # Each answer is the engine's, cut at its own line's max_tokens (or, seldom, at EOS).
    limits = {pid: max_tokens_of(row) for pid, row in zip(iter_ids(rows), rows, strict=True)}
    for line in lines:
        assert line["usage"]["completion_tokens"] <= limits[line["id"]], line
        assert line["usage"]["prompt_tokens"] > 0, line
        assert line["finish_reason"] in ("length", "stop"), line
    assert {line["worker"] for line in lines} == {"gpu0@test"}
