"""The simulator serves multi-step programs: tool loops a program can run, best-of-n judge
answers it can parse, and a thinking model that empties answers at a small max_tokens.

As in docs/development/simulator.md#programs. One simulator serves the whole module, started
with the thinking-empty recipe (its lengths do not matter to the tool and judge tests, which
leave max_tokens unset)."""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.sim_helpers import chat_body, running_sim

RECIPE = ("--mean-output-tokens", "1800", "--output-sigma", "0.6")
MAX_TOOL_TURNS = 3  # the default of --max-tool-turns
UNITS = ("celsius", "fahrenheit")
OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub,
                                             "*": operator.mul}


def get_weather(city: str, days: int, unit: str, detailed: bool = False) -> str:
    assert isinstance(city, str) and re.fullmatch(r"[a-z]+", city), city
    assert isinstance(days, int) and 1 <= days <= 7, days
    assert unit in UNITS and isinstance(detailed, bool)
    return f"{days} days of sun in {city} ({unit})"


def calculate(expression: str) -> str:
    match = re.fullmatch(r"(\d+) ([-+*]) (\d+)", expression)
    assert match, expression
    return str(OPS[match[2]](int(match[1]), int(match[3])))


FUNCTIONS: dict[str, Callable[..., str]] = {"get_weather": get_weather, "calculate": calculate}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city", "days", "unit"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"type": "string", "enum": list(UNITS)}, "detailed": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "calculate", "parameters": {
        "type": "object", "required": ["expression"],
        "properties": {"expression": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    # one keep-alive client: a new one per request would cost more than the simulator does
    with running_sim("--instant", *RECIPE) as base_url, httpx.Client(base_url=base_url) as c:
        yield c


def ask(client: httpx.Client, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {**chat_body(), "messages": messages, **extra}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def run_calls(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """The assistant turn and one tool message per call, each call run in Python."""
    calls = choice["message"]["tool_calls"]
    out: list[dict[str, Any]] = [{"role": "assistant", "content": choice["message"]["content"],
                                  "tool_calls": calls}]
    for call in calls:
        function = FUNCTIONS[call["function"]["name"]]
        result = function(**json.loads(call["function"]["arguments"]))
        out.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return out


def tool_loop(client: httpx.Client, prompt: str, tool_choice: Any) -> tuple[int, dict[str, Any], list[Any]]:
    """Run a program's tool loop to its end: (tool results, last choice, messages)."""
    messages = user(prompt)
    for _ in range(2 * MAX_TOOL_TURNS):  # a loop that never ended fails below
        choice = ask(client, messages, tools=TOOLS, tool_choice=tool_choice)
        if choice["finish_reason"] != "tool_calls":
            return sum(m["role"] == "tool" for m in messages), choice, messages
        messages += run_calls(choice)
    raise AssertionError(f"the tool loop of {prompt!r} did not end")


def test_tool_arguments_conform_to_the_schema_so_the_function_runs(client: httpx.Client) -> None:
    for name in FUNCTIONS:
        for i in range(10):
            choice = ask(client, user(f"Task {i}: use {name}"), tools=TOOLS,
                         tool_choice={"type": "function", "function": {"name": name}})
            assert choice["finish_reason"] == "tool_calls"
            [call] = choice["message"]["tool_calls"]
            assert call["function"]["name"] == name
            arguments = json.loads(call["function"]["arguments"])
            if name == "get_weather":
                assert {"city", "days", "unit", "detailed"} == set(arguments)
            run_calls(choice)  # the function asserts each argument's type and range


def test_tool_arguments_are_drawn_from_the_prompt_the_same_each_time(client: httpx.Client) -> None:
    def arguments(prompt: str) -> str:
        choice = ask(client, user(prompt), tools=TOOLS, tool_choice="required")
        return str(choice["message"]["tool_calls"][0]["function"]["arguments"])

    drawn = [arguments(f"Request {i}") for i in range(10)]
    assert drawn == [arguments(f"Request {i}") for i in range(10)]
    assert len(set(drawn)) > 3


def test_tool_choice_none_never_calls_and_required_always_calls(client: httpx.Client) -> None:
    for i in range(20):
        none = ask(client, user(f"Question {i}"), tools=TOOLS, tool_choice="none")
        assert none["finish_reason"] == "stop" and not none["message"].get("tool_calls")
        required = ask(client, user(f"Question {i}"), tools=TOOLS, tool_choice="required")
        assert required["finish_reason"] == "tool_calls"
        assert len(required["message"]["tool_calls"]) == 1


def test_tool_call_ids_are_new_for_each_request(client: httpx.Client) -> None:
    ids = [ask(client, user("Same question"), tools=TOOLS, tool_choice="required")
           ["message"]["tool_calls"][0]["id"] for _ in range(5)]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    assert len(set(ids)) == 5


def test_the_answer_after_a_tool_result_quotes_it(client: httpx.Client) -> None:
    for i in range(10):
        messages = user(f"What is the weather, case {i}?")
        messages += run_calls(ask(client, messages, tools=TOOLS, tool_choice="required"))
        result = messages[-1]["content"]
        choice = ask(client, messages, tools=TOOLS, tool_choice="auto")
        assert choice["message"]["content"] == f"The tool returned: {result}."


def test_a_required_tool_loop_ends_after_max_tool_turns_results(client: httpx.Client) -> None:
    results, last, messages = tool_loop(client, "Keep calling tools", "required")
    assert results == MAX_TOOL_TURNS and last["finish_reason"] == "stop"
    assert last["message"]["content"] == f"The tool returned: {messages[-1]['content']}."


def test_auto_tool_loops_end_within_max_tool_turns(client: httpx.Client) -> None:
    lengths = [tool_loop(client, f"Plan trip {i}", "auto")[0] for i in range(30)]
    assert max(lengths) <= MAX_TOOL_TURNS
    assert 0 in lengths and len(set(lengths)) > 1  # the rate decides each round


def test_max_tool_turns_is_a_flag() -> None:
    with running_sim("--instant", "--max-tool-turns", "1") as base_url, \
            httpx.Client(base_url=base_url) as one_turn:
        assert tool_loop(one_turn, "Keep calling tools", "required")[0] == 1


def judge_prompt(i: int, candidates: int) -> str:
    listed = "\n".join(f"[{n}] Answer {n} to question {i}." for n in range(1, candidates + 1))
    return (f"Question {i}: which answer is best?\n\n{listed}\n\n"
            'Reply with the number of the best candidate as "BEST: <number>".')


def best(choice: dict[str, Any]) -> int:
    match = re.fullmatch(r"(?:.*\n)?BEST: (\d+)", choice["message"]["content"])
    assert match, choice["message"]["content"]
    return int(match[1])


def test_a_judge_answer_parses_names_a_candidate_and_is_deterministic(client: httpx.Client) -> None:
    picks = {}
    for i in range(30):
        candidates = 2 + i % 4
        pick = best(ask(client, user(judge_prompt(i, candidates))))
        assert 1 <= pick <= candidates
        picks[i] = pick
    assert picks == {i: best(ask(client, user(judge_prompt(i, 2 + i % 4)))) for i in range(30)}
    assert len(set(picks.values())) > 2


def test_a_judge_prompt_without_candidate_markers_gets_best_1(client: httpx.Client) -> None:
    assert best(ask(client, user('Which was best? Reply as "BEST: <number>".'))) == 1


def empty_share(client: httpx.Client, max_tokens: int, prompts: int = 200) -> float:
    empty = 0
    for i in range(prompts):
        choice = ask(client, user(f"Solve problem {i} step by step."), max_tokens=max_tokens)
        if not choice["message"]["content"]:
            assert choice["finish_reason"] == "length"
            assert choice["message"]["reasoning_content"]
            empty += 1
    return empty / prompts


def test_thinking_empties_most_answers_at_512_tokens_but_not_at_8192(client: httpx.Client) -> None:
    assert 0.8 <= empty_share(client, 512) <= 0.93
    assert empty_share(client, 8192) <= 0.01
