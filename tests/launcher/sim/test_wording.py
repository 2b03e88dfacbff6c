"""A job that does not fit the context, refused in each engine's words (launcher/sim/wording.py):
(a) a prompt too long, (b) a max_tokens too large, each with its engine's status, text and
JSON shape, byte for byte, on a 64-token context."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from launcher.sim.protocol import RequestError
from launcher.sim.wording import WORDINGS, Ask, fit
from tests.sim_helpers import TLS, chat_body, running_sim

CHAT = "/v1/chat/completions"
MODEL = "sim/Qwen3.6-27B"
# 100 words and a trailing space are 101 tokens, plus 7 of chat template: 108 on 64
LONG = "word " * 100
# "Hello there" is 9 prompt tokens: 9 + 60 > 64, and 100 is more than the context itself


def openai(message: str, param: str, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param,
                      "code": code}}


def tgi(message: str) -> dict[str, Any]:
    return {"error": f"Input validation error: {message}", "error_type": "validation"}


def anthropic(message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


def sglang(message: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": "BadRequestError", "param": None,
            "code": 400}


def vllm(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "param": None,
                      "code": 400}}


REFUSALS: list[tuple[str, str, dict[str, Any], int, dict[str, Any]]] = [
    ("sglang", LONG, {}, 400, sglang(
        "The input (108 tokens) is longer than the model's context length (64 tokens).")),
    ("sglang", "Hello there", {"max_tokens": 60}, 400, sglang(
        "Requested token count exceeds the model's maximum context length of 64 tokens. You "
        "requested a total of 69 tokens: 9 tokens from the input messages and 60 tokens for "
        "the completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit.")),
    ("sglang", "Hello there", {"max_tokens": 100}, 400, sglang(
        "max_completion_tokens is too large: 100.This model supports at most 64 completion "
        "tokens.")),
    ("vllm", LONG, {}, 400, vllm(
        "This model's maximum context length is 64 tokens. However, your request has 108 "
        "input tokens. Please reduce the length of the input messages. None")),
    ("vllm", "Hello there", {"max_tokens": 60}, 400, vllm(
        "'max_tokens' or 'max_completion_tokens' is too large: 60. This model's maximum "
        "context length is 64 tokens and your request has 9 input tokens (60 > 64 - 9). None")),
    ("tgi", LONG, {}, 422, tgi(
        "`inputs` tokens + `max_new_tokens` must be <= 64. Given: 108 `inputs` tokens and 0 "
        "`max_new_tokens`")),
    ("tgi", "Hello there", {"max_tokens": 60}, 422, tgi(
        "`inputs` tokens + `max_new_tokens` must be <= 64. Given: 9 `inputs` tokens and 60 "
        "`max_new_tokens`")),
    ("openai", LONG, {}, 400, openai(
        "This model's maximum context length is 64 tokens. However, your messages resulted "
        "in 108 tokens. Please reduce the length of the messages.", "messages",
        "context_length_exceeded")),
    ("openai", LONG, {"max_tokens": 10}, 400, openai(
        "This model's maximum context length is 64 tokens. However, you requested 118 tokens "
        "(108 in the messages, 10 in the completion). Please reduce the length of the "
        "messages or completion.", "messages", "context_length_exceeded")),
    ("openai", "Hello there", {"max_tokens": 60}, 400, openai(
        "This model's maximum context length is 64 tokens. However, you requested 69 tokens "
        "(9 in the messages, 60 in the completion). Please reduce the length of the messages "
        "or completion.", "messages", "context_length_exceeded")),
    ("openai", "Hello there", {"max_tokens": 100}, 400, openai(
        "max_tokens is too large: 100. This model supports at most 64 completion tokens, "
        "whereas you provided 100.", "max_tokens", None)),
    ("openai", "Hello there", {"max_completion_tokens": 100}, 400, openai(
        "max_completion_tokens is too large: 100. This model supports at most 64 completion "
        "tokens, whereas you provided 100.", "max_completion_tokens", None)),
    ("llamacpp", LONG, {"max_tokens": 10}, 400, {"error": {
        "code": 400, "message": "the request exceeds the available context size, try "
        "increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 108,
        "n_ctx": 64}}),
    ("anthropic", LONG, {"max_tokens": 10}, 400, anthropic(
        "prompt is too long: 108 tokens > 64 maximum")),
    ("anthropic", "Hello there", {"max_tokens": 60}, 400, anthropic(
        "input length and `max_tokens` exceed context limit: 9 + 60 > 64, decrease input "
        "length or `max_tokens` and try again")),
    ("anthropic", "Hello there", {"max_tokens": 100}, 400, anthropic(
        f"max_tokens: 100 > 64, which is the maximum allowed number of output tokens for "
        f"{MODEL}")),
]


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    """One server per wording on a 64-token context, the wording given by its flag (SGLang's
    by the flavour's default)."""
    with contextlib.ExitStack() as stack:
        yield {words: stack.enter_context(running_sim(
            "--instant", "--context-length", "64",
            *(("--wording", words) if words != "sglang" else ())))
            for words in WORDINGS}


@pytest.mark.parametrize(("words", "text", "extra", "status", "body"), REFUSALS,
                         ids=[f"{r[0]}-{'a' if r[1] == LONG else 'b'}-{i}"
                              for i, r in enumerate(REFUSALS)])
def test_each_wording_refuses_as_its_engine_does(
        urls: dict[str, str], words: str, text: str, extra: dict[str, Any], status: int,
        body: dict[str, Any]) -> None:
    response = httpx.post(urls[words] + CHAT, json=chat_body(text, **extra), verify=TLS)
    assert response.status_code == status
    assert response.content == orjson.dumps(body)
    assert response.headers["content-type"] == "application/json"


def test_llama_cpp_takes_a_max_tokens_too_large_and_stops_at_the_end_of_the_context(
        urls: dict[str, str]) -> None:
    response = httpx.post(urls["llamacpp"] + CHAT,
                          json=chat_body(max_tokens=100, ignore_eos=True), verify=TLS)
    assert response.status_code == 200
    answer = response.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 64 - 9


@pytest.mark.parametrize("words", WORDINGS)
def test_a_job_that_fits_is_served_in_every_wording(urls: dict[str, str], words: str) -> None:
    response = httpx.post(urls[words] + CHAT, json=chat_body(max_tokens=20), verify=TLS)
    assert response.status_code == 200


def test_the_wording_is_switched_while_the_server_runs_and_cleared_to_the_flavours() -> None:
    with running_sim("--instant", "--flavor", "vllm", "--context-length", "64") as url:
        own = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": LONG}]},
                         verify=TLS)
        state = httpx.post(url + "/sim/misbehave", json={"wording": "tgi"}, verify=TLS).json()
        switched = httpx.post(url + CHAT, json={"messages": [{"role": "user",
                                                              "content": LONG}]}, verify=TLS)
        cleared = httpx.post(url + "/sim/misbehave", json={"clear": True}, verify=TLS).json()
        again = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": LONG}]},
                           verify=TLS)
    assert (own.status_code, switched.status_code, again.status_code) == (400, 422, 400)
    assert own.json()["error"]["message"].startswith("This model's maximum context length")
    assert switched.json()["error_type"] == "validation"
    assert (state["wording"], cleared["wording"]) == ("tgi", None)
    assert again.content == own.content


def test_the_strict_flavour_keeps_sglangs_words_in_its_own_shape_unless_told() -> None:
    with running_sim("--instant", "--flavor", "strict", "--context-length", "64") as url:
        body = {"messages": [{"role": "user", "content": LONG}]}
        own = httpx.post(url + CHAT, json=body, verify=TLS)
        # transformers serve has no completion cap of its own
        large = httpx.post(url + CHAT, json={**body, "messages": [
            {"role": "user", "content": "Hello there"}], "max_tokens": 30}, verify=TLS)
        httpx.post(url + "/sim/misbehave", json={"wording": "openai"}, verify=TLS)
        told = httpx.post(url + CHAT, json=body, verify=TLS)
    assert own.status_code == 400 and own.json() == {"detail": (
        "The input (108 tokens) is longer than the model's context length (64 tokens).")}
    assert large.status_code == 200
    assert told.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("prompt", "completion", "message"), [
    (64, None, "`inputs` must have less than 63 tokens. Given: 64"),
    (63, 2, "`inputs` tokens + `max_new_tokens` must be <= 64. Given: 63 `inputs` tokens and 2 "
            "`max_new_tokens`"),
    (63, 1, None), (10, None, None)])
def test_tgi_refuses_a_prompt_that_fills_the_context_even_with_room_for_no_answer(
        prompt: int, completion: int | None, message: str | None) -> None:
    ask = Ask(prompt=prompt, completion=completion, param="max_tokens", context=64, model="m")
    if message is None:
        assert fit("tgi", ask, "sglang") == (prompt, completion)
        return
    with pytest.raises(RequestError) as refused:
        fit("tgi", ask, "sglang")
    assert refused.value.status == 422
    assert orjson.loads(refused.value.body) == tgi(message)


@pytest.mark.parametrize("words", WORDINGS)
def test_a_prompt_that_fills_the_context_exactly_is_refused_in_every_wording(
        words: str) -> None:
    ask = Ask(prompt=64, completion=None, param="max_tokens", context=64, model="m")
    with pytest.raises(RequestError) as refused:
        fit(words, ask, "sglang")
    assert refused.value.status in (400, 422)
