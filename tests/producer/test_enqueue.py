"""`python -m producer enqueue` through `main([...])` on a real Redis: what it refuses before
anything is written (empty input, bad flags, a folder), stdin, rejects, and a reader of stdout
that goes away."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetgen import broker, keys
from fleetgen.job import MAX_TOKENS_LIMIT
from producer.cli import RET_BROKEN_PIPE, main
from producer.inputs import REJECT_RAW_CHARS
from tests.stack import PYTHON, ROOT, chat_rows, iter_ids, queue_depth, write_jsonl


@pytest.fixture
def cli(redis_client: Any, cli_env: None) -> Any:
    """main() pointed at the test Redis, with the Celery app publishing there too.

    Yields the Redis client (flushed: an empty database before the test).
    """
    return redis_client


@pytest.fixture
def own_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temporary-files folder of the test's own, to see what enqueue leaves there."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder


def feed_stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))


def enqueue(tmp_path: Path, source: str, job: str, *flags: str) -> int:
    return main(["enqueue", source, "--job", job, "--output", str(tmp_path / "out"), *flags])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


# An empty input: no job, nothing written.


@pytest.mark.parametrize(
    ("content", "flags", "why"),
    [
        (b"", (), "the file is empty"),
        (b"\n  \n\n", (), "3 lines, all blank"),
        (b"", ("--skip-invalid",), "the file is empty"),
    ],
    ids=["empty", "blank", "empty-skip-invalid"],
)
def test_an_input_without_prompts_creates_no_job_and_writes_nothing(
    cli: Any, tmp_path: Path, own_tmp: Path, capsys: pytest.CaptureFixture[str],
    content: bytes, flags: tuple[str, ...], why: str,
) -> None:
    src = tmp_path / "none.jsonl"
    src.write_bytes(content)
    assert enqueue(tmp_path, str(src), "none", *flags) == 2
    assert capsys.readouterr().err == f"error: {src}: no prompts ({why})\n"
    assert not cli.exists(keys.job("none")) and cli.dbsize() == 0
    assert not (tmp_path / "out").exists()
    assert list(own_tmp.iterdir()) == []


def test_skip_invalid_with_every_line_rejected_creates_no_job_and_shows_the_first_rejects(
    cli: Any, tmp_path: Path, own_tmp: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b'{"id": "a", "messages": "nope"}\n' * 3 + b"\n" + b"{\n" * 22)
    assert enqueue(tmp_path, str(src), "bad", "--skip-invalid") == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"{src}:1: messages: expected a non-empty list of messages; got \"nope\""
    assert err[3].startswith(f"{src}:5: line: invalid JSON")
    assert err[-2:] == ["... and 5 more",
                        f"error: {src}: no prompts (25 lines rejected, see the first 20 above)"]
    assert cli.dbsize() == 0
    assert not (tmp_path / "out").exists()
    assert list(own_tmp.iterdir()) == []


# Sampling values: the job's flags are bounded like a line's own values.


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (("--max-tokens", str(MAX_TOKENS_LIMIT + 1)),
         f"--max-tokens must be an integer in [1, {MAX_TOKENS_LIMIT}], got {MAX_TOKENS_LIMIT + 1}"),
        (("--max-tokens", "0"), f"--max-tokens must be an integer in [1, {MAX_TOKENS_LIMIT}], got 0"),
        (("--temperature", "5"), "--temperature must be in [0, 2], got 5.0"),
        (("--top-p", "-3"), "--top-p must be in (0, 1], got -3.0"),
    ],
)
def test_job_flags_out_of_range_are_refused_before_anything_is_written(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    flag: tuple[str, str], message: str,
) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(3))
    assert enqueue(tmp_path, str(src), "flags", *flag) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert cli.dbsize() == 0 and not (tmp_path / "out").exists()


def test_canary_thresholds_with_the_canary_off_are_refused_before_anything_is_written(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(10))
    assert enqueue(tmp_path, str(src), "both", "--canary", "length=off", "--no-canary") == 2
    assert "--no-canary turns it off: pass one of them" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not cli.exists(keys.job("both"))


def test_a_sampling_typo_stops_enqueue_with_file_line_field_and_a_hint(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    rows = [*chat_rows(2), {"id": "typo", "prompt": "hi", "sampling": {"max_token": 100}}]
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    assert enqueue(tmp_path, str(src), "typo") == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        f"{src}:3: sampling.max_token: unknown sampling parameter; did you mean max_tokens?"
    )
    assert cli.dbsize() == 0 and not (tmp_path / "out").exists()


# What the input is: a folder, a missing file, stdin.


def test_a_folder_of_no_input_files_is_named_as_such(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "notes.txt").write_text("no prompts here")
    assert enqueue(tmp_path, str(tmp_path), "folder") == 2
    assert capsys.readouterr().err == (f"error: {tmp_path}: no *.jsonl or *.parquet file in it, "
                                       "and no saved dataset (state.json)\n")
    assert cli.dbsize() == 0


def test_a_missing_input_is_named_as_missing(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert enqueue(tmp_path, str(tmp_path / "nope.jsonl"), "missing") == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope.jsonl'}: no such file\n"


def test_a_pipe_as_input_points_to_stdin(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert enqueue(tmp_path, str(fifo), "fifo") == 2
    assert capsys.readouterr().err == (
        f"error: {fifo}: not a regular file; pipe it to `enqueue - --job NAME`\n"
    )


def test_stdin_needs_a_job_name(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    feed_stdin(monkeypatch, b'{"prompt": "hi"}\n')
    assert main(["enqueue", "-", "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == "error: reading prompts from stdin (-) needs --job NAME\n"
    assert cli.dbsize() == 0


def test_prompts_from_stdin_are_enqueued_and_the_manifest_says_stdin(
    cli: Any, tmp_path: Path, own_tmp: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = chat_rows(30)
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    feed_stdin(monkeypatch, data)
    assert enqueue(tmp_path, "-", "piped", "--batch-size", "10") == 0
    assert "job piped created: 30 prompts in 3 batches" in capsys.readouterr().out
    manifest = orjson.loads((tmp_path / "out/piped/manifest.json").read_bytes())
    assert manifest["input"] == {"path": "<stdin>", "sha256": hashlib.sha256(data).hexdigest(),
                                 "lines": 30, "bytes": len(data)}
    stored = [row["id"] for f in sorted((tmp_path / "out/piped/inputs").glob("*.jsonl"))
              for row in read_jsonl(f)]
    assert stored == list(iter_ids(rows))
    assert queue_depth(cli, keys.SHARED_QUEUE) == 3
    assert list(own_tmp.iterdir()) == []  # the spooled copy is gone

    # The same stream again resumes the job: same bytes, same sha256.
    feed_stdin(monkeypatch, data)
    assert enqueue(tmp_path, "-", "piped", "--batch-size", "10") == 0
    assert "job piped resumed" in capsys.readouterr().out


def test_a_bad_line_from_stdin_is_named_as_from_stdin(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    feed_stdin(monkeypatch, b'{"prompt": "hi"}\n{"prompt": ""}\n')
    assert enqueue(tmp_path, "-", "piped") == 2
    assert capsys.readouterr().err.startswith('<stdin>:2: prompt: expected a non-empty string')
    assert cli.dbsize() == 0 and not (tmp_path / "out").exists()


# Where it writes: a folder not there yet is created, and said so.


def test_a_missing_output_folder_is_created_and_named_by_its_absolute_path(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(3))
    monkeypatch.chdir(tmp_path)
    assert main(["enqueue", "p.jsonl", "--job", "here", "--output", "runs/today"]) == 0
    out = capsys.readouterr().out
    assert f"created output folder {tmp_path / 'runs' / 'today'}\n" in out
    assert f"output {tmp_path / 'runs' / 'today'}" in out
    assert main(["enqueue", str(src), "--job", "here", "--output", "runs/today"]) == 0
    assert "created output folder" not in capsys.readouterr().out  # it was there


# Rejects: every one in the file, each cut short.


def test_skip_invalid_writes_every_reject_in_order_with_its_line_cut_short(
    cli: Any, tmp_path: Path, own_tmp: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    long_bad = b'{"id": "long", "messages": [{"role": "bot", "content": "' + b"x" * 100_000 + b'"}]}'
    lines = [orjson.dumps(r) for r in chat_rows(5)] + [b"{"] * 25 + [long_bad]
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    assert enqueue(tmp_path, str(src), "mixed", "--skip-invalid") == 0
    assert "rejected 26 invalid lines" in capsys.readouterr().out
    rejects = read_jsonl(tmp_path / "out/mixed/rejects.jsonl")
    assert [r["line"] for r in rejects] == list(range(6, 32))
    assert rejects[-1]["field"] == "messages[0].role"
    assert rejects[-1]["raw"] == long_bad[:REJECT_RAW_CHARS].decode()
    assert orjson.loads((tmp_path / "out/mixed/manifest.json").read_bytes())["rejected"] == 26
    assert list(own_tmp.iterdir()) == []


# A reader of stdout that goes away (`status JOB | head -1`).


def broken_pipe() -> int:
    """The write end of a pipe whose reader is gone: every write to it fails with EPIPE."""
    r, w = os.pipe()
    os.close(r)
    return w


def test_a_reader_that_goes_away_ends_status_quietly(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(3))
    assert enqueue(tmp_path, str(src), "piped") == 0
    capsys.readouterr()
    w = broken_pipe()
    with open(w, "w") as stdout, monkeypatch.context() as patch:
        patch.setattr("sys.stdout", stdout)
        assert main(["status", "piped", "--no-servers"]) == RET_BROKEN_PIPE
    assert capsys.readouterr().err == ""


def test_a_reader_that_goes_away_ends_the_process_without_a_traceback(
    redis_url: str, redis_client: Any,
) -> None:
    # In a process of its own: Python's last flush of stdout at exit must not fail either.
    w = broken_pipe()
    try:
        done = subprocess.run([PYTHON, "-m", "producer", "jobs"], check=False, cwd=ROOT, stdout=w,
                              stderr=subprocess.PIPE, env={**os.environ, "REDIS_URL": redis_url},
                              timeout=120)
    finally:
        os.close(w)
    assert (done.returncode, done.stderr.decode()) == (RET_BROKEN_PIPE, "")


def test_a_bad_setting_is_one_error_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REDIS_URL", "garbage")
    assert main(["jobs"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: REDIS_URL must be a redis:// or sentinel:// URL")
    assert "Traceback" not in err
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("FLEETGEN_LEASE_TTL_S", "-3")
    assert main(["jobs"]) == 2
    assert "error: FLEETGEN_LEASE_TTL_S must be >= 0" in capsys.readouterr().err


# Ctrl-C: what the message counts is what Redis holds, and the same command finishes the job.


def queued_batches(r: Any, job: str) -> set[str]:
    """The job's batches with a message in the broker (each once: the test checks the depth)."""

    return {b for j, b in broker.waiting_batches(r, grace_s=float("inf")) if j == job}


def interrupted_count(err: str) -> tuple[int, int]:
    """(queued, of) from the interrupted message's "N of the M batches ... are queued"."""
    import re

    found = re.search(r"([\d,]+) of the ([\d,]+) batches this run was queueing are queued", err)
    assert found, err
    return int(found[1].replace(",", "")), int(found[2].replace(",", ""))


def test_ctrl_c_while_queueing_counts_the_batches_in_the_broker_and_a_rerun_queues_the_rest(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    from celery import Celery

    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(150))
    send = Celery.send_task
    sent = []

    def send_then_ctrl_c(self: Celery, *args: Any, **kwargs: Any) -> Any:
        if len(sent) == 120:
            raise KeyboardInterrupt  # Ctrl-C while the 121st batch is sent
        sent.append(1)
        return send(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(Celery, "send_task", send_then_ctrl_c)
        assert enqueue(tmp_path, str(src), "cut", "--batch-size", "1") == 130
    err = capsys.readouterr().err
    queued, of = interrupted_count(err)
    in_broker = queued_batches(cli, "cut")
    assert queued == len(in_broker) == 120 and of == 150
    assert "interrupted: job cut is running: all 150 batch inputs are stored; 120 of" in err
    assert queue_depth(cli, keys.SHARED_QUEUE) == 120
    assert f"Run the same command again to queue the other {of - queued}" in err

    assert enqueue(tmp_path, str(src), "cut", "--batch-size", "1") == 0
    out = capsys.readouterr().out
    assert "job cut resumed" in out and f"enqueued {of - queued} batches" in out
    assert f"{queued} already queued or running" in out
    # Every batch once in the broker: none was sent twice, none was left out.
    assert len(queued_batches(cli, "cut")) == queue_depth(cli, keys.SHARED_QUEUE) == 150


def test_ctrl_c_after_the_last_batch_was_queued_says_all_are_queued(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    import producer.enqueue

    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(150))
    dispatch = producer.enqueue.dispatch

    def dispatch_then_ctrl_c(app: Any, ledger: Any, job: str, batches: Any, queue: str) -> int:
        sent = dispatch(app, ledger, job, batches, queue)
        if len(queued_batches(cli, job)) == 150:
            raise KeyboardInterrupt  # the last batch is in the broker; enqueue has not returned
        return sent

    monkeypatch.setattr(producer.enqueue, "dispatch", dispatch_then_ctrl_c)
    assert enqueue(tmp_path, str(src), "whole", "--batch-size", "1") == 130
    err = capsys.readouterr().err
    assert ("job whole is running: all 150 batch inputs are stored; all 150 batches this run "
            "was queueing are queued: nothing is left to do") in err
    assert len(queued_batches(cli, "whole")) == queue_depth(cli, keys.SHARED_QUEUE) == 150


def test_on_a_terminal_ctrl_c_while_queueing_leaves_the_messages_count_alone_on_screen(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """The queueing bar is redrawn once per 100 batches: left on screen above the message, it
    showed another count than the message's."""
    import sys

    from celery import Celery

    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(150))
    send = Celery.send_task
    sent: list[int] = []

    def send_then_ctrl_c(self: Celery, *args: Any, **kwargs: Any) -> Any:
        if len(sent) == 120:
            raise KeyboardInterrupt
        sent.append(1)
        return send(self, *args, **kwargs)

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(Celery, "send_task", send_then_ctrl_c)
    assert enqueue(tmp_path, str(src), "cut", "--batch-size", "1") == 130
    bar, message = capsys.readouterr().err.rsplit("\r\x1b[K", 1)
    assert "100 of 150 batches" in bar.rsplit("\r", 1)[-1]  # its last redraw, now erased
    assert message.startswith("interrupted: job cut is running: all 150 batch inputs are "
                              "stored; 120 of the 150 batches this run was queueing are queued")
    assert "\r" not in message


@pytest.mark.parametrize("phase", ["checking", "storing"])
def test_ctrl_c_before_queueing_says_what_was_stored_and_queues_nothing(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    phase: str,
) -> None:
    from producer import cli as command

    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(150))

    def ctrl_c(at: str, done: int, total: int) -> None:
        if at == phase:
            raise KeyboardInterrupt

    monkeypatch.setattr(command, "_progress", lambda: ctrl_c)
    assert enqueue(tmp_path, str(src), "early", "--batch-size", "1") == 130
    err = capsys.readouterr().err
    if phase == "checking":
        assert f"interrupted while checking {src}: nothing was stored or queued" in err
    else:
        assert "interrupted: job early was not started" in err
    assert queue_depth(cli, keys.SHARED_QUEUE) == 0
