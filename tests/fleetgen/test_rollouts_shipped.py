"""The rollouts fleetgen ships (fleetgen/rollouts): what each asks the server and what it
answers, against a scripted stand-in for `generate` that records every body it is sent."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fleetgen.errors import RolloutError
from fleetgen.rollouts import (
    BestOfN,
    Body,
    CallFailed,
    Chunked,
    Completion,
    Prompt,
    RetryUnusable,
    Rollout,
    RolloutSpec,
    ToolLoop,
    best_of_n,
    chunked,
    request_digest,
    retry_unusable,
    rollout_prompt,
    tool_schema,
)

T = TypeVar("T")
# What the scripted server does with call `index` of body: answer, or refuse (CallFailed), or
# end it otherwise (the worker handing the prompt back raises its own BaseException).
Script = Callable[[int, Body], Completion | BaseException]


class FakeGenerate:
    """`generate` as a rollout sees it: numbers each call when it is made, yields to the loop
    (longer for earlier calls, so concurrent calls finish out of order), then answers from
    `script`; `bodies` is what was asked, in call order."""

    def __init__(self, script: Script, seed: int = 0) -> None:
        self.random = random.Random(seed)
        self.bodies: list[Body] = []
        self.ended = 0
        self._script = script

    async def __call__(self, body: Body) -> Completion:
        index = len(self.bodies)
        self.bodies.append(copy.deepcopy(body))
        for _ in range(3 - index % 3):
            await asyncio.sleep(0)
        self.ended += 1
        outcome = self._script(index, body)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    @property
    def calls(self) -> int:
        return len(self.bodies)


def answer(content: str | None, finish: str = "stop", reasoning: str | None = None,
           tool_calls: list[dict[str, Any]] | None = None,
           completion_tokens: int | None = None) -> Completion:
    message: dict[str, Any] = {"role": "assistant", "content": content,
                               "reasoning_content": reasoning}
    if tool_calls:
        message["tool_calls"] = tool_calls
    completion: Completion = {"id": "x", "object": "chat.completion",
                              "choices": [{"index": 0, "message": message,
                                           "finish_reason": finish}]}
    if completion_tokens is not None:
        completion["usage"] = {"completion_tokens": completion_tokens}
    return completion


def refused(index: int, code: str = "prompt_too_long") -> CallFailed:
    return CallFailed(index, code, "the request is longer than the context", status=400)


def make_prompt(text: str = "What is 6*7?", system: str | None = None,
                **sampling: Any) -> Prompt:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    return rollout_prompt("p1", 1, {"messages": messages, **sampling})


def run(rollout: Rollout, prompt: Prompt, script: Script) -> tuple[dict[str, Any], FakeGenerate]:
    generate = FakeGenerate(script)

    async def main() -> dict[str, Any]:
        return await rollout(prompt, generate)

    return asyncio.run(main()), generate


def caps(generate: FakeGenerate, key: str = "max_tokens") -> list[Any]:
    return [body.get(key) for body in generate.bodies]


# --- RetryUnusable ------------------------------------------------------------------------


def thinks_past(tokens: int) -> Script:
    """A thinking model that needs more than `tokens` of cap to reach its answer."""
    def script(index: int, body: Body) -> Completion:
        cap = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        if cap <= tokens:
            return answer("", finish="length", reasoning="Let me think...")
        return answer("42", reasoning="Let me think... 42.")
    return script


def test_an_answer_with_empty_content_cut_at_length_is_reasked_with_four_times_the_tokens() -> None:
    result, generate = run(retry_unusable, make_prompt(max_tokens=512), thinks_past(512))
    assert caps(generate) == [512, 2048]
    assert result == {"content": "42", "reasoning_content": "Let me think... 42.",
                      "finish_reason": "stop", "attempts": 2, "reasked": True, "usable": True}


def test_a_usable_first_answer_is_asked_once_as_the_line_asked_it() -> None:
    prompt = make_prompt(max_tokens=512, temperature=0.6)
    result, generate = run(retry_unusable, prompt, thinks_past(100))
    assert generate.bodies == [{"messages": prompt["messages"], "max_tokens": 512,
                                "temperature": 0.6}]
    assert (result["attempts"], result["reasked"], result["usable"]) == (1, False, True)


def test_reasks_stop_after_tries_calls_and_keep_the_last_answer_as_unusable() -> None:
    result, generate = run(RetryUnusable(tries=3), make_prompt(max_tokens=512),
                           thinks_past(10**9))
    assert caps(generate) == [512, 2048, 8192]
    assert result["attempts"] == 3
    assert (result["content"], result["finish_reason"], result["usable"]) == ("", "length", False)


def test_the_grown_cap_stops_at_max_tokens_limit() -> None:
    rollout = RetryUnusable(tries=4, growth=4, max_tokens_limit=3000)
    _, generate = run(rollout, make_prompt(max_tokens=512), thinks_past(10**9))
    assert caps(generate) == [512, 2048, 3000, 3000]


def test_a_body_capped_by_max_completion_tokens_grows_that_cap() -> None:
    _, generate = run(RetryUnusable(growth=2), make_prompt(max_completion_tokens=100),
                      thinks_past(150))
    assert caps(generate, "max_completion_tokens") == [100, 200]
    assert caps(generate) == [None, None]


def test_a_body_without_a_cap_grows_what_the_answer_spent() -> None:
    def script(index: int, body: Body) -> Completion:
        if "max_tokens" not in body:
            return answer(None, finish="length", completion_tokens=700)
        return answer("done")

    result, generate = run(retry_unusable, make_prompt(), script)
    assert caps(generate) == [None, 2800]
    assert result["usable"]


@pytest.mark.parametrize(("content", "finish", "usable"), [
    ("  \n ", "stop", False), ("", "stop", False), (None, "stop", False),
    ("half an answ", "length", False), ("42", "stop", True), ("42", None, True)])
def test_an_answer_is_unusable_when_its_content_is_blank_or_cut_at_length(
    content: str | None, finish: str | None, usable: bool,
) -> None:
    result, generate = run(RetryUnusable(tries=1), make_prompt(max_tokens=64),
                           lambda index, body: answer(content, finish=finish or "stop")
                           if finish else {"choices": [{"message": {"content": content}}]})
    assert (result["usable"], generate.calls) == (usable, 1)


def test_a_refused_reask_keeps_the_answer_in_hand_and_says_why() -> None:
    def script(index: int, body: Body) -> Completion | BaseException:
        return refused(index) if index else answer("", finish="length")

    result, generate = run(retry_unusable, make_prompt(max_tokens=512), script)
    assert generate.calls == 2
    assert (result["attempts"], result["usable"]) == (1, False)
    assert result["error"] == "prompt_too_long: the request is longer than the context"


def test_a_refused_first_call_fails_the_prompt() -> None:
    with pytest.raises(CallFailed, match="longer than the context"):
        run(retry_unusable, make_prompt(max_tokens=512), lambda index, body: refused(index))


@pytest.mark.parametrize("options", [{"tries": 0}, {"growth": 0.5}, {"tries": "3"},
                                     {"max_tokens_limit": 0}])
def test_retry_options_that_make_no_sense_are_refused_at_enqueue(options: dict[str, Any]) -> None:
    with pytest.raises(RolloutError, match="RetryUnusable"):
        RolloutSpec.of("fleetgen.rollouts:RetryUnusable", options)


# --- Chunked ------------------------------------------------------------------------------

WORDS = ["the", "of", "and", "a", "to", "in", "is", "you", "that", "it", "he", "was", "for",
         "on", "are", "as", "with", "his", "they", "at"]


def long_text(paragraphs: int = 12, seed: int = 7) -> str:
    """Paragraphs of sentences of words, as a book's text."""
    draw = random.Random(seed)
    return "\n\n".join(
        " ".join(" ".join(draw.choices(WORDS, k=draw.randint(4, 14))).capitalize() + "."
                 for _ in range(draw.randint(1, 6)))
        for _ in range(paragraphs))


@pytest.mark.parametrize("size", [40, 120, 500, 5000])
def test_pieces_hold_at_most_size_characters_and_join_back_into_the_text(size: int) -> None:
    text = long_text()
    pieces = Chunked(size=size).split(text)
    assert all(len(piece) <= size for piece in pieces)
    assert "".join(pieces) == text
    assert (pieces == [text]) == (size >= len(text))


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.sampled_from(list("ab .!?\n\t。é")), max_size=200),
       size=st.integers(1, 30))
@example(text="\n\n", size=1)
def test_any_text_is_cut_into_pieces_of_at_most_size_that_follow_each_other_in_it(
    text: str, size: int,
) -> None:
    pieces = Chunked(size=size).split(text)
    at = 0
    for piece in pieces:
        assert 0 < len(piece) <= size and piece.strip()
        found = text.index(piece, at)
        assert text[at:found].strip() == ""  # only whitespace is left out between pieces
        at = found + len(piece)
    assert text[at:].strip() == ""


def test_pieces_end_at_a_paragraph_then_a_sentence_then_a_word_when_one_fits() -> None:
    text = "First paragraph here.\n\nSecond one, which is longer. It has two sentences."
    assert Chunked(size=40).split(text) == [
        "First paragraph here.\n\n", "Second one, which is longer. ", "It has two sentences."]
    assert Chunked(size=12).split("alpha beta gamma delta") == ["alpha beta ", "gamma delta"]


def test_a_text_without_boundaries_is_cut_at_size() -> None:
    assert [len(p) for p in Chunked(size=100).split("x" * 250)] == [100, 100, 50]


def test_overlap_starts_each_piece_with_the_end_of_the_one_before() -> None:
    text = long_text(4)
    pieces = Chunked(size=100, overlap=30).split(text)
    spans, at = [], 0
    for piece in pieces:
        start = text.index(piece, max(0, at - 100))
        spans.append((start, start + len(piece)))
        at = start + len(piece)
    assert all(len(piece) <= 100 for piece in pieces)
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(b_start < a_end for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    assert all(text[b_start - 1].isspace() for _, (b_start, _) in itertools.pairwise(spans))


def echo_upper(instruction: str = "") -> Script:
    """A server that answers each piece with the piece in capitals."""
    def script(index: int, body: Body) -> Completion:
        content = body["messages"][-1]["content"]
        return answer(content.removeprefix(instruction).upper())
    return script


def test_each_piece_is_sent_in_the_user_messages_place_and_the_answers_stitched_in_order() -> None:
    text = long_text(6)
    rollout = Chunked(size=200, instruction="Translate to French:", joiner="\n--\n")
    prompt = make_prompt(text, system="You translate.", max_tokens=1024)
    result, generate = run(rollout, prompt, echo_upper("Translate to French:\n\n"))
    pieces = rollout.split(text)
    assert len(pieces) > 2
    assert [body["messages"] for body in generate.bodies] == [
        [{"role": "system", "content": "You translate."},
         {"role": "user", "content": f"Translate to French:\n\n{piece.strip()}"}]
        for piece in pieces]
    assert all(body["max_tokens"] == 1024 for body in generate.bodies)
    assert result == {"content": "\n--\n".join(p.strip().upper() for p in pieces),
                      "finish_reason": "stop", "pieces": len(pieces), "finish_reasons": ["stop"] * len(pieces),
                      "failed": []}


def test_parallel_pieces_are_asked_in_order_and_stitched_in_order() -> None:
    text = long_text(8)
    prompt = make_prompt(text)
    alone, in_turn = run(Chunked(size=150), prompt, echo_upper())
    together, at_once = run(Chunked(size=150, parallel=True), prompt, echo_upper())
    assert at_once.bodies == in_turn.bodies
    assert together == alone


def test_a_piece_answer_cut_at_length_makes_the_prompts_finish_reason_length() -> None:
    def script(index: int, body: Body) -> Completion:
        return answer("partial", finish="length" if index == 1 else "stop")

    result, _ = run(Chunked(size=100), make_prompt(long_text(4)), script)
    assert result["finish_reason"] == "length"
    assert result["finish_reasons"][:3] == ["stop", "length", "stop"]


class Handed(BaseException):
    """Stands for the worker handing a prompt back mid-call (a held request)."""


def test_parallel_calls_all_end_before_a_call_ended_otherwise_is_raised() -> None:
    text = long_text(6)
    rollout = Chunked(size=100, parallel=True)
    generate = FakeGenerate(lambda index, body: Handed() if index == 0 else answer("x"))
    with pytest.raises(Handed):
        asyncio.run(rollout(make_prompt(text), generate))
    assert generate.ended == generate.calls == len(rollout.split(text))


def refuse_call(refused_index: int) -> Script:
    def script(index: int, body: Body) -> Completion | BaseException:
        return refused(index) if index == refused_index else answer(f"answer {index}")
    return script


@pytest.mark.parametrize("parallel", [False, True])
def test_a_refused_piece_fails_the_prompt(parallel: bool) -> None:
    generate = FakeGenerate(refuse_call(1))
    rollout = Chunked(size=100, parallel=parallel)
    with pytest.raises(CallFailed) as failed:
        asyncio.run(rollout(make_prompt(long_text(4)), generate))
    assert failed.value.index == 1
    assert generate.calls == (len(rollout.split(long_text(4))) if parallel else 2)


def test_with_skip_failed_a_refused_piece_is_left_out_and_listed() -> None:
    result, generate = run(Chunked(size=100, skip_failed=True), make_prompt(long_text(4)),
                           refuse_call(1))
    assert generate.calls == result["pieces"] >= 3
    kept = [f"answer {k}" for k in range(result["pieces"]) if k != 1]
    assert result["content"] == "\n\n".join(kept)
    assert result["failed"] == [1]
    assert result["finish_reasons"][:3] == ["stop", None, "stop"]


def word_tokenizer(folder: Path) -> Path:
    """A tokenizer.json counting one token per word or punctuation mark."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, **{word: k for k, word in enumerate(WORDS + [".", ","], 1)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_by_tokens_pieces_hold_at_most_size_tokens_of_the_served_models_tokenizer(
    tmp_path: Path,
) -> None:
    path = word_tokenizer(tmp_path)
    text = long_text()
    for name in (str(path), str(tmp_path)):  # the file, or the model folder holding it
        rollout = Chunked(size=25, by="tokens", tokenizer=name)
        pieces = rollout.split(text)
        counted = [len(rollout._tokenizer.encode(p, add_special_tokens=False).ids)
                   for p in pieces]
        assert max(counted) <= 25 and sum(counted) == len(text.split()) + text.count(".")
        assert "".join(pieces) == text


def test_by_tokens_needs_a_tokenizer_and_the_tokenizers_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(RolloutError, match="name it"):
        Chunked(by="tokens")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "tokenizers" else real(name, *rest))
    with pytest.raises(RolloutError, match=r"pip install .fleetgen\[rollouts\]."):
        Chunked(by="tokens", tokenizer="Qwen/Qwen3-8B")


def test_a_tokenizer_that_cannot_be_loaded_says_what_to_give(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(RolloutError, match="cannot load tokenizer"):
        Chunked(by="tokens", tokenizer=str(tmp_path / "tokenizer.json")).split("text")


@pytest.mark.parametrize("options", [{"size": 0}, {"by": "words"}, {"overlap": 4000},
                                     {"joiner": None}])
def test_chunk_options_that_make_no_sense_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(RolloutError, match="Chunked"):
        Chunked(**options)


# --- BestOfN ------------------------------------------------------------------------------

JUDGE_PROMPT = (
    "Here are candidate answers to the same request. Judge which one answers it best.\n\n"
    "Request:\nWhat is 6*7?\n\n"
    "[1] alpha\n\n[2] beta\n\n[3] gamma\n\n"
    'Reply with the number of the best candidate as "BEST: <number>".')


def candidates_then(verdict: str, n: int = 3) -> Script:
    names = ["alpha", "beta", "gamma", "delta"]

    def script(index: int, body: Body) -> Completion:
        return answer(names[index] if index < n else verdict)
    return script


def test_the_judge_is_shown_the_numbered_candidates_and_its_choice_is_the_answer() -> None:
    prompt = make_prompt(system="Be brief.", max_tokens=256)
    prompt["tools"] = [{"type": "function", "function": {"name": "calc"}}]
    result, generate = run(BestOfN(n=3, temperature=1.0), prompt,
                           candidates_then("The second is right.\nBEST: 2"))
    *asked, judged = generate.bodies
    seeds = [body.pop("seed") for body in asked]
    assert asked == [{"messages": prompt["messages"], "max_tokens": 256, "temperature": 1.0,
                      "tools": prompt["tools"]}] * 3
    drawn = random.Random(0)  # generate.random's seed
    assert seeds == [drawn.randrange(2**31) for _ in range(3)]
    assert judged == {"messages": [{"role": "user", "content": JUDGE_PROMPT}], "max_tokens": 256}
    assert result == {"content": "beta", "finish_reason": "stop", "chosen": 2, "judged": True,
                      "candidates": ["alpha", "beta", "gamma"]}


def test_the_last_verdict_in_the_judges_reply_counts() -> None:
    result, _ = run(BestOfN(n=3), make_prompt(), candidates_then("BEST: 1? No. BEST: 3"))
    assert (result["content"], result["chosen"], result["judged"]) == ("gamma", 3, True)


@pytest.mark.parametrize("verdict", ["BEST: 4", "BEST: 0", "They are all fine.", ""])
def test_a_verdict_naming_no_candidate_falls_back_to_the_first_and_says_so(verdict: str) -> None:
    result, _ = run(BestOfN(n=3), make_prompt(), candidates_then(verdict))
    assert (result["content"], result["chosen"], result["judged"]) == ("alpha", 1, False)


def test_a_judge_instruction_replaces_the_leading_text_only() -> None:
    _, generate = run(BestOfN(n=3, judge="Which one is correct?"), make_prompt(),
                      candidates_then("BEST: 1"))
    content = generate.bodies[-1]["messages"][0]["content"]
    assert content == JUDGE_PROMPT.replace(
        "Here are candidate answers to the same request. Judge which one answers it best.",
        "Which one is correct?")


def test_a_line_asking_several_answers_gets_one_per_call() -> None:
    _, generate = run(best_of_n, make_prompt(n=3), candidates_then("BEST: 2", n=4))
    assert [body["n"] for body in generate.bodies] == [1] * 5


def test_candidates_of_a_line_with_its_own_seed_get_that_seed_plus_their_index() -> None:
    _, generate = run(best_of_n, make_prompt(seed=7), candidates_then("BEST: 2", n=4))
    assert [body["seed"] for body in generate.bodies] == [7, 8, 9, 10, 7]


def test_parallel_candidates_ask_what_sequential_ones_ask() -> None:
    alone, in_turn = run(BestOfN(n=3), make_prompt(), candidates_then("BEST: 3"))
    together, at_once = run(BestOfN(n=3, parallel=True), make_prompt(), candidates_then("BEST: 3"))
    assert (together, at_once.bodies) == (alone, in_turn.bodies)


@pytest.mark.parametrize("options", [{"n": 1}, {"temperature": 3}, {"judge": " "}])
def test_best_of_n_options_that_make_no_sense_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(RolloutError, match="BestOfN"):
        BestOfN(**options)


# --- ToolLoop -----------------------------------------------------------------------------


def add(a: int, b: int) -> int:
    """Add two integers.

    Used by the tests as a model's calculator."""
    return a + b


def divide(a: float, b: float = 1.0) -> float:
    return a / b


flow = ToolLoop(tools={"add": add, "divide": divide})


def call(name: str, arguments: str, call_id: str = "c1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def model_calling(*turns: list[dict[str, Any]]) -> Script:
    """A model that makes the given tool calls in its first turns, then answers with the
    last tool result it saw."""
    def script(index: int, body: Body) -> Completion:
        if index < len(turns):
            return answer(None, finish="tool_calls", tool_calls=turns[index])
        return answer(f"The result is {body['messages'][-1]['content']}")
    return script


def test_a_tool_call_runs_the_python_function_and_the_model_sees_its_result() -> None:
    prompt = make_prompt("What is 2 + 3?", max_tokens=128)
    result, generate = run(flow, prompt, model_calling([call("add", '{"a": 2, "b": 3}')]))
    conversation = [
        prompt["messages"][0],
        {"role": "assistant", "content": "", "tool_calls": [call("add", '{"a": 2, "b": 3}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    assert [body["messages"] for body in generate.bodies] == [conversation[:1], conversation]
    assert generate.bodies[0]["tools"] == flow.tool_schemas
    assert result == {"content": "The result is 5", "finish_reason": "stop", "turns": 2,
                      "tool_calls": 1, "capped": False,
                      "messages": [*conversation,
                                   {"role": "assistant", "content": "The result is 5"}]}


@pytest.mark.parametrize(("tool_call", "told"), [
    (call("add", '{"a": 2,'), "error: the arguments of add are not valid JSON ("),
    (call("add", '[2, 3]'), "error: the arguments of add must be a JSON object"),
    (call("add", '{"a": 2}'), "error: TypeError: "),
    (call("divide", '{"a": 1, "b": 0}'), "error: ZeroDivisionError: "),
    (call("sqrt", '{"x": 4}'), "error: no tool named 'sqrt'; the tools are add, divide"),
])
def test_a_bad_tool_call_is_told_to_the_model_as_an_error_and_the_loop_goes_on(
    tool_call: dict[str, Any], told: str,
) -> None:
    result, generate = run(flow, make_prompt(), model_calling([tool_call]))
    tool_message = result["messages"][2]
    assert tool_message["role"] == "tool" and tool_message["content"].startswith(told)
    assert (generate.calls, result["tool_calls"]) == (2, 1)
    assert result["content"] == f"The result is {tool_message['content']}"


def test_every_tool_call_of_an_answer_runs_in_order() -> None:
    result, _ = run(flow, make_prompt(), model_calling(
        [call("add", '{"a": 1, "b": 1}', "x"), call("divide", '{"a": 9, "b": 2}', "y")]))
    assert [(m["tool_call_id"], m["content"]) for m in result["messages"] if m["role"] == "tool"] \
        == [("x", "2"), ("y", "4.5")]


def test_the_loop_stops_after_turns_calls_without_running_the_last_tool_calls() -> None:
    always = model_calling(*[[call("add", '{"a": 1, "b": 2}')]] * 10)
    result, generate = run(ToolLoop(tools={"add": add}, turns=3), make_prompt(), always)
    assert (generate.calls, result["turns"], result["tool_calls"]) == (3, 3, 2)
    assert (result["capped"], result["finish_reason"]) == (True, "tool_calls")
    assert result["messages"][-1]["role"] == "assistant"


def test_a_tool_schema_is_built_from_the_signature_hints_and_docstring() -> None:
    def forecast(city: str, days: int = 3, metric: bool | None = None,
                 *, precision: float) -> str:
        """Weather forecast for a city.

        Longer text the model is not shown."""
        return city

    assert tool_schema("forecast", forecast) == {"type": "function", "function": {
        "name": "forecast", "description": "Weather forecast for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "metric": {"type": "boolean"}, "precision": {"type": "number"}},
            "required": ["city", "precision"]}}}
    assert "description" not in tool_schema("divide", divide)["function"]


def test_a_tool_whose_schema_cannot_be_built_is_refused_unless_schemas_are_given() -> None:
    def search(query, limit: list[int]) -> str:  # type: ignore[no-untyped-def]
        return str(query)

    with pytest.raises(RolloutError, match="parameter query needs a type hint"):
        ToolLoop(tools={"search": search})
    schemas = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    assert ToolLoop(tools={"search": search}, schemas=schemas).tool_schemas == schemas


def test_an_async_tool_is_refused() -> None:
    async def fetch(url: str) -> str:
        return url

    with pytest.raises(RolloutError, match="plain function"):
        ToolLoop(tools={"fetch": fetch})


def test_the_prompts_own_tools_are_shown_instead_of_built_schemas() -> None:
    prompt = make_prompt()
    prompt["tools"] = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    _, generate = run(flow, prompt, model_calling())
    assert generate.bodies[0]["tools"] == prompt["tools"]


# --- all of them ----------------------------------------------------------------------------


def test_the_shipped_rollouts_load_by_name_with_json_options() -> None:
    assert RolloutSpec.of("fleetgen.rollouts:retry_unusable").load() is retry_unusable
    assert RolloutSpec.of("fleetgen.rollouts:chunked").load() is chunked
    assert RolloutSpec.of("fleetgen.rollouts:best_of_n").load() is best_of_n
    built = RolloutSpec.of("fleetgen.rollouts:RetryUnusable", {"tries": 5}).load()
    assert built == RetryUnusable(tries=5)
    options = json.loads('{"size": 2000, "instruction": "Translate to French:", "parallel": true}')
    assert RolloutSpec.of("fleetgen.rollouts:Chunked", options).load() == Chunked(**options)
    assert RolloutSpec.of("fleetgen.rollouts:BestOfN", {"n": 2}).load() == BestOfN(n=2)
    assert RolloutSpec.of(f"{__name__}:flow").load() is flow


ROLLOUTS: list[tuple[Rollout, Prompt, Script]] = [
    (retry_unusable, make_prompt(max_tokens=64), thinks_past(1024)),
    (Chunked(size=90, parallel=True), make_prompt(long_text(5)), echo_upper()),
    (BestOfN(n=4, parallel=True), make_prompt(), candidates_then("BEST: 4", n=4)),
    (flow, make_prompt(), model_calling([call("add", '{"a": 1, "b": 2}')],
                                        [call("divide", '{"a": 3}')])),
]


@pytest.mark.parametrize(("rollout", "prompt", "script"), ROLLOUTS,
                         ids=["retry", "chunked", "best-of-n", "tool-loop"])
def test_a_rollout_run_again_on_the_same_answers_asks_the_same_bodies(
    rollout: Rollout, prompt: Prompt, script: Script,
) -> None:
    first, once = run(rollout, prompt, script)
    second, again = run(rollout, prompt, script)
    assert once.calls > 1
    assert [request_digest(b) for b in again.bodies] == [request_digest(b) for b in once.bodies]
    assert second == first
    assert json.loads(json.dumps(first)) == first  # the answer is JSON, as records keep it
