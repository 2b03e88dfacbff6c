"""POST /v1/chat/completions: validate, plan the output, queue it, answer when done.

Streaming answers open (send headers) only once the first token exists, as SGLang's
kick-started generator does, so a queued streaming request waits without a response. Tokens
are then written in batches: one SSE chunk per token, all chunks due since the last wake
in one write, waking at most every STREAM_TICK seconds.

The other flavours (--flavor vllm, strict) change what is checked and how the answer reads
(docs/development/simulator.md#other-engines), never the scheduling. An --abort-rate draw
plans an abort at a token; it ends there as /abort_request would have ended it.

`n` asks several choices of one prompt, as SGLang and vLLM take it: each choice is a request
of its own in the scheduler (so n of them count as n running requests), with its own text
drawn from the request's seed plus its index; the body holds the n choices by index and one
`usage`, the prompt counted once and the completion tokens summed. A streamed request, and
the strict flavour (transformers serve), answer one choice whatever `n` says.

An embedding server (--is-embedding) answers its engine's refusal (protocol.wrong_mode).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from launcher.sim import protocol, responses, tokenizer, wording
from launcher.sim.protocol import ChatRequest, RequestError, bad_request, flavor_error
from launcher.sim.responses import ChatView
from launcher.sim.scheduler import SimRequest
from launcher.sim.simulator import Simulator
from launcher.sim.stress import error_response
from launcher.sim.textgen import OutputPlan, TextRequest, plan_output, read_conversation

STREAM_TICK = 0.02  # wall seconds between stream writes, whatever --speed is
JSON = "application/json"


@dataclass
class ChatJob:
    """A validated, scheduled chat request."""

    sreq: SimRequest
    plan: OutputPlan
    view: ChatView
    left: list[bool] = field(default_factory=lambda: [False])
    # The other choices of a request with n > 1, each its own request in the scheduler.
    more: list[tuple[SimRequest, OutputPlan]] = field(default_factory=list)

    @property
    def sreqs(self) -> list[SimRequest]:
        return [self.sreq, *(sreq for sreq, _ in self.more)]


def thinking_requested(sim: Simulator, req: ChatRequest) -> bool:
    """Qwen3's template thinks unless told not to; thinking-off mode ignores the request.

    Only SGLang maps `reasoning_effort: "none"` to thinking off; vLLM hands it to the chat
    template, which Qwen3's ignores, and transformers serve drops it."""
    if sim.cfg.mode == "thinking-off":
        return False
    kwargs = {**(sim.cfg.default_chat_template_kwargs or {}), **(req.chat_template_kwargs or {})}
    for key in ("enable_thinking", "thinking"):
        if key in kwargs:
            return bool(kwargs[key])
    return sim.cfg.flavor != "sglang" or req.reasoning_effort != "none"


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


def check_model(sim: Simulator, model: str | None, given: bool) -> None:
    """SGLang echoes any model name; vLLM answers 404 and the pinned strict server 400
    (`given`: the request named a model)."""
    cfg = sim.cfg
    if cfg.flavor == "sglang" or not given:
        return
    if cfg.flavor == "vllm" and model != cfg.served_name:
        raise flavor_error("vllm", 404, f"The model `{model}` does not exist.",
                           "NotFoundError")
    if cfg.flavor == "strict" and model != cfg.served_name:
        raise flavor_error("strict", 400, f"Server is pinned to '{cfg.served_name}'; "
                           f"requested '{model}'.", "BadRequestError")


def _check_context(sim: Simulator, req: ChatRequest, prompt_tokens: int,
                   fail_prompt: bool) -> tuple[int, int | None]:
    """(prompt tokens, max_new_tokens) once the context checks pass, in the words in force
    (--wording, else the flavour's own)."""
    cfg, given = sim.cfg, sim.stress.wording
    words = given or wording.FLAVOR_WORDINGS[cfg.flavor]
    shape = cfg.flavor if given is None else words
    ask = wording.Ask(
        prompt=prompt_tokens + (cfg.context_len if fail_prompt else 0),
        completion=req.max_completion_tokens or req.max_tokens,
        param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        context=cfg.context_len, model=cfg.served_name,
        # SGLang's own check of an explicit --context-length (transformers serve has none)
        explicit_context=cfg.context_length is not None and shape == "sglang",
        auto_truncate=cfg.allow_auto_truncate)
    return wording.fit(words, ask, shape)


def _identity(sim: Simulator, req: ChatRequest, given_rid: str | None) -> tuple[str, str]:
    """(response id, model echoed) in the flavour's manner."""
    cfg = sim.cfg
    if cfg.flavor == "vllm":
        return "chatcmpl-" + (given_rid or uuid.uuid4().hex), cfg.served_name
    if cfg.flavor == "strict":  # transformers serve names a Hub model by its revision
        name = cfg.served_name
        return str(uuid.uuid4()), name if "@" in name else name + "@main"
    return given_rid or uuid.uuid4().hex, req.model


def _view(sim: Simulator, req: ChatRequest, rid: str, model: str, prompt_tokens: int,
          thinking: bool) -> ChatView:
    cfg = sim.cfg
    parser = cfg.reasoning_parser is not None
    # vLLM splits whenever a parser runs (it has no separate_reasoning); strict never does
    split = {"sglang": parser and req.separate_reasoning, "vllm": parser, "strict": False}
    return ChatView(rid=rid, created=int(time.time()), model=model, prompt_tokens=prompt_tokens,
                    reasoning_on=split[cfg.flavor], count_reasoning=parser and thinking,
                    include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    cache_report=cfg.enable_cache_report, flavor=cfg.flavor,
                    show_reasoning=req.include_reasoning or cfg.flavor != "vllm",
                    reasoning_field=cfg.vllm_reasoning_field if cfg.flavor == "vllm"
                    else "reasoning_content")


def prepare(sim: Simulator, req: ChatRequest) -> ChatJob:
    """Validate like SGLang's serving_chat + tokenizer manager, then plan and queue."""
    cfg, flavor = sim.cfg, sim.cfg.flavor
    check_model(sim, req.model, "model" in req.model_fields_set)
    if flavor == "strict":  # transformers serve ignores these (UNUSED_CHAT_COMPLETION_FIELDS)
        req = req.model_copy(update={"tool_choice": "auto", "stream_options": None})
    if not req.messages:
        raise bad_request("Messages cannot be empty.", flavor)
    texts = [tokenizer.content_text(m.content) for m in req.messages]
    thinking = thinking_requested(sim, req)
    tools, choice = _tools(req)
    prompt_tokens = tokenizer.chat_prompt_tokens(texts, [t["function"] for t in tools], thinking)
    given_rid = req.request_id if flavor == "vllm" else _first_rid(req.rid)
    index = sim.count_request()
    prompt_tokens, max_new = _check_context(sim, req, prompt_tokens,
                                            sim.fail_prompt_hit(given_rid, texts))
    sim.fail_if_poisoned(texts)
    roles_texts = [(m.role, t) for m, t in zip(req.messages, texts, strict=True)]
    conversation = read_conversation(roles_texts)
    key = "\x00".join(f"{role}\x01{t}" for role, t in roles_texts)
    key_bytes = (key + "\x02" + ",".join(t["function"]["name"] for t in tools)).encode()
    sim.fail_if_drawn(key_bytes, index)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    # SGLang leaves room for one more token; vLLM's get_max_tokens fills the context
    room = cfg.context_len - prompt_tokens - (1 if flavor == "sglang" else 0)

    def planned(nth: int) -> OutputPlan:
        # A request's own seed draws another answer, the same one each time, as an engine's
        # does; choice i of n draws with the seed plus i (vLLM's children's seeds).
        if req.seed is None:
            seed = cfg.seed if nth == 0 else (cfg.seed << 48) + nth
        else:
            seed = (cfg.seed << 32) + req.seed + nth + 1
        return plan_output(TextRequest(
            key=key_bytes, seed=seed, mean_tokens=cfg.mean_output_tokens,
            sigma=cfg.output_sigma, limit=max_new if max_new is not None else room,
            thinking=thinking, tools=tools, tool_choice=choice, tool_rate=cfg.tool_call_rate,
            max_tool_turns=cfg.max_tool_turns, conversation=conversation,
            parse_tools=cfg.tool_call_parser is not None and flavor != "strict",
            boilerplate_rate=cfg.boilerplate_rate if cfg.mode == "thinking-off" else 0.0,
            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, stop=stop))

    def scheduled(rid: str, plan: OutputPlan, salt: bytes) -> SimRequest:
        abort_at = sim.abort_point(key_bytes + salt, index, plan.n_tokens)
        sreq = SimRequest(rid, prompt_tokens, plan.n_tokens if abort_at is None else abort_at,
                          req.stream, sim.scheduler.loop, abort_planned=abort_at is not None)
        sreq.finish_reason = "length" if plan.finish == "length" else "stop"
        return sreq

    rid, model = _identity(sim, req, given_rid)
    n = 1 if req.stream or flavor == "strict" else max(1, req.n)
    plans = [planned(i) for i in range(n)]
    sreqs = [scheduled(rid if i == 0 else f"{rid}-{i}", plan, b"" if i == 0 else b"|%d" % i)
             for i, plan in enumerate(plans)]
    submitted: list[SimRequest] = []
    try:
        for sreq in sreqs:
            sim.submit(sreq)
            submitted.append(sreq)
    except RequestError:
        for sreq in submitted:  # refused whole: the choices already queued are dropped
            sim.scheduler.abort_request(sreq)
        raise
    return ChatJob(sreqs[0], plans[0], _view(sim, req, rid, model, prompt_tokens, thinking),
                   more=list(zip(sreqs[1:], plans[1:], strict=True)))


async def chat_completions(sim: Simulator, request: Request) -> Response:
    """The route handler."""
    sim.enter()
    job: ChatJob | None = None
    try:
        req = protocol.parse_chat(request.headers.get("content-type"), await request.body(),
                                  sim.cfg.flavor)
        if sim.cfg.is_embedding:
            raise protocol.wrong_mode(sim.cfg.flavor, "chat")
        job = prepare(sim, req)
        if req.stream:
            return await _open_stream(sim, job, request)
        for sreq in job.sreqs:
            await sim.wait_done(sreq, request)
        bodies = [responses.chat_body(plan, sreq.completion_tokens, job.view, sreq.aborted)
                  for sreq, plan in [(job.sreq, job.plan), *job.more]]
        body = bodies[0] if len(bodies) == 1 else responses.several_body(bodies)
        return Response(body, media_type=JSON)
    except RequestError as err:
        return error_response(err)
    finally:
        if job is None or not job.sreq.streaming:
            sim.leave()


class ReleasingStream(StreamingResponse):
    """An SSE stream that calls `release` once it is over, however it ends: also when it
    never started (a hang held its headers until the client left), so its generator, whose
    own `finally` would release it, never ran."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


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
    return ReleasingStream(_events(sim, job), lambda: _release(sim, job))


async def _events(sim: Simulator, job: ChatJob) -> AsyncIterator[bytes]:
    sreq, plan, loop = job.sreq, job.plan, sim.scheduler.loop
    writer = responses.chunk_writer(job.view)
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
                out += writer.closing(plan, sreq.completion_tokens, sreq.aborted)
                yield b"".join(out)
                return
            yield b"".join(out)
            out = []
            delay = max(sreq.decode_start + (sent + 1) / sreq.rate - loop.time(), STREAM_TICK)
            await asyncio.wait([sreq.done], timeout=delay)
    finally:
        _release(sim, job)

