"""The simulator's error answers are byte-for-byte SGLang's (docs/reference/sglang.md#errors)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.sim_helpers import TLS, chat_body, gauge, running_sim, wait_until

CHAT = "/v1/chat/completions"


def error(message: str, type_: str, code: int) -> bytes:
    return orjson.dumps({"object": "error", "message": message, "type": type_, "param": None,
                         "code": code})


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_sim("--instant", "--context-length", "64", "--fail-prompt", "POISON") as base:
        yield base


def test_wrong_content_type_is_a_400_bad_request(url: str) -> None:
    response = httpx.post(url + CHAT, content=b"{}", headers={"content-type": "text/plain"},
                          verify=TLS)
    err = ("{'loc': ['header', 'content-type'], 'msg': \"Unsupported Media Type: Only "
           "'application/json' is allowed\", 'type': 'value_error'}")
    assert response.status_code == 400
    assert response.content == error(f"1 validation error:\n  {err} [{err}]", "Bad Request", 400)


def test_missing_messages_is_a_pydantic_style_400(url: str) -> None:
    response = httpx.post(url + CHAT, json={"model": "m"}, verify=TLS)
    err = ("{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required', "
           "'input': {'model': 'm', 'tool_choice': 'none'}}")
    assert response.status_code == 400
    assert response.content == error(f"1 validation error:\n  {err} [{err}]", "Bad Request", 400)


def test_invalid_json_is_a_400_with_the_decode_position(url: str) -> None:
    response = httpx.post(url + CHAT, content=b'{"model": ', headers={
        "content-type": "application/json"}, verify=TLS)
    err = ("{'type': 'json_invalid', 'loc': ('body', 10), 'msg': 'JSON decode error', "
           "'input': {}, 'ctx': {'error': 'Expecting value'}}")
    assert response.content == error(f"1 validation error:\n  {err} [{err}]", "Bad Request", 400)


def test_empty_messages_is_a_bad_request_error(url: str) -> None:
    response = httpx.post(url + CHAT, json={"model": "m", "messages": []}, verify=TLS)
    assert response.content == error("Messages cannot be empty.", "BadRequestError", 400)


def test_prompt_over_the_context_length_is_refused(url: str) -> None:
    # 100 words and a trailing space are 101 tokens, plus 4 + 3 of chat template
    response = httpx.post(url + CHAT, json=chat_body("word " * 100), verify=TLS)
    assert response.status_code == 400
    assert response.content == error(
        "The input (108 tokens) is longer than the model's context length (64 tokens).",
        "BadRequestError", 400)


def test_prompt_plus_max_tokens_over_the_context_is_refused(url: str) -> None:
    response = httpx.post(url + CHAT, json=chat_body("Hello there", max_tokens=60), verify=TLS)
    assert response.content == error(
        "Requested token count exceeds the model's maximum context length of 64 tokens. You "
        "requested a total of 69 tokens: 9 tokens from the input messages and 60 tokens for the "
        "completion. Please reduce the number of tokens in the input messages or the completion "
        "to fit within the limit.", "BadRequestError", 400)


def test_max_completion_tokens_over_an_explicit_context_length_is_refused(url: str) -> None:
    response = httpx.post(url + CHAT, json=chat_body(max_completion_tokens=100), verify=TLS)
    assert response.content == error("max_completion_tokens is too large: 100.This model "
                                      "supports at most 64 completion tokens.",
                                      "BadRequestError", 400)


def test_fail_prompt_marker_in_content_or_rid_prefix_gets_the_context_400(url: str) -> None:
    by_content = httpx.post(url + CHAT, json=chat_body("some POISON here", max_tokens=1),
                            verify=TLS)
    assert by_content.content == error(
        "The input (74 tokens) is longer than the model's context length (64 tokens).",
        "BadRequestError", 400)
    by_rid = httpx.post(url + CHAT, json=chat_body(max_tokens=1, rid="POISON-7"), verify=TLS)
    assert by_rid.status_code == 400


def test_generate_context_errors_use_the_native_error_shape(url: str) -> None:
    response = httpx.post(url + "/generate", json={"text": "word " * 100}, verify=TLS)
    assert response.status_code == 400
    assert response.content == orjson.dumps({"error": {"message": (
        "The input (101 tokens) is longer than the model's context length (64 tokens).")}})


def test_unknown_routes_and_models_get_framework_and_openai_404s(url: str) -> None:
    assert httpx.get(url + "/nope", verify=TLS).content == b'{"detail":"Not Found"}'
    assert httpx.get(url + CHAT, verify=TLS).status_code == 405
    missing = httpx.get(url + "/v1/models/other", verify=TLS)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_metrics_are_404_when_disabled() -> None:
    with running_sim("--instant", "--disable-metrics") as base:
        assert httpx.get(base + "/metrics", verify=TLS).status_code == 404


def test_fail_rate_answers_500s_that_a_retry_can_get_past() -> None:
    with running_sim("--instant", "--fail-rate", "0.5") as base:
        codes = [httpx.post(base + CHAT, json=chat_body(max_tokens=1), verify=TLS).status_code
                 for _ in range(40)]
        failed = httpx.post(base + CHAT, json=chat_body(max_tokens=1), verify=TLS)
        while failed.status_code != 500:
            failed = httpx.post(base + CHAT, json=chat_body(max_tokens=1), verify=TLS)
    assert set(codes) == {200, 500} and 8 < codes.count(500) < 32
    assert failed.content == error("Internal server error: simulated failure (--fail-rate)",
                                   "InternalServerError", 500)


def test_full_waiting_queue_answers_503() -> None:
    with running_sim("--max-running-requests", "1", "--max-queued-requests", "1",
                     "--decode-tps", "10") as base:
        threads = [threading.Thread(target=httpx.post, args=(base + CHAT,),
                                    kwargs={"json": chat_body(max_tokens=500), "timeout": 60})
                   for _ in range(2)]
        threads[0].start()
        wait_until(lambda: gauge(base, "sglang:num_running_reqs") == 1, what="one running")
        threads[1].start()
        wait_until(lambda: gauge(base, "sglang:num_queue_reqs") == 1, what="one queued")
        response = httpx.post(base + CHAT, json=chat_body(max_tokens=1), verify=TLS)
        httpx.post(base + "/abort_request", json={"abort_all": True}, verify=TLS)
        for thread in threads:
            thread.join(timeout=10)
    assert response.status_code == 503
    assert response.content == error("The request queue is full.", "503", 503)
