"""Chat completion bodies and SSE chunks in SGLang's shapes, and in the other flavours'.

As in docs/reference/sglang.md#chat-response.

With a reasoning parser and `separate_reasoning`, text before `</think>` goes to
`reasoning_content` and the rest to `content`; cut off while thinking, everything is
reasoning and `content` is "". Without them the raw text (with `</think>`) is the content.
A complete tool call found by the tool-call parser becomes `tool_calls` and leaves no text.

The vLLM flavour follows vLLM 0.11.0's `ChatCompletionResponse` (every field, as its
`model_dump()` sends them) and stream chunks (`exclude_unset`); its Qwen3 reasoning parser
needs both think tags, so an answer cut while thinking is all `content`. The strict flavour
follows transformers serve: openai's `ChatCompletion` dumped with `exclude_none`, no reasoning
split, the usage in the last stream chunk and no `[DONE]` (docs/development/simulator.md).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, TypedDict

import orjson

from launcher.sim.textgen import OutputPlan

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ChatView:
    """How one chat request's output is presented."""

    rid: str
    created: int
    model: str
    prompt_tokens: int
    reasoning_on: bool  # reasoning parser active and separate_reasoning
    count_reasoning: bool  # thinking requested and a parser active: usage.reasoning_tokens
    include_usage: bool = False
    cache_report: bool = False
    flavor: str = "sglang"
    show_reasoning: bool = True  # vLLM's include_reasoning: false drops the split-off text
    reasoning_field: str = "reasoning_content"  # vLLM's name of it (--vllm-reasoning-field)


class ToolFunction(TypedDict):
    name: str
    arguments: str


class ToolCall(TypedDict):
    """One parsed tool call in SGLang's shape."""

    id: str
    index: int
    type: str
    function: ToolFunction


class Usage(TypedDict):
    """SGLang's `usage` object (completion tokens include the reasoning tokens)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None
    reasoning_tokens: int
    completion_tokens_details: dict[str, int]


def reasoning_tokens(plan: OutputPlan, n: int, view: ChatView) -> int:
    """Reasoning tokens among the first `n` (up to and including </think>)."""
    if not (view.count_reasoning and plan.thinking):
        return 0
    return plan.think_end + 1 if 0 <= plan.think_end < n else n


def _tool_calls(plan: OutputPlan) -> list[ToolCall] | None:
    if plan.tool_call is None:
        return None
    # SGLang's own id: unique per call, so a program can key the tool results by it (the
    # choices of a request with n > 1 included)
    call_id = "call_" + uuid.uuid4().hex[:24]
    return [{"id": call_id, "index": 0, "type": "function",
             "function": {"name": plan.tool_call.name, "arguments": plan.tool_call.arguments}}]


def split_output(plan: OutputPlan, n: int, view: ChatView,
                 complete: bool) -> tuple[str | None, str, list[ToolCall] | None]:
    """(reasoning_content, content, tool_calls) of the first `n` tokens."""
    pieces = plan.pieces[:n]
    tools = _tool_calls(plan) if complete and plan.tool_span else None
    if tools and plan.tool_span:
        start, end = plan.tool_span
        pieces = pieces[:start] + pieces[end:]
    if not (view.reasoning_on and plan.thinking):
        return None, "".join(pieces), tools
    end_at = plan.think_end
    if 0 <= end_at < n:
        # SGLang's parser strips the blank line after </think>; vLLM's partition keeps it
        after = end_at + (2 if view.flavor == "sglang" else 1)
        return "".join(pieces[:end_at]), "".join(pieces[after:]), tools
    if view.flavor == "vllm":  # vLLM 0.11.0's Qwen3 parser needs both tags to split
        return None, "".join(pieces), tools
    return "".join(pieces), "", tools


def usage(plan: OutputPlan, n: int, view: ChatView) -> Usage:
    """The `usage` object (completion tokens include reasoning tokens)."""
    reasoning = reasoning_tokens(plan, n, view)
    return {"prompt_tokens": view.prompt_tokens, "completion_tokens": n,
            "total_tokens": view.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": 0} if view.cache_report else None,
            "reasoning_tokens": reasoning,
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def finish_of(plan: OutputPlan, aborted: str | None) -> tuple[str, int | str | None]:
    """(finish_reason, matched_stop)."""
    return ("abort", None) if aborted else (plan.finish, plan.matched)


def chat_body(plan: OutputPlan, n: int, view: ChatView, aborted: str | None) -> bytes:
    """A non-streaming chat.completion body, in the shape of the view's flavour."""
    if view.flavor == "vllm":
        return _vllm_body(plan, n, view, aborted)
    if view.flavor == "strict":
        return _strict_body(plan, n, view, aborted)
    reasoning, content, tools = split_output(plan, n, view, complete=not aborted)
    message: dict[str, Any] = {"role": "assistant", "content": content,
                               "reasoning_content": reasoning}
    if tools:
        message["tool_calls"] = tools
    finish, matched = finish_of(plan, aborted)
    return orjson.dumps({
        "id": view.rid, "object": "chat.completion", "created": view.created,
        "model": view.model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": finish, "matched_stop": matched}],
        "usage": usage(plan, n, view),
        "metadata": {"weight_version": "default"}})


def several_body(bodies: list[bytes]) -> bytes:
    """The body of a request with n > 1 from its choices' own bodies: the choices by index,
    one `usage` with the prompt counted once and the completion and reasoning tokens summed
    (SGLang's UsageProcessor and vLLM alike)."""
    docs = [orjson.loads(b) for b in bodies]
    out = docs[0]
    out["choices"] = [{**d["choices"][0], "index": i} for i, d in enumerate(docs)]
    usage = out["usage"]
    usage["completion_tokens"] = sum(d["usage"]["completion_tokens"] for d in docs)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    if "reasoning_tokens" in usage:
        usage["reasoning_tokens"] = sum(d["usage"]["reasoning_tokens"] for d in docs)
        usage["completion_tokens_details"] = {"reasoning_tokens": usage["reasoning_tokens"]}
    return orjson.dumps(out)


def _vllm_tool_calls(tools: list[ToolCall] | None) -> list[dict[str, Any]]:
    """vLLM's ToolCall dumps: `chatcmpl-tool-<hex>` ids (a random UUID each), no index."""
    return [{"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
             "function": t["function"]} for t in tools or ()]


def _vllm_usage(view: ChatView, n: int) -> dict[str, Any]:
    """vLLM's UsageInfo (no reasoning tokens, no cached-token details without a cache)."""
    return {"prompt_tokens": view.prompt_tokens, "total_tokens": view.prompt_tokens + n,
            "completion_tokens": n, "prompt_tokens_details": None}


def _vllm_stop_reason(plan: OutputPlan, aborted: str | None) -> str | None:
    """vLLM's `stop_reason`: the stop string matched; None for EOS, length and aborts."""
    return plan.matched if isinstance(plan.matched, str) and not aborted else None


def _vllm_body(plan: OutputPlan, n: int, view: ChatView, aborted: str | None) -> bytes:
    reasoning, content, tools = split_output(plan, n, view, complete=not aborted)
    message: dict[str, Any] = {
        "role": "assistant", "content": content or None, "refusal": None, "annotations": None,
        "audio": None, "function_call": None, "tool_calls": _vllm_tool_calls(tools),
        view.reasoning_field: reasoning if view.show_reasoning else None}
    finish, _ = finish_of(plan, aborted)
    return orjson.dumps({
        "id": view.rid, "object": "chat.completion", "created": view.created,
        "model": view.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                     "stop_reason": _vllm_stop_reason(plan, aborted), "token_ids": None}],
        "service_tier": None, "system_fingerprint": None, "usage": _vllm_usage(view, n),
        "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None})


def _strict_usage(view: ChatView, n: int) -> dict[str, Any]:
    return {"completion_tokens": n, "prompt_tokens": view.prompt_tokens,
            "total_tokens": view.prompt_tokens + n}


def _strict_body(plan: OutputPlan, n: int, view: ChatView, aborted: str | None) -> bytes:
    _, content, _ = split_output(plan, n, view, complete=False)
    finish, _ = finish_of(plan, aborted)
    return orjson.dumps({
        "id": view.rid,
        "choices": [{"finish_reason": finish, "index": 0,
                     "message": {"content": content, "role": "assistant"}}],
        "created": view.created, "model": view.model, "object": "chat.completion",
        "usage": _strict_usage(view, n)})


def chunk_writer(view: ChatView) -> ChunkWriter:
    """The SSE chunk writer of the view's flavour."""
    if view.flavor == "vllm":
        return VllmChunkWriter(view)
    if view.flavor == "strict":
        return StrictChunkWriter(view)
    return ChunkWriter(view)


class ChunkWriter:
    """SSE chunks of one streaming chat completion (SGLang's shapes)."""

    # tokens after </think> that the reasoning parser swallows: SGLang strips the blank line
    skip_after_think = 1

    def __init__(self, view: ChatView) -> None:
        self.view = view
        head = orjson.dumps({"id": view.rid, "object": "chat.completion.chunk",
                             "created": view.created, "model": view.model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":0,"delta":'
        self._tail = b',"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n'

    def role(self) -> bytes:
        """The first chunk: role, empty content, null reasoning_content."""
        return self._head + b'{"role":"assistant","content":"","reasoning_content":null}' \
            + self._tail

    def delta(self, content: str | None, reasoning: str | None) -> bytes:
        """A text chunk: `content` or `reasoning_content`."""
        body = orjson.dumps({"role": None, "content": content, "reasoning_content": reasoning})
        return self._head + body + self._tail

    def tools(self, calls: list[ToolCall]) -> bytes:
        """The parsed tool calls, sent once the call is complete."""
        body = orjson.dumps({"role": None, "content": None, "reasoning_content": None,
                             "tool_calls": calls})
        return self._head + body + self._tail

    def finish(self, finish: str, matched: int | str | None) -> bytes:
        """The closing chunk carrying finish_reason and matched_stop."""
        end = orjson.dumps({"finish_reason": finish, "matched_stop": matched})
        return (self._head + b'{"role":null,"content":null,"reasoning_content":null}'
                + b',"logprobs":null,' + end[1:-1] + b"}]}\n\n")

    def usage(self, plan: OutputPlan, n: int) -> bytes:
        """The `choices: []` chunk with usage (stream_options.include_usage)."""
        view = self.view
        return b"data: " + orjson.dumps({
            "id": view.rid, "object": "chat.completion.chunk", "created": view.created,
            "model": view.model, "choices": [], "usage": usage(plan, n, view)}) + b"\n\n"

    def closing(self, plan: OutputPlan, n: int, aborted: str | None) -> list[bytes]:
        """The chunks after the last token: tool calls, finish, usage, `[DONE]`."""
        out = []
        _, _, calls = split_output(plan, n, self.view, complete=not aborted)
        if calls:
            out.append(self.tools(calls))
        out.append(self.finish(*finish_of(plan, aborted)))
        if self.view.include_usage:
            out.append(self.usage(plan, n))
        out.append(DONE)
        return out

    def tokens(self, plan: OutputPlan, start: int, stop: int) -> bytes:
        """One chunk per visible token in [start, stop)."""
        out = []
        reasoning_on = self.view.reasoning_on and plan.thinking
        think_end = plan.think_end if plan.think_end >= 0 else plan.n_tokens
        span = plan.tool_span or (plan.n_tokens, plan.n_tokens)
        for i in range(start, stop):
            piece = plan.pieces[i]
            if not piece or span[0] <= i < span[1]:
                continue  # EOS, a trimmed stop string, or tool-call text the parser holds
            if reasoning_on and i < think_end:
                if self.view.show_reasoning:
                    out.append(self.delta(None, piece))
            elif not reasoning_on or i > think_end + self.skip_after_think:
                out.append(self.delta(piece, None))
        return b"".join(out)


class VllmChunkWriter(ChunkWriter):
    """vLLM 0.11.0's chunks: `model_dump_json(exclude_unset=True)` of its stream models."""

    skip_after_think = 0

    def __init__(self, view: ChatView) -> None:
        super().__init__(view)
        self._tail = b',"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        self._reasoning_key = orjson.dumps(view.reasoning_field)

    def role(self) -> bytes:
        """The first chunk: role and empty content (and the explicitly set prompt_token_ids)."""
        return (self._head + b'{"role":"assistant","content":""},"logprobs":null,'
                b'"finish_reason":null}],"prompt_token_ids":null}\n\n')

    def delta(self, content: str | None, reasoning: str | None) -> bytes:
        """A text chunk: `content` or the reasoning field, the other left unset."""
        if content is not None:
            body = b'{"content":' + orjson.dumps(content) + b"}"
        else:
            body = b"{" + self._reasoning_key + b":" + orjson.dumps(reasoning) + b"}"
        return self._head + body + self._tail

    def tools(self, calls: list[ToolCall]) -> bytes:
        """The parsed tool calls in one delta."""
        tools = [{**call, "index": 0} for call in _vllm_tool_calls(calls)]
        return self._head + orjson.dumps({"tool_calls": tools}) + self._tail

    def finish(self, finish: str, matched: int | str | None) -> bytes:
        """An empty delta carrying finish_reason and stop_reason."""
        stop_reason = matched if isinstance(matched, str) else None
        end = orjson.dumps({"logprobs": None, "finish_reason": finish,
                            "stop_reason": stop_reason, "token_ids": None})
        return self._head + b"{}," + end[1:-1] + b"}]}\n\n"

    def usage(self, plan: OutputPlan, n: int) -> bytes:
        """The `choices: []` usage chunk (`exclude_none`: no prompt_tokens_details)."""
        view = self.view
        usage_ = {k: v for k, v in _vllm_usage(view, n).items() if v is not None}
        return b"data: " + orjson.dumps({
            "id": view.rid, "object": "chat.completion.chunk", "created": view.created,
            "model": view.model, "choices": [], "usage": usage_}) + b"\n\n"


class StrictChunkWriter(ChunkWriter):
    """transformers serve's chunks: openai's ChatCompletionChunk with `exclude_none`; the
    last one carries finish_reason and usage, and no `[DONE]` follows."""

    def __init__(self, view: ChatView) -> None:
        super().__init__(view)
        self._head = b'data: {"id":' + orjson.dumps(view.rid) + b',"choices":[{"delta":'
        self._after_choices = (b',"created":' + str(view.created).encode() + b',"model":'
                               + orjson.dumps(view.model)
                               + b',"object":"chat.completion.chunk","system_fingerprint":""')
        self._tail = b',"index":0}]' + self._after_choices + b"}\n\n"

    def role(self) -> bytes:
        """The first chunk: the role alone."""
        return self._head + b'{"role":"assistant"}' + self._tail

    def delta(self, content: str | None, reasoning: str | None) -> bytes:
        """A content chunk (the strict flavour never splits reasoning off)."""
        return self._head + b'{"content":' + orjson.dumps(content or reasoning) + b"}" \
            + self._tail

    def closing(self, plan: OutputPlan, n: int, aborted: str | None) -> list[bytes]:
        """One last chunk: empty delta, finish_reason and usage."""
        finish, _ = finish_of(plan, aborted)
        return [self._head + b'{},"finish_reason":' + orjson.dumps(finish) + b',"index":0}]'
                + self._after_choices + b',"usage":'
                + orjson.dumps(_strict_usage(self.view, n)) + b"}\n\n"]
