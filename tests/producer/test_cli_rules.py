"""The rules of the producer's flags (producer/cli.py RULES): each refuses what it should with
the one-line error a user sees, before anything is read or written, and names only flags its
command has, whose absence can be told."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from fleetgen import keys
from producer.cli import RET_BAD_INPUT, RULES, Excludes, Requires, broken_rule, build_parser, main
from tests.stack import chat_rows, write_jsonl


def commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def parsed(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_every_flag_a_rule_names_is_a_flag_of_its_command() -> None:
    parsers = commands()
    for command, rules in RULES.items():
        names = {option for action in parsers[command]._actions
                 for option in (*action.option_strings, action.metavar)}
        assert {flag for rule in rules for flag in rule.named() if flag not in names} == set()


def test_a_flag_whose_presence_a_rule_reads_is_absent_by_default() -> None:
    """`Requires` and `Excludes` tell a given flag by a value other than None or off: a
    default of 1 would read as given on every command line."""
    parsers = commands()
    for command, rules in RULES.items():
        defaults = {option: action.default for action in parsers[command]._actions
                    for option in (*action.option_strings, action.metavar)}
        read = {flag for rule in rules if isinstance(rule, Requires | Excludes)
                for flag in rule.named()}
        assert {flag: defaults[flag] for flag in read if defaults[flag] not in (None, False)} == {}


def test_a_rollout_with_one_sample_or_options_breaks_no_rule() -> None:
    rollout = ("--rollout", "fleetgen.rollouts:retry_unusable")
    assert broken_rule(parsed("enqueue", "p.jsonl", "--samples", "1", *rollout)) is None
    assert broken_rule(parsed("enqueue", "p.jsonl", "--keep-calls",
                              "--rollout-options", "{}", *rollout)) is None
    assert broken_rule(parsed("enqueue", "-", "--job", "piped")) is None
    assert broken_rule(parsed("status", "j", "--watch", "--interval", "0.5")) is None


def test_the_first_broken_rule_in_the_table_is_the_one_reported() -> None:
    args = parsed("enqueue", "p.jsonl", "--seed", "-1", "--batch-size", "0")
    assert broken_rule(args) == "--batch-size must be >= 1, got 0"


ROLLOUT = "fleetgen.rollouts:retry_unusable"


@pytest.mark.parametrize(("argv", "message"), [
    (["enqueue", "-", "--output", "OUT"], "reading prompts from stdin (-) needs --job NAME"),
    (["enqueue", "IN", "--queue", "gpu-x"], f"--queue 'gpu-x': use {keys.SHARED_QUEUE} or gpuN"),
    (["enqueue", "IN", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["enqueue", "IN", "--samples", "1025"], "--samples must be in [1, 1024], got 1025"),
    (["enqueue", "IN", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["enqueue", "IN", "--output", "  "], "--output is empty: give s3://bucket/prefix or a "
     "folder, or leave it out for $FLEETGEN_OUTPUT, else ./fleetgen-output"),
    (["enqueue", "IN", "--canary", "length=off", "--no-canary"], "--canary sets the canary's "
     "thresholds and --no-canary turns it off: pass one of them"),
    (["enqueue", "IN", "--keep-calls"], "--rollout-options and --keep-calls go with --rollout"),
    (["enqueue", "IN", "--rollout-options", "{}"],
     "--rollout-options and --keep-calls go with --rollout"),
    (["enqueue", "IN", "--samples", "4", "--rollout", ROLLOUT], "--samples with --rollout: a "
     "rollout asks for the answers it needs itself (fleetgen.rollouts:BestOfN takes n)"),
    (["status", "j", "--interval", "5"], "--interval sets how often --watch redraws: add --watch"),
    (["status", "j", "--watch", "--interval", "0"], "--interval must be more than 0 seconds"),
    (["report", "j", "--max-batches", "0"], "--max-batches must be >= 1, got 0"),
], ids=lambda value: value if isinstance(value, str) else "-".join(value[:3]))
def test_a_broken_rule_is_one_error_line_and_nothing_is_written(
    argv: list[str], message: str, redis_client: Any, cli_env: None, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(3))
    out = tmp_path / "out"
    argv = [str(src) if a == "IN" else str(out) if a == "OUT" else a for a in argv]
    if argv[0] == "enqueue" and "--job" not in argv and argv[1] != "-":
        argv += ["--job", "ruled"]
    if argv[0] == "enqueue" and "--output" not in argv:
        argv += ["--output", str(out)]
    assert main(argv) == RET_BAD_INPUT
    assert capsys.readouterr() == ("", f"error: {message}\n")
    assert redis_client.dbsize() == 0 and not out.exists()


# A job's endpoint (--endpoint, --text-column): what each endpoint cannot do is refused up front.


@pytest.mark.parametrize(("argv", "message"), [
    (["enqueue", "IN", "--endpoint", "completions", "--rollout", ROLLOUT],
     "--rollout with --endpoint completions: a rollout's calls are chat requests"),
    (["enqueue", "IN", "--endpoint", "embeddings", "--samples", "2"],
     "--samples with --endpoint embeddings: a request of it gives one answer per text (a "
     "vector, a label), the same every time"),
    (["enqueue", "IN", "--endpoint", "classify", "--samples", "3"],
     "--samples with --endpoint classify: a request of it gives one answer per text (a "
     "vector, a label), the same every time"),
    (["enqueue", "IN", "--endpoint", "embeddings", "--canary", "length=off"],
     "--canary with --endpoint embeddings: the canary judges generated text, which such a "
     "job has none of; its canary is off"),
    (["enqueue", "IN", "--endpoint", "classify", "--canary", "length=off"],
     "--canary with --endpoint classify: the canary judges generated text, which such a "
     "job has none of; its canary is off"),
    (["enqueue", "IN", "--endpoint", "embeddings", "--no-thinking"],
     "--no-thinking with --endpoint embeddings: such a job generates no text"),
    (["enqueue", "IN", "--endpoint", "classify", "--no-thinking"],
     "--no-thinking with --endpoint classify: such a job generates no text"),
    (["enqueue", "IN", "--text-column", "body"],
     "--text-column names the text field of a completions, embeddings or classify job's plain "
     "lines: add --endpoint with one of them"),
    (["enqueue", "IN", "--endpoint", "chat", "--text-column", "body"],
     "--text-column with --endpoint chat: a chat line's text is its prompt or messages (a "
     "table's column of another name: --prompt-column)"),
    (["enqueue", "IN", "--endpoint", "embeddings", "--prompt-column", "q"],
     "--prompt-column with --endpoint embeddings: the text column of a completions, "
     "embeddings or classify job is named by --text-column"),
    (["enqueue", "IN", "--endpoint", "completions", "--text-column", "sampling"],
     "--text-column 'sampling': id, sampling are read as themselves; the text field has "
     "another name"),
], ids=lambda value: value if isinstance(value, str) else "-".join(value[2:6]))
def test_an_endpoint_rule_is_one_error_line_and_nothing_is_written(
    argv: list[str], message: str, redis_client: Any, cli_env: None, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", chat_rows(3))
    out = tmp_path / "out"
    argv = [str(src) if a == "IN" else a for a in argv]
    assert main([*argv, "--job", "ruled", "--output", str(out)]) == RET_BAD_INPUT
    assert capsys.readouterr() == ("", f"error: {message}\n")
    assert redis_client.dbsize() == 0 and not out.exists()


def test_what_an_endpoint_can_do_breaks_no_rule() -> None:
    for argv in (("--endpoint", "completions", "--samples", "4", "--text-column", "question"),
                 ("--endpoint", "embeddings", "--samples", "1", "--no-canary"),
                 ("--endpoint", "embeddings", "--text-column", "body", "--id-column", "doc"),
                 ("--endpoint", "chat", "--rollout", ROLLOUT, "--prompt-column", "q"),
                 ("--endpoint", "completions", "--canary", "length=off")):
        assert broken_rule(parsed("enqueue", "p.jsonl", *argv)) is None, argv
