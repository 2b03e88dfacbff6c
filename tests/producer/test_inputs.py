"""producer.inputs: the three line shapes, ids, every kind of bad line, streaming and rejects."""

import hashlib
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen.errors import JobError
from fleetgen.job import MAX_SAMPLES, MAX_TOKENS_LIMIT, GenerationParams
from fleetgen.sink import open_sink
from producer.inputs import (
    REJECT_RAW_CHARS,
    SAMPLING_PARAMS,
    IdIndex,
    InputError,
    InputErrors,
    NoPrompts,
    PromptRecord,
    Rejects,
    hash_id,
    read_prompts,
    validate_file,
)
from producer.samples import SAMPLE_PATH
from producer.samples.generate_sample import write_bulk, write_sample

HI = [{"role": "user", "content": "hi"}]
ANSWERS = f"an integer in [1, {MAX_SAMPLES}] (answers per prompt)"
GOOD = {"id": "good", "messages": HI}


def write_jsonl(tmp_path: Path, *lines: Any, name: str = "prompts.jsonl") -> Path:
    """Write each line: bytes and str verbatim, anything else as JSON."""
    path = tmp_path / name
    with path.open("wb") as out:
        for line in lines:
            if isinstance(line, str):
                line = line.encode()
            elif not isinstance(line, bytes):
                line = orjson.dumps(line)
            out.write(line + b"\n")
    return path


def the_only_error(path: Path) -> InputError:
    with pytest.raises(InputErrors) as raised:
        validate_file(path)
    assert len(raised.value.errors) == 1, str(raised.value)
    return raised.value.errors[0]


def openai_line(custom_id: str = "req-1", **body: Any) -> dict[str, Any]:
    body = {"model": "m", "messages": HI, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_chat_line_is_read_with_its_id_tools_and_sampling(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    line = {"id": "q1", "messages": HI, "tools": tools, "sampling": {"temperature": 0.2}}
    [record] = read_prompts(write_jsonl(tmp_path, line))
    assert record == PromptRecord("q1", 1, {"messages": HI, "tools": tools, "temperature": 0.2})


def test_plain_prompt_becomes_one_user_message(tmp_path: Path) -> None:
    [record] = read_prompts(write_jsonl(tmp_path, {"id": "p", "prompt": "hi"}))
    assert record.body == {"messages": HI}


def test_integer_id_becomes_a_string(tmp_path: Path) -> None:
    [record] = read_prompts(write_jsonl(tmp_path, {"id": 42, "prompt": "hi"}))
    assert record.id == "42"


def test_openai_batch_line_keeps_chat_params_and_drops_model_and_stream(tmp_path: Path) -> None:
    line = openai_line(max_tokens=64, stream=False, seed=3, chat_template_kwargs={"think": True})
    [record] = read_prompts(write_jsonl(tmp_path, line))
    assert record.id == "req-1"
    assert record.body == {
        "messages": HI,
        "max_tokens": 64,
        "seed": 3,
        "chat_template_kwargs": {"think": True},
    }


def test_null_sampling_values_are_dropped_so_job_defaults_apply(tmp_path: Path) -> None:
    line = {"id": "a", "messages": HI, "sampling": {"temperature": None, "max_tokens": 5}}
    [record] = read_prompts(write_jsonl(tmp_path, line))
    assert record.body == {"messages": HI, "max_tokens": 5}


def test_content_parts_and_assistant_tool_calls_without_content_are_accepted(
    tmp_path: Path,
) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "tool_calls": [call]},
    ]
    [record] = read_prompts(write_jsonl(tmp_path, {"messages": messages}))
    assert record.body["messages"] == messages


def test_line_without_id_is_named_by_the_documented_content_hash(tmp_path: Path) -> None:
    sampling = {"temperature": 0.5, "stop": ["\n"]}
    [record] = read_prompts(write_jsonl(tmp_path, {"messages": HI, "sampling": sampling}))
    canonical = {"messages": HI, "tools": None, "sampling": sampling}
    digest = hashlib.sha256(orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS)).hexdigest()
    assert record.id == "h-" + digest[:24]


def test_hash_id_does_not_depend_on_key_order(tmp_path: Path) -> None:
    one = '{"messages": [{"role": "user", "content": "hi"}], "sampling": {"top_p": 1, "seed": 2}}'
    two = '{"sampling": {"seed": 2, "top_p": 1}, "messages": [{"content": "hi", "role": "user"}]}'
    [first] = read_prompts(write_jsonl(tmp_path, one, name="one.jsonl"))
    [second] = read_prompts(write_jsonl(tmp_path, two, name="two.jsonl"))
    assert first.id == second.id


def test_plain_prompt_hashes_like_the_same_chat_message(tmp_path: Path) -> None:
    [plain] = read_prompts(write_jsonl(tmp_path, {"prompt": "hi"}, name="plain.jsonl"))
    [chat] = read_prompts(write_jsonl(tmp_path, {"messages": HI}, name="chat.jsonl"))
    assert plain.id == chat.id


def test_hash_id_changes_with_any_part_of_the_content() -> None:
    bodies: list[dict[str, Any]] = [
        {"messages": HI},
        {"messages": [{"role": "user", "content": "hi!"}]},
        {"messages": [{"role": "system", "content": "hi"}]},
        {"messages": HI, "tools": [{"type": "function"}]},
        {"messages": HI, "tools": []},
        {"messages": HI, "temperature": 0.1},
        {"messages": HI, "temperature": 0.2},
    ]
    assert len({hash_id(body) for body in bodies}) == len(bodies)


def test_blank_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path, "", {"id": "a", "prompt": "x"}, "   ", "\t", {"id": "b", "prompt": "y"}
    )
    assert [(r.id, r.line) for r in read_prompts(path)] == [("a", 2), ("b", 5)]
    summary = validate_file(path)
    assert (summary.lines, summary.prompts, summary.blank_lines) == (5, 2, 3)


def test_a_byte_order_mark_at_the_start_of_the_file_is_ignored(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, b"\xef\xbb\xbf" + orjson.dumps(GOOD))
    assert [r.id for r in read_prompts(path)] == ["good"]


def test_windows_line_endings_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "x"}\r\n{"id": "b", "prompt": "y"}\r\n')
    assert [r.id for r in read_prompts(path)] == ["a", "b"]


BAD_LINES: list[tuple[str, Any, str, str]] = [
    ("invalid JSON", '{"id": "x", "prompt": "hi"', "line", "invalid JSON: unexpected end of data"),
    ("not an object", [1, 2], "line", "expected a JSON object; got array"),
    ("no known shape", {"text": "hi"}, "line", "no prompt"),
    ("missing messages", {"id": "x"}, "messages", "missing"),
    (
        "empty messages",
        {"messages": []},
        "messages",
        "expected a non-empty list of messages; got []",
    ),
    ("messages not a list", {"messages": "hi"}, "messages", 'got "hi"'),
    ("message not an object", {"messages": ["hi"]}, "messages[0]", 'expected an object; got "hi"'),
    ("missing role", {"messages": [{"content": "hi"}]}, "messages[0].role", "; missing"),
    (
        "wrong role",
        {"messages": [*HI, *HI, {"role": "bot", "content": "x"}]},
        "messages[2].role",
        'expected one of system, user, assistant, tool, developer; got "bot"',
    ),
    (
        "content of the wrong type",
        {"messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
        "expected a string, a list of content parts or null; got 5",
    ),
    (
        "null content for a user",
        {"messages": [{"role": "user", "content": None}]},
        "messages[0].content",
        "got null; only an assistant message with tool_calls may omit it",
    ),
    (
        "missing content without tool calls",
        {"messages": [{"role": "assistant"}]},
        "messages[0].content",
        "missing",
    ),
    (
        "content part without a type",
        {"messages": [{"role": "user", "content": [{"text": "hi"}]}]},
        "messages[0].content[0]",
        '"type"',
    ),
    ("empty prompt", {"prompt": ""}, "prompt", 'expected a non-empty string; got ""'),
    ("prompt not a string", {"prompt": ["hi"]}, "prompt", "got array"),
    ("prompt and messages", {"prompt": "hi", "messages": HI}, "prompt", "not both"),
    ("tools not a list", {"messages": HI, "tools": {"a": 1}}, "tools", "got object"),
    ("tools of strings", {"messages": HI, "tools": ["get_weather"]}, "tools", "list of objects"),
    ("sampling not an object", {"messages": HI, "sampling": [1]}, "sampling", "got array"),
    (
        "misplaced sampling param",
        {"messages": HI, "max_tokens": 5},
        "max_tokens",
        'unknown field (sampling params go under "sampling")',
    ),
    (
        "messages in sampling",
        {"messages": HI, "sampling": {"messages": HI}},
        "sampling.messages",
        "not a sampling",
    ),
    ("bad method", openai_line() | {"method": "GET"}, "method", 'expected "POST"; got "GET"'),
    ("bad url", openai_line() | {"url": "/v1/responses"}, "url", 'got "/v1/responses"'),
    (
        "missing body",
        {"custom_id": "r", "method": "POST", "url": "/v1/chat/completions"},
        "body",
        "missing",
    ),
    (
        "missing custom_id",
        {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": HI}},
        "custom_id",
        "missing",
    ),
    ("body without messages", openai_line() | {"body": {"model": "m"}}, "body.messages", "missing"),
    (
        "integer custom_id",
        openai_line() | {"custom_id": 7},
        "custom_id",
        "expected a string; got 7",
    ),
    ("unknown OpenAI field", openai_line() | {"extra": 1}, "extra", "unknown field"),
    ("id with a slash", {"id": "a/b", "prompt": "x"}, "id", "contains '/' at character 2"),
    ("id with a newline", {"id": "a\nb", "prompt": "x"}, "id", "control characters"),
    ("empty id", {"id": "", "prompt": "x"}, "id", "non-empty"),
    ("long id", {"id": "x" * 257, "prompt": "x"}, "id", "longer than 256 characters (257)"),
    ("dot-dot id", {"id": "..", "prompt": "x"}, "id", "names a directory"),
    ("float id", {"id": 1.5, "prompt": "x"}, "id", "expected a string or an integer; got 1.5"),
    ("boolean id", {"id": True, "prompt": "x"}, "id", "got true"),
    ("bad custom_id", openai_line("a/b"), "custom_id", "contains '/'"),
]


@pytest.mark.parametrize(
    ("line", "field", "message"),
    [case[1:] for case in BAD_LINES],
    ids=[case[0] for case in BAD_LINES],
)
def test_each_bad_line_is_named_with_its_line_and_field(
    tmp_path: Path, line: Any, field: str, message: str
) -> None:
    path = write_jsonl(tmp_path, GOOD, line)
    error = the_only_error(path)
    assert (error.path, error.line, error.field) == (str(path), 2, field)
    assert message in error.message
    assert str(error) == f"{path}:2: {field}: {error.message}"


TOKENS = f"an integer in [1, {MAX_TOKENS_LIMIT}]"
BAD_SAMPLING: list[tuple[str, Any, str]] = [
    ("max_tokens", "100", f'{TOKENS}; got "100"'),
    ("max_tokens", 0, f"{TOKENS}; got 0"),
    ("max_tokens", -1, f"{TOKENS}; got -1"),
    ("max_tokens", 1e15, f"{TOKENS}; got 1000000000000000.0"),  # a float is not a count
    ("max_tokens", 100.0, f"{TOKENS}; got 100.0"),
    ("max_tokens", MAX_TOKENS_LIMIT + 1, f"{TOKENS}; got 2147483648"),
    ("max_completion_tokens", 1.5, f"{TOKENS}; got 1.5"),
    ("max_completion_tokens", 0, f"{TOKENS}; got 0"),
    ("min_tokens", True, f"an integer in [0, {MAX_TOKENS_LIMIT}]; got true"),
    ("min_tokens", -1, f"an integer in [0, {MAX_TOKENS_LIMIT}]; got -1"),
    ("seed", -3, "an integer >= 0; got -3"),
    ("top_k", -2, "-1 (no limit) or an integer >= 1; got -2"),
    ("top_k", 0, "-1 (no limit) or an integer >= 1; got 0"),
    ("temperature", "hot", 'a number in [0, 2]; got "hot"'),
    ("temperature", 5, "a number in [0, 2]; got 5"),
    ("temperature", -0.1, "a number in [0, 2]; got -0.1"),
    ("top_p", [1], "a number in (0, 1]; got array"),
    ("top_p", -3, "a number in (0, 1]; got -3"),
    ("top_p", 0, "a number in (0, 1]; got 0"),
    ("top_p", 1.01, "a number in (0, 1]; got 1.01"),
    ("min_p", False, "a number in [0, 1]; got false"),
    ("min_p", 1.5, "a number in [0, 1]; got 1.5"),
    ("frequency_penalty", {}, "a number in [-2, 2]; got {}"),
    ("frequency_penalty", 2.5, "a number in [-2, 2]; got 2.5"),
    ("presence_penalty", "0", 'a number in [-2, 2]; got "0"'),
    ("presence_penalty", -3, "a number in [-2, 2]; got -3"),
    ("repetition_penalty", "1.1", 'a number in (0, 2]; got "1.1"'),
    ("repetition_penalty", 0, "a number in (0, 2]; got 0"),
    ("repetition_penalty", 2.1, "a number in (0, 2]; got 2.1"),
    ("stop", 3, "a string or a list of strings; got 3"),
    ("stop", ["a", 1], "a string or a list of strings; got array"),
    ("stop_token_ids", [-1], "a list of token ids (integers >= 0); got array"),
    ("ignore_eos", "yes", 'true or false; got "yes"'),
    ("chat_template_kwargs", [], "an object; got []"),
    ("n", 0, f"{ANSWERS}; got 0"),
    ("n", -1, f"{ANSWERS}; got -1"),
    ("n", 1.5, f"{ANSWERS}; got 1.5"),
    ("n", "4", f'{ANSWERS}; got "4"'),
    ("n", True, f"{ANSWERS}; got true"),
    ("n", MAX_SAMPLES + 1, f"{ANSWERS}; got {MAX_SAMPLES + 1}"),
    ("tool_choice", "sometimes", 'one of auto, required, none or an object; got "sometimes"'),
    ("reasoning_effort", "max", 'one of low, medium, high; got "max"'),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD_SAMPLING)
def test_sampling_values_of_the_wrong_type_or_out_of_range_are_named(
    tmp_path: Path, key: str, value: Any, message: str
) -> None:
    path = write_jsonl(
        tmp_path, GOOD, {"messages": HI, "sampling": {key: value}}, openai_line(**{key: value})
    )
    with pytest.raises(InputErrors) as raised:
        validate_file(path)
    errors = raised.value.errors
    assert [(e.line, e.field) for e in errors] == [(2, f"sampling.{key}"), (3, f"body.{key}")]
    assert [e.message for e in errors] == [f"expected {message}"] * 2
    assert str(errors[0]) == f"{path}:2: sampling.{key}: {errors[0].message}"


def test_good_sampling_values_are_kept_up_to_their_bounds(tmp_path: Path) -> None:
    lowest = {
        "max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 0, "top_k": -1, "seed": 0,
        "temperature": 0, "top_p": 1e-9, "min_p": 0.0, "frequency_penalty": -2,
        "presence_penalty": -2.0, "repetition_penalty": 1e-9, "stop": "END", "ignore_eos": False,
        "chat_template_kwargs": {}, "logprobs": True, "n": 1, "tool_choice": "none",
    }  # fmt: skip
    highest: dict[str, Any] = {
        "max_tokens": MAX_TOKENS_LIMIT, "max_completion_tokens": MAX_TOKENS_LIMIT, "top_k": 1,
        "temperature": 2, "top_p": 1, "min_p": 1, "frequency_penalty": 2.0,
        "presence_penalty": 2, "repetition_penalty": 2, "stop": ["a", "b"],
        "stop_token_ids": [0, 151645], "tool_choice": {"type": "function"},
        "reasoning_effort": "low", "response_format": {"type": "json_object"},
    }  # fmt: skip
    path = write_jsonl(tmp_path, {"messages": HI, "sampling": lowest}, openai_line(**highest))
    low, high = read_prompts(path)
    assert low.body == {"messages": HI, **{k: v for k, v in lowest.items() if k != "n"}}
    assert (low.samples, high.samples) == (1, None)
    assert high.body == {"messages": HI, **highest}


def test_a_lines_n_is_its_count_of_answers_taken_out_of_the_request(tmp_path: Path) -> None:
    """n is not sent: each answer is its own request (producer/answers.py)."""
    path = write_jsonl(tmp_path, {"id": "a", "messages": HI, "sampling": {"n": 4, "seed": 7}},
                       openai_line("b", n=MAX_SAMPLES), {"id": "c", "messages": HI},
                       {"id": "d", "messages": HI, "sampling": {"n": None}})
    records = list(read_prompts(path))
    assert [(r.id, r.samples) for r in records] == [("a", 4), ("b", MAX_SAMPLES), ("c", None),
                                                    ("d", None)]
    assert records[0].body == {"messages": HI, "seed": 7}
    assert "n" not in records[1].body
    summary = validate_file(path, samples=3)
    assert (summary.prompts, summary.answers) == (4, 4 + MAX_SAMPLES + 3 + 3)


def test_a_hash_id_is_the_same_whatever_n_does_to_the_request(tmp_path: Path) -> None:
    """A line without an id keeps the hash id it always had: n counts in it as a field of the
    line, though it is not sent."""
    line = {"messages": HI, "sampling": {"n": 1}}
    (record,) = read_prompts(write_jsonl(tmp_path, line))
    assert record.id == hash_id({"messages": HI, "n": 1})


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("max_token", "max_tokens"),
        ("maxtokens", "max_tokens"),
        ("temprature", "temperature"),
        ("top-p", "top_p"),
        ("frequency_penality", "frequency_penalty"),
        ("max_new_tokens", "max_tokens"),  # SGLang's own name, in the wrong place
        ("repeat_penalty", "repetition_penalty"),
        ("topk", "top_k"),
    ],
)
def test_unknown_sampling_keys_are_refused_with_the_closest_known_one(
    tmp_path: Path, key: str, hint: str
) -> None:
    typo: dict[str, Any] = {key: 100}
    path = write_jsonl(tmp_path, GOOD, {"messages": HI, "sampling": typo}, openai_line(**typo))
    with pytest.raises(InputErrors) as raised:
        validate_file(path)
    errors = raised.value.errors
    assert [str(e) for e in errors] == [
        f"{path}:2: sampling.{key}: unknown sampling parameter; did you mean {hint}?",
        f"{path}:3: body.{key}: unknown sampling parameter; did you mean {hint}?",
    ]


def test_an_unknown_sampling_key_with_no_close_match_lists_the_known_ones(tmp_path: Path) -> None:
    error = the_only_error(write_jsonl(tmp_path, openai_line(user="alice")))
    assert error.field == "body.user"
    assert error.message == f"unknown sampling parameter; known: {', '.join(SAMPLING_PARAMS)}"


def test_a_null_does_not_hide_an_unknown_sampling_key(tmp_path: Path) -> None:
    error = the_only_error(write_jsonl(tmp_path, {"messages": HI, "sampling": {"max_token": None}}))
    assert (error.field, error.message) == (
        "sampling.max_token",
        "unknown sampling parameter; did you mean max_tokens?",
    )


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_tokens": 0}, f"--max-tokens must be an integer in [1, {MAX_TOKENS_LIMIT}], got 0"),
        ({"max_tokens": MAX_TOKENS_LIMIT + 1}, "got 2147483648"),
        ({"max_tokens": 1e15}, "got 1000000000000000.0"),
        ({"temperature": 2.5}, "--temperature must be in [0, 2], got 2.5"),
        ({"temperature": float("nan")}, "--temperature must be in [0, 2], got nan"),
        ({"top_p": 0.0}, "--top-p must be in (0, 1], got 0.0"),
    ],
)
def test_job_defaults_out_of_range_are_refused(params: dict[str, Any], message: str) -> None:
    with pytest.raises(JobError) as raised:
        GenerationParams(**params)
    assert message in str(raised.value)


def test_job_defaults_at_their_bounds_are_accepted() -> None:
    GenerationParams(max_tokens=1, temperature=0.0, top_p=1.0)
    GenerationParams(max_tokens=MAX_TOKENS_LIMIT, temperature=2.0, top_p=1e-9)


def test_bad_utf8_is_reported_with_its_byte_offset(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, GOOD, b'{"prompt": "caf\xe9"}')
    error = the_only_error(path)
    assert (error.line, error.field) == (2, "line")
    assert error.message == "not valid UTF-8 at byte 16 (0xe9)"
    assert error.raw == '{"prompt": "caf\ufffd"}'


def test_invalid_json_reports_orjsons_message_and_column(tmp_path: Path) -> None:
    error = the_only_error(write_jsonl(tmp_path, '{"prompt": "x",}'))
    assert error.message.startswith("invalid JSON: ")
    assert error.message.endswith("at column 15")  # the stray comma


def test_duplicate_ids_name_both_lines(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, {"id": "a", "prompt": "x"}, GOOD, {"id": "a", "prompt": "y"})
    error = the_only_error(path)
    assert (error.line, error.field) == (3, "id")
    assert error.message == 'duplicate id "a", first on line 1'


def test_duplicate_custom_ids_name_both_lines(tmp_path: Path) -> None:
    error = the_only_error(write_jsonl(tmp_path, openai_line("r"), openai_line("r", seed=1)))
    assert (error.line, error.field) == (2, "custom_id")
    assert "first on line 1" in error.message


def test_an_integer_id_and_its_string_are_the_same_id(tmp_path: Path) -> None:
    error = the_only_error(
        write_jsonl(tmp_path, {"id": 7, "prompt": "x"}, {"id": "7", "prompt": "y"})
    )
    assert error.message == 'duplicate id "7", first on line 1'


def test_identical_prompts_without_ids_are_reported_as_duplicate_content(tmp_path: Path) -> None:
    error = the_only_error(write_jsonl(tmp_path, {"prompt": "x"}, GOOD, {"prompt": "x"}))
    assert error.line == 3
    assert error.message.startswith("same content as line 1 (hash id h-")
    assert 'give repeated prompts an "id"' in error.message


def test_read_prompts_yields_good_lines_then_raises_at_the_first_bad_one(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, GOOD, {"prompt": ""}, {"id": "later", "prompt": "x"})
    records = read_prompts(path)
    assert next(records).id == "good"
    with pytest.raises(InputError) as raised:
        next(records)
    assert (raised.value.line, raised.value.field) == (2, "prompt")


def test_skip_invalid_streams_the_good_lines_and_reports_each_reject(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path,
        {"id": "a", "prompt": "x"},
        "not json",
        {"id": "b", "messages": [{"role": "bot", "content": "x"}]},
        {"id": "a", "prompt": "again"},
        {"id": "b", "prompt": "y"},
    )
    rejects: list[InputError] = []
    records = list(read_prompts(path, skip_invalid=True, on_error=rejects.append))
    assert [(r.id, r.line) for r in records] == [("a", 1), ("b", 5)]
    assert [(e.line, e.field) for e in rejects] == [(2, "line"), (3, "messages[0].role"), (4, "id")]


def test_skip_invalid_without_a_callback_still_skips(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, "{", GOOD)
    assert [r.id for r in read_prompts(path, skip_invalid=True)] == ["good"]


def test_validate_file_summarises_a_clean_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, GOOD, "", {"prompt": "x"}, openai_line())
    summary = validate_file(path)
    data = path.read_bytes()
    assert summary.path == str(path)
    assert (summary.lines, summary.prompts, summary.blank_lines) == (4, 3, 1)
    assert (summary.bytes, summary.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert summary.rejected == 0


def test_validate_file_keeps_max_errors_and_counts_the_rest(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, GOOD, *["{"] * 30)
    with pytest.raises(InputErrors) as raised:
        validate_file(path, max_errors=25)
    assert [e.line for e in raised.value.errors] == list(range(2, 27))
    assert raised.value.total == 30
    shown = str(raised.value).splitlines()
    assert len(shown) == InputErrors.SHOWN + 1
    assert shown[0].startswith(f"{path}:2: line: invalid JSON")
    assert shown[-1] == "... and 10 more"


def test_validate_file_with_on_error_reports_every_reject_and_returns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path, GOOD, *["{"] * 30, {"prompt": "x"})
    rejects: list[InputError] = []
    summary = validate_file(path, max_errors=1, on_error=rejects.append)
    assert (summary.prompts, summary.rejected, len(rejects)) == (2, 30, 30)


def test_a_rejects_file_holds_line_field_error_and_truncated_raw(tmp_path: Path) -> None:
    long_line = '{"prompt": "' + "x" * 2000 + '", "id": "a/b"}'
    path = write_jsonl(tmp_path, GOOD, long_line, "[1]")
    rejects = Rejects()
    list(read_prompts(path, skip_invalid=True, on_error=rejects))
    assert rejects.count == 2
    rejects.upload(open_sink(str(tmp_path / "out")), "job/rejects.jsonl")
    out = tmp_path / "out/job/rejects.jsonl"
    first, second = (orjson.loads(line) for line in out.read_bytes().splitlines())
    assert first["line"] == 2 and first["field"] == "id" and "contains '/'" in first["error"]
    assert first["raw"] == long_line[:REJECT_RAW_CHARS]
    assert second == {
        "line": 3,
        "field": "line",
        "error": "expected a JSON object; got array",
        "raw": "[1]",
    }


def test_a_file_streams_with_progress_every_n_lines_and_at_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every 1,000 lines instead of 10,000: the same pattern on a file ten times smaller.
    monkeypatch.setattr("producer.inputs.PROGRESS_EVERY", 1_000)
    path = tmp_path / "big.jsonl"
    write_bulk(path, 10_500)
    calls: list[tuple[int, int]] = []
    summary = validate_file(path, progress=lambda done, lines: calls.append((done, lines)))
    assert summary.prompts == summary.lines == 10_500
    assert [lines for _, lines in calls] == [*range(1_000, 10_001, 1_000), 10_500]
    assert calls[-1][0] == path.stat().st_size


def test_id_index_finds_duplicates_after_growing() -> None:
    index = IdIndex()
    assert all(index.add(f"id-{n}", n + 1) is None for n in range(100_000))
    assert len(index) == 100_000
    assert index.add("id-0", 200_000) == 1
    assert index.add("id-99999", 200_001) == 100_000
    assert index.add("new", 200_002) is None


def test_bundled_sample_is_valid_and_has_every_shape() -> None:
    summary = validate_file(SAMPLE_PATH)
    assert summary.prompts == summary.lines == 200
    lines = [orjson.loads(line) for line in SAMPLE_PATH.read_bytes().splitlines()]
    assert sum("prompt" in line for line in lines) == 50
    assert sum("custom_id" in line for line in lines) == 35
    assert sum("tools" in line for line in lines) == 45
    assert sum("id" not in line and "custom_id" not in line for line in lines) > 0
    records = list(read_prompts(SAMPLE_PATH))
    assert any(len(r.body["messages"]) >= 6 for r in records)


def test_bundled_sample_is_what_the_generator_writes(tmp_path: Path) -> None:
    regenerated = tmp_path / "sample.jsonl"
    assert write_sample(regenerated) == 200
    assert regenerated.read_bytes() == SAMPLE_PATH.read_bytes()


@pytest.mark.parametrize(
    "char", ["x", "é", "語", "😀"], ids=["ascii", "2-byte", "3-byte", "4-byte"]
)
def test_an_error_keeps_only_the_start_of_a_long_line(tmp_path: Path, char: str) -> None:
    line = '{"messages": [{"role": "bot", "content": "' + char * 1_000_000 + '"}]}'
    error = the_only_error(write_jsonl(tmp_path, GOOD, line))
    assert error.raw == line[:REJECT_RAW_CHARS]
    assert all(len(arg) <= REJECT_RAW_CHARS for arg in error.args if isinstance(arg, str))


def test_rejects_go_to_the_file_in_order_and_only_the_first_stay_in_memory(
    tmp_path: Path,
) -> None:
    long_line = '{"prompt": "' + "x" * 2000 + '", "id": "a/b"}'
    path = write_jsonl(tmp_path, GOOD, *["{"] * 25, long_line, {"prompt": "y"})
    rejects = Rejects()
    summary = validate_file(path, on_error=rejects)
    assert (summary.prompts, summary.rejected, rejects.count) == (2, 26, 26)
    assert [e.line for e in rejects.first] == list(range(2, 2 + InputErrors.SHOWN))
    rejects.upload(open_sink(str(tmp_path / "out")), "job/rejects.jsonl")
    written = (tmp_path / "out/job/rejects.jsonl").read_bytes().splitlines()
    assert [orjson.loads(line)["line"] for line in written] == list(range(2, 28))
    assert orjson.loads(written[-1])["raw"] == long_line[:REJECT_RAW_CHARS]


def peak_memory_of(work: Any) -> int:
    """Bytes of Python memory at the peak of ``work()`` (tracemalloc: exact, not timing-bound)."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_skip_invalid_memory_does_not_grow_with_the_number_of_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    content = "x" * 900
    with path.open("w") as out:
        for n in range(20_000):  # 19 MB of bad lines
            out.write(
                f'{{"id": "q{n}", "messages": [{{"role": "bot", "content": "{content}"}}]}}\n'
            )
    rejects = Rejects()
    peak = peak_memory_of(lambda: validate_file(path, on_error=rejects))
    assert rejects.count == 20_000
    # The read buffer (1 MiB), the id index (0.75 MiB) and the 20 errors kept; a list of every
    # reject would hold the 19 MB.
    assert peak < 4 * 2**20, f"{peak / 2**20:.1f} MiB"


def test_reported_errors_hold_kilobytes_of_their_lines_not_megabytes(tmp_path: Path) -> None:
    line = '{"messages": [{"role": "bot", "content": "' + "x" * 1_000_000 + '"}]}'
    path = write_jsonl(tmp_path, *[line] * InputErrors.SHOWN)
    tracemalloc.start()
    try:
        with pytest.raises(InputErrors) as raised:
            validate_file(path)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(raised.value.errors) == InputErrors.SHOWN
    # Each error keeps REJECT_RAW_CHARS of its line; keeping the lines would hold 20 MB.
    assert held < 2**20, f"{held / 2**20:.1f} MiB"


@pytest.mark.parametrize(
    ("lines", "rejected", "shown", "why"),
    [
        (0, 0, 0, "the file is empty"),
        (3, 0, 0, "3 lines, all blank"),
        (1, 1, 1, "1 line rejected, see above"),
        (30, 30, 20, "30 lines rejected, see the first 20 above"),
    ],
)
def test_no_prompts_says_why(lines: int, rejected: int, shown: int, why: str) -> None:
    first = [InputError("f.jsonl", n + 1, "line", "bad") for n in range(shown)]
    assert str(NoPrompts("f.jsonl", lines, rejected, first)) == f"f.jsonl: no prompts ({why})"


MISSPELT_FIELDS: list[tuple[str, Any, str, str]] = [
    ("beside an id", {"id": "q1", "promt": "Explain"}, "promt", "prompt"),
    ("alone", {"promt": "Explain"}, "promt", "prompt"),
    ("messages", {"id": "q1", "mesages": HI}, "mesages", "messages"),
    ("an OpenAI Batch field", openai_line() | {"bdy": {}}, "bdy", "body"),
]


@pytest.mark.parametrize(("line", "field", "meant"), [case[1:] for case in MISSPELT_FIELDS],
                         ids=[case[0] for case in MISSPELT_FIELDS])
def test_a_misspelt_field_names_the_field_it_likely_meant(
    tmp_path: Path, line: Any, field: str, meant: str
) -> None:
    """`promt: unknown field` left the user to find the typo."""
    error = the_only_error(write_jsonl(tmp_path, GOOD, line))
    assert error.field == field
    assert error.message.startswith(f"unknown field; did you mean {meant!r}? ")


def test_a_field_like_no_known_one_gets_no_guess(tmp_path: Path) -> None:
    error = the_only_error(write_jsonl(tmp_path, GOOD, {"id": "q1", "prompt": "x", "colour": 1}))
    assert error.field == "colour"
    assert error.message == "unknown field; a prompt line has id, messages, prompt, tools, sampling"
