"""Prompt tables and inputs of several parts: Parquet files, saved Hugging Face datasets,
folders of shards and S3 objects, read by producer.inputs with the rules of a JSONL line."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import orjson
import pytest

from launcher.services import S3Server
from producer.inputs import (
    Columns,
    InputErrors,
    Rejects,
    UnreadableInput,
    open_input,
    read_prompts,
    reject_line,
    validate_file,
)
from tests.stack import chat_rows, save_dataset, write_jsonl, write_parquet

HI = [{"role": "user", "content": "hi"}]


def records(spec: Path | str, **options: Any) -> list[tuple[str, int, dict[str, Any]]]:
    with open_input(str(spec), **options) as source:
        return [(r.id, r.line, r.body) for r in read_prompts(source)]


def errors_of(spec: Path | str, **options: Any) -> list[str]:
    with open_input(str(spec), **options) as source, pytest.raises(InputErrors) as caught:
        validate_file(source)
    return [str(e) for e in caught.value.errors]


def test_a_parquet_table_of_the_three_shapes_reads_as_the_same_jsonl_lines(tmp_path: Path) -> None:
    rows = chat_rows(9)
    lines = records(write_jsonl(tmp_path / "p.jsonl", rows))
    chat = [r for r in rows if "messages" in r]
    plain = [r for r in rows if "prompt" in r]
    batch = [r for r in rows if "custom_id" in r]
    chat_file = write_parquet(tmp_path / "chat.parquet", {
        "id": [r["id"] for r in chat], "messages": [r["messages"] for r in chat]})
    plain_file = write_parquet(tmp_path / "plain.parquet", {
        "id": [r["id"] for r in plain], "prompt": [r["prompt"] for r in plain]})
    batch_file = write_parquet(tmp_path / "batch.parquet", {
        k: [r[k] for r in batch] for k in ("custom_id", "method", "url", "body")})
    tables = records(chat_file) + records(plain_file) + records(batch_file)
    assert sorted((i, b) for i, _, b in tables) == sorted((i, b) for i, _, b in lines)


def test_a_null_cell_is_an_absent_field_and_a_null_struct_field_an_absent_key(
    tmp_path: Path,
) -> None:
    path = write_parquet(tmp_path / "p.parquet", {
        "prompt": ["one", None],
        "messages": [None, [{"role": "assistant", "content": None,
                             "tool_calls": [{"id": "c1", "type": "function"}]},
                            {"role": "user", "content": "go", "tool_calls": None}]],
        "sampling": [{"max_tokens": 7, "temperature": None}, None],
    })
    [(_, _, first), (_, _, second)] = records(path)
    assert first == {"messages": [{"role": "user", "content": "one"}], "max_tokens": 7}
    assert second["messages"] == [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "user", "content": "go"}]
    # Without an id, a row is named by its content, as the same JSONL line is.
    [(jsonl_id, _, _)] = records(write_jsonl(tmp_path / "one.jsonl", [
        {"prompt": "one", "sampling": {"max_tokens": 7}}]))
    assert records(path)[0][0] == jsonl_id


def test_string_cells_of_messages_tools_and_sampling_hold_json(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    path = write_parquet(tmp_path / "p.parquet", {
        "id": ["a"], "messages": [orjson.dumps(HI).decode()],
        "tools": [orjson.dumps(tools).decode()], "sampling": ['{"seed": 3, "top_k": null}']})
    assert records(path) == [("a", 1, {"messages": HI, "tools": tools, "seed": 3})]


def test_bad_rows_are_named_by_file_row_and_column(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "bad.parquet", {
        "id": ["a", "b", "c", "d", "a"],
        "messages": [orjson.dumps(m).decode() if m else "[not json" for m in
                     (HI, HI, [{"role": "bot", "content": "x"}], None, HI)],
        "sampling": [None, {"temperature": 9.0}, None, None, None],
    })
    assert errors_of(path) == [
        f"{path}: row 2: column sampling.temperature: expected a number in [0, 2]; got 9.0",
        f"{path}: row 3: column messages[0].role: expected one of system, user, assistant, "
        'tool, developer; got "bot"',
        f"{path}: row 4: column messages: a string here must be JSON: invalid literal, expected 'null'",
        f'{path}: row 5: column id: duplicate id "a", first on row 1',
    ]


def test_a_mapped_column_is_named_as_the_user_named_it(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "q.parquet", {
        "question": ["What is 2+2?", ""], "qid": [1, 2], "answer": ["4", "?"]})
    columns = Columns(prompt="question", id="qid")
    assert errors_of(path, columns=columns) == [
        f'{path}: row 2: column question: expected a non-empty string; got ""']
    with open_input(str(path), columns=columns) as source:
        summary = validate_file(source, on_error=Rejects())
    assert summary.ignored_columns == ("answer",) and summary.rejected == 1
    # A list column named as the prompt holds the messages.
    chat = write_parquet(tmp_path / "c.parquet", {"conversation": [HI]})
    [(_, _, body)] = records(chat, columns=Columns(prompt="conversation"))
    assert body == {"messages": HI}


def test_a_rejected_row_is_kept_with_its_file_row_and_cells(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "bad.parquet", {"id": ["a", "b"], "prompt": ["x", ""]})
    rejects: list[Any] = []
    with open_input(str(path)) as source:
        validate_file(source, on_error=rejects.append)
    assert orjson.loads(reject_line(rejects[0])) == {
        "file": str(path), "row": 2, "field": "prompt",
        "error": 'expected a non-empty string; got ""', "raw": '{"id":"b","prompt":""}'}


@pytest.mark.parametrize(("column", "why"), [
    ("max_tokens", "a sampling parameter as a column of its own would not be used"),
    ("promt", "did you mean 'prompt'?"),
])
def test_a_column_a_pass_over_would_hide_is_refused_before_any_row(
    tmp_path: Path, column: str, why: str,
) -> None:
    path = write_parquet(tmp_path / "p.parquet", {"prompt": ["x"], column: [5]})
    with pytest.raises(UnreadableInput, match=f"p.parquet: column {column}: {why}"):
        records(path)


def test_a_missing_mapped_column_names_the_columns_there_are(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "p.parquet", {"question": ["x"]})
    with pytest.raises(UnreadableInput, match="--prompt-column text: no such column; the "
                       "columns are question"):
        records(path, columns=Columns(prompt="text"))


def test_column_flags_are_refused_for_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    with pytest.raises(UnreadableInput, match="--prompt-column and --id-column are for Parquet"):
        open_input(str(path), columns=Columns(prompt="question"))


def test_a_folder_of_shards_is_read_in_name_order_with_rows_counted_per_shard(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    write_parquet(folder / "part-1.parquet", {"id": ["c", "a"], "prompt": ["3", "4"]})
    write_parquet(folder / "part-0.parquet", {"id": ["a", "b"], "prompt": ["1", "2"]})
    write_jsonl(folder / "part-2.jsonl", [{"id": "d", "prompt": "5"}])
    (folder / "_SUCCESS").write_bytes(b"")
    assert errors_of(folder) == [f'{folder}/part-1.parquet: row 2: column id: duplicate id '
                                 f'"a", first on row 1 of {folder}/part-0.parquet']
    (folder / "part-1.parquet").unlink()
    write_parquet(folder / "part-1.parquet", {"id": ["c"], "prompt": ["3"]})
    assert [(i, n) for i, n, _ in records(folder)] == [("a", 1), ("b", 2), ("c", 3), ("d", 4)]


def test_a_saved_dataset_is_read_shard_by_shard_in_its_state_order(tmp_path: Path) -> None:
    ids = [f"q{i:02d}" for i in range(20)]
    folder = save_dataset(tmp_path / "ds", {"id": ids, "prompt": [f"p{i}" for i in ids],
                                            "label": list(range(20))}, shards=3)
    with open_input(str(folder)) as source:
        summary = validate_file(source)
        read = [r.id for r in read_prompts(source)]
    assert read == ids
    assert (summary.prompts, summary.ignored_columns) == (20, ("label",))


def test_a_dataset_of_several_splits_needs_one_named(tmp_path: Path) -> None:
    folder = save_dataset(tmp_path / "dd", {}, splits={
        "train": {"prompt": ["a", "b"]}, "test": {"prompt": ["c"]}})
    with pytest.raises(UnreadableInput, match=r"several splits; name one with --split "
                       r"\(train, test\)"):
        open_input(str(folder))
    with pytest.raises(UnreadableInput, match="no split 'dev'"):
        open_input(str(folder), split="dev")
    assert [b["messages"][0]["content"] for _, _, b in records(folder, split="test")] == ["c"]


def test_the_identity_of_several_parts_changes_with_any_of_them(tmp_path: Path) -> None:
    folder = save_dataset(tmp_path / "ds", {"prompt": ["a", "b", "c", "d"]}, shards=2)

    def identity() -> str:
        with open_input(str(folder)) as source:
            return validate_file(source).sha256

    first = identity()
    assert identity() == first
    save_dataset(tmp_path / "other", {"prompt": ["a", "b", "c", "e"]}, shards=2)
    shard = "data-00001-of-00002.arrow"
    (folder / shard).write_bytes((tmp_path / "other" / shard).read_bytes())
    assert identity() != first


def test_without_pyarrow_a_table_is_refused_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = write_parquet(tmp_path / "p.parquet", {"prompt": ["x"]})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pyarrow" else real(name, *a))
    with pytest.raises(UnreadableInput, match=r"needs pyarrow, which is not installed: pip "
                       r"install 'fleetgen\[parquet\]'"):
        open_input(str(path))


def test_a_file_that_is_no_parquet_is_named(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    path.write_bytes(b'{"prompt": "x"}\n')
    with pytest.raises(UnreadableInput, match="p.parquet: not a Parquet file"):
        records(path)


# S3: the same inputs as objects, each read pinned to the version first seen.


@pytest.fixture
def bucket(s3_env: dict[str, str], s3_server: S3Server, s3_client: Any) -> tuple[Any, str]:
    return s3_client, s3_server.bucket


def test_s3_objects_read_as_the_same_local_files(tmp_path: Path, bucket: tuple[Any, str]) -> None:
    client, name = bucket
    local = write_jsonl(tmp_path / "p.jsonl", chat_rows(30))
    client.upload_file(str(local), name, "in/p.jsonl")
    table = write_parquet(tmp_path / "t.parquet", {"id": ["x", "y"], "prompt": ["1", "2"]})
    client.upload_file(str(table), name, "in/shards/a.parquet")
    client.upload_file(str(local), name, "in/shards/b.jsonl")
    assert records(f"s3://{name}/in/p.jsonl") == records(local)
    both = records(f"s3://{name}/in/shards/")
    assert [i for i, _, _ in both] == ["x", "y", *[i for i, _, _ in records(local)]]


def test_an_s3_object_changed_between_the_two_passes_stops_the_second(
    tmp_path: Path, bucket: tuple[Any, str],
) -> None:
    client, name = bucket
    client.put_object(Bucket=name, Key="p.jsonl", Body=b'{"prompt": "one"}\n')
    with open_input(f"s3://{name}/p.jsonl") as source:
        before = validate_file(source).sha256
        client.put_object(Bucket=name, Key="p.jsonl", Body=b'{"prompt": "two"}\n')
        with pytest.raises(Exception, match=f"s3://{name}/p.jsonl: changed while enqueue was "
                           "reading it"):
            list(read_prompts(source))
    with open_input(f"s3://{name}/p.jsonl") as source:
        assert validate_file(source).sha256 != before


def test_a_missing_s3_input_is_named_with_its_endpoint(bucket: tuple[Any, str]) -> None:
    _, name = bucket
    with pytest.raises(UnreadableInput, match=f"s3://{name}/nope.jsonl: no such object"):
        open_input(f"s3://{name}/nope.jsonl")


def test_a_rows_sampling_n_asks_several_answers_as_a_jsonl_lines_does(tmp_path: Path) -> None:
    table = write_parquet(tmp_path / "n.parquet", {
        "id": ["a", "b"], "prompt": ["one", "two"],
        "sampling": [{"n": 3, "temperature": 1.0}, {"n": None, "temperature": 0.5}]})
    with open_input(str(table)) as source:
        summary = validate_file(source, samples=2)
        prompts = list(read_prompts(source))
    assert (summary.prompts, summary.answers) == (2, 5)
    assert [(p.id, p.samples) for p in prompts] == [("a", 3), ("b", None)]
    assert all("n" not in p.body for p in prompts)
