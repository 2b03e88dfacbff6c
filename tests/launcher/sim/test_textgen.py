"""The simulator's tokenizer and deterministic outputs (launcher/sim/tokenizer.py, textgen.py)."""

from __future__ import annotations

import random
import re
import statistics

import orjson

from launcher.sim import tokenizer
from launcher.sim.textgen import (
    EOS_ID,
    THINK_END,
    TextRequest,
    plan_output,
    read_conversation,
    tool_arguments,
)


def request(key: str = "hello", **kw: object) -> TextRequest:
    base: dict[str, object] = {"key": key.encode(), "seed": 0, "mean_tokens": 300.0,
                               "sigma": 0.8, "limit": 100_000}
    base.update(kw)
    return TextRequest(**base)  # type: ignore[arg-type]


def test_tokenizer_pieces_partition_the_text() -> None:
    text = "Hello, world! It's 2026 — naïve café 東京 snake_case\n\n  end."
    assert "".join(tokenizer.split(text)) == text


def test_tokenizer_counts_words_digits_and_symbols_as_documented() -> None:
    assert tokenizer.count("Hello there, how are you?") == 7
    assert tokenizer.count("1234") == 4
    assert tokenizer.count("東京") == 2


def test_chat_prompt_count_adds_template_overhead_per_message() -> None:
    one = tokenizer.chat_prompt_tokens(["Hello there"], None, thinking=True)
    two = tokenizer.chat_prompt_tokens(["Hello there", "Hello there"], None, thinking=True)
    assert one == 2 + 4 + 3
    assert two - one == 2 + 4
    assert tokenizer.chat_prompt_tokens(["Hello there"], None, thinking=False) == one + 4


def test_same_content_and_seed_give_the_same_output() -> None:
    first, again = plan_output(request()), plan_output(request())
    assert first.pieces == again.pieces and first.ids == again.ids


def test_another_seed_or_content_gives_another_output() -> None:
    base = plan_output(request())
    assert plan_output(request(seed=1)).pieces != base.pieces
    assert plan_output(request(key="other")).pieces != base.pieces


def test_natural_lengths_are_heavy_tailed_with_the_configured_mean() -> None:
    lengths = [plan_output(request(key=f"k{i}")).n_tokens for i in range(1500)]
    assert abs(statistics.mean(lengths) - 300) < 30
    assert max(lengths) > 3 * statistics.median(lengths)


def test_natural_finish_is_eos_with_its_token_id() -> None:
    plan = plan_output(request())
    assert plan.finish == "stop" and plan.matched == EOS_ID and plan.ids[-1] == EOS_ID


def test_limit_cuts_the_output_with_finish_length() -> None:
    plan = plan_output(request(limit=5))
    assert plan.n_tokens == 5 and plan.finish == "length" and plan.matched is None


def test_ignore_eos_runs_to_the_limit() -> None:
    plan = plan_output(request(limit=2000, ignore_eos=True, mean_tokens=20.0))
    assert plan.n_tokens == 2000 and plan.finish == "length"


def test_min_tokens_masks_eos_until_reached() -> None:
    plan = plan_output(request(min_tokens=500, mean_tokens=10.0))
    assert plan.n_tokens == 501 and plan.finish == "stop"


def test_stop_string_is_trimmed_and_reported() -> None:
    full = "".join(plan_output(request()).pieces)
    stop = full.split()[5]
    plan = plan_output(request(stop=(stop,)))
    text = "".join(plan.pieces)
    assert plan.finish == "stop" and plan.matched == stop
    assert text == full[:full.index(stop)]


def test_thinking_output_has_reasoning_then_think_end_then_answer() -> None:
    plan = plan_output(request(thinking=True))
    assert plan.pieces[plan.think_end] == THINK_END
    assert 0 < plan.reasoning_tokens == plan.think_end + 1 < plan.n_tokens


def test_cut_inside_thinking_counts_every_token_as_reasoning() -> None:
    plan = plan_output(request(thinking=True, limit=3))
    assert plan.think_end == -1 and plan.reasoning_tokens == 3 and plan.finish == "length"


def test_required_tool_choice_always_calls_a_tool() -> None:
    tools = ({"function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},)
    plan = plan_output(request(tools=tools, tool_choice="required"))
    assert plan.finish == "tool_calls" and plan.tool_call is not None
    assert plan.tool_call.name == "get_weather"
    assert list(orjson.loads(plan.tool_call.arguments)) == ["city"]


def test_tool_arguments_follow_the_schema_bounds_types_and_required_names() -> None:
    schema = {"type": "object", "required": ["query", "limit", "unlisted"], "properties": {
        "query": {"type": "string", "maxLength": 3}, "limit": {"type": "integer", "minimum": 50},
        "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "when": {"type": "string", "format": "date"}, "maybe": {"type": ["null", "boolean"]},
        "mode": {"anyOf": [{"type": "null"}, {"enum": ["fast", "slow"]}]},
        "ids": {"type": "array", "items": {"type": "integer", "maximum": 0}, "minItems": 2},
        "filter": {"type": "object", "properties": {"formula": {"type": "string"}}}}}
    for seed in range(20):
        args = orjson.loads(tool_arguments(schema, random.Random(seed)))
        assert list(args) == [*schema["properties"], "unlisted"]
        assert isinstance(args["query"], str) and 0 < len(args["query"]) <= 3
        assert isinstance(args["limit"], int) and 50 <= args["limit"] <= 59
        assert isinstance(args["ratio"], float) and 0 < args["ratio"] <= 1
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", args["when"])
        assert isinstance(args["maybe"], bool) and args["mode"] in ("fast", "slow")
        assert len(args["ids"]) == 2 and all(i <= 0 for i in args["ids"])
        assert re.fullmatch(r"\d+ [-+*] \d+", args["filter"]["formula"])
        assert isinstance(args["unlisted"], str)


def test_a_tool_result_is_quoted_and_the_judge_names_a_candidate() -> None:
    after_tool = read_conversation([("user", "q"), ("assistant", ""), ("tool", "42 C")])
    plan = plan_output(request(thinking=True, conversation=after_tool))
    assert "".join(plan.pieces[plan.think_end + 2:]) == "The tool returned: 42 C."
    judge = read_conversation([("user", "Pick one.\n[1] a\n[2] b\n[2] b again\nBEST:")])
    assert judge.judge_candidates == 2
    picks = {"".join(plan_output(request(f"k{i}", conversation=judge)).pieces)
             for i in range(20)}
    assert picks == {"BEST: 1", "BEST: 2"}
