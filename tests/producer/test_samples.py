"""Several answers per prompt (`sampling.n`, `enqueue --samples`) without a worker: a prompt
becomes one work item per answer with distinct, reproducible seeds; each answer is written,
requeued, exported and rebuilt once, keyed by its id and index; a job of one answer per prompt
is stored and exported as it always was.

Batches are written as a worker writes them (tests/producer/test_control_requeue.py `SinkJob`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen.job import GenerationParams
from fleetgen.jobview import job_status
from fleetgen.ledger import Ledger
from fleetgen.records import answer_key
from producer import control
from producer.answers import job_seed, sample_seed, work_items
from producer.cli import main
from producer.enqueue import EnqueueReport, EnqueueRequest, enqueue
from producer.inputs import PromptRecord
from producer.rebuild import rebuild
from producer.sinkview import stored_manifest
from tests.producer.test_control_requeue import CONTEXT, SinkJob
from tests.producer.test_enqueue import cli
from tests.stack import write_jsonl

__all__ = ["cli"]  # a fixture shared with that module

HI = [{"role": "user", "content": "hi"}]


def record(samples: int | None = None, **body: Any) -> PromptRecord:
    return PromptRecord("p1", 3, {"messages": HI, **body}, samples)


def test_a_prompt_of_n_answers_becomes_n_items_with_distinct_reproducible_seeds() -> None:
    seed = job_seed("best-of-4", None)
    items = list(work_items(record(4), samples=1, seed=seed, sampled=True))
    assert [(i.id, i.sample, i.line) for i in items] == [("p1", s, 3) for s in range(4)]
    seeds = [i.body["seed"] for i in items]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**31 for s in seeds)
    assert seeds == [sample_seed(seed, "p1", s) for s in range(4)]
    assert [i.body["seed"] for i in work_items(record(4), samples=1, seed=seed,
                                               sampled=True)] == seeds
    other = list(work_items(record(4), samples=1, seed=seed + 1, sampled=True))
    assert {i.body["seed"] for i in other}.isdisjoint(seeds)
    assert job_seed("best-of-4", None) == seed != job_seed("best-of-5", None)
    assert job_seed("best-of-4", 123) == 123


def test_a_lines_own_seed_is_the_first_answers_and_counts_up() -> None:
    items = work_items(record(3, seed=40), samples=1, seed=job_seed("j", None), sampled=True)
    assert [i.body["seed"] for i in items] == [40, 41, 42]


def test_a_lines_own_n_wins_over_the_jobs_samples() -> None:
    assert len(list(work_items(record(2), samples=5, seed=1, sampled=True))) == 2
    assert len(list(work_items(record(None), samples=5, seed=1, sampled=True))) == 5
    (single,) = work_items(record(1), samples=5, seed=1, sampled=True)
    assert (single.sample, "seed" in single.body) == (0, False)  # no seed it did not ask for


def test_a_job_of_one_answer_per_prompt_has_no_index_and_no_seed() -> None:
    (item,) = work_items(record(None), samples=1, seed=None, sampled=False)
    assert (item.sample, item.body) == (None, {"messages": HI})
    assert answer_key("p1", None) == "p1" and answer_key("p1", 2) == "p1/2"


# Through enqueue, on a real Redis and a folder sink.


def inputs(folder: Path, job: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for f in sorted((folder / job / "inputs").glob("*.jsonl"))
            for line in f.read_bytes().splitlines() if line]


def test_enqueue_samples_stores_an_item_per_answer_and_counts_answers_in_batches(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two", "sampling": {"n": 2}},
        {"id": "c", "prompt": "three"}])
    out = tmp_path / "out"
    assert main(["enqueue", str(src), "--job", "s4", "--output", str(out), "--samples", "4",
                 "--batch-size", "3"]) == 0
    assert "3 prompts (10 answers) in 4 batches" in capsys.readouterr().out
    rows = inputs(out, "s4")
    assert [(r["id"], r["sample"]) for r in rows] == [
        ("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0), ("b", 1),
        ("c", 0), ("c", 1), ("c", 2), ("c", 3)]
    assert all("n" not in r["body"] for r in rows)
    assert len({(r["id"], r["body"]["seed"]) for r in rows}) == 10
    manifest = Ledger(cli).jobs.load("s4")
    assert (manifest.prompts, manifest.answers, manifest.samples, manifest.batches) == (3, 10, 4, 4)
    assert manifest.seed == job_seed("s4", None)
    # The same command again resumes; other --samples or --seed are noted and ignored.
    assert main(["enqueue", str(src), "--job", "s4", "--output", str(out), "--samples", "2"]) == 0
    assert "--samples/--seed ignored" in capsys.readouterr().out
    assert inputs(out, "s4") == rows


def test_a_one_answer_job_stores_its_inputs_as_before(cli: Any, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "one", "sampling": {"n": 1}}])
    assert main(["enqueue", str(src), "--job", "one", "--output", str(tmp_path / "out")]) == 0
    (row,) = inputs(tmp_path / "out", "one")
    assert set(row) == {"id", "line", "body"} and "seed" not in row["body"]
    manifest = Ledger(cli).jobs.load("one")
    assert (manifest.answers, manifest.seed, manifest.sampled) == (1, None, False)


@pytest.mark.parametrize("value", ["0", "-2", "1025"])
def test_samples_out_of_range_are_refused_before_anything_is_written(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str,
) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "one"}])
    assert main(["enqueue", str(src), "--job", "bad", "--output", str(tmp_path / "out"),
                 "--samples", value]) == 2
    assert f"--samples must be in [1, 1024], got {value}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_bad_n_is_named_by_file_line_and_field(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "one"},
                                             {"id": "b", "prompt": "two", "sampling": {"n": 0}}])
    assert main(["enqueue", str(src), "--job", "badn", "--output", str(tmp_path / "out")]) == 2
    assert f"{src}:2: sampling.n: expected an integer in [1, 1024]" in capsys.readouterr().err


# Written, requeued, exported and rebuilt once per answer.


class SampledJob(SinkJob):
    """SinkJob of 6 prompts asking 3 answers each (18 answers in batches of 10)."""

    def enqueue(self) -> EnqueueReport:
        return enqueue(EnqueueRequest(path=self.source, job=self.name, output=self.output,
                                      params=GenerationParams(), batch_size=10, samples=3),
                       self.ledger, self.app)


def export_lines(job: str, to: Path, *flags: str) -> list[dict[str, Any]]:
    assert main(["export", job, "--to", str(to), "--force", *flags]) == 0
    return [orjson.loads(line) for line in to.read_bytes().splitlines()]


def test_each_answer_is_requeued_exported_and_rebuilt_once(
    ledger: Ledger, celery_app: Any, cli: Any, tmp_path: Path,
) -> None:
    job = SampledJob(ledger, celery_app, tmp_path, "triple", prompts=6)
    # Answer 1 of p00001 and answer 2 of p00004 fail; the other answers of those prompts do not.
    job.write_pending(fail={"p00001/1": CONTEXT, "p00004/2": CONTEXT})
    status = job_status(ledger, "triple")
    assert (status.total, status.prompts, status.done, status.failed) == (18, 6, 16, 2)
    report = control.requeue_failed(ledger, celery_app, "triple")
    assert report.prompts == 2
    requeued = inputs(Path(job.output), "triple")[18:]
    assert sorted((r["id"], r["sample"]) for r in requeued) == [("p00001", 1), ("p00004", 2)]
    job.write_pending()
    rows = export_lines("triple", tmp_path / "x.jsonl")
    assert [(r["id"], r["sample"]) for r in rows] == [
        (f"p{i:05d}", s) for i in range(6) for s in range(3)]
    assert all("error" not in r for r in rows)
    grouped = export_lines("triple", tmp_path / "g.jsonl", "--group-answers")
    assert [g["id"] for g in grouped] == [f"p{i:05d}" for i in range(6)]
    assert all([a["sample"] for a in g["answers"]] == [0, 1, 2] for g in grouped)
    openai = export_lines("triple", tmp_path / "o.jsonl", "--format", "openai")
    assert len({o["custom_id"] for o in openai}) == 18 and openai[1]["custom_id"] == "p00000/1"
    # Redis loses the job: the rebuilt ledger counts answers as the sink holds them.
    ledger.r.flushdb()
    manifest = stored_manifest(job.sink, "triple")
    assert manifest is not None
    rebuilt = rebuild(ledger, manifest, job.sink)
    assert (rebuilt.found.total, rebuilt.found.done, rebuilt.found.failed) == (18, 18, 0)
    assert rebuilt.lines()[-1].startswith("answers: 18: 18 done")
    status = job_status(ledger, "triple")
    assert (status.total, status.done, status.failed) == (18, 18, 0)


def test_grouped_parquet_holds_a_row_per_prompt_and_its_answers_by_index(
    ledger: Ledger, celery_app: Any, cli: Any, tmp_path: Path,
) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    job = SampledJob(ledger, celery_app, tmp_path, "pq", prompts=4)
    job.write_pending()
    assert main(["export", "pq", "--to", str(tmp_path / "a.parquet"), "--format", "parquet"]) == 0
    flat = pq.read_table(tmp_path / "a.parquet").to_pylist()
    assert [(r["id"], r["sample"]) for r in flat] == [
        (f"p{i:05d}", s) for i in range(4) for s in range(3)]
    assert main(["export", "pq", "--to", str(tmp_path / "g.parquet"), "--format", "parquet",
                 "--group-answers"]) == 0
    grouped = pq.read_table(tmp_path / "g.parquet").to_pylist()
    assert [(g["id"], [a["sample"] for a in g["answers"]]) for g in grouped] == [
        (f"p{i:05d}", [0, 1, 2]) for i in range(4)]


def test_group_answers_is_refused_for_openai_lines(cli: Any, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "any", "--to", str(tmp_path / "o.jsonl"), "--format", "openai",
                 "--group-answers"]) == 2
    assert "--group-answers writes jsonl or parquet" in capsys.readouterr().err
