"""The simulator's HTTP API has SGLang's shapes, seen through real clients.

As in docs/reference/sglang.md#endpoints."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import pytest

from tests.sim_helpers import TLS, chat_body, gauge, metric_sum, running_sim, wait_until

if TYPE_CHECKING:
    # Imported where a test uses it: openai is a heavy import, and every test process imports
    # this module to collect it.
    import openai

TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_sim("--instant", "--mean-output-tokens", "300") as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[openai.OpenAI]:
    import openai

    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def chat(url: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(url + "/v1/chat/completions", json=chat_body(**body), verify=TLS)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_chat_completion_reads_through_the_openai_client(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="anything", messages=[{"role": "user", "content": "Hello there"}], max_tokens=4000)
    choice = result.choices[0]
    assert result.model == "anything" and len(result.id) == 32
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    # reasoning_content is not in OpenAI's schema: the client keeps it as an extra field
    assert (choice.message.model_extra or {})["reasoning_content"] and choice.message.content
    assert result.usage is not None and result.usage.prompt_tokens == 2 + 4 + 3
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    details = result.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens is not None
    assert 0 < details.reasoning_tokens < result.usage.completion_tokens


def test_chat_body_has_sglang_keys_and_order(url: str) -> None:
    body = chat(url, max_tokens=4000)
    assert list(body) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
    assert list(body["choices"][0]) == ["index", "message", "logprobs", "finish_reason",
                                        "matched_stop"]
    assert body["choices"][0]["matched_stop"] == 151645
    assert list(body["usage"]) == ["prompt_tokens", "completion_tokens", "total_tokens",
                                   "prompt_tokens_details", "reasoning_tokens",
                                   "completion_tokens_details"]
    assert body["usage"]["reasoning_tokens"] == \
        body["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert body["metadata"] == {"weight_version": "default"}


def test_max_tokens_inside_thinking_gives_length_and_empty_content(url: str) -> None:
    body = chat(url, max_tokens=3)
    choice, usage = body["choices"][0], body["usage"]
    assert choice["finish_reason"] == "length" and choice["matched_stop"] is None
    assert choice["message"]["content"] == "" and choice["message"]["reasoning_content"]
    assert usage["completion_tokens"] == usage["reasoning_tokens"] == 3


def test_max_completion_tokens_wins_over_max_tokens(url: str) -> None:
    body = chat(url, max_tokens=3, max_completion_tokens=5)
    assert body["usage"]["completion_tokens"] == 5


def test_thinking_off_gives_no_reasoning_and_a_longer_prompt(url: str) -> None:
    on = chat(url, max_tokens=4000)
    off = chat(url, max_tokens=4000, chat_template_kwargs={"enable_thinking": False})
    assert off["choices"][0]["message"]["reasoning_content"] is None
    assert off["usage"]["reasoning_tokens"] == 0
    assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] + 4


def test_separate_reasoning_false_keeps_the_think_tag_in_content(url: str) -> None:
    body = chat(url, max_tokens=4000, separate_reasoning=False)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] is None and "</think>" in message["content"]
    assert body["usage"]["reasoning_tokens"] > 0


def test_unknown_fields_are_ignored(url: str) -> None:
    body = chat(url, max_tokens=2, frobnicate={"x": 1}, top_k=20)
    assert body["usage"]["completion_tokens"] == 2


def test_stop_string_truncates_content_and_sets_matched_stop(url: str) -> None:
    off = {"enable_thinking": False}
    full = chat(url, max_tokens=4000, chat_template_kwargs=off)["choices"][0]["message"]
    stop = full["content"].split()[4]
    choice = chat(url, max_tokens=4000, chat_template_kwargs=off, stop=[stop])["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == stop
    assert choice["message"]["content"] == full["content"][:full["content"].index(stop)]


def test_stream_carries_the_same_text_as_the_non_streaming_answer(
        url: str, client: openai.OpenAI) -> None:
    whole = chat(url, max_tokens=4000)["choices"][0]["message"]
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hello there"}], max_tokens=4000,
        stream=True, stream_options={"include_usage": True})
    reasoning, content, finish, usage = "", "", None, None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert finish == "stop" and usage is not None and usage.completion_tokens > 0


def test_stream_starts_with_the_role_chunk_and_ends_with_done(url: str) -> None:
    raw = httpx.post(url + "/v1/chat/completions",
                     json=chat_body(max_tokens=6, stream=True), verify=TLS).content
    events = raw.split(b"\n\n")
    first = orjson.loads(events[0].removeprefix(b"data: "))
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "",
                                            "reasoning_content": None}
    assert first["choices"][0]["finish_reason"] is None and first["choices"][0]["logprobs"] is None
    last = orjson.loads(events[-3].removeprefix(b"data: "))
    assert last["choices"][0]["finish_reason"] == "length"
    assert events[-2:] == [b"data: [DONE]", b""]


def test_required_tool_choice_returns_tool_calls(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS, tool_choice="required", max_tokens=4000)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert list(orjson.loads(call.function.arguments)) == ["city"]


def test_auto_tool_choice_calls_tools_for_a_deterministic_share(url: str) -> None:
    finishes = [chat(url, text=f"question {i}", tools=TOOLS, max_tokens=4000)
                ["choices"][0]["finish_reason"] for i in range(30)]
    assert 5 < finishes.count("tool_calls") < 25
    assert finishes == [chat(url, text=f"question {i}", tools=TOOLS, max_tokens=4000)
                        ["choices"][0]["finish_reason"] for i in range(30)]


def test_generate_defaults_to_128_new_tokens_and_reports_meta_info(url: str) -> None:
    body = httpx.post(url + "/generate", json={"text": "The capital city of France is",
                                               "sampling_params": {"ignore_eos": True}},
                      verify=TLS).json()
    meta = body["meta_info"]
    assert meta["completion_tokens"] == 128 == len(body["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 128}
    assert meta["prompt_tokens"] == 6
    for key in ("id", "cached_tokens", "reasoning_tokens", "weight_version", "num_retractions",
                "e2e_latency"):
        assert key in meta


def test_generate_accepts_batches_and_input_ids(url: str) -> None:
    batch = httpx.post(url + "/generate", json={"text": ["a", "b"],
                                                "sampling_params": {"max_new_tokens": 3}},
                       verify=TLS).json()
    assert [r["meta_info"]["completion_tokens"] for r in batch] == [3, 3]
    ids = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3, 4],
                                              "sampling_params": {"max_new_tokens": 2}},
                     verify=TLS).json()
    assert ids["meta_info"]["prompt_tokens"] == 4


def test_generate_stream_sends_cumulative_text(url: str) -> None:
    raw = httpx.post(url + "/generate", json={"text": "x", "stream": True,
                                              "sampling_params": {"max_new_tokens": 5}},
                     verify=TLS).content
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    final = orjson.loads(events[-2])
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert final["meta_info"]["completion_tokens"] == 5


def test_info_endpoints_have_sglang_shapes(url: str) -> None:
    models = httpx.get(url + "/v1/models", verify=TLS).json()
    card = models["data"][0]
    assert models["object"] == "list" and card["id"] == "sim/Qwen3.6-27B"
    assert card["owned_by"] == "sglang" and card["max_model_len"] == 40960
    model_info = httpx.get(url + "/model_info", verify=TLS).json()
    assert model_info["is_generation"] is True and model_info["reasoning_parser"] == "qwen3"
    info = httpx.get(url + "/server_info", verify=TLS).json()
    assert info == httpx.get(url + "/get_server_info", verify=TLS).json() | {
        "internal_states": info["internal_states"]}
    assert info["version"] == "0.5.23" and info["max_total_num_tokens"] > 0
    assert info["max_req_input_len"] < 40960
    state = info["internal_states"][0]
    assert state["effective_max_running_requests_per_dp"] == 4096
    assert set(state["memory_usage"]) >= {"weight", "kvcache", "token_capacity", "graph"}


def test_health_is_200_with_an_empty_body(url: str) -> None:
    for path in ("/health", "/health_generate"):
        response = httpx.get(url + path, verify=TLS)
        assert (response.status_code, response.content) == (200, b"")


def test_metrics_have_sglang_names_and_the_model_name_label(url: str) -> None:
    chat(url, max_tokens=3)
    text = httpx.get(url + "/metrics", verify=TLS).text
    for name in ("num_running_reqs", "num_queue_reqs", "gen_throughput", "token_usage",
                 "max_total_num_tokens", "prompt_tokens_total", "generation_tokens_total",
                 "num_requests_total", "num_aborted_requests_total",
                 "time_to_first_token_seconds_bucket", "e2e_request_latency_seconds_count"):
        assert f"sglang:{name}{{" in text, name
    assert 'model_name="sim/Qwen3.6-27B"' in text
    # Summed over the `stream` label: the first sample may be the streamed requests' (none yet
    # when this test runs alone).
    assert metric_sum(text, "sglang:generation_tokens_total") >= 3


def test_abort_request_ends_a_running_request_with_finish_abort() -> None:
    with running_sim("--decode-tps", "20") as url:
        result: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: result.update(
            chat(url, max_tokens=1000, rid="victim")))
        worker.start()
        wait_until(lambda: gauge(url, "sglang:num_running_reqs") == 1, what="a running request")
        assert httpx.post(url + "/abort_request", json={"rid": "victim"},
                          verify=TLS).status_code == 200
        worker.join(timeout=10)
        choice = result["choices"][0]
        assert result["id"] == "victim" and choice["finish_reason"] == "abort"
        assert result["usage"]["completion_tokens"] < 1000


def test_api_key_guards_all_but_health_and_metrics() -> None:
    with running_sim("--instant", "--api-key", "sekret") as url:
        denied = httpx.post(url + "/v1/chat/completions", json=chat_body(max_tokens=1), verify=TLS)
        assert (denied.status_code, denied.content) == (401, b'{"error":"Unauthorized"}')
        assert httpx.get(url + "/health", verify=TLS).status_code == 200
        assert httpx.get(url + "/metrics", verify=TLS).status_code == 200
        allowed = httpx.post(url + "/v1/chat/completions", json=chat_body(max_tokens=1),
                             headers={"Authorization": "Bearer sekret"}, verify=TLS)
        assert allowed.status_code == 200


def test_thinking_off_mode_ignores_enable_thinking_and_answers_boilerplate() -> None:
    with running_sim("--instant", "--mode", "thinking-off") as url:
        bodies = [chat(url, text=f"q{i}", max_tokens=4000,
                       chat_template_kwargs={"enable_thinking": True}) for i in range(40)]
    assert all(b["choices"][0]["message"]["reasoning_content"] is None for b in bodies)
    ok = sum(b["choices"][0]["message"]["content"] == "OK." for b in bodies)
    assert 28 <= ok <= 39


def test_a_client_leaving_a_stream_aborts_its_request() -> None:
    with running_sim("--decode-tps", "20") as url:
        with httpx.stream("POST", url + "/v1/chat/completions",
                          json=chat_body(max_tokens=1000, stream=True)) as response:
            next(response.iter_bytes())
        wait_until(lambda: gauge(url, "sglang:num_aborted_requests_total") == 1,
                   what="the abort")
        assert gauge(url, "sglang:num_running_reqs") == 0


def test_a_requests_seed_draws_its_own_answer_the_same_each_time(url: str) -> None:
    def content(**seed: int) -> str:
        body = chat(url, messages=[{"role": "user", "content": "Name a colour"}],
                    max_tokens=4000, **seed)
        return str(body["choices"][0]["message"]["content"])

    unseeded, first, second = content(), content(seed=1), content(seed=2)
    assert len({unseeded, first, second}) == 3
    assert content(seed=1) == first and content() == unseeded


def test_n_gives_n_choices_each_drawn_from_the_seed_plus_its_index_usage_summed(
        url: str) -> None:
    ask = {"messages": [{"role": "user", "content": "Name a colour"}], "max_tokens": 4000}
    body = chat(url, n=3, seed=5, **ask)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    singles = [chat(url, seed=5 + i, **ask) for i in range(3)]
    assert [c["message"] for c in choices] == [s["choices"][0]["message"] for s in singles]
    assert len({c["message"]["content"] for c in choices}) == 3
    usage = body["usage"]
    assert usage["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]  # counted once
    assert usage["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert usage["reasoning_tokens"] == sum(s["usage"]["reasoning_tokens"] for s in singles)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_request_with_n_runs_as_n_requests_in_the_scheduler() -> None:
    with running_sim("--decode-tps", "20") as url:
        done: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: done.append(httpx.post(
            url + "/v1/chat/completions", json=chat_body(max_tokens=60, n=3, ignore_eos=True),
            timeout=60, verify=TLS)))
        thread.start()
        wait_until(lambda: gauge(url, "sglang:num_running_reqs") == 3, what="3 running")
        thread.join()
        assert len(done[0].json()["choices"]) == 3
        assert httpx.get(url + "/sim/stats", verify=TLS).json()["requests"] == 1
