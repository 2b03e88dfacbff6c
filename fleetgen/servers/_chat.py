"""OpenAI's chat-completions schema as fleetgen sends it and reads it back: the request body
(`RequestBody`) and the answer (`ChatCompletion`), the same for every server kind.

A body holds what a prompt line may give (producer/inputs: `messages`, `tools` and the
sampling parameters its `SAMPLING_PARAMS` checks), the job's defaults (fleetgen/job.py), and
what a kind adds at send time (`separate_reasoning`, `chat_template_kwargs`, the served model,
`n`). An answer's fields are read where servers differ (vLLM's `reasoning`, SGLang's
`reasoning_content`, usage with or without its details), so every one may be missing.
"""

from __future__ import annotations

from typing import Any, TypedDict

# Messages, tools and the structured parameters are the prompt line's, checked at enqueue
# (producer/inputs) and sent as given.
JSONObject = dict[str, Any]


class ChatTemplateKwargs(TypedDict, total=False):
    """Passed to the model's chat template (a line may add its own keys)."""

    enable_thinking: bool


class RequestBody(TypedDict, total=False):
    """A request body, stored neutral at enqueue, shaped per server at send time: a chat
    completion's (`messages`), a raw completion's (`prompt`, `echo`), embeddings' (`input`,
    `dimensions`, `encoding_format`) or a classification's (`input`, vLLM's `use_activation`),
    fleetgen/endpoints.py."""

    model: str
    messages: list[JSONObject]
    tools: list[JSONObject]
    stream: bool
    n: int
    max_tokens: int
    max_completion_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    seed: int
    stop: str | list[str]
    stop_token_ids: list[int]
    stop_regex: str | list[str]
    ignore_eos: bool
    no_stop_trim: bool
    skip_special_tokens: bool
    logit_bias: JSONObject
    logprobs: bool
    top_logprobs: int
    response_format: JSONObject
    regex: str
    ebnf: str
    tool_choice: str | JSONObject
    reasoning_effort: str
    separate_reasoning: bool
    continue_final_message: bool
    chat_template_kwargs: ChatTemplateKwargs | None
    prompt: str | list[int]
    echo: bool
    input: str | list[str] | list[int]
    dimensions: int
    encoding_format: str
    user: str
    use_activation: bool


class Message(TypedDict, total=False):
    role: str
    content: str | None
    # SGLang and vLLM before 0.10 name the reasoning `reasoning_content`; vLLM since `reasoning`.
    reasoning_content: str | None
    reasoning: str | None
    tool_calls: list[JSONObject] | None


class Choice(TypedDict, total=False):
    index: int
    message: Message
    text: str  # a raw completion's
    finish_reason: str | None


class CompletionTokensDetails(TypedDict, total=False):
    reasoning_tokens: int | None


class CompletionUsage(TypedDict, total=False):
    """The request's token counts; SGLang gives `reasoning_tokens` at the top, vLLM and OpenAI
    in `completion_tokens_details`."""

    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None
    completion_tokens_details: CompletionTokensDetails | None


class ChatCompletion(TypedDict, total=False):
    """A chat-completions answer, as the server sent it."""

    id: str
    model: str
    object: str
    choices: list[Choice]
    # Embeddings': {"object": "embedding", "index", "embedding": [float] | base64 str}.
    data: list[JSONObject]
    usage: CompletionUsage
