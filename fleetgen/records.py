"""Per-answer output records: what a result line and an error line contain.

`id` is the prompt's input id on both, so every line of a job's output and of its JSONL export
names its prompt in the same field. A job that asks several answers of a prompt (`sampling.n`,
`enqueue --samples`) gives each answer its own record, with its index in `sample` (0..n-1);
a job of one answer per prompt has no `sample` field. An error line also carries the answer's
key (`answer_key`) as `custom_id`, the field OpenAI's Batch error format names it by;
`is_failure` tells the two kinds apart.

Result line (`results/{batch}.jsonl`):
    {"id", "sample"?, "line", "reasoning_content", "content", "tool_calls", "finish_reason",
     "usage": {"prompt_tokens", "completion_tokens", "reasoning_tokens"},
     "latency_s", "server", "worker", "attempt"}
A raw completion's (`/v1/completions`) is the same, its text in `content`. An embedding's has
`content` "", `finish_reason` null and, besides, the line's vectors (one per text of its
`input`, in order) as base64 of little-endian float32, and the format the line asked them in:
    {..., "embedding": [str, ...], "embedding_format": "float" | "base64"}
A classification's (`/v1/classify`) is the same with, per text of its `input` in order, the
class the model chose (null where the model names none) and every class's probability:
    {..., "label": [str | null, ...], "probs": [[float, ...], ...]}
Error line (`errors/{batch}.jsonl`, OpenAI Batch error format plus the reason's origin):
    {"id", "sample"?, "custom_id", "response": {"status_code", "body"} | null,
     "error": {"code", "message"}, "line", "server", "worker", "attempt", "tries"}

The two are typed as `AnswerRecord` and `FailureRecord` (together `OutputRecord`): built by
`result_record` and `error_record`, read back from JSON by `read_record`, told apart by
`is_failure`. They stay plain dicts, so a line is written as orjson writes a dict.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, cast, final

import orjson
from typing_extensions import TypeIs

from fleetgen.causes import Reply, classify

if TYPE_CHECKING:  # the servers' package loads httpx, which a record's reader never needs
    from fleetgen.servers import ChatCompletion

# Between a prompt's id and an answer's index in an answer's key: ids never hold a "/"
# (producer/inputs), so `a/1` cannot be another prompt's id.
SAMPLE_SEPARATOR = "/"


def answer_key(prompt_id: str, sample: int | None) -> str:
    """The one name of an answer wherever answers are keyed (checkpoints, the export's
    exactly-once check, requeue, an error's `custom_id`): the prompt's id for the answer of a
    one-answer job, `{id}/{sample}` for an answer of a job of several."""
    return prompt_id if sample is None else f"{prompt_id}{SAMPLE_SEPARATOR}{sample}"


class Usage(TypedDict):
    """An answer's token counts (its share of a request's, when one request asked several)."""

    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int


class RecordError(TypedDict):
    """Why a prompt failed: `code` (error_code) and the server's or fleetgen's message."""

    code: str
    message: str


class _ErrorBody(TypedDict):
    error: RecordError


class ErrorResponse(TypedDict):
    """The HTTP answer that refused a prompt, in OpenAI Batch's error format."""

    status_code: int
    body: _ErrorBody


class _Sample(TypedDict):
    sample: NotRequired[int]


@final
class AnswerRecord(TypedDict):
    """A result line: one answer of a prompt."""

    id: str
    sample: NotRequired[int]
    line: int
    reasoning_content: str | None
    content: str
    # As the server gave them (OpenAI's `tool_calls`), passed through.
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str | None
    usage: Usage
    latency_s: float
    server: str
    worker: str
    attempt: int
    # A rollout's answer (fleetgen/rollouts): the dict it returned, the calls it made, and
    # with `--keep-calls` each call's request and completion in order.
    result: NotRequired[dict[str, Any]]
    calls: NotRequired[int]
    trajectory: NotRequired[list[dict[str, Any]]]
    # An embedding's (fleetgen/endpoints.py): a vector per text of the line's `input`, base64
    # of little-endian float32 (4 bytes a dimension, exact), and the format the line asked
    # for (`encoding_format`: what the OpenAI Batch export gives back).
    embedding: NotRequired[list[str]]
    embedding_format: NotRequired[str]
    # A classification's: a label and the classes' probabilities per text of the line's `input`.
    label: NotRequired[list[str | None]]
    probs: NotRequired[list[list[float]]]


@final
class FailureRecord(TypedDict):
    """An error line: a prompt's answer that failed, and why."""

    id: str
    sample: NotRequired[int]
    custom_id: str
    response: ErrorResponse | None
    error: RecordError
    line: int
    server: str
    worker: str
    attempt: int
    tries: int
    # A rollout's failure: the calls it had made, and the type of the exception that ended
    # it when its own code raised one.
    calls: NotRequired[int]
    exception: NotRequired[str]


# What a batch's objects and a checkpoint hold for each answer.
OutputRecord = AnswerRecord | FailureRecord


def read_record(raw: bytes | str) -> OutputRecord:
    """A result or error line (or a checkpoint's value) read back: the one reader of the
    records `result_record` and `error_record` build."""
    return cast(OutputRecord, orjson.loads(raw))


def record_key(record: OutputRecord) -> str:
    """The key (`answer_key`) of the answer a result or error record is the outcome of."""
    return answer_key(record["id"], record.get("sample"))


# Live counters every finished prompt adds to (checkpoints.RECORD_GROUP).
COUNTERS = (
    "prompts_done",
    "prompts_failed",
    "input_tokens",
    "output_tokens",
    "reasoning_tokens",
    "empty_content",
    "missing_reasoning",
    "latency_s",
)


# The tags a thinking model's chat template puts around its reasoning (Qwen3, DeepSeek-R1).
THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class Origin:
    """Where and how a prompt ran; stamped on every record."""

    server: str
    worker: str
    attempt: int


def usage_of(response: Mapping[str, Any]) -> Usage:
    """A completion's token counts: its reasoning tokens where the engine puts them
    (`usage.reasoning_tokens`, SGLang; `completion_tokens_details.reasoning_tokens`, OpenAI's
    and vLLM's), 0 for what it does not say."""
    usage = response.get("usage") or {}
    details = usage.get("completion_tokens_details") or {}
    reasoning_tokens = usage.get("reasoning_tokens")
    if reasoning_tokens is None:
        reasoning_tokens = details.get("reasoning_tokens", 0)
    return {"prompt_tokens": int(usage.get("prompt_tokens") or 0),
            "completion_tokens": int(usage.get("completion_tokens") or 0),
            "reasoning_tokens": int(reasoning_tokens or 0)}


def result_record(
    prompt_id: str, line: int, response: ChatCompletion, latency_s: float, origin: Origin,
    sample: int | None = None,
) -> AnswerRecord:
    choice = (response.get("choices") or [{}])[0]
    # A raw completion's choice holds its `text` where a chat one holds a message.
    message = choice.get("message") or {"content": choice.get("text")}
    # vLLM since 0.10 names it `reasoning`; SGLang and older vLLM `reasoning_content`.
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    content = message.get("content") or ""
    if reasoning is None and THINK_END in content:
        # A server without a reasoning parser leaves the thinking in the content, as the
        # template's tags delimit it: split it as SGLang's parser would.
        reasoning, _, content = content.partition(THINK_END)
        reasoning = reasoning.removeprefix(THINK_START).strip()
        content = content.lstrip()
    return {
        "id": prompt_id,
        # (mypy asks a spread to name the record's other optional fields too: a rollout's)
        **_sample_field(sample),  # type: ignore[typeddict-item]
        "line": line,
        "reasoning_content": reasoning,
        "content": content,
        "tool_calls": message.get("tool_calls") or None,
        "finish_reason": choice.get("finish_reason"),
        "usage": usage_of(response),
        "latency_s": round(latency_s, 4),
        "server": origin.server,
        "worker": origin.worker,
        "attempt": origin.attempt,
    }


def split_choices(response: ChatCompletion) -> list[ChatCompletion]:
    """The answers of a response that asked several (`n`), in choice-index order, each as a
    response of one choice that `result_record` reads.

    Engines give `usage` for the whole request only: the prompt once, the completion and
    reasoning tokens summed over the choices (SGLang and vLLM alike). Each answer's record
    says its prompt's tokens, as a request of its own would, and its share of the completion
    and reasoning tokens, apportioned by the length of its text so that the shares add up to
    the totals exactly: the job's output and reasoning counters stay the engine's figures,
    and its input counter counts the prompt once per answer, however the answers were sent.
    """
    choices = sorted(response.get("choices") or [], key=lambda c: int(c.get("index") or 0))
    usage = response.get("usage") or {}
    details = usage.get("completion_tokens_details") or {}
    reasoning = usage.get("reasoning_tokens")
    if reasoning is None:
        reasoning = details.get("reasoning_tokens", 0)
    messages = [c.get("message") or {"content": c.get("text")} for c in choices]
    thought = [len(m.get("reasoning_content") or m.get("reasoning") or "") for m in messages]
    said = [len(m.get("content") or "") + len(str(m.get("tool_calls") or "")) for m in messages]
    completion = _apportion(int(usage.get("completion_tokens") or 0),
                            [t + c for t, c in zip(thought, said, strict=True)])
    reasoned = _apportion(int(reasoning or 0), thought)
    return [{**response, "choices": [choice],
             "usage": {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": out,
                       "reasoning_tokens": think}}
            for choice, out, think in zip(choices, completion, reasoned, strict=True)]


def _pooled_record(prompt_id: str, line: int, prompt_tokens: int, latency_s: float,
                   origin: Origin) -> AnswerRecord:
    """What the answer of a prompt that generates nothing (embeddings, classify) holds beside
    its own fields: no text, its share of the request's prompt tokens, where it was made."""
    return {
        "id": prompt_id,
        "line": line,
        "reasoning_content": None,
        "content": "",
        "tool_calls": None,
        "finish_reason": None,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "reasoning_tokens": 0},
        "latency_s": round(latency_s, 4),
        "server": origin.server,
        "worker": origin.worker,
        "attempt": origin.attempt,
    }


def embedding_record(
    prompt_id: str, line: int, items: list[dict[str, Any]], prompt_tokens: int,
    latency_s: float, origin: Origin, asked_format: str,
) -> AnswerRecord:
    """The answer of an embeddings prompt: its texts' vectors (`items`: its texts' entries of
    the answer's `data`) as base64 float32 (`vector_b64`), its share of the request's prompt
    tokens, and the format its line asked for."""
    record = _pooled_record(prompt_id, line, prompt_tokens, latency_s, origin)
    record["embedding"] = [vector_b64(d["embedding"]) for d in items]
    record["embedding_format"] = asked_format
    return record


def classified_record(
    prompt_id: str, line: int, items: list[dict[str, Any]], prompt_tokens: int,
    latency_s: float, origin: Origin,
) -> AnswerRecord:
    """The answer of a classify prompt: each text's label and probabilities (`items`: its
    texts' entries of the answer's `data`), and its share of the request's prompt tokens."""
    record = _pooled_record(prompt_id, line, prompt_tokens, latency_s, origin)
    record["label"] = [d.get("label") for d in items]
    record["probs"] = [[float(p) for p in d["probs"]] for d in items]
    return record


def split_pooled(
    response: ChatCompletion, counts: list[int], weights: list[int],
) -> list[tuple[list[dict[str, Any]], int]]:
    """The `data` entries of an embeddings or classify request that carried several prompts'
    texts (`counts` texts each, in order), each prompt's with its share of the request's
    prompt tokens: engines count them for the request only, so they are apportioned by
    `weights` (the texts' lengths), adding up to the engine's figure exactly."""
    data = sorted(response.get("data") or [], key=lambda d: int(d.get("index") or 0))
    usage = response.get("usage") or {}
    tokens = _apportion(int(usage.get("prompt_tokens") or 0), weights)
    out, at = [], 0
    for count, share in zip(counts, tokens, strict=True):
        out.append((data[at:at + count], share))
        at += count
    return out


def vector_b64(embedding: list[float] | str) -> str:
    """One vector as a record keeps it: base64 of little-endian float32. A server's base64
    (`encoding_format: base64`, the same bytes) is kept as it came; a list of floats is packed."""
    if isinstance(embedding, str):
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode()


def vector_floats(b64: str) -> list[float]:
    """A record's vector as floats (float32 values, as the server computed them)."""
    raw = vector_bytes(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def vector_bytes(b64: str) -> bytes:
    """A record's vector as its bytes: little-endian float32, 4 a dimension."""
    return base64.b64decode(b64)


def _apportion(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights` (evenly where they are all 0), by largest
    remainder, so the parts add up to `total`."""
    if not weights:
        return []
    if sum(weights) == 0:
        weights = [1] * len(weights)
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    parts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: parts[i] - exact[i])
    for i in by_remainder[:total - sum(parts)]:
        parts[i] += 1
    return parts


def error_code(status: int | None, message: str) -> str:
    """The code of a failure given only its status and message (fleetgen/causes.py reads the
    reply itself where there is one)."""
    if status is not None:
        return classify(Reply(status, message.encode())).code
    text = message.lower()
    if "aborted the generation" in text:
        return "aborted"
    if "timed out" in text:
        return "timeout"
    return "generation_failed"


# The one reason a prompt is failed without having been sent: its batch was started
# FLEETGEN_BATCH_MAX_ATTEMPTS times and each attempt ended with its worker dead, its lease lost
# or an unexpected error (a poison batch must not loop forever). The message names the cause.
UNSENT_ATTEMPTS_EXHAUSTED = "batch_attempts_exhausted"


def error_record(
    prompt_id: str,
    line: int,
    message: str,
    status: int | None,
    origin: Origin,
    tries: int,
    code: str | None = None,
    sample: int | None = None,
) -> FailureRecord:
    code = code or error_code(status, message)
    return {
        "id": prompt_id,
        # (mypy asks a spread to name the record's other optional fields too: a rollout's)
        **_sample_field(sample),  # type: ignore[typeddict-item]
        "custom_id": answer_key(prompt_id, sample),
        "response": (
            {"status_code": status, "body": {"error": {"message": message, "code": code}}}
            if status is not None
            else None
        ),
        "error": {"code": code, "message": message},
        "line": line,
        "server": origin.server,
        "worker": origin.worker,
        "attempt": origin.attempt,
        "tries": tries,
    }


def _sample_field(sample: int | None) -> _Sample:
    return {} if sample is None else {"sample": sample}


def is_failure(record: OutputRecord) -> TypeIs[FailureRecord]:
    return "error" in record and "custom_id" in record


def counters(record: OutputRecord, *, thinking: bool) -> dict[str, float]:
    """What one finished prompt adds to the job's counters."""
    if is_failure(record):
        failed: dict[str, float] = {"prompts_failed": 1, f"error_{record['error']['code']}": 1}
        if "calls" in record:
            failed.update(_rollout_counters(record["calls"]))
            if "exception" in record:
                failed[f"rollout_failed_{record['exception']}"] = 1
        return failed
    usage = record["usage"]
    if "embedding" in record:
        # Vectors have no finish, no content to be empty, no reasoning.
        return {"prompts_done": 1, "input_tokens": usage["prompt_tokens"],
                "latency_s": record["latency_s"], "embeddings": len(record["embedding"])}
    if "label" in record:
        return {"prompts_done": 1, "input_tokens": usage["prompt_tokens"],
                "latency_s": record["latency_s"], "classified": len(record["label"])}
    out: dict[str, float] = {
        "prompts_done": 1,
        "input_tokens": usage["prompt_tokens"],
        "output_tokens": usage["completion_tokens"],
        "reasoning_tokens": usage["reasoning_tokens"],
        "latency_s": record["latency_s"],
        f"finish_{record['finish_reason'] or 'none'}": 1,
    }
    if not record["content"] and not record["tool_calls"]:
        out["empty_content"] = 1
    if thinking and not record["reasoning_content"]:
        out["missing_reasoning"] = 1
    if "calls" in record:
        out.update(_rollout_counters(record["calls"]))
    return out


# A rollout's calls are counted by number up to this; more count here (the status's "max"
# then reads "this or more").
ROLLOUT_CALLS_COUNTED = 64


def _rollout_counters(calls: int) -> dict[str, float]:
    """What a finished rollout adds: its calls, and one to the rollouts of its number of
    calls (`rollout_calls_{k}`: the status's mean and max)."""
    return {"rollout_calls": calls, f"rollout_calls_{min(calls, ROLLOUT_CALLS_COUNTED)}": 1}


def rollout_record(
    prompt_id: str, line: int, result: dict[str, Any], usage: Usage, latency_s: float,
    origin: Origin, calls: int, trajectory: list[dict[str, Any]] | None = None,
) -> AnswerRecord:
    """The answer of a prompt whose rollout returned `result`: its `content` (the answer the
    canary judges and the exports show) is the result's "content" when that is text, else the
    result as JSON; `usage` sums its calls'."""
    content = result.get("content")
    reasoning = result.get("reasoning_content")
    finish = result.get("finish_reason")
    record: AnswerRecord = {
        "id": prompt_id,
        "line": line,
        "reasoning_content": reasoning if isinstance(reasoning, str) else None,
        "content": content if isinstance(content, str) else orjson.dumps(result).decode(),
        "tool_calls": None,
        "finish_reason": finish if isinstance(finish, str) else "stop",
        "usage": usage,
        "latency_s": round(latency_s, 4),
        "server": origin.server,
        "worker": origin.worker,
        "attempt": origin.attempt,
        "result": result,
        "calls": calls,
    }
    if trajectory is not None:
        record["trajectory"] = trajectory
    return record


def written_counts(records: Iterable[OutputRecord]) -> dict[str, float]:
    """What a batch's written objects add to the job's written counters
    (Batches.finish_and_settle): prompts answered, prompts failed, and failures by error code —
    what `export` will count."""
    out: dict[str, float] = {"prompts_done": 0, "prompts_failed": 0}
    for record in records:
        if is_failure(record):
            out["prompts_failed"] += 1
            code = f"error_{record['error']['code']}"
            out[code] = out.get(code, 0) + 1
        else:
            out["prompts_done"] += 1
    return out


def answered_counts(records: Iterable[OutputRecord],
                    counted: Container[str] = ()) -> dict[str, float]:
    """What a batch's answers that skipped the checkpoint add to the job's live counters: each
    answer's `counters`, summed, but for those whose key is in `counted` (checkpointed, so
    counted already). An embeddings batch's answers skip it (the batch is their group), and
    Batches.finish_and_settle adds this once, as their checkpoint would have."""
    out: dict[str, float] = {}
    for record in records:
        if is_failure(record) or record_key(record) in counted:
            continue
        for name, value in counters(record, thinking=False).items():
            out[name] = out.get(name, 0) + value
    return out
