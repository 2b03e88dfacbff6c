"""POST /generate, SGLang's native API (docs/reference/sglang.md#generate).

`text` (str or list) or `input_ids` (list or list of lists); `sampling_params` (dict or one
per prompt) with `max_new_tokens` defaulting to 128, `stop`, `ignore_eos`, `min_new_tokens`.
Outputs are plain continuations (no chat template, no thinking). A stream sends the
cumulative text, one event per write (SGLang sends one per token; the content is the same).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, NotRequired, TypedDict

import orjson
from fastapi import Request, Response

from launcher.sim import protocol, tokenizer, wording
from launcher.sim.chat import JSON, STREAM_TICK, ReleasingStream
from launcher.sim.protocol import RequestError
from launcher.sim.scheduler import SimRequest
from launcher.sim.simulator import Simulator
from launcher.sim.stress import media_type
from launcher.sim.textgen import OutputPlan, TextRequest, plan_output

DEFAULT_MAX_NEW_TOKENS = 128
Job = tuple[SimRequest, OutputPlan]


def _error(message: str, status: int = 400) -> RequestError:
    return RequestError(status, orjson.dumps({"error": {"message": message}}))


def _prompts(data: Any) -> tuple[list[tuple[str | None, list[int] | None]], bool]:
    """[(text, input_ids)] and whether the request was a batch."""
    if not isinstance(data, dict):
        raise RequestError(400, orjson.dumps({"error": "Request body must be a JSON object."}))
    text, ids = data.get("text"), data.get("input_ids")
    if isinstance(text, str):
        return [(text, None)], False
    if isinstance(text, list) and all(isinstance(t, str) for t in text) and text:
        return [(t, None) for t in text], True
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
        return [(None, ids)], False
    if isinstance(ids, list) and ids and all(isinstance(i, list) for i in ids):
        return [(None, list(i)) for i in ids], True
    if text is None and ids is None:
        raise _error("Either text, input_ids or input_embeds should be provided.")
    raise RequestError(400, orjson.dumps({"error": "'text' must be a string or a list of "
                                                   "strings; 'input_ids' a list of integers"}))


def _params(data: dict[str, Any], i: int) -> dict[str, Any]:
    params = data.get("sampling_params") or {}
    if isinstance(params, list):
        params = params[i] if i < len(params) else {}
    return params if isinstance(params, dict) else {}


def _prepare_one(sim: Simulator, data: dict[str, Any], i: int, text: str | None,
                 ids: list[int] | None, stream: bool) -> Job:
    cfg, params = sim.cfg, _params(data, i)
    prompt_tokens = tokenizer.count(text) if text is not None else len(ids or ())
    rids = data.get("rid")
    rid = rids[i] if isinstance(rids, list) and i < len(rids) else rids
    rid = rid if isinstance(rid, str) else uuid.uuid4().hex
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    index = sim.count_request()
    try:
        if sim.fail_prompt_hit(rid, [text or ""]):
            raise wording.input_too_long(cfg.context_len + prompt_tokens, cfg.context_len)
        prompt_tokens, max_new = wording.sglang_fit(prompt_tokens, max_new, cfg.context_len,
                                                    cfg.allow_auto_truncate)
    except wording.ContextLengthError as exc:
        raise _error(str(exc)) from exc
    key = (text if text is not None else ",".join(map(str, ids or ()))).encode()
    sim.fail_if_drawn(key, index, plain_500=True)
    stop = params.get("stop")
    plan = plan_output(TextRequest(
        key=key, seed=cfg.seed, mean_tokens=cfg.mean_output_tokens, sigma=cfg.output_sigma,
        limit=max_new if max_new is not None else cfg.context_len - prompt_tokens - 1,
        ignore_eos=bool(params.get("ignore_eos")),
        min_tokens=int(params.get("min_new_tokens") or 0),
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ())))
    sreq = SimRequest(rid, prompt_tokens, plan.n_tokens, stream, sim.scheduler.loop)
    sim.submit(sreq)
    return sreq, plan


class MetaInfo(TypedDict):
    """A result's `meta_info`, as SGLang's /generate writes it: the speculative figures with
    speculative decoding, the timings with --enable-metrics."""

    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    weight_version: str
    num_retractions: int
    e2e_latency: float
    spec_verify_ct: NotRequired[int]
    spec_accept_length: NotRequired[float]
    spec_accept_rate: NotRequired[float]
    spec_num_correct_drafts: NotRequired[int]
    spec_num_proposed_drafts: NotRequired[int]
    request_received_ts: NotRequired[float]
    first_token_latency: NotRequired[float]
    queue_time: NotRequired[float]
    decode_throughput: NotRequired[float]
    forward_entry_time: NotRequired[float]
    prefill_finished_time: NotRequired[float]
    request_finished_ts: NotRequired[float]


def meta_info(sim: Simulator, job: Job, n: int, final: bool) -> MetaInfo:
    """The `meta_info` of a (possibly partial) result."""
    sreq, plan = job
    loop_now = sim.scheduler.loop.time()
    meta: MetaInfo = {"id": sreq.rid, "finish_reason": _finish(plan, sreq) if final else None,
                      "prompt_tokens": sreq.input_tokens, "completion_tokens": n,
                      "cached_tokens": 0, "reasoning_tokens": 0,
                      "weight_version": "default", "num_retractions": 0,
                      "e2e_latency": loop_now - sreq.arrival}
    if sim.cfg.speculative and n > 0:
        accept = sim.cfg.speculative_accept_length
        verify = max(1, math.ceil(n / accept))
        draft = sim.capacity.spec_draft_tokens or 2
        meta["spec_verify_ct"] = verify
        meta["spec_accept_length"] = n / verify
        meta["spec_accept_rate"] = sim.scheduler.accept_rate()
        meta["spec_num_correct_drafts"] = n - verify
        meta["spec_num_proposed_drafts"] = verify * (draft - 1)
    if sim.cfg.enable_metrics and sreq.admitted_at is not None:
        to_unix = time.time() - loop_now
        first = sreq.first_token_at()
        meta["request_received_ts"] = to_unix + sreq.arrival
        meta["first_token_latency"] = first - sreq.arrival
        meta["queue_time"] = sreq.admitted_at - sreq.arrival
        meta["decode_throughput"] = n / max(loop_now - first, 1e-9) if n > 1 else 0.0
        meta["forward_entry_time"] = to_unix + sreq.admitted_at
        meta["prefill_finished_time"] = to_unix + sreq.decode_start
        meta["request_finished_ts"] = to_unix + loop_now
    return meta


def _finish(plan: OutputPlan, sreq: SimRequest) -> dict[str, Any]:
    if sreq.aborted:
        return {"type": "abort", "message": "Aborted" if sreq.aborted == "Aborted"
                else sreq.aborted, "status_code": None, "err_type": None}
    if plan.finish == "length":
        return {"type": "length", "length": plan.n_tokens}
    return {"type": "stop", "matched": plan.matched}


def _result(sim: Simulator, job: Job, n: int, final: bool) -> dict[str, Any]:
    plan = job[1]
    return {"text": "".join(plan.pieces[:n]), "output_ids": plan.ids[:n],
            "meta_info": meta_info(sim, job, n, final)}


async def generate(sim: Simulator, request: Request) -> Response:
    """The route handler."""
    sim.enter()
    jobs: list[Job] = []
    streaming = False
    try:
        data = protocol.parse_json_body(request.headers.get("content-type"),
                                        await request.body(), check_media_type=False)
        prompts, batch = _prompts(data)
        streaming = bool(data.get("stream")) and not batch
        for i, (text, ids) in enumerate(prompts):
            jobs.append(_prepare_one(sim, data, i, text, ids, streaming))
        if streaming:
            release = _releaser(sim, jobs[0][0])
            return ReleasingStream(_events(sim, jobs[0], release), release)
        for sreq, _ in jobs:
            await sim.wait_done(sreq, request)
        results = [_result(sim, job, job[0].completion_tokens, True) for job in jobs]
        return Response(orjson.dumps(results if batch else results[0]), media_type=JSON)
    except RequestError as err:
        for sreq, _ in jobs:
            sim.scheduler.abort_request(sreq)
        return Response(err.body, status_code=err.status, media_type=media_type(err.body),
                        headers=err.headers)
    finally:
        if not streaming or not jobs:
            sim.leave()


def _releaser(sim: Simulator, sreq: SimRequest) -> Callable[[], None]:
    """Abort a streamed request that did not finish and count it out, once."""
    released = [False]

    def release() -> None:
        if not released[0]:
            released[0] = True
            if not sreq.done.done():
                sim.scheduler.abort_request(sreq)
            sim.leave()

    return release


async def _events(sim: Simulator, job: Job, release: Callable[[], None]) -> AsyncIterator[bytes]:
    sreq, loop = job[0], sim.scheduler.loop
    sent = 0
    try:
        while True:
            done = sreq.done.done()
            upto = sreq.completion_tokens if done else sreq.tokens_at(loop.time())
            if upto > sent or done:
                sent = upto
                yield b"data: " + orjson.dumps(_result(sim, job, sent, done)) + b"\n\n"
            if done:
                yield b"data: [DONE]\n\n"
                return
            if sreq.admitted is not None and not sreq.admitted.done():
                await asyncio.wait([sreq.admitted])
                continue
            next_at = sreq.decode_start + (sent + 1) / sreq.rate
            await asyncio.wait([sreq.done], timeout=max(next_at - loop.time(), STREAM_TICK))
    finally:
        release()
