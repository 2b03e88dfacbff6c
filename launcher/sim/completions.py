"""POST /v1/completions: a raw-text continuation, in SGLang's or vLLM's shape.

The same scheduler and speed model as chat (prefill, then decode), and the same text as
/generate: a plain continuation drawn from the prompt (no chat template, no thinking). Each
prompt of a list, and each of its `n` choices, is a request of its own in the scheduler; the
choices are indexed prompt by prompt (index = prompt * n + choice) and one `usage` counts
each prompt once. `max_tokens` defaults to 16 in both engines; `stop`, `min_tokens`,
`ignore_eos` and `seed` act as in chat; `echo` puts a text prompt before its continuation;
`logprobs` N adds OpenAI's legacy logprobs object (the tokens, a deterministic log
probability each, the chosen token as the only top entry when N > 0). Streaming is not
simulated on this route: `stream: true` is a 400 that says so.

An embedding server answers its engine's refusal (protocol.wrong_mode).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

import orjson
from fastapi import Request, Response

from launcher.sim import protocol, tokenizer, wording
from launcher.sim.chat import check_model
from launcher.sim.protocol import CompletionRequest, RequestError, bad_request
from launcher.sim.scheduler import SimRequest
from launcher.sim.simulator import Simulator
from launcher.sim.stress import answered
from launcher.sim.textgen import OutputPlan, TextRequest, plan_output

JSON = "application/json"
Job = tuple[SimRequest, OutputPlan, int]  # the request, its text, its prompt's index




def _fit(sim: Simulator, req: CompletionRequest, prompt_tokens: int) -> int | None:
    """max_tokens once the prompt and it pass the context checks of the words in force."""
    cfg, given = sim.cfg, sim.stress.wording
    words = given or wording.FLAVOR_WORDINGS[cfg.flavor]
    ask = wording.Ask(prompt=prompt_tokens, completion=req.max_tokens, param="max_tokens",
                      context=cfg.context_len, model=cfg.served_name,
                      auto_truncate=cfg.allow_auto_truncate)
    return wording.fit(words, ask, cfg.flavor if given is None else words)[1]


def _plan(sim: Simulator, req: CompletionRequest, key: bytes, prompt_tokens: int,
          nth: int) -> OutputPlan:
    cfg = sim.cfg
    max_new = _fit(sim, req, prompt_tokens)
    if req.seed is None:
        seed = cfg.seed if nth == 0 else (cfg.seed << 48) + nth
    else:
        seed = (cfg.seed << 32) + req.seed + nth + 1
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    room = cfg.context_len - prompt_tokens - (1 if cfg.flavor == "sglang" else 0)
    return plan_output(TextRequest(
        key=key, seed=seed, mean_tokens=cfg.mean_output_tokens, sigma=cfg.output_sigma,
        limit=max_new if max_new is not None else room, ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens, stop=stop))


def _schedule(sim: Simulator, req: CompletionRequest, rid: str,
              prompts: list[str | list[int]]) -> list[Job]:
    jobs: list[Job] = []
    try:
        for p, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else ""
            tokens = tokenizer.count(prompt) if isinstance(prompt, str) else len(prompt)
            key = text.encode() if isinstance(prompt, str) else repr(prompt).encode()
            index = sim.count_request()
            if sim.fail_prompt_hit(rid, [text]):
                tokens += sim.cfg.context_len
            sim.fail_if_poisoned([text])
            sim.fail_if_drawn(key, index)
            for c in range(max(1, req.n)):
                plan = _plan(sim, req, key, tokens, c)
                k = len(jobs)
                sreq = SimRequest(f"{rid}-{k}" if k else rid, tokens, plan.n_tokens, False,
                                  sim.scheduler.loop)
                sreq.finish_reason = "length" if plan.finish == "length" else "stop"
                sim.submit(sreq)
                jobs.append((sreq, plan, p))
    except RequestError:
        for sreq, _, _ in jobs:  # refused whole: the choices already queued are dropped
            sim.scheduler.abort_request(sreq)
        raise
    return jobs


def _logprobs(plan: OutputPlan, n: int, top: int, offset: int) -> dict[str, Any]:
    tokens = plan.pieces[:n]
    values = [-(hashlib.blake2b(b"%d" % token_id, digest_size=2).digest()[0] / 64.0)
              for token_id in plan.ids[:n]]
    offsets, at = [], offset
    for piece in tokens:
        offsets.append(at)
        at += len(piece)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
            "top_logprobs": [{t: v} for t, v in zip(tokens, values, strict=True)]
            if top > 0 else [None] * len(tokens)}


def _choice(sim: Simulator, req: CompletionRequest, job: Job, i: int,
            prompts: list[str | list[int]]) -> dict[str, Any]:
    sreq, plan, p = job
    n = sreq.completion_tokens
    prompt = prompts[p]
    echo = prompt if req.echo and isinstance(prompt, str) else ""
    text = echo + "".join(plan.pieces[:n])
    finish = "abort" if sreq.aborted else plan.finish
    logprobs = None if req.logprobs is None else _logprobs(plan, n, req.logprobs, len(echo))
    if sim.cfg.flavor == "vllm":
        stop = plan.matched if isinstance(plan.matched, str) and not sreq.aborted else None
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop, "token_ids": None, "prompt_logprobs": None,
                "prompt_token_ids": None}
    return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish,
            "matched_stop": None if sreq.aborted else plan.matched}


def _body(sim: Simulator, req: CompletionRequest, rid: str, jobs: list[Job],
          prompts: list[str | list[int]]) -> dict[str, Any]:
    choices = [_choice(sim, req, job, i, prompts) for i, job in enumerate(jobs)]
    prompt_tokens = sum(sreq.input_tokens for sreq, _, _ in jobs[::max(1, req.n)])
    completion = sum(sreq.completion_tokens for sreq, _, _ in jobs)
    total = prompt_tokens + completion
    if sim.cfg.flavor == "vllm":
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": sim.cfg.served_name, "choices": choices, "service_tier": None,
                "system_fingerprint": None,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": total,
                          "completion_tokens": completion, "prompt_tokens_details": None},
                "kv_transfer_params": None}
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": req.model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": total,
                      "completion_tokens": completion,
                      "prompt_tokens_details": {"cached_tokens": 0}
                      if sim.cfg.enable_cache_report else None,
                      "reasoning_tokens": 0, "completion_tokens_details": None},
            "metadata": {"weight_version": "default"}}


async def _answer(sim: Simulator, request: Request) -> bytes:
    flavor = sim.cfg.flavor
    req = protocol.parse_completion(request.headers.get("content-type"), await request.body(),
                                    flavor)
    if sim.cfg.is_embedding:
        raise protocol.wrong_mode(flavor, "completions")
    check_model(sim, req.model, "model" in req.model_fields_set)
    if req.stream:
        raise bad_request("stream is not simulated on /v1/completions", flavor)
    prompts = protocol.one_per_sequence(req.prompt)
    if flavor == "sglang" and (not prompts or all(not p for p in prompts)):
        raise bad_request("Prompt cannot be empty")
    rids = req.rid if isinstance(req.rid, list) else [req.rid]
    if flavor == "vllm":
        rid = "cmpl-" + (request.headers.get("x-request-id") or req.request_id
                         or uuid.uuid4().hex)
    else:
        rid = rids[0] if rids and rids[0] else uuid.uuid4().hex
    jobs = _schedule(sim, req, rid, prompts)
    for sreq, _, _ in jobs:
        await sim.wait_done(sreq, request)
    return orjson.dumps(_body(sim, req, rid, jobs, prompts))


async def completions(sim: Simulator, request: Request) -> Response:
    """The route handler."""
    return await answered(sim, request, _answer)
