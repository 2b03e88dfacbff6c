"""producer.inputs and `enqueue` for a job's endpoint (fleetgen/endpoints.py): the lines of a
completions and an embeddings job, plain and OpenAI Batch, become the bodies the worker sends;
each bad line names its file, line and field; one endpoint per job; tables with --text-column;
and enqueue end to end into the test Redis, keeping the endpoint in the manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen.ledger import Ledger
from producer.cli import RET_BAD_INPUT, RET_ERROR, RET_OK, main
from producer.inputs import (
    MAX_EMBEDDING_INPUTS,
    TEXT_FIELDS,
    Columns,
    InputErrors,
    UnreadableInput,
    hash_id,
    open_input,
    read_prompts,
    validate_file,
)
from tests.stack import write_parquet

HI = [{"role": "user", "content": "hi"}]


def write_lines(path: Path, *lines: Any) -> Path:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


def openai(url: str, custom_id: str = "r1", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def embedding_line(custom_id: str = "r1", **body: Any) -> dict[str, Any]:
    return openai("/v1/embeddings", custom_id, **body)


def completion_line(custom_id: str = "r1", **body: Any) -> dict[str, Any]:
    return openai("/v1/completions", custom_id, **body)


def records(path: Path, endpoint: str | None = None, **options: Any) -> list[tuple[str, Any, Any]]:
    with open_input(str(path), **options) as source:
        return [(r.id, r.body, r.samples) for r in read_prompts(source, endpoint=endpoint)]


def errors(path: Path, endpoint: str | None = None, **options: Any) -> list[str]:
    with open_input(str(path), **options) as source, pytest.raises(InputErrors) as raised:
        validate_file(source, endpoint=endpoint)
    return [str(e) for e in raised.value.errors]


# Each shape parses to the body the worker sends (less `model`, which the worker sets).


def test_a_plain_completions_line_is_its_prompt_and_sampling_with_n_as_its_answers(
    tmp_path: Path,
) -> None:
    path = write_lines(tmp_path / "c.jsonl", {"id": "a", "prompt": "Once upon a time",
                                              "sampling": {"max_tokens": 64, "n": 3, "seed": 1}})
    assert records(path, "completions") == [
        ("a", {"prompt": "Once upon a time", "max_tokens": 64, "seed": 1}, 3)]


def test_an_openai_completions_line_names_its_endpoint_and_keeps_its_sampling(
    tmp_path: Path,
) -> None:
    path = write_lines(tmp_path / "c.jsonl", completion_line(
        "c-1", model="m", prompt="def f():", temperature=0.2, stop=["\n\n"], logprobs=2,
        stream=False))
    assert records(path) == [("c-1", {"prompt": "def f():", "temperature": 0.2,
                                      "stop": ["\n\n"], "logprobs": 2}, None)]
    assert validate_file(path).endpoint == "completions"


def test_a_plain_embeddings_line_is_its_text_as_input(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "e.jsonl", {"id": 7, "text": "a passage"}, {"text": "another"})
    [(first, body, samples), (second, other, _)] = records(path, "embeddings")
    assert (first, body, samples) == ("7", {"input": "a passage"}, None)
    assert other == {"input": "another"} and second == hash_id({"input": "another"})


def test_text_column_names_the_field_of_a_plain_line_holding_the_text(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "e.jsonl", {"id": "a", "body": "a passage"})
    assert records(path, "embeddings", columns=Columns(text="body")) == [
        ("a", {"input": "a passage"}, None)]
    path = write_lines(tmp_path / "c.jsonl", {"id": "a", "question": "2+2="})
    assert records(path, "completions", columns=Columns(text="question")) == [
        ("a", {"prompt": "2+2="}, None)]


def test_an_openai_embeddings_line_keeps_input_dimensions_format_and_user_but_not_model(
    tmp_path: Path,
) -> None:
    path = write_lines(tmp_path / "e.jsonl", embedding_line(
        "e-1", model="m", input=["one", "two"], dimensions=256, encoding_format="base64",
        user="u"), embedding_line("e-2", input="three", dimensions=None))
    assert records(path) == [
        ("e-1", {"input": ["one", "two"], "dimensions": 256, "encoding_format": "base64",
                 "user": "u"}, None),
        ("e-2", {"input": "three"}, None)]
    assert validate_file(path).endpoint == "embeddings"


def test_a_line_without_an_id_is_named_by_its_content_and_differs_across_endpoints(
    tmp_path: Path,
) -> None:
    chat = write_lines(tmp_path / "chat.jsonl", {"prompt": "same words"})
    completion = write_lines(tmp_path / "c.jsonl", {"prompt": "same words"})
    embedding = write_lines(tmp_path / "e.jsonl", {"text": "same words"})
    ids = {records(chat)[0][0], records(completion, "completions")[0][0],
           records(embedding, "embeddings")[0][0]}
    assert len(ids) == 3
    assert records(completion, "completions")[0][0] == records(completion, "completions")[0][0]


# Every bad line names its file, line and field, and says what is wrong.


def a_good_line(endpoint: str | None, url: str | None) -> dict[str, Any]:
    """A valid line 1 of the job a bad line 2 is read for."""
    if endpoint is not None:
        return {"id": "ok", TEXT_FIELDS.get(endpoint, "prompt"): "fine"}
    if url == "/v1/embeddings":
        return embedding_line("ok", input="fine")
    return completion_line("ok", prompt="fine")


@pytest.mark.parametrize(("endpoint", "line", "field", "message"), [
    ("completions", {"prompt": ["one", "two"]}, "prompt",
     "one prompt per line: a list would be several prompts (or token ids), each its own "
     "request; give each prompt a line of its own"),
    (None, completion_line(prompt=["one", "two"]), "body.prompt", "one prompt per line"),
    (None, completion_line(), "body.prompt", "missing"),
    ("completions", {"prompt": ""}, "prompt", 'expected a non-empty string; got ""'),
    ("completions", {"prompt": "x", "sampling": {"stream": True}}, "sampling.stream",
     "not a sampling parameter"),
    ("completions", {"prompt": "x", "sampling": {"temperature": 5}}, "sampling.temperature",
     "expected a number in [0, 2]; got 5"),
    ("completions", {"prompt": "x", "sampling": {"chat_template_kwargs": {}}},
     "sampling.chat_template_kwargs", "a chat parameter; a completions request has none"),
    (None, completion_line(prompt="x", logprobs=True), "body.logprobs",
     "expected an integer >= 0 (top log-probabilities per token); got true"),
    ("completions", {"prompt": "x", "messages": HI}, "messages",
     "unknown field; a completions line has id, prompt, sampling"),
    ("embeddings", {"text": "x", "sampling": {"temperature": 0}}, "sampling",
     "an embeddings request takes no sampling parameters (n, temperature, max_tokens, ...): "
     "it gives one vector per text, the same every time"),
    ("embeddings", {"text": "x", "n": 2}, "n", "an embeddings request takes no sampling"),
    ("embeddings", {"text": ["a", "b"]}, "text", "expected a non-empty string (one text per "
     "line; an OpenAI Batch line's body.input may hold a list); got array"),
    ("embeddings", {"id": "a", "content": "x"}, "text",
     'missing; this line has id, content: --text-column names the field holding the text '
     '(default for embeddings: "text")'),
    (None, embedding_line(input="x", n=2), "body.n", "an embeddings request takes no sampling"),
    (None, embedding_line(input="x", temperature=0.0), "body.temperature",
     "an embeddings request takes no sampling"),
    (None, embedding_line(input="x", truncate=True), "body.truncate",
     "unknown field; an embeddings body has input, dimensions, encoding_format, user (and "
     "model)"),
    (None, embedding_line(), "body.input", "missing; an embeddings body has input"),
    (None, embedding_line(input=[]), "body.input",
     "expected a non-empty string or a non-empty list of strings; got []"),
    (None, embedding_line(input=["a", ""]), "body.input[1]", 'expected a non-empty string; got ""'),
    (None, embedding_line(input=[101, 2023]), "body.input[0]",
     "expected a non-empty string; got 101"),
    (None, embedding_line(input=["t"] * (MAX_EMBEDDING_INPUTS + 1)), "body.input",
     f"{MAX_EMBEDDING_INPUTS + 1} texts; one request holds at most {MAX_EMBEDDING_INPUTS}: "
     "split them over several lines"),
    (None, embedding_line(input="x", dimensions=0), "body.dimensions",
     "expected an integer >= 1; got 0"),
    (None, embedding_line(input="x", encoding_format="int8"), "body.encoding_format",
     'expected one of float, base64; got "int8"'),
    (None, openai("/v1/responses", input="x"), "url",
     'expected one of "/v1/chat/completions", "/v1/completions", "/v1/embeddings", '
     '"/v1/classify", "/classify"; got "/v1/responses"'),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_bad_line_of_an_endpoint_names_its_file_line_field_and_problem(
    tmp_path: Path, endpoint: str | None, line: dict[str, Any], field: str, message: str,
) -> None:
    path = write_lines(tmp_path / "p.jsonl", a_good_line(endpoint, line.get("url")), line)
    [error] = errors(path, endpoint)
    assert error.startswith(f"{path}:2: {field}: {message}")


# One endpoint per job: a line of another url is a bad line, handled like any other.


def test_a_line_of_another_url_names_the_endpoint_the_first_line_chose(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "mixed.jsonl", embedding_line("e1", input="x"),
                       openai("/v1/chat/completions", "c1", messages=HI),
                       completion_line("p1", prompt="y"), embedding_line("e2", input="z"))
    assert errors(path) == [
        f'{path}:2: url: "/v1/chat/completions" is another endpoint: this job\'s endpoint is '
        "/v1/embeddings (from line 1); a job makes one kind of request, so give these lines a "
        "job of their own",
        f'{path}:3: url: "/v1/completions" is another endpoint: this job\'s endpoint is '
        "/v1/embeddings (from line 1); a job makes one kind of request, so give these lines a "
        "job of their own"]
    rejected: list[str] = []
    summary = validate_file(path, on_error=lambda e: rejected.append(e.field))
    assert (summary.endpoint, summary.prompts, rejected) == ("embeddings", 2, ["url", "url"])


def test_a_line_of_another_url_than_the_given_endpoint_says_it_came_from_the_flag(
    tmp_path: Path,
) -> None:
    path = write_lines(tmp_path / "p.jsonl", embedding_line(input="x"))
    assert errors(path, "completions") == [
        f'{path}:1: url: "/v1/embeddings" is another endpoint: this job\'s endpoint is '
        "/v1/completions (from --endpoint); a job makes one kind of request, so give these "
        "lines a job of their own"]


def test_a_plain_first_line_makes_a_job_given_no_endpoint_chat(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", {"prompt": "hi"}, embedding_line(input="x"))
    [error] = errors(path)
    assert error.startswith(f"{path}:2: url: \"/v1/embeddings\" is another endpoint: this job's "
                            "endpoint is /v1/chat/completions (from line 1)")


def test_a_plain_line_of_another_endpoint_without_the_flag_says_what_a_chat_line_has(
    tmp_path: Path,
) -> None:
    path = write_lines(tmp_path / "p.jsonl", {"text": "hi"})
    [error] = errors(path)
    assert error == (f'{path}:1: line: no prompt: expected "messages" or "prompt" or an OpenAI '
                     "Batch line")


# Tables: the text column, by default or --text-column.


def test_a_parquet_table_reads_its_text_column_as_an_embeddings_input(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "t.parquet", {
        "doc": ["d1", "d2"], "body": ["first passage", "second"], "title": ["A", "B"]})
    options: dict[str, Any] = {"columns": Columns(id="doc", text="body")}
    assert records(path, "embeddings", **options) == [
        ("d1", {"input": "first passage"}, None), ("d2", {"input": "second"}, None)]
    with open_input(str(path), **options) as source:
        summary = validate_file(source, endpoint="embeddings")
    assert (summary.endpoint, summary.ignored_columns) == ("embeddings", ("title",))


def test_a_completions_table_reads_its_prompt_column_and_passes_chat_columns_over(
    tmp_path: Path,
) -> None:
    path = write_parquet(tmp_path / "t.parquet", {
        "id": ["a"], "prompt": ["2+2="], "messages": [HI], "sampling": [{"max_tokens": 4}]})
    assert records(path, "completions") == [("a", {"prompt": "2+2=", "max_tokens": 4}, None)]
    path = write_parquet(tmp_path / "e.parquet", {"text": ["t"], "prompt": ["p"]})
    assert records(path, "embeddings") == [(hash_id({"input": "t"}), {"input": "t"}, None)]


def test_a_table_without_its_text_column_names_the_columns_it_has(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "t.parquet", {"id": ["a"], "passage": ["x"]})
    with pytest.raises(UnreadableInput) as raised:
        records(path, "embeddings", columns=Columns(text="body"))
    assert str(raised.value) == (f"{path}: --text-column body: no such column; the columns "
                                 "are id, passage")
    with pytest.raises(UnreadableInput) as raised:
        records(path, "embeddings")
    assert str(raised.value) == (f"{path}: no column text (this embeddings job's text; "
                                 "--text-column names another); the columns are id, passage")


def test_a_table_row_of_a_list_prompt_names_its_row_and_column(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "t.parquet", {"id": ["a", "b"], "q": ["x", None]})
    assert errors(path, "completions", columns=Columns(text="q")) == [
        f'{path}: row 2: column q: missing; this line has id: --text-column names the field '
        'holding the text (default for completions: "prompt")']


# enqueue end to end, into the test Redis.


def enqueue(tmp_path: Path, source: Path, job: str, *flags: str) -> int:
    return main(["enqueue", str(source), "--job", job, "--output", str(tmp_path / "out"),
                 *flags])


def stored_inputs(tmp_path: Path, job: str) -> list[dict[str, Any]]:
    folder = tmp_path / "out" / job / "inputs"
    return [orjson.loads(line) for f in sorted(folder.iterdir())
            for line in f.read_bytes().splitlines()]


def test_enqueue_of_embeddings_stores_the_endpoint_bodies_without_defaults_and_no_canary(
    tmp_path: Path, ledger: Ledger, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_lines(tmp_path / "texts.jsonl",
                      *({"id": f"t{i}", "body": f"passage {i}"} for i in range(5)))
    assert enqueue(tmp_path, src, "embed", "--endpoint", "embeddings", "--text-column", "body",
                   "--model", "e5") == RET_OK
    assert "job embed created: 5 prompts for /v1/embeddings in " in capsys.readouterr().out
    manifest = ledger.jobs.load("embed")
    assert (manifest.endpoint, manifest.canary.enabled) == ("embeddings", False)
    on_disk = orjson.loads((tmp_path / "out/embed/manifest.json").read_bytes())
    assert on_disk["endpoint"] == "embeddings"
    assert [(i["id"], i["body"]) for i in stored_inputs(tmp_path, "embed")] == [
        (f"t{i}", {"model": "e5", "input": f"passage {i}"}) for i in range(5)]


def test_enqueue_of_openai_embeddings_lines_is_an_embeddings_job_without_the_flag(
    tmp_path: Path, ledger: Ledger, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_lines(tmp_path / "batch.jsonl",
                      *(embedding_line(f"r{i}", model="m", input=[f"a{i}", f"b{i}"])
                        for i in range(3)))
    assert enqueue(tmp_path, src, "batch") == RET_OK
    assert "3 prompts for /v1/embeddings" in capsys.readouterr().out
    assert ledger.jobs.load("batch").endpoint == "embeddings"
    assert stored_inputs(tmp_path, "batch")[0]["body"] == {"input": ["a0", "b0"]}


def test_enqueue_of_completions_merges_the_job_defaults_under_the_line(
    tmp_path: Path, ledger: Ledger, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_lines(tmp_path / "c.jsonl", {"id": "a", "prompt": "x", "sampling": {"top_p": 0.5}})
    assert enqueue(tmp_path, src, "comp", "--endpoint", "completions",
                   "--max-tokens", "32") == RET_OK
    assert "1 prompts for /v1/completions" in capsys.readouterr().out
    assert ledger.jobs.load("comp").endpoint == "completions"
    assert stored_inputs(tmp_path, "comp")[0]["body"] == {
        "prompt": "x", "max_tokens": 32, "temperature": 0.6, "top_p": 0.5}


def test_a_chat_job_says_no_endpoint_in_its_summary_and_keeps_chat(
    tmp_path: Path, ledger: Ledger, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_lines(tmp_path / "p.jsonl", {"id": "a", "prompt": "hi"})
    assert enqueue(tmp_path, src, "chat") == RET_OK
    assert " prompts in 1 batches" in capsys.readouterr().out
    assert ledger.jobs.load("chat").endpoint == "chat"


def test_resuming_a_job_with_another_endpoint_is_refused_naming_both(
    tmp_path: Path, ledger: Ledger, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_lines(tmp_path / "p.jsonl", {"id": "a", "prompt": "hi"})
    assert enqueue(tmp_path, src, "one", "--endpoint", "completions") == RET_OK
    capsys.readouterr()
    assert enqueue(tmp_path, src, "one") == RET_ERROR
    assert capsys.readouterr().err == (
        "error: job 'one' makes completions requests (/v1/completions), not chat "
        "(/v1/chat/completions); a job makes one kind of request for all its prompts: resume "
        "it as it was enqueued, or use a new --job name\n")
    assert enqueue(tmp_path, src, "one", "--endpoint", "completions") == RET_OK
    assert ledger.jobs.load("one").endpoint == "completions"


@pytest.mark.parametrize(("flags", "message"), [
    (("--samples", "2"), "--samples 2: an embeddings job (/v1/embeddings) generates no text; "
     "each text gets one answer (a vector, a label), the same every time"),
    (("--canary", "length=off"), "--canary: an embeddings job (/v1/embeddings) generates no "
     "text, which the canary judges; its canary is off"),
    (("--temperature", "0"), "--max-tokens, --temperature, --top-p and --no-thinking: an "
     "embeddings job (/v1/embeddings) generates no text; leave them out"),
    (("--rollout", "fleetgen.rollouts:retry_unusable"), "--rollout with embeddings "
     "(/v1/embeddings): a rollout's calls are chat requests"),
], ids=lambda v: v[0] if isinstance(v, tuple) else None)
def test_what_an_embeddings_job_cannot_do_is_refused_when_its_lines_name_it(
    tmp_path: Path, ledger: Ledger, cli_env: None, capsys: pytest.CaptureFixture[str],
    flags: tuple[str, ...], message: str,
) -> None:
    src = write_lines(tmp_path / "batch.jsonl", embedding_line(input="x"))
    assert enqueue(tmp_path, src, "refused", *flags) == RET_ERROR
    assert capsys.readouterr().err == f"error: {message}\n"
    assert not ledger.jobs.exists("refused") and not (tmp_path / "out").exists()


def test_an_enqueue_with_a_bad_line_of_another_url_writes_nothing_unless_skip_invalid(
    tmp_path: Path, ledger: Ledger, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_lines(tmp_path / "mixed.jsonl", embedding_line("e1", input="x"),
                      completion_line("c1", prompt="y"))
    assert enqueue(tmp_path, src, "mixed") == RET_BAD_INPUT
    assert capsys.readouterr().err.startswith(f'{src}:2: url: "/v1/completions" is another')
    assert not ledger.jobs.exists("mixed")
    assert enqueue(tmp_path, src, "mixed", "--skip-invalid") == RET_OK
    assert "rejected 1 invalid lines" in capsys.readouterr().out
    assert [i["id"] for i in stored_inputs(tmp_path, "mixed")] == ["e1"]
