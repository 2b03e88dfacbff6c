"""The table of causes: what each reply a server (or a proxy before it) can give means, as the
engines word it."""

from __future__ import annotations

import email.utils

import orjson
import pytest

from fleetgen.causes import Reply, classify, job_caused, normalise, retry_after_s


def openai(message: str, type_: str | None = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}})


def sglang(message: str, status: int = 400) -> bytes:
    return orjson.dumps({"object": "error", "message": message, "type": "BadRequestError",
                         "param": None, "code": status})


def vllm(message: str, status: int = 400, type_: str = "BadRequestError") -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None,
                                   "code": status}})


def tgi(message: str, error_type: str = "validation") -> bytes:
    return orjson.dumps({"error": message, "error_type": error_type})


def anthropic(type_: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": type_, "message": message}})


NGINX_502 = (b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>"
             b"502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>")
VLLM_MAX_TOKENS = ("'max_tokens' or 'max_completion_tokens' is too large: 16384. This model's "
                   "maximum context length is 8192 tokens and your request has 13 input tokens "
                   "(16384 > 8192 - 13).")
VLLM_LONG_WITH_MAX_TOKENS = ("'max_tokens' or 'max_completion_tokens' is too large: 512. This "
                             "model's maximum context length is 8192 tokens and your request has "
                             "7900 input tokens (512 > 8192 - 7900).")

# (what came back, its cause, its code)
TABLE: list[tuple[str, Reply, str, str]] = [
    # Full, whatever the words: no attempt, no failure.
    ("429 with Retry-After", Reply(429, tgi("Model is overloaded", "overloaded"), 5.0),
     "overloaded", "overloaded"),
    ("429 without Retry-After", Reply(429, b"Too Many Requests"), "overloaded", "overloaded"),
    ("429 of a rate limit (OpenAI)", Reply(429, openai(
        "Rate limit reached for requests per min (RPM): Limit 60, Used 60, Requested 1.",
        "requests", None, "rate_limit_exceeded"), 1.0), "overloaded", "overloaded"),
    ("429 of a spent quota", Reply(429, openai("You exceeded your current quota", "insufficient_quota",
                                               None, "insufficient_quota")),
     "job", "quota_exceeded"),
    ("529 overloaded (Anthropic)", Reply(529, anthropic("overloaded_error", "Overloaded")),
     "overloaded", "overloaded"),
    ("overloaded_error at another status", Reply(500, anthropic("overloaded_error", "Overloaded")),
     "overloaded", "overloaded"),
    ("503 queue full, health up", Reply(503, sglang("The request queue is full.", 503),
                                        health_up=True), "overloaded", "overloaded"),
    ("503 health unknown", Reply(503, b"Service Unavailable"), "overloaded", "overloaded"),
    ("503 health down (starting, draining)", Reply(503, b"", health_up=False), "down",
     "server_down"),
    ("503 no healthy upstream (Envoy)", Reply(503, b"no healthy upstream", health_up=True),
     "server", "server_error"),
    # The server's failure: the prompt's attempts decide.
    ("500", Reply(500, vllm("CUDA out of memory. Tried to allocate the KV cache", 500,
                            "InternalServerError")), "server", "server_error"),
    ("502 (nginx)", Reply(502, NGINX_502), "server", "server_error"),
    ("504", Reply(504, b"Gateway Time-out"), "server", "server_error"),
    ("408", Reply(408, b"Request Timeout"), "server", "timeout"),
    ("reset, health unknown", Reply(failure="reset", detail="connection lost"), "down",
     "server_down"),
    ("reset, health up", Reply(failure="reset", detail="connection lost", health_up=True),
     "server", "generation_failed"),
    ("refused connection", Reply(failure="connect", detail="unreachable"), "down", "server_down"),
    ("timeout", Reply(failure="timeout", detail="timed out (ReadTimeout)"), "server", "timeout"),
    ("a probe unanswered in its time", Reply(failure="timeout", detail="probe unanswered in 10s"),
     "server", "timeout"),
    ("hang: nothing back, a probe unanswered", Reply(failure="hung", detail="hung: 116 requests"),
     "down", "server_hung"),
    ("abort", Reply(failure="aborted", detail="server aborted the generation"), "server",
     "aborted"),
    ("fewer choices than asked", Reply(failure="incomplete", detail="2 choices of 4"), "server",
     "generation_failed"),
    # The prompt's own: it fails alone.
    ("SGLang prompt too long", Reply(400, sglang(
        "The input (41230 tokens) is longer than the model's context length (40960 tokens).")),
     "prompt", "context_length_exceeded"),
    ("vLLM prompt too long", Reply(400, vllm(
        "This model's maximum context length is 8192 tokens. However, your request has 9000 "
        "input tokens. Please reduce the length of the input messages.")),
     "prompt", "context_length_exceeded"),
    ("vLLM long prompt + a fair max_tokens", Reply(400, vllm(VLLM_LONG_WITH_MAX_TOKENS)),
     "prompt", "context_length_exceeded"),
    ("TGI prompt too long (422)", Reply(422, tgi(
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 40960. Given: "
        "40000 `inputs` tokens and 2000 `max_new_tokens`")), "prompt", "context_length_exceeded"),
    ("TGI wording without the numbers", Reply(422, tgi(
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 40960")),
     "prompt", "context_length_exceeded"),
    ("TGI inputs alone too long", Reply(422, tgi(
        "Input validation error: `inputs` must have less than 40960 tokens. Given: 41000")),
     "prompt", "context_length_exceeded"),
    ("OpenAI context_length_exceeded", Reply(400, openai(
        "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens "
        "(8000 in the messages, 1000 in the completion).", param="messages",
        code="context_length_exceeded")), "prompt", "context_length_exceeded"),
    ("llama.cpp exceed_context_size_error", Reply(400, orjson.dumps({"error": {
        "code": 400, "message": "the request exceeds the available context size, try increasing "
        "it", "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 8192}})),
     "prompt", "context_length_exceeded"),
    ("Anthropic prompt too long", Reply(400, anthropic(
        "invalid_request_error", "prompt is too long: 210000 tokens > 200000 maximum")),
     "prompt", "context_length_exceeded"),
    ("413", Reply(413, b"Request Entity Too Large"), "prompt", "payload_too_large"),
    ("content policy", Reply(400, openai("Your request was rejected by our content policy.",
                                         code="content_policy_violation")),
     "prompt", "content_filtered"),
    # The job's: every prompt would meet it; the failure breaker judges them.
    ("vLLM max_tokens above the context", Reply(400, vllm(VLLM_MAX_TOKENS)), "job",
     "max_tokens_too_large"),
    ("vLLM max_tokens with a request id", Reply(400, vllm(
        VLLM_MAX_TOKENS + " (request id req_91b72265b1f5b)")), "job", "max_tokens_too_large"),
    ("SGLang max_tokens above the context", Reply(400, sglang(
        "Requested token count exceeds the model's maximum context length of 8192 tokens. You "
        "requested a total of 16397 tokens: 13 tokens from the input messages and 16384 tokens "
        "for the completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit.")), "job", "max_tokens_too_large"),
    ("SGLang max_completion_tokens", Reply(400, sglang(
        "max_completion_tokens is too large: 50000.This model supports at most 40960 completion "
        "tokens.")), "job", "max_tokens_too_large"),
    ("TGI max_new_tokens above the context", Reply(422, tgi(
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 8192. Given: 13 "
        "`inputs` tokens and 16384 `max_new_tokens`")), "job", "max_tokens_too_large"),
    ("OpenAI max_tokens", Reply(400, openai(
        "max_tokens is too large: 16384. This model supports at most 4096 completion tokens, "
        "whereas you provided 16384.", param="max_tokens")), "job", "max_tokens_too_large"),
    ("OpenAI context with a large completion", Reply(400, openai(
        "This model's maximum context length is 8192 tokens. However, you requested 16397 tokens "
        "(13 in the messages, 16384 in the completion).", param="messages",
        code="context_length_exceeded")), "job", "max_tokens_too_large"),
    ("Anthropic max_tokens", Reply(400, anthropic(
        "invalid_request_error", "max_tokens: 16384 > 8192, which is the maximum allowed number "
        "of output tokens for claude")), "job", "max_tokens_too_large"),
    ("400 parameter refused", Reply(400, vllm("tool_choice is not supported")), "job",
     "invalid_request"),
    ("422 field (FastAPI)", Reply(422, orjson.dumps({"detail": [{
        "type": "extra_forbidden", "loc": ["body", "top_k"], "msg": "Extra inputs are not "
        "permitted"}]})), "job", "invalid_request"),
    ("404 model", Reply(404, vllm("The model `nosuch` does not exist.", 404, "NotFoundError")),
     "job", "model_not_found"),
    ("400 model not found", Reply(400, openai("The model 'gpt-x' does not exist",
                                              code="model_not_found")), "job", "model_not_found"),
    ("401", Reply(401, openai("Incorrect API key provided")), "job", "unauthorized"),
    ("403", Reply(403, b"Forbidden"), "job", "unauthorized"),
    ("501", Reply(501, b"Not Implemented"), "job", "not_implemented"),
]


@pytest.mark.parametrize(("reply", "cause", "code"), [row[1:] for row in TABLE],
                         ids=[row[0] for row in TABLE])
def test_each_reply_has_one_cause(reply: Reply, cause: str, code: str) -> None:
    verdict = classify(reply)
    assert (verdict.cause, verdict.code) == (cause, code)
    assert job_caused(verdict.code) == (cause == "job")


def test_a_full_servers_wait_is_its_retry_after_in_seconds_or_as_an_http_date() -> None:
    assert retry_after_s("5") == 5.0
    assert retry_after_s(" 0.5 ") == 0.5
    assert retry_after_s(None) is None and retry_after_s("soon") is None
    date = email.utils.formatdate(1_000_030.0, usegmt=True)
    assert retry_after_s(date, now=1_000_000.0) == 30.0
    assert retry_after_s(date, now=1_000_100.0) == 0.0  # in the past: at once
    verdict = classify(Reply(429, b"", retry_after_s(date, now=1_000_000.0)))
    assert (verdict.cause, verdict.retry_after_s) == ("overloaded", 30.0)


def test_what_varies_between_requests_of_one_cause_is_normalised_away() -> None:
    one = classify(Reply(400, vllm(VLLM_MAX_TOKENS + " (request id req_91b72265b1f5b)")))
    two = classify(Reply(400, vllm(VLLM_MAX_TOKENS.replace("13", "27")
                                   + " (request id req_0a4c1f33e9d2e)")))
    assert one.key == two.key
    assert normalise("model 'gpt-x' id chatcmpl-8f2a9c1b3d4e5f60 uuid "
                     "123e4567-e89b-12d3-a456-426614174000 n=42") == "model Q id ID uuid ID n=N"


def test_an_error_body_that_is_a_proxys_page_is_named_by_its_title() -> None:
    verdict = classify(Reply(502, NGINX_502))
    assert verdict.message == "HTTP 502: 502 Bad Gateway"
