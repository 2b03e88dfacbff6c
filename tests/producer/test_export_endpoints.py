"""`producer export` of completions and embeddings jobs: each format's shape, an embeddings
job's vectors exact through Parquet (float16 close), its Parquet written a row group at a time,
and what is refused.

Jobs are written into a real folder sink the way the workers write them (`result_record` of a
raw completion, `embedding_record` of `split_pooled`), the manifest into a real Redis;
`python -m producer export` runs in-process (`producer.cli.main`).
"""

from __future__ import annotations

import dataclasses
import random
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import keys
from fleetgen.endpoints import COMPLETIONS, EMBEDDINGS
from fleetgen.ledger import Ledger
from fleetgen.records import (
    embedding_record,
    error_record,
    result_record,
    split_pooled,
    vector_floats,
)
from fleetgen.sink import Sink, open_sink
from producer import export
from producer.cli import main
from tests.producer.test_export import CONTEXT, ORIGIN, Job, lines, read_jsonl, run_export

DIMENSIONS = 8


class EndpointJob(Job):
    """A job of `endpoint` whose batches the workers answered: a completions job's prompts
    with raw completions, an embeddings job's lines (of `texts[id]` texts, 1 by default, and
    vectors in `formats[id]`, "float" by default) with vectors of `dimensions[id]`."""

    def __init__(self, ledger: Ledger, sink: Sink, folder: Path, endpoint: str, *,
                 name: str = "job", prompts: int = 30, batch_size: int = 10,
                 texts: dict[str, int] | None = None, formats: dict[str, str] | None = None,
                 dimensions: dict[str, int] | None = None) -> None:
        super().__init__(ledger, sink, folder, name, prompts=prompts, batch_size=batch_size)
        self.endpoint = endpoint
        self.manifest = dataclasses.replace(self.manifest, endpoint=endpoint)
        ledger.jobs.save(self.manifest)
        sink.put(keys.sink_manifest(name), self.manifest.to_json())
        self.texts, self.formats = texts or {}, formats or {}
        self.dimensions = dimensions or {}
        self.written: dict[str, dict[str, Any]] = {}

    def line(self, prompt_id: str) -> int:
        return self.ids.index(prompt_id) + 1

    def vector(self, prompt_id: str, text: int) -> list[float]:
        """The vector a server gives text `text` of a prompt: floats of JSON, as SGLang sends."""
        rng = random.Random(f"{prompt_id}/{text}")
        return [rng.uniform(-1, 1) for _ in range(self.dimensions.get(prompt_id, DIMENSIONS))]

    def _put_input(self, batch: str, ids: list[str]) -> None:
        self.sink.put(keys.sink_input(self.name, batch), lines([
            {"id": i, "line": self.line(i), "body": {"input": ["a text"] * self.texts.get(i, 1)}
             if self.endpoint == EMBEDDINGS else {"prompt": f"Say {i}."}} for i in ids]))

    def _outcomes(self, batch: str, ids: list[str], fail: set[str]) -> None:
        bad: list[dict[str, Any]] = [
            dict(error_record(i, self.line(i), CONTEXT, 400, ORIGIN, 1)) for i in ids if i in fail]
        asked = [i for i in ids if i not in fail]
        if self.endpoint == EMBEDDINGS:
            good = self._embeddings(asked)
        else:
            # A raw completion: its text in the choice, as /v1/completions answers.
            good = [dict(result_record(i, self.line(i), {
                "choices": [{"index": 0, "text": f"{i} continued.", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 16}}, 0.25, ORIGIN))
                for i in asked]
        self.written.update((r["id"], r) for r in bad + good)
        if bad:
            self.sink.put(keys.sink_errors(self.name, batch), lines(bad))
        self.sink.put(keys.sink_result(self.name, batch), lines(good))

    def _embeddings(self, ids: list[str]) -> list[dict[str, Any]]:
        """The records of one request carrying the batch's texts, split back by prompt as the
        worker splits them."""
        counts = [self.texts.get(i, 1) for i in ids]
        data = [{"object": "embedding", "index": n, "embedding": vector}
                for n, vector in enumerate(self.vector(i, t) for i, c in zip(ids, counts, strict=True)
                                           for t in range(c))]
        response = {"object": "list", "data": data, "usage": {"prompt_tokens": 3 * len(data)}}
        return [dict(embedding_record(i, self.line(i), items, tokens, 0.125, ORIGIN,
                                      self.formats.get(i, "float")))
                for i, (items, tokens) in zip(
                    ids, split_pooled(response, counts, counts), strict=True)]  # type: ignore[arg-type]

    def floats(self, prompt_id: str) -> list[list[float]]:
        """The vectors of a prompt as its record keeps them, as float32 values."""
        return [vector_floats(v) for v in self.written[prompt_id]["embedding"]]


@pytest.fixture
def sink(tmp_path: Path) -> Sink:
    return open_sink(str(tmp_path / "out"))


def test_a_completions_job_exports_text_completions_and_chats_columns(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    import pyarrow.parquet as pq

    job = EndpointJob(ledger, sink, tmp_path, COMPLETIONS, prompts=12)
    job.finish(fail={"p00004"})
    for fmt in export.FORMATS:
        assert run_export(capsys, "job", "--to", str(tmp_path / f"c.{fmt}"), "--format", fmt)[0] == 0

    stored = read_jsonl(tmp_path / "c.jsonl")
    first = (sink.get(keys.sink_result("job", "b000001")) or b"").split(b"\n")[0]
    assert stored[0] == orjson.loads(first)
    assert stored[0]["content"] == "p00000 continued."

    openai = read_jsonl(tmp_path / "c.openai")
    assert openai[0] == {
        "id": "fg-p00000", "custom_id": "p00000", "error": None,
        "response": {"status_code": 200, "request_id": "fg-p00000-1", "body": {
            "id": "fg-p00000-1", "object": "text_completion", "model": "default",
            "choices": [{"index": 0, "text": "p00000 continued.", "finish_reason": "length",
                         "logprobs": None}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 16, "reasoning_tokens": 0,
                      "total_tokens": 20}}}}
    assert openai[4] == {"id": "fg-p00004", "custom_id": "p00004",
                         **{k: stored[4][k] for k in ("response", "error")}}

    table = pq.read_table(tmp_path / "c.parquet")
    assert table.column_names == list(export.PARQUET_COLUMNS)
    assert table.column("content").to_pylist()[:5] == [
        "p00000 continued.", "p00001 continued.", "p00002 continued.", "p00003 continued.", None]


def test_an_embeddings_jobs_jsonl_gives_each_lines_vectors_in_the_format_it_asked(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    job = EndpointJob(ledger, sink, tmp_path, EMBEDDINGS, prompts=6, batch_size=3,
                      texts={"p00001": 3}, formats={"p00002": "base64"})
    job.finish(fail={"p00004"})
    assert run_export(capsys, "job", "--to", str(tmp_path / "e.jsonl"))[0] == 0
    rows = read_jsonl(tmp_path / "e.jsonl")
    assert [r["id"] for r in rows] == job.ids
    stored = job.written["p00001"]
    assert rows[1] == {**stored, "embedding": job.floats("p00001")}
    assert len(rows[1]["embedding"]) == 3 and rows[1]["embedding_format"] == "float"
    # Floats of float32 values, as a server's JSON gives them: the vectors exactly.
    assert rows[1]["embedding"][2] == pytest.approx(job.vector("p00001", 2), rel=1e-6)
    assert rows[2] == job.written["p00002"] and isinstance(rows[2]["embedding"][0], str)
    assert rows[4] == job.written["p00004"]


def test_an_embeddings_jobs_openai_lines_hold_an_embeddings_list_per_prompt(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    job = EndpointJob(ledger, sink, tmp_path, EMBEDDINGS, prompts=6, batch_size=3,
                      texts={"p00001": 2}, formats={"p00002": "base64"})
    job.manifest = dataclasses.replace(job.manifest, params=dataclasses.replace(
        job.manifest.params, model="bge-m3"))
    ledger.jobs.save(job.manifest)
    job.finish(fail={"p00004"})
    assert run_export(capsys, "job", "--to", str(tmp_path / "e.openai"), "--format", "openai")[0] == 0
    rows = read_jsonl(tmp_path / "e.openai")
    assert [r["custom_id"] for r in rows] == job.ids
    assert rows[1] == {
        "id": "fg-p00001", "custom_id": "p00001", "error": None,
        "response": {"status_code": 200, "request_id": "fg-p00001-1", "body": {
            "object": "list", "model": "bge-m3",
            "data": [{"object": "embedding", "index": 0, "embedding": job.floats("p00001")[0]},
                     {"object": "embedding", "index": 1, "embedding": job.floats("p00001")[1]}],
            "usage": {"prompt_tokens": 6, "total_tokens": 6}}}}
    base64_line = rows[2]["response"]["body"]["data"]
    assert base64_line == [{"object": "embedding", "index": 0,
                            "embedding": job.written["p00002"]["embedding"][0]}]
    failure = job.written["p00004"]
    assert rows[4] == {"id": "fg-p00004", "custom_id": "p00004",
                       "response": failure["response"], "error": failure["error"]}


def test_an_embeddings_jobs_parquet_has_a_row_per_vector_its_float32_values_exact(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    job = EndpointJob(ledger, sink, tmp_path, EMBEDDINGS, prompts=6, batch_size=3,
                      texts={"p00001": 3}, formats={"p00002": "base64"})
    job.finish(fail={"p00004"})
    code, out, _ = run_export(capsys, "job", "--to", str(tmp_path / "e.parquet"),
                              "--format", "parquet")
    assert code == 0 and "wrote 8 lines" in out
    table = pq.read_table(tmp_path / "e.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), DIMENSIONS)
    assert table.column_names == ["id", "index", "status", "embedding", "prompt_tokens", "error",
                                  "worker", "attempt"]
    rows = table.to_pylist()
    assert [(r["id"], r["index"]) for r in rows] == [
        ("p00000", 0), ("p00001", 0), ("p00001", 1), ("p00001", 2), ("p00002", 0),
        ("p00003", 0), ("p00004", None), ("p00005", 0)]
    assert [r["embedding"] for r in rows[1:4]] == job.floats("p00001")
    assert rows[4]["embedding"] == job.floats("p00002")[0]
    # The line's tokens once, on its first vector's row: the column sums to the job's.
    assert [r["prompt_tokens"] for r in rows[:5]] == [3, 9, None, None, 3]
    assert rows[6] == {"id": "p00004", "index": None, "status": "failed", "embedding": None,
                       "prompt_tokens": None, "error": CONTEXT, "worker": "gpu0@test",
                       "attempt": 1}


def test_float16_on_request_keeps_each_value_within_half_precision(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    job = EndpointJob(ledger, sink, tmp_path, EMBEDDINGS, prompts=5, texts={"p00003": 2})
    job.finish(fail={"p00001"})
    assert run_export(capsys, "job", "--to", str(tmp_path / "h.parquet"), "--format", "parquet",
                      "--embedding-dtype", "float16")[0] == 0
    table = pq.read_table(tmp_path / "h.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.float16(), DIMENSIONS)
    got = [v for v in table.column("embedding").to_pylist() if v is not None]
    want = [v for i in job.ids if i != "p00001" for v in job.floats(i)]
    assert len(got) == len(want) == 5
    for half, single in zip(got, want, strict=True):
        assert half == pytest.approx(single, rel=2**-11, abs=2**-24)
        assert half != single  # narrowed: float16 cannot hold these float32 values


def test_an_embeddings_parquet_is_written_a_row_group_at_a_time(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pyarrow.parquet as pq

    # Row groups of 4 vectors' bytes: a line of 3 texts straddles them, the failure waits for
    # no vector (the column's size is known from the first row).
    monkeypatch.setattr(export, "ROW_GROUP_BYTES", 4 * 4 * DIMENSIONS)
    job = EndpointJob(ledger, sink, tmp_path, EMBEDDINGS, prompts=20, texts={"p00002": 3})
    job.finish(fail={"p00007"})
    assert run_export(capsys, "job", "--to", str(tmp_path / "g.parquet"), "--format", "parquet")[0] == 0
    parquet = pq.ParquetFile(tmp_path / "g.parquet")
    assert parquet.metadata.num_rows == 22
    assert parquet.metadata.num_row_groups == 5
    assert parquet.read().column("id").to_pylist()[:6] == [
        "p00000", "p00001", "p00002", "p00002", "p00002", "p00003"]


def test_an_embeddings_parquet_export_holds_a_row_group_not_the_job(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Python's peak heap while exporting 10 and 40 batches of 1,024-dimension vectors in row
    # groups of 64 KiB: holding the job's vectors would make the second about four times the
    # first.
    monkeypatch.setattr(export, "ROW_GROUP_BYTES", 64 << 10)

    def peak(batches: int) -> int:
        name = f"job{batches}"
        EndpointJob(ledger, sink, tmp_path, EMBEDDINGS, name=name, prompts=batches * 20,
                    batch_size=20, dimensions={f"p{i:05d}": 1024 for i in range(batches * 20)},
                    ).finish(fail={"p00003"})
        tracemalloc.start()
        try:
            assert main(["export", name, "--to", str(tmp_path / f"{name}.parquet"),
                         "--format", "parquet", "--force"]) == 0
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    peak(10)  # imports and connections, paid once
    small, large = peak(10), peak(40)
    capsys.readouterr()
    assert large < 1.5 * small, (small, large)


def test_vectors_of_several_lengths_are_refused_in_parquet_and_leave_no_file(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
) -> None:
    job = EndpointJob(ledger, sink, tmp_path, EMBEDDINGS, prompts=12, dimensions={"p00007": 4})
    job.finish()
    to = tmp_path / "d.parquet"
    code, _, err = run_export(capsys, "job", "--to", str(to), "--format", "parquet")
    assert code == 1
    assert err == (f"error: id p00007 (line 8): a vector of 4 dimensions in a job whose vectors "
                   f"have {DIMENSIONS}; Parquet's embedding column is of one size: export as "
                   "--format jsonl (or openai)\n")
    assert not to.exists() and list(tmp_path.glob(".d.parquet*")) == []
    assert run_export(capsys, "job", "--to", str(tmp_path / "d.jsonl"))[0] == 0
    assert len(read_jsonl(tmp_path / "d.jsonl")[7]["embedding"][0]) == 4


@pytest.mark.parametrize(("endpoint", "argv", "message"), [
    (EMBEDDINGS, ["--group-answers"], "job job: --group-answers groups a prompt's several "
     "answers: an embeddings prompt has one, its vectors in one record (export without it)"),
    (COMPLETIONS, ["--format", "parquet", "--embedding-dtype", "float16"], "job job: "
     "--embedding-dtype sets the type of an embeddings job's vectors: this is a completions job"),
    (EMBEDDINGS, ["--embedding-dtype", "float16"], "--embedding-dtype sets the type of "
     "Parquet's embedding column; --format jsonl gives vectors as their lines asked (floats or "
     "base64 float32): add --format parquet"),
])
def test_what_an_endpoint_cannot_export_is_refused_before_its_outcomes_are_read(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, endpoint: str, argv: list[str], message: str,
) -> None:
    from producer import sinkview

    EndpointJob(ledger, sink, tmp_path, endpoint).finish()

    def no_reading(*args: object) -> Any:
        raise AssertionError("the job's outcomes were read")

    monkeypatch.setattr(sinkview, "survey", no_reading)
    to = tmp_path / "refused.out"
    code, out, err = run_export(capsys, "job", "--to", str(to), *argv)
    assert (code, out, err, to.exists()) == (2, "", f"error: {message}\n", False)


def test_failed_lines_before_the_first_vector_wait_for_its_size_and_a_job_of_failures_has_none(
    ledger: Ledger, sink: Sink, tmp_path: Path, cli_env: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(export, "ROW_GROUP_ROWS", 2)
    job = EndpointJob(ledger, sink, tmp_path, EMBEDDINGS, prompts=6, batch_size=3)
    job.finish(fail={"p00000", "p00001", "p00002", "p00003"})
    assert run_export(capsys, "job", "--to", str(tmp_path / "w.parquet"), "--format", "parquet")[0] == 0
    table = pq.read_table(tmp_path / "w.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), DIMENSIONS)
    assert table.column("status").to_pylist() == ["failed"] * 4 + ["ok"] * 2
    assert table.column("embedding").to_pylist()[4:] == [job.floats("p00004")[0],
                                                          job.floats("p00005")[0]]

    failed = EndpointJob(ledger, sink, tmp_path, EMBEDDINGS, name="failed", prompts=3)
    failed.finish(fail=set(failed.ids))
    assert run_export(capsys, "failed", "--to", str(tmp_path / "f.parquet"), "--format", "parquet")[0] == 0
    table = pq.read_table(tmp_path / "f.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 0)
    assert table.column("error").to_pylist() == [CONTEXT] * 3
