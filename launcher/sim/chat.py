"""POST /v1/chat/completions: validate, plan the output, queue it, answer when done.

Streaming answers open (send headers) only once the first token exists, as SGLang's
kick-started generator does, so a queued streaming request waits without a response. Tokens
are then written in batches: one SSE chunk per token, all chunks due since the last wake
in one write, waking at most every STREAM_TICK seconds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from launcher.sim import protocol, responses, tokenizer
from launcher.sim.protocol import ChatRequest, RequestError, bad_request, error_body
from launcher.sim.responses import ChatView, ChunkWriter
from launcher.sim.scheduler import QueueFullError, SimRequest
from launcher.sim.simulator import Simulator
from launcher.sim.textgen import OutputPlan, TextRequest, plan_output

STREAM_TICK = 0.02  # wall seconds between stream writes, whatever --speed is
JSON = "application/json"


@dataclass
class ChatJob:
    """A validated, scheduled chat request."""

    sreq: SimRequest
    plan: OutputPlan
    view: ChatView
    left: list[bool] = field(default_factory=lambda: [False])


def thinking_requested(sim: Simulator, req: ChatRequest) -> bool:
    """Qwen3's template thinks unless told not to; thinking-off mode ignores the request."""
    if sim.cfg.mode == "thinking-off":
        return False
    kwargs = {**(sim.cfg.default_chat_template_kwargs or {}), **(req.chat_template_kwargs or {})}
    for key in ("enable_thinking", "thinking"):
        if key in kwargs:
            return bool(kwargs[key])
    return req.reasoning_effort != "none"


def _first_rid(rid: str | list[str] | None) -> str | None:
    if isinstance(rid, list):
        return rid[0] if rid else None
    return rid


def _tools(req: ChatRequest) -> tuple[tuple[dict[str, Any], ...], Any]:
    tools = tuple({"function": t.function.model_dump()} for t in req.tools or ())
    choice: Any = req.tool_choice
    if isinstance(choice, protocol.ToolChoice):
        choice = {"function": {"name": choice.function.name}}
    return tools, choice


def prepare(sim: Simulator, req: ChatRequest) -> ChatJob:
    """Validate like SGLang's serving_chat + tokenizer manager, then plan and queue."""
    cfg = sim.cfg
    if not req.messages:
        raise bad_request("Messages cannot be empty.")
    if cfg.context_length is not None and (req.max_completion_tokens or 0) > cfg.context_length:
        raise bad_request(f"max_completion_tokens is too large: {req.max_completion_tokens}."
                          f"This model supports at most {cfg.context_length} completion tokens.")
    texts = [tokenizer.content_text(m.content) for m in req.messages]
    thinking = thinking_requested(sim, req)
    tools, choice = _tools(req)
    prompt_tokens = tokenizer.chat_prompt_tokens(texts, [t["function"] for t in tools], thinking)
    given_rid = _first_rid(req.rid)
    index = sim.count_request()
    try:
        if sim.fail_prompt_hit(given_rid, texts):
            raise protocol.input_too_long(cfg.context_len + prompt_tokens, cfg.context_len)
        prompt_tokens, max_new = protocol.check_context(
            prompt_tokens, req.max_completion_tokens or req.max_tokens, cfg.context_len,
            cfg.allow_auto_truncate)
    except protocol.ContextLengthError as exc:
        raise bad_request(str(exc)) from exc
    key = "\x00".join(f"{m.role}\x01{t}" for m, t in zip(req.messages, texts, strict=True))
    key_bytes = (key + "\x02" + ",".join(t["function"]["name"] for t in tools)).encode()
    if sim.should_fail(key_bytes, index):
        raise RequestError(500, error_body("Internal server error: simulated failure "
                                           "(--fail-rate)", "InternalServerError", 500))
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    plan = plan_output(TextRequest(
        key=key_bytes, seed=cfg.seed, mean_tokens=cfg.mean_output_tokens,
        sigma=cfg.output_sigma,
        limit=max_new if max_new is not None else cfg.context_len - prompt_tokens - 1,
        thinking=thinking, tools=tools, tool_choice=choice, tool_rate=cfg.tool_call_rate,
        parse_tools=cfg.tool_call_parser is not None,
        boilerplate_rate=cfg.boilerplate_rate if cfg.mode == "thinking-off" else 0.0,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, stop=stop))
    rid = given_rid or uuid.uuid4().hex
    sreq = SimRequest(rid, prompt_tokens, plan.n_tokens, req.stream, sim.scheduler.loop)
    try:
        sim.scheduler.submit(sreq)
    except QueueFullError as exc:
        raise RequestError(503, error_body(str(exc), "503", 503)) from exc
    parser = cfg.reasoning_parser is not None
    view = ChatView(rid=rid, created=int(time.time()), model=req.model,
                    prompt_tokens=prompt_tokens, reasoning_on=parser and req.separate_reasoning,
                    count_reasoning=parser and thinking,
                    include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    cache_report=cfg.enable_cache_report)
    return ChatJob(sreq, plan, view)


async def chat_completions(sim: Simulator, request: Request) -> Response:
    """The route handler."""
    sim.enter()
    job: ChatJob | None = None
    try:
        req = protocol.parse_chat(request.headers.get("content-type"), await request.body())
        job = prepare(sim, req)
        if req.stream:
            return await _open_stream(sim, job, request)
        await sim.wait_done(job.sreq, request)
        body = responses.chat_body(job.plan, job.sreq.completion_tokens, job.view,
                                   job.sreq.aborted)
        return Response(body, media_type=JSON)
    except RequestError as err:
        return Response(err.body, status_code=err.status, media_type=JSON)
    finally:
        if job is None or not job.sreq.streaming:
            sim.leave()


def _release(sim: Simulator, job: ChatJob) -> None:
    if not job.sreq.done.done():
        sim.scheduler.abort_request(job.sreq)
    if not job.left[0]:
        job.left[0] = True
        sim.leave()


async def _open_stream(sim: Simulator, job: ChatJob, request: Request) -> Response:
    sreq, loop = job.sreq, sim.scheduler.loop
    try:
        assert sreq.admitted is not None
        await sim.wait_for(sreq.admitted, sreq, request)
        delay = sreq.first_token_at() - loop.time()
        if delay > 0 and not sreq.done.done():
            await asyncio.wait([sreq.done], timeout=delay)
    except BaseException:
        _release(sim, job)
        raise
    return StreamingResponse(_events(sim, job), media_type="text/event-stream")


async def _events(sim: Simulator, job: ChatJob) -> AsyncIterator[bytes]:
    sreq, plan, loop = job.sreq, job.plan, sim.scheduler.loop
    writer = ChunkWriter(job.view)
    sent = 0
    out = [writer.role()]
    try:
        while True:
            done = sreq.done.done()
            upto = sreq.completion_tokens if done else sreq.tokens_at(loop.time())
            if upto > sent:
                out.append(writer.tokens(plan, sent, upto))
                sent = upto
            if done:
                out += _closing(writer, job)
                yield b"".join(out)
                return
            yield b"".join(out)
            out = []
            delay = max(sreq.decode_start + (sent + 1) / sreq.rate - loop.time(), STREAM_TICK)
            await asyncio.wait([sreq.done], timeout=delay)
    finally:
        _release(sim, job)


def _closing(writer: ChunkWriter, job: ChatJob) -> list[bytes]:
    plan, sreq = job.plan, job.sreq
    out = []
    _, _, calls = responses.split_output(plan, sreq.completion_tokens, job.view,
                                         complete=not sreq.aborted)
    if calls:
        out.append(writer.tools(calls))
    out.append(writer.finish(*responses.finish_of(plan, sreq.aborted)))
    if job.view.include_usage:
        out.append(writer.usage(plan, sreq.completion_tokens))
    out.append(responses.DONE)
    return out
