"""A chat job that does not fit the context, refused in the words of each engine (`--wording`).

Two cases, each engine with its own comparison, status, text and JSON shape
(docs/development/simulator.md#wordings):

- (a) the prompt does not fit: the prompt alone fills the context;
- (b) the completion does not fit: the prompt fits, but the tokens the job asks to generate
  (`max_completion_tokens`, else `max_tokens`) do not fit beside it, or are more than the model
  may generate at all (the context length stands for that cap).

    wording     (a)                                  (b)
    sglang      400 "The input (N tokens) is ..."    400 "Requested token count exceeds ..."
    vllm        400 "... your request has N input"   400 "'max_tokens' or ... is too large"
    tgi         422 "`inputs` tokens + ... <= C"     422 the same
    openai      400 context_length_exceeded          400 "max_tokens is too large" or the same
    llamacpp    400 exceed_context_size_error        none: the answer stops at the context
    anthropic   400 "prompt is too long: ..."        400 "max_tokens: M > C ..." or "input
                                                     length and `max_tokens` exceed ..."

`fit` checks one job in one wording; the SGLang checks are shared with `/generate`
(`sglang_fit`), which always speaks SGLang's words.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from launcher.sim.errors import SimError
from launcher.sim.protocol import RequestError, flavor_error

WORDINGS = ("sglang", "vllm", "tgi", "openai", "llamacpp", "anthropic")
# The wording a flavour speaks unless told otherwise: transformers serve has no context check
# of its own, so the strict flavour keeps SGLang's, in its own `{"detail": ...}` shape.
FLAVOR_WORDINGS = {"sglang": "sglang", "vllm": "vllm", "strict": "sglang"}


class ContextLengthError(SimError, ValueError):
    """The input (or input + max_new_tokens) does not fit the context, in SGLang's words."""


@dataclass(slots=True)
class Ask:
    """What a chat job asks of the context (one per request: plain slots are cheapest)."""

    prompt: int  # the prompt's tokens
    completion: int | None  # max_completion_tokens, else max_tokens; None: neither was given
    param: str  # the request field that carried `completion`
    context: int  # the context length in force
    model: str  # the served model's name (Anthropic's message names it)
    # --context-length was given: SGLang then also caps the completion at it
    explicit_context: bool = False
    auto_truncate: bool = False  # SGLang's --allow-auto-truncate


def fit(wording: str, ask: Ask, shape: str) -> tuple[int, int | None]:
    """(prompt tokens, completion limit) once `ask` passes `wording`'s checks, else the
    RequestError that engine answers. `shape` is the flavour whose error body carries SGLang's
    words (its own, or the strict flavour's `{"detail": ...}`)."""
    if wording == "sglang":
        return _sglang(ask, shape)
    refusal = _REFUSALS[wording](ask)
    if refusal is not None:
        raise refusal
    if wording == "llamacpp" and ask.completion is not None:
        # llama.cpp checks the prompt only; generation stops where the context ends
        return ask.prompt, min(ask.completion, ask.context - ask.prompt)
    return ask.prompt, ask.completion


def input_too_long(input_tokens: int, context_len: int) -> ContextLengthError:
    """SGLang's message for a prompt at or over the context length."""
    return ContextLengthError(f"The input ({input_tokens} tokens) is longer than the model's "
                              f"context length ({context_len} tokens).")


def sglang_fit(input_tokens: int, max_new: int | None, context_len: int,
               auto_truncate: bool) -> tuple[int, int | None]:
    """(input, max_new_tokens) after SGLang's `_validate_one_request` checks (tokenizer
    manager); --allow-auto-truncate clamps instead of refusing."""
    if auto_truncate:
        input_tokens = min(input_tokens, context_len - 2)
        if max_new is not None and max_new + input_tokens >= context_len:
            max_new = context_len - input_tokens - 1
        return input_tokens, max_new
    if input_tokens >= context_len:
        raise input_too_long(input_tokens, context_len)
    if max_new is not None and max_new + input_tokens >= context_len:
        raise ContextLengthError(
            f"Requested token count exceeds the model's maximum context length of {context_len} "
            f"tokens. You requested a total of {max_new + input_tokens} tokens: {input_tokens} "
            f"tokens from the input messages and {max_new} tokens for the completion. Please "
            "reduce the number of tokens in the input messages or the completion to fit within "
            "the limit.")
    return input_tokens, max_new


def _sglang(ask: Ask, shape: str) -> tuple[int, int | None]:
    # serving_chat's `_validate_request` runs before tokenization, and only with an explicit
    # --context-length (sic: no space after the first full stop)
    if ask.explicit_context and ask.completion and ask.completion > ask.context:
        raise flavor_error(shape, 400, f"max_completion_tokens is too large: {ask.completion}."
                           f"This model supports at most {ask.context} completion tokens.",
                           "BadRequestError")
    try:
        return sglang_fit(ask.prompt, ask.completion, ask.context, ask.auto_truncate)
    except ContextLengthError as exc:
        raise flavor_error(shape, 400, str(exc), "BadRequestError") from exc


def _vllm(ask: Ask) -> RequestError | None:
    """vLLM 0.11.0's `_validate_input` (serving_engine.py)."""
    n, m, c = ask.prompt, ask.completion, ask.context
    if n >= c:
        message = (f"This model's maximum context length is {c} tokens. However, your request "
                   f"has {n} input tokens. Please reduce the length of the input messages.")
    elif m is not None and n + m > c:
        message = (f"'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's "
                   f"maximum context length is {c} tokens and your request has {n} input "
                   f"tokens ({m} > {c} - {n}).")
    else:
        return None
    # vLLM reports preprocessing errors as f"{e} {e.__cause__}": a trailing " None"
    return flavor_error("vllm", 400, f"{message} None", "BadRequestError")


def _tgi(ask: Ask) -> RequestError | None:
    """TGI's router (validation.rs `validate_input`): max_total_tokens is the context, and
    max_input_tokens one less; without max_new_tokens the rest of the context is asked."""
    n, c = ask.prompt, ask.context
    m = ask.completion if ask.completion is not None else max(c - n, 0)
    if n + m > c:
        message = (f"`inputs` tokens + `max_new_tokens` must be <= {c}. Given: {n} `inputs` "
                   f"tokens and {m} `max_new_tokens`")
    elif n > c - 1:
        message = f"`inputs` must have less than {c - 1} tokens. Given: {n}"
    else:
        return None
    return RequestError(422, orjson.dumps({"error": f"Input validation error: {message}",
                                           "error_type": "validation"}))


def _openai(ask: Ask) -> RequestError | None:
    """OpenAI's API: the completion cap first (a parameter check), then the context."""
    n, m, c = ask.prompt, ask.completion, ask.context
    if m is not None and m > c:
        return _openai_error(f"{ask.param} is too large: {m}. This model supports at most {c} "
                             f"completion tokens, whereas you provided {m}.", ask.param, None)
    if m is not None and n + m > c:
        return _openai_error(
            f"This model's maximum context length is {c} tokens. However, you requested "
            f"{n + m} tokens ({n} in the messages, {m} in the completion). Please reduce the "
            "length of the messages or completion.", "messages", "context_length_exceeded")
    if m is None and n >= c:
        return _openai_error(
            f"This model's maximum context length is {c} tokens. However, your messages "
            f"resulted in {n} tokens. Please reduce the length of the messages.", "messages",
            "context_length_exceeded")
    return None


def _openai_error(message: str, param: str, code: str | None) -> RequestError:
    return RequestError(400, orjson.dumps({"error": {
        "message": message, "type": "invalid_request_error", "param": param, "code": code}}))


def _llamacpp(ask: Ask) -> RequestError | None:
    """llama.cpp's server: a prompt that fills the slot's context is refused, with the counts
    as fields of their own."""
    if ask.prompt < ask.context:
        return None
    return RequestError(400, orjson.dumps({"error": {
        "code": 400, "message": "the request exceeds the available context size, try "
        "increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": ask.prompt,
        "n_ctx": ask.context}}))


def _anthropic(ask: Ask) -> RequestError | None:
    """Anthropic's Messages API: the output cap, the prompt, then the prompt and max_tokens
    together (the context length stands for the output cap)."""
    n, m, c = ask.prompt, ask.completion, ask.context
    if m is not None and m > c:
        message = (f"max_tokens: {m} > {c}, which is the maximum allowed number of output "
                   f"tokens for {ask.model}")
    # a prompt that fills the context exactly is refused here only when no max_tokens asks
    # for more (Anthropic requires one; the simulator's clients may leave it out)
    elif n > c or (m is None and n >= c):
        message = f"prompt is too long: {n} tokens > {c} maximum"
    elif m is not None and n + m > c:
        message = (f"input length and `max_tokens` exceed context limit: {n} + {m} > {c}, "
                   "decrease input length or `max_tokens` and try again")
    else:
        return None
    return RequestError(400, orjson.dumps({"type": "error", "error": {
        "type": "invalid_request_error", "message": message}}))


_REFUSALS = {"vllm": _vllm, "tgi": _tgi, "openai": _openai, "llamacpp": _llamacpp,
             "anthropic": _anthropic}
