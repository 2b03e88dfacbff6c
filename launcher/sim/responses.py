"""Chat completion bodies and SSE chunks in SGLang's shapes.

As in docs/reference/sglang.md#chat-response.

With a reasoning parser and `separate_reasoning`, text before `</think>` goes to
`reasoning_content` and the rest to `content`; cut off while thinking, everything is
reasoning and `content` is "". Without them the raw text (with `</think>`) is the content.
A complete tool call found by the tool-call parser becomes `tool_calls` and leaves no text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

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


def reasoning_tokens(plan: OutputPlan, n: int, view: ChatView) -> int:
    """Reasoning tokens among the first `n` (up to and including </think>)."""
    if not (view.count_reasoning and plan.thinking):
        return 0
    return plan.think_end + 1 if 0 <= plan.think_end < n else n


def _tool_calls(plan: OutputPlan, rid: str) -> list[dict[str, Any]] | None:
    if plan.tool_call is None:
        return None
    call_id = "call_" + hashlib.blake2b(rid.encode(), digest_size=12).hexdigest()
    return [{"id": call_id, "index": 0, "type": "function",
             "function": {"name": plan.tool_call.name, "arguments": plan.tool_call.arguments}}]


def split_output(plan: OutputPlan, n: int, view: ChatView,
                 complete: bool) -> tuple[str | None, str, list[dict[str, Any]] | None]:
    """(reasoning_content, content, tool_calls) of the first `n` tokens."""
    pieces = plan.pieces[:n]
    tools = _tool_calls(plan, view.rid) if complete and plan.tool_span else None
    if tools and plan.tool_span:
        start, end = plan.tool_span
        pieces = pieces[:start] + pieces[end:]
    if not (view.reasoning_on and plan.thinking):
        return None, "".join(pieces), tools
    end_at = plan.think_end
    if 0 <= end_at < n:
        return "".join(pieces[:end_at]), "".join(pieces[end_at + 2:]), tools
    return "".join(pieces), "", tools


def usage(plan: OutputPlan, n: int, view: ChatView) -> dict[str, Any]:
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
    """A non-streaming chat.completion body."""
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


class ChunkWriter:
    """SSE chunks of one streaming chat completion."""

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

    def tools(self, calls: list[dict[str, Any]]) -> bytes:
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
                out.append(self.delta(None, piece))
            elif not reasoning_on or i > think_end + 1:
                out.append(self.delta(piece, None))
        return b"".join(out)
