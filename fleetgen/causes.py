"""What a server's reply means: one pure function from what came back to one cause.

Every request a worker sends ends in one of these, and each has one response (the worker's
door, workers/backend.py `Backend.send`, executes it):

    cause        what it says                              the response
    overloaded   full or rate-limited: not run             wait (Retry-After or backoff), resend;
                                                           no attempt, no failure budget
    down         not there (refused, starting, draining,   wait for /health, or hand the request
                 hung)                                     back with its batch; no attempt
    server       the server failed this request            the prompt's attempts decide; counts
                                                           toward taking the server out only
                                                           with evidence about the server
    prompt       this prompt is refused (too long, its     the prompt fails alone; never judged
                 content, too large a body)                by the failure breaker
    job          every prompt would meet it (max_tokens    the prompt fails, and the failure
                 above the context, a model not served,    breaker judges the job's run of them
                 a parameter refused, a key refused)       (fleetgen/breaker.py): it pauses

`classify` reads structure first: the HTTP status, the error's `type`, `code` and `param`,
known fields (llama.cpp's `n_prompt_tokens`), `Retry-After`, whether `/health` passes. Wording
is a fallback, read with the numbers it carries: "too many tokens asked for" is the job's
when the completion the job asks for is the larger part (`max_tokens` ≥ the prompt's tokens:
every prompt would meet it) and the prompt's when the prompt is (a long prompt), whatever the
engine's words (SGLang, vLLM, TGI, OpenAI, llama.cpp, Anthropic-style). `normalise` strips ids,
numbers and quoted values, so a refusal every prompt meets reads as one cause however its
message varies from request to request.

    verdict = classify(Reply(status=400, body=raw, retry_after_s=None))
    verdict.cause, verdict.code      # ("job", "max_tokens_too_large")
"""

from __future__ import annotations

import email.utils
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

import orjson

Cause = Literal["overloaded", "down", "server", "prompt", "job"]
# What ended a request without an HTTP status: refused or unreachable (`connect`), a connection
# lost mid-request or a broken exchange (`reset`), no answer within the request timeout
# (`timeout`), a generation the server ended without finishing it (`aborted`), an answer that
# is not a whole one (`incomplete`: fewer choices than asked), a request abandoned at a server
# that returns nothing at all (`hung`: workers/healthcheck.py finds it by its progress).
Failure = Literal["connect", "reset", "timeout", "aborted", "incomplete", "hung"]

# The codes of a rollout's own ends (workers/rollouts.py): its code raised (`rollout_error`),
# a replay asked another call than the journal's (`rollout_changed`), its own time ran out.
ROLLOUT_ERROR = "rollout_error"
ROLLOUT_CHANGED = "rollout_changed"
ROLLOUT_TIMEOUT = "rollout_timeout"
# Codes of failures the failure breaker judges: a refusal the next prompt would meet too, and
# a rollout's exception or timeout (a bug or a missing tool meets every prompt alike).
JOB_CODES = frozenset({"invalid_request", "max_tokens_too_large", "model_not_found",
                       "unauthorized", "quota_exceeded", "not_implemented", ROLLOUT_ERROR,
                       ROLLOUT_TIMEOUT})
# How much of an error message a record keeps.
MESSAGE_CHARS = 2000
# How much of a normalised message a cause keeps (the breaker groups by it).
KEY_CHARS = 200

# Error types and codes that say "full, come back later" at any status (429 and 529 always do;
# 503 does unless /health fails or a gateway says it has no backend).
_OVERLOAD_TYPES = frozenset({"overloaded_error", "overloaded", "rate_limit_exceeded",
                             "rate_limit_error", "server_overloaded"})
# Error codes that refuse the prompt's content, and the words for it.
_CONTENT_CODES = frozenset({"content_filter", "content_policy_violation", "content_filtered"})
_CONTENT_WORDS = re.compile(r"content (management )?policy|content_filter|flagged|safety system",
                            re.IGNORECASE)
# A gateway with no backend to send to (Envoy, Istio, a router whose workers are all gone):
# the server's cause, not a full one.
_NO_UPSTREAM = re.compile(r"no healthy upstream|no (available|healthy) (backend|worker|server)s?"
                          r"|upstream connect error", re.IGNORECASE)
_OVERLOAD_WORDS = re.compile(r"\boverloaded\b|too many requests|rate limit", re.IGNORECASE)

# The numbers a token-limit refusal carries, in each engine's words. Each pattern names the
# groups it has: `limit` (the context, or the most tokens allowed), `prompt` (the prompt's
# tokens), `completion` (the tokens asked to generate).
_TOKEN_PATTERNS = tuple(re.compile(p, re.IGNORECASE | re.DOTALL) for p in (
    # vLLM: "'max_tokens' or 'max_completion_tokens' is too large: 16384. This model's maximum
    # context length is 8192 tokens and your request has 13 input tokens (16384 > 8192 - 13)."
    r"is too large: (?P<completion>\d+).*?maximum context length is (?P<limit>\d+) tokens"
    r".*?has (?P<prompt>\d+) input tokens",
    # vLLM: "This model's maximum context length is 8192 tokens. However, your request has
    # 9000 input tokens."
    r"maximum context length is (?P<limit>\d+) tokens\. However, your request has "
    r"(?P<prompt>\d+) input tokens",
    # OpenAI: "This model's maximum context length is 8192 tokens. However, you requested
    # 9000 tokens (8000 in the messages, 1000 in the completion)."
    r"maximum context length is (?P<limit>\d+) tokens.*?\((?P<prompt>\d+) in the messages,"
    r"\s*(?P<completion>\d+) in the completion\)",
    # SGLang: "Requested token count exceeds the model's maximum context length of 8192 tokens.
    # You requested a total of 16397 tokens: 13 tokens from the input messages and 16384
    # tokens for the completion."
    r"maximum context length of (?P<limit>\d+) tokens.*?: (?P<prompt>\d+) tokens from the "
    r"input messages and (?P<completion>\d+) tokens for the completion",
    # SGLang: "The input (41230 tokens) is longer than the model's context length (40960
    # tokens)."
    r"input \((?P<prompt>\d+) tokens\) is longer than the model's context length "
    r"\((?P<limit>\d+) tokens\)",
    # TGI, the HF router, Together: "`inputs` tokens + `max_new_tokens` must be <= 40960.
    # Given: 40000 `inputs` tokens and 2000 `max_new_tokens`".
    r"`?inputs`? tokens \+ `?max_new_tokens`? must be <= (?P<limit>\d+)\.\s*Given: "
    r"(?P<prompt>\d+) `?inputs`? tokens and (?P<completion>\d+) `?max_new_tokens`?",
    # TGI: "`inputs` must have less than 40960 tokens. Given: 41000".
    r"`?inputs`? must have less than (?P<limit>\d+) tokens\. Given: (?P<prompt>\d+)",
    # Anthropic-style: "prompt is too long: 210000 tokens > 200000 maximum".
    r"prompt is too long: (?P<prompt>\d+) tokens > (?P<limit>\d+)",
))
# Wordings without the numbers: the prompt's (its length) or the job's (the completion asked).
_PROMPT_TOO_LONG = re.compile(
    r"context length|maximum context|context size|context window|must have less than"
    r"|input is too long|prompt is too long|inputs`? tokens \+|too many tokens in the prompt",
    re.IGNORECASE)
_COMPLETION_TOO_LARGE = re.compile(
    r"(max_tokens|max_new_tokens|max_completion_tokens|max_output_tokens)\W.*"
    r"(too large|must be <=|must be less|maximum allowed|at most|exceeds)", re.IGNORECASE)
_BOTH = re.compile(r"inputs`? tokens \+", re.IGNORECASE)
_COMPLETION_PARAMS = frozenset({"max_tokens", "max_completion_tokens", "max_new_tokens",
                                "max_output_tokens"})
_MODEL_WORDS = re.compile(r"model\W.*(does not exist|not found|not served|unknown)"
                          r"|(no|unknown) model", re.IGNORECASE)

# What `normalise` replaces: ids (`req_91b72265b1f5b`, `chatcmpl-…`, UUIDs, long hex), quoted
# values, then the numbers left.
_IDS = re.compile(r"\b(?:[a-z]+[-_])?(?=[0-9a-z_-]*\d)[0-9a-f]{8,}(?:-[0-9a-f]{4,})*\b"
                  r"|\b[a-z]+[-_][0-9a-z]{10,}\b", re.IGNORECASE)
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`")
_NUMBERS = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Reply:
    """What came back from one request: an HTTP status and its body and `Retry-After`, or a
    failure without a status; with whether the server's `/health` passes (None: not known)."""

    status: int | None = None
    body: bytes = b""
    retry_after_s: float | None = None
    failure: Failure | None = None
    detail: str = ""
    health_up: bool | None = None


@dataclass(frozen=True)
class ErrorFields:
    """An error body's structured fields, whatever the engine's shape: OpenAI's and vLLM's
    `{"error": {message, type, param, code}}`, SGLang's `{"object": "error", message, type,
    code}`, TGI's `{"error": "...", "error_type": "..."}`, Anthropic's `{"type": "error",
    "error": {type, message}}`, FastAPI's `{"detail": ...}`, llama.cpp's extra counts."""

    message: str
    type: str | None = None
    code: str | None = None
    param: str | None = None
    prompt_tokens: int | None = None
    context: int | None = None

    @classmethod
    def parse(cls, body: bytes) -> ErrorFields:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return cls(_plain(body))
        if not isinstance(data, dict):
            return cls(str(data)[:MESSAGE_CHARS])
        inner = data.get("error", data)
        if isinstance(inner, str):  # TGI: {"error": "...", "error_type": "validation"}
            return cls(inner, _text(data.get("error_type")))
        if not isinstance(inner, dict):
            return cls(str(inner))
        message = inner.get("message") or inner.get("detail") or inner.get("msg")
        return cls(str(message if message is not None else data)[:MESSAGE_CHARS],
                   _text(inner.get("type")), _text(inner.get("code")), _text(inner.get("param")),
                   _int(inner.get("n_prompt_tokens")), _int(inner.get("n_ctx")))


@dataclass(frozen=True)
class Verdict:
    """One reply's meaning: its cause, the record's error code, the message shown, the wait a
    full server asked for."""

    cause: Cause
    code: str
    message: str
    retry_after_s: float | None = None

    @property
    def key(self) -> str:
        """What failures of one reason share (the failure breaker groups by it)."""
        return f"{self.code}: {normalise(self.message)}"[:KEY_CHARS]


def classify(reply: Reply) -> Verdict:
    """The cause of one reply: the table this module's docstring draws."""
    if reply.status is None:
        return _failure(reply)
    status = reply.status
    fields = ErrorFields.parse(reply.body)
    message = f"HTTP {status}: {fields.message}"
    kinds = {k.lower() for k in (fields.type, fields.code) if k}
    if kinds & _OVERLOAD_TYPES or status in (429, 529):
        if "insufficient_quota" in kinds:
            return Verdict("job", "quota_exceeded", message)
        return Verdict("overloaded", "overloaded", message, reply.retry_after_s)
    if status == 503:
        if reply.health_up is False:
            return Verdict("down", "server_down", message)
        if _NO_UPSTREAM.search(fields.message):
            return Verdict("server", "server_error", message)
        return Verdict("overloaded", "overloaded", message, reply.retry_after_s)
    if status >= 500:
        if _OVERLOAD_WORDS.search(fields.message) and not kinds & {"internal_error"}:
            return Verdict("overloaded", "overloaded", message, reply.retry_after_s)
        if status == 501:
            return Verdict("job", "not_implemented", message)
        return Verdict("server", "server_error", message)
    if status in (401, 403):
        return Verdict("job", "unauthorized", message)
    if status == 404:
        return Verdict("job", "model_not_found", message)
    if status == 408:
        return Verdict("server", "timeout", message)
    if status == 413:
        return Verdict("prompt", "payload_too_large", message)
    if status < 400:
        return Verdict("server", "generation_failed", message)
    return _refusal(fields, message)


def _failure(reply: Reply) -> Verdict:
    detail = reply.detail
    match reply.failure:
        case "connect":
            return Verdict("down", "server_down", detail)
        case "hung":
            return Verdict("down", "server_hung", detail)
        case "timeout":
            return Verdict("server", "timeout", detail)
        case "aborted":
            return Verdict("server", "aborted", detail)
        case "reset" if reply.health_up is not True:
            # A connection lost is a crash until /health says the server is up.
            return Verdict("down", "server_down", detail)
        case _:
            return Verdict("server", "generation_failed", detail)


def _refusal(fields: ErrorFields, message: str) -> Verdict:
    """A 4xx other than the statuses `classify` knows: the prompt's or the job's."""
    kinds = {k.lower() for k in (fields.type, fields.code) if k}
    text = fields.message
    if kinds & _CONTENT_CODES or _CONTENT_WORDS.search(text):
        return Verdict("prompt", "content_filtered", message)
    if "model_not_found" in kinds or (_MODEL_WORDS.search(text)
                                      and not _PROMPT_TOO_LONG.search(text)):
        return Verdict("job", "model_not_found", message)
    tokens = _token_verdict(fields, message)
    if tokens is not None:
        return tokens
    return Verdict("job", "invalid_request", message)


def _token_verdict(fields: ErrorFields, message: str) -> Verdict | None:
    """A refusal for asking more tokens than the server holds, the prompt's or the job's; None
    when the refusal is not about tokens."""
    text = fields.message
    prompt, completion, limit = fields.prompt_tokens, None, fields.context
    for pattern in _TOKEN_PATTERNS:
        found = pattern.search(text)
        if found is not None:
            groups = found.groupdict()
            prompt = _int(groups.get("prompt"))
            completion = _int(groups.get("completion"))
            limit = _int(groups.get("limit"))
            break
    context = ("context_length_exceeded" in {fields.code, fields.type}
               or fields.type == "exceed_context_size_error" or fields.param == "messages")
    # TGI's "`inputs` tokens + `max_new_tokens` must be <= N" without its numbers names both:
    # read as the prompt's (a long prompt is what meets it among others that pass).
    asked = fields.param in _COMPLETION_PARAMS or (
        bool(_COMPLETION_TOO_LARGE.search(text)) and not _BOTH.search(text))
    if prompt is not None and (completion is not None or limit is not None):
        # The numbers decide: the job's when what it asks to generate is at least the prompt
        # (every prompt as short would meet it), the prompt's when the prompt is the larger.
        if completion is not None and completion >= prompt:
            return Verdict("job", "max_tokens_too_large", message)
        return Verdict("prompt", "context_length_exceeded", message)
    if asked and not (context and fields.param == "messages"):
        return Verdict("job", "max_tokens_too_large", message)
    if context or _PROMPT_TOO_LONG.search(text):
        return Verdict("prompt", "context_length_exceeded", message)
    return None


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """The wait a `Retry-After` header asks for (delay-seconds or an HTTP date), or None."""
    value = (value or "").strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def normalise(message: str) -> str:
    """`message` with what differs between requests of one cause read as placeholders: ids as
    `ID`, quoted values as `Q`, numbers as `N`."""
    return _NUMBERS.sub("N", _QUOTED.sub("Q", _IDS.sub("ID", message)))


def job_caused(code: str) -> bool:
    """Whether a failure's code is one the next prompt would meet too (the breaker's)."""
    return code in JOB_CODES


def _plain(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    if text.startswith("<"):  # a proxy's HTML page: its title says it
        title = re.search(r"<title>(.*?)</title>", text, re.IGNORECASE | re.DOTALL)
        if title is not None:
            return title.group(1).strip()
    return text[:MESSAGE_CHARS]


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None
