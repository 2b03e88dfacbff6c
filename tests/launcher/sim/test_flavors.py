"""The simulator's other flavours: vLLM's OpenAI server, a strict OpenAI-schema server, aborts.

As in docs/development/simulator.md#other-engines (vLLM 0.11.0; transformers serve 5.x)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher.sim.cli import main
from tests.sim_helpers import TLS, WAIT_S, chat_body, gauge, running_sim

MODEL = "sim/Qwen3.6-27B"  # the simulator's default --model-path, so its served name
NOT_FOUND = (404, {"detail": "Not Found"})


@pytest.fixture(scope="module")
def vllm_url() -> Iterator[str]:
    with running_sim("--instant", "--flavor", "vllm", "--mean-output-tokens", "300",
                     "--fail-prompt", "TOO-LONG") as base_url:
        yield base_url


@pytest.fixture(scope="module")
def strict_url() -> Iterator[str]:
    with running_sim("--instant", "--flavor", "strict", "--mean-output-tokens", "300") as url:
        yield url


def post(url: str, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=chat_body(**body), verify=TLS)


def answer(url: str, **body: Any) -> dict[str, Any]:
    response = post(url, **body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def status_and_json(url: str, path: str) -> tuple[int, Any]:
    response = httpx.get(url + path, verify=TLS)
    return response.status_code, response.json()


def families(url: str) -> dict[str, Any]:
    text = httpx.get(url + "/metrics", verify=TLS).text
    return {f.name: f for f in text_string_to_metric_families(text)}


# --- vLLM -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/server_info", "/get_server_info", "/model_info",
                                  "/get_model_info", "/generate", "/v1/models/" + MODEL])
def test_vllm_has_none_of_sglangs_own_endpoints(vllm_url: str, path: str) -> None:
    assert status_and_json(vllm_url, path) == NOT_FOUND


def test_vllm_version_and_health_answer_as_vllm_does(vllm_url: str) -> None:
    assert status_and_json(vllm_url, "/version") == (200, {"version": "0.11.0"})
    health = httpx.get(vllm_url + "/health", verify=TLS)
    assert (health.status_code, health.content) == (200, b"")
    assert httpx.post(vllm_url + "/ping", verify=TLS).status_code == 200


def test_vllm_lists_its_model_owned_by_vllm_with_root_and_max_model_len(vllm_url: str) -> None:
    status, models = status_and_json(vllm_url, "/v1/models")
    assert status == 200 and models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == card["root"] == MODEL and card["owned_by"] == "vllm"
    assert card["max_model_len"] == 40960 and card["parent"] is None
    assert card["permission"][0]["object"] == "model_permission"


def test_vllm_metrics_parse_with_vllms_names_and_labels_and_no_sglang_name(
        vllm_url: str) -> None:
    answer(vllm_url, model=MODEL, max_tokens=3)
    found = families(vllm_url)
    assert not [name for name in found if name.startswith("sglang:")]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:request_success", "vllm:time_to_first_token_seconds",
                 "vllm:e2e_request_latency_seconds"):
        samples = found[name].samples
        assert samples and all(s.labels["model_name"] == MODEL for s in samples), name
        assert all(s.labels["engine"] == "0" for s in samples), name
    successes = {s.labels["finished_reason"]: s.value for s in found["vllm:request_success"]
                 .samples if s.name == "vllm:request_success_total"}
    assert set(successes) == {"stop", "length", "abort"} and successes["length"] >= 1
    assert "vllm:gpu_cache_usage_perc" not in found  # hidden since 0.10, renamed in 0.9.2


def test_vllm_answers_an_unknown_model_with_its_404_error_body(vllm_url: str) -> None:
    response = post(vllm_url, model="gpt-4o")
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "The model `gpt-4o` does not exist.",
                                         "type": "NotFoundError", "param": None, "code": 404}}


@pytest.mark.parametrize("model", [{}, {"model": None}])
def test_vllm_answers_a_request_without_model_with_its_own_name(
        vllm_url: str, model: dict[str, Any]) -> None:
    response = httpx.post(vllm_url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "Hi"}], **model},
                          verify=TLS)
    body = response.json()
    assert body["model"] == MODEL and body["id"].startswith("chatcmpl-")


def test_vllm_gives_its_400_body_when_the_completion_does_not_fit_the_context(
        vllm_url: str) -> None:
    response = post(vllm_url, model=MODEL, max_tokens=40960)
    assert response.status_code == 400
    assert response.json() == {"error": {
        "message": "'max_tokens' or 'max_completion_tokens' is too large: 40960. This model's "
                   "maximum context length is 40960 tokens and your request has 9 input tokens "
                   "(40960 > 40960 - 9). None",
        "type": "BadRequestError", "param": None, "code": 400}}


def test_vllm_gives_its_400_body_when_the_prompt_is_too_long(vllm_url: str) -> None:
    response = post(vllm_url, model=MODEL, text="TOO-LONG please")
    assert response.status_code == 400
    error = response.json()["error"]
    assert re.fullmatch(r"This model's maximum context length is 40960 tokens\. However, your "
                        r"request has \d+ input tokens\. Please reduce the length of the input "
                        r"messages\. None", error["message"])
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", None, 400)


def test_vllm_separates_reasoning_without_asking_and_accepts_unknown_fields(
        vllm_url: str) -> None:
    body = answer(vllm_url, model=MODEL, max_tokens=4000, separate_reasoning=False,
                  no_such_field={"x": 1})
    choice = body["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] and "</think>" not in (message["content"] or "")
    assert list(message) == ["role", "content", "refusal", "annotations", "audio",
                             "function_call", "tool_calls", "reasoning_content"]
    assert choice["stop_reason"] is None and "matched_stop" not in choice
    assert list(body["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens",
                                   "prompt_tokens_details"]


def test_vllm_honours_enable_thinking_false(vllm_url: str) -> None:
    body = answer(vllm_url, model=MODEL, max_tokens=4000,
                  chat_template_kwargs={"enable_thinking": False})
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"]


def test_vllm_cut_while_thinking_leaves_everything_in_content(vllm_url: str) -> None:
    # vLLM 0.11.0's Qwen3 parser splits only when both think tags are present
    message = answer(vllm_url, model=MODEL, max_tokens=3)["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"]


def test_vllm_streams_reasoning_and_content_through_the_openai_client(vllm_url: str) -> None:
    import openai  # a heavy import, for the two tests that use it

    with openai.OpenAI(base_url=vllm_url + "/v1", api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=4000,
            stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = answer(vllm_url, model=MODEL, max_tokens=4000)["choices"][0]["message"]
    assert (reasoning, content) == (full["reasoning_content"], full["content"])
    assert chunks[-1].usage is not None and chunks[-2].choices[0].finish_reason == "stop"


def test_vllm_can_name_the_reasoning_field_reasoning_as_newer_releases_do() -> None:
    with running_sim("--instant", "--flavor", "vllm", "--vllm-reasoning-field",
                     "reasoning") as url:
        message = answer(url, model=MODEL, max_tokens=4000)["choices"][0]["message"]
    assert message["reasoning"] and "reasoning_content" not in message


async def _watch_queue(url: str, requests: int, cap: int) -> tuple[float, float]:
    """Send `requests` long chats at once; every scrape must show running <= cap. Returns
    (running, waiting) once the queue is visible, then hangs up on all of them."""
    body = chat_body(model=MODEL, max_tokens=1000, ignore_eos=True)
    async with httpx.AsyncClient(timeout=WAIT_S) as client:
        tasks = [asyncio.create_task(client.post(url + "/v1/chat/completions", json=body))
                 for _ in range(requests)]
        try:
            async with asyncio.timeout(WAIT_S):
                while True:
                    text = (await client.get(url + "/metrics")).text
                    gauges = {f.name: f.samples[0].value
                              for f in text_string_to_metric_families(text)}
                    running = gauges["vllm:num_requests_running"]
                    waiting = gauges["vllm:num_requests_waiting"]
                    assert running <= cap
                    if running + waiting == requests:
                        return running, waiting
                    await asyncio.sleep(0.02)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def test_vllm_runs_at_most_max_num_seqs_and_queues_the_rest() -> None:
    with running_sim("--flavor", "vllm", "--max-num-seqs", "3", "--decode-tps", "20") as url:
        assert asyncio.run(_watch_queue(url, requests=5, cap=3)) == (3, 2)


def test_max_num_seqs_is_an_unknown_flag_outside_the_vllm_flavour(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--max-num-seqs", "4"]) == 2
    assert "--max-num-seqs" in capsys.readouterr().err


# --- strict (transformers serve) ------------------------------------------------------------

@pytest.mark.parametrize("path", ["/server_info", "/get_server_info", "/metrics",
                                  "/model_info", "/version"])
def test_strict_has_no_server_info_and_no_metrics(strict_url: str, path: str) -> None:
    assert status_and_json(strict_url, path) == NOT_FOUND


def test_strict_health_is_200_when_ready(strict_url: str) -> None:
    assert status_and_json(strict_url, "/health") == (200, {"status": "ok"})


def test_strict_refuses_separate_reasoning_with_a_422_naming_it(strict_url: str) -> None:
    response = post(strict_url, model=MODEL, separate_reasoning=True)
    assert response.status_code == 422
    assert response.content == b'{"detail":"Unexpected fields in the request: ' \
                               b"{'separate_reasoning'}\"}"


def test_strict_accepts_openai_fields_and_its_own_extras(strict_url: str) -> None:
    body = answer(strict_url, model=MODEL, max_completion_tokens=4000, temperature=0.6, seed=1,
                  stream_options={"include_usage": True}, generation_config="{}",
                  chat_template_kwargs={"enable_thinking": False})
    assert body["choices"][0]["finish_reason"] == "stop"


def test_strict_is_pinned_to_its_model(strict_url: str) -> None:
    response = post(strict_url, model="other/model")
    assert response.status_code == 400
    assert response.json() == {"detail": f"Server is pinned to '{MODEL}'; requested "
                                         "'other/model'."}
    assert status_and_json(strict_url, "/v1/models") == (200, {"object": "list", "data": [
        {"owned_by": "sim", "id": MODEL, "object": "model", "created": 0,
         "status": {"value": "loaded"}}]})


def test_strict_keeps_the_reasoning_in_content(strict_url: str) -> None:
    body = answer(strict_url, model=MODEL, max_tokens=4000)
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and "reasoning_content" not in message
    assert "</think>" in message["content"]
    assert body["model"] == MODEL + "@main"
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_strict_streams_through_the_openai_client_with_usage_in_the_last_chunk(
        strict_url: str) -> None:
    import openai  # a heavy import, for the two tests that use it

    with openai.OpenAI(base_url=strict_url + "/v1", api_key="unused", max_retries=0) as client:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=4000,
            stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == answer(strict_url, model=MODEL, max_tokens=4000)["choices"][0][
        "message"]["content"]
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage is not None


async def _streams_started(url: str, requests: int, cap: int) -> tuple[int, int]:
    """Open `requests` long streams at once and wait until `cap` have started (a queued
    stream gets no response yet); then close those. Returns how many had started when `cap`
    had, and how many started once the first ones were closed."""
    body = chat_body(model=MODEL, max_tokens=1000, stream=True)
    started: list[int] = []

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            started.append(i)
            async for _ in response.aiter_bytes():
                pass

    async def until(count: int) -> None:
        async with asyncio.timeout(WAIT_S):
            while len(started) < count:
                await asyncio.sleep(0.02)

    async with httpx.AsyncClient(timeout=WAIT_S) as client:
        tasks = [asyncio.create_task(stream(client, i)) for i in range(requests)]
        try:
            await until(cap)
            first = list(started)
            for i in first:
                tasks[i].cancel()
            await until(len(first) + 1)
            return len(first), len(set(started) - set(first))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def test_strict_serves_only_max_running_requests_at_once() -> None:
    # 1000 tokens at 20 tokens/s: the first two cannot end by themselves during the test
    with running_sim("--flavor", "strict", "--max-running-requests", "2",
                     "--decode-tps", "20") as url:
        assert asyncio.run(_streams_started(url, requests=3, cap=2)) == (2, 1)


# --- --abort-rate, every flavour ------------------------------------------------------------

@pytest.mark.parametrize("flavor", ["sglang", "vllm", "strict"])
@pytest.mark.parametrize("stream", [False, True])
def test_abort_rate_one_ends_every_chat_with_finish_abort(flavor: str, stream: bool) -> None:
    with running_sim("--instant", "--flavor", flavor, "--abort-rate", "1.0") as url:
        response = post(url, model=MODEL, max_tokens=4000, stream=stream,
                        stream_options={"include_usage": True} if stream else None)
        assert response.status_code == 200, response.text
        if stream:
            events = [line[6:] for line in response.text.splitlines()
                      if line.startswith("data: {")]
            chunks = [httpx.Response(200, content=e).json() for e in events]
            finishes = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]]
            assert finishes[-1] == "abort" and set(finishes[:-1]) <= {None}
            usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
        else:
            body = response.json()
            assert body["choices"][0]["finish_reason"] == "abort"
            usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_abort_rate_aborts_a_deterministic_share_and_counts_the_aborts() -> None:
    flags = ("--instant", "--abort-rate", "0.5", "--mean-output-tokens", "200")
    runs = []
    for _ in range(2):
        with running_sim(*flags) as url:
            runs.append([answer(url, text=f"q{i}", max_tokens=4000)["choices"][0]
                         ["finish_reason"] == "abort" for i in range(40)])
            aborted = gauge(url, "sglang:num_aborted_requests_total")
        assert aborted == sum(runs[-1])
    assert runs[0] == runs[1] and 10 <= sum(runs[0]) <= 30


def test_help_lists_the_new_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--flavor", "--abort-rate", "--max-num-seqs", "--vllm-reasoning-field",
                 "--vllm-version"):
        assert flag in out
