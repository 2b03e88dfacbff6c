"""`python -m producer COMMAND`: enqueue a job, watch it, steer it.

A command is a builder of its flags (`_add_enqueue`, ...), its `cmd_*` function in COMMANDS,
and its row of RULES: what it refuses of its flags' values and combinations, checked by `main`
before the command runs. A new flag is its add_argument in the builder, its rules in RULES,
and its use in `cmd_*`.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import urlparse

import orjson
from celery import Celery

from fleetgen import broker, keys, redisconn
from fleetgen.canary import Thresholds
from fleetgen.commandline import CommandParser
from fleetgen.endpoints import CHAT, ENDPOINTS, endpoint
from fleetgen.errors import FleetgenError, JobError, RolloutError, UnknownJobError
from fleetgen.job import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    MAX_SAMPLES,
    GenerationParams,
    JobManifest,
)
from fleetgen.ledger import STATE_CANCELLED, STATE_RUNNING, Ledger
from fleetgen.redact import redact
from fleetgen.retry import (
    REDIS_ERRORS,
    RedisAuthError,
    RedisConnectionError,
    RedisNoPermissionError,
    RedisProtocolError,
)
from fleetgen.rollouts import RolloutSpec
from fleetgen.settings import Settings, SettingsError
from fleetgen.sink import absolute, location, open_sink
from producer import export, report
from producer.enqueue import (
    CHECKING,
    MAX_DEFAULT_BATCH,
    MAX_DEFAULT_EMBEDDINGS_BATCH,
    MIN_BATCHES,
    MIN_DEFAULT_BATCH,
    MIN_DEFAULT_EMBEDDINGS_BATCH,
    QUEUEING,
    STORING,
    EnqueueInterrupted,
    EnqueueReport,
    EnqueueRequest,
    Progress,
    enqueue,
)
from producer.export import EMBEDDING_DTYPES, FORMATS
from producer.inputs import (
    RESERVED_FIELDS,
    TEXT_FIELDS,
    Columns,
    InputErrors,
    InputSource,
    NoPrompts,
    UnreadableInput,
    open_input,
)
from producer.upload import UploadError, upload

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[CommandParser]

# The job view and the control verbs (`producer.control`, `producer.status`, `fleetgen.jobview`)
# are imported by the commands that use them: they bring httpx, the reconciler and the fleet
# reader, ~0.25 s that `enqueue` would otherwise spend before its first batch is queued (a
# short job is timed from the enqueue command to its first request).

RET_OK = 0
RET_ERROR = 1
RET_BAD_INPUT = 2
RET_INTERRUPTED = 130
RET_BROKEN_PIPE = 128 + 13  # what a shell reports for a process ended by SIGPIPE
STDIN = "-"
STDIN_NAME = "<stdin>"  # the input's name in errors and the manifest when it came from stdin
# `status --watch` redraws this often: a batch's answers move the figures every second or so.
WATCH_INTERVAL_S = 2.0
# Where a job writes when neither --output nor FLEETGEN_OUTPUT names a place: beside the user.
DEFAULT_OUTPUT = "fleetgen-output"

EPILOG = """examples:
  python -m producer enqueue prompts.jsonl --job distill-v1 --output s3://bucket/runs
  python -m producer enqueue prompts.jsonl --job distill-v1 --output ./runs   # re-run = resume
  zcat prompts.jsonl.gz | python -m producer enqueue - --job distill-v1        # from stdin
  python -m producer enqueue s3://bucket/prompts/ --job distill-v1 --prompt-column question
  python -m producer enqueue texts.jsonl --job embed-v1 --endpoint embeddings --text-column body
  python -m producer status distill-v1
  python -m producer status distill-v1 --watch        # live, until it is done
  python -m producer status distill-v1 --json         # the same figures for machines
  python -m producer jobs
  python -m producer report distill-v1                 # one HTML page: plots and figures
  python -m producer rebuild distill-v1 --output s3://bucket/runs   # after Redis lost its data
  python -m producer upload prompts.jsonl s3://bucket/prompts/     # then enqueue it from there

`python -m producer COMMAND --help` shows a command's flags, defaults and an example.
"""


class CommandError(FleetgenError):
    """A command could not do what was asked; printed without a traceback."""

    def __init__(self, message: str, code: int = RET_ERROR) -> None:
        super().__init__(message)
        self.code = code


def _given(value: object) -> bool:
    """Whether a flag was given: rules name only flags whose default is None or off."""
    return value is not None and value is not False


def _value(args: argparse.Namespace, flag: str) -> Any:
    """The parsed value of `flag`: `--rollout-options` is `args.rollout_options`, the
    positional `INPUT` is `args.input`."""
    return getattr(args, flag.lstrip("-").replace("-", "_").lower())


@dataclass(frozen=True)
class Requires:
    """Any of `flags`, given (and its value passing `when`), needs `needs` given too."""

    flags: tuple[str, ...]
    needs: str
    says: str = "{flags} {go} with {needs}"
    when: Callable[[Any], bool] = _given

    def named(self) -> tuple[str, ...]:
        return (*self.flags, self.needs)

    def error(self, args: argparse.Namespace) -> str | None:
        if _given(_value(args, self.needs)) or not any(
                _given(_value(args, flag)) and self.when(_value(args, flag)) for flag in self.flags):
            return None
        return self.says.format(flags=" and ".join(self.flags), needs=self.needs,
                                go="go" if len(self.flags) > 1 else "goes")


@dataclass(frozen=True)
class Excludes:
    """`flag`, given (and its value passing `when`), and `other`, given (and its value passing
    `other_when`), are not given together. `says` may name `other`'s value as {value}."""

    flag: str
    other: str
    why: str = ""
    says: str = "{flag} with {other}: {why}"
    when: Callable[[Any], bool] = _given
    other_when: Callable[[Any], bool] = _given

    def named(self) -> tuple[str, ...]:
        return (self.flag, self.other)

    def error(self, args: argparse.Namespace) -> str | None:
        value, other = _value(args, self.flag), _value(args, self.other)
        if not (_given(value) and self.when(value) and _given(other) and self.other_when(other)):
            return None
        return self.says.format(flag=self.flag, other=self.other, why=self.why, value=other)


@dataclass(frozen=True)
class Within:
    """A number flag, when given, is at least `low` (more than it when `above`) and at most
    `high`."""

    flag: str
    low: int
    high: int | None = None
    above: bool = False
    says: str = ""  # default: "{flag} must be in [{low}, {high}], got {value}" or ">= {low}"

    def named(self) -> tuple[str, ...]:
        return (self.flag,)

    def error(self, args: argparse.Namespace) -> str | None:
        value = _value(args, self.flag)
        if value is None:
            return None
        if (value > self.low if self.above else value >= self.low) and (
                self.high is None or value <= self.high):
            return None
        span = f">= {self.low}" if self.high is None else f"in [{self.low}, {self.high}]"
        says = self.says or "{flag} must be {span}, got {value}"
        return says.format(flag=self.flag, span=span, value=value)


@dataclass(frozen=True)
class Valid:
    """A flag's value, when given, passes `test`; `why` says what a valid one is."""

    flag: str
    test: Callable[[Any], bool]
    why: str
    says: str = "{flag} {value!r}: {why}"

    def named(self) -> tuple[str, ...]:
        return (self.flag,)

    def error(self, args: argparse.Namespace) -> str | None:
        value = _value(args, self.flag)
        if value is None or self.test(value):
            return None
        return self.says.format(flag=self.flag, value=value, why=self.why)


# A rule's `named()` is the flags it reads (a positional by its metavar), `error(args)` what
# is printed when `args` break it, else None.
Rule = Requires | Excludes | Within | Valid

# What each command refuses of its flags' values and combinations, checked in this order
# before the command runs (`broken_rule`); the first one broken is the error, exit code 2. A
# flag's rules live here and nowhere else: a new flag adds its add_argument to its command's
# builder below and its rules to its command's row.
RULES: dict[str, tuple[Rule, ...]] = {
    "enqueue": (
        Valid("--queue", lambda q: q == keys.SHARED_QUEUE or bool(keys.GPU_QUEUE.match(q)),
              f"use {keys.SHARED_QUEUE} or gpuN"),
        Requires(("INPUT",), "--job", when=lambda path: path == STDIN,
                 says="reading prompts from stdin (-) needs --job NAME"),
        Within("--batch-size", 1),
        Within("--samples", 1, MAX_SAMPLES),
        Within("--seed", 0),
        Valid("--output", lambda out: bool(out.strip()), says="{flag} is empty: {why}",
              why="give s3://bucket/prefix or a folder, or leave it out for $FLEETGEN_OUTPUT, "
              "else ./fleetgen-output"),
        Excludes("--canary", "--no-canary", "pass one of them",
                 says="{flag} sets the canary's thresholds and {other} turns it off: {why}"),
        Requires(("--rollout-options", "--keep-calls"), "--rollout"),
        Excludes("--samples", "--rollout", when=lambda n: n > 1,
                 why="a rollout asks for the answers it needs itself "
                 "(fleetgen.rollouts:BestOfN takes n)"),
        # One endpoint per job (fleetgen/endpoints.py); an input of OpenAI Batch lines names
        # its own by url, which enqueue checks the same way once it has read it.
        Excludes("--rollout", "--endpoint", other_when=lambda e: e != CHAT,
                 says="{flag} with {other} {value}: a rollout's calls are chat requests"),
        Excludes("--samples", "--endpoint", when=lambda n: n > 1,
                 other_when=lambda e: not endpoint(e).generates,
                 says="{flag} with {other} {value}: a request of it gives one answer per "
                 "text (a vector, a label), the same every time"),
        Excludes("--canary", "--endpoint", other_when=lambda e: not endpoint(e).generates,
                 says="{flag} with {other} {value}: the canary judges generated text, which "
                 "such a job has none of; its canary is off"),
        Excludes("--no-thinking", "--endpoint", other_when=lambda e: not endpoint(e).generates,
                 says="{flag} with {other} {value}: such a job generates no text"),
        Requires(("--text-column",), "--endpoint",
                 says="--text-column names the text field of a completions, embeddings or classify "
                 "job's plain lines: add --endpoint with one of them"),
        Excludes("--text-column", "--endpoint", other_when=lambda e: e == CHAT,
                 says="{flag} with {other} {value}: a chat line's text is its prompt or "
                 "messages (a table's column of another name: --prompt-column)"),
        Excludes("--prompt-column", "--endpoint", other_when=lambda e: e != CHAT,
                 says="{flag} with {other} {value}: the text column of a completions, "
                 "embeddings or classify job is named by --text-column"),
        Valid("--text-column", lambda name: name not in RESERVED_FIELDS,
              why=f"{', '.join(RESERVED_FIELDS)} are read as themselves; the text field has "
              "another name"),
    ),
    "status": (
        Requires(("--interval",), "--watch",
                 says="--interval sets how often --watch redraws: add --watch"),
        Within("--interval", 0, above=True, says="{flag} must be more than 0 seconds"),
    ),
    "report": (Within("--max-batches", 1),),
}


def broken_rule(args: argparse.Namespace) -> str | None:
    """The error of the first rule of the chosen command (RULES) that `args` break, if any."""
    for rule in RULES.get(args.command, ()):
        error = rule.error(args)
        if error is not None:
            return error
    return None


def build_parser() -> CommandParser:
    parser = CommandParser(prog="python -m producer", epilog=EPILOG,
                           description="Enqueue a job's prompts, watch it, steer it, export it.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")
    for add in (_add_enqueue, _add_status, _add_jobs, _add_requeue, _add_pause, _add_cancel,
                _add_resume, _add_export, _add_rebuild, _add_report, _add_upload):
        add(sub)
    return parser


def _command(sub: Subparsers, name: str, text: str, *examples: str) -> CommandParser:
    """A command's parser: `text` its help line and description, `examples` its epilog."""
    lines = "\n".join(f"  python -m producer {name} {example}".rstrip() for example in examples)
    return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                          epilog=f"example{'s' if len(examples) > 1 else ''}:\n{lines}")


def _add_enqueue(sub: Subparsers) -> None:
    p = _command(sub, "enqueue", "check an input (JSONL, Parquet, a saved Hugging Face dataset; "
                 "a file, a folder or S3), store its prompts in the output as batches and queue "
                 "them; the same command again resumes an interrupted enqueue",
                 "prompts.jsonl --job distill-v1 --output s3://bucket/runs",
                 "prompts.jsonl --job distill-v1 --max-tokens 8192 --queue gpu3",
                 "prompts.jsonl --job best-of-4 --samples 4 --temperature 1.0",
                 "prompts.parquet --job distill-v1 --prompt-column question --id-column qid",
                 "texts.jsonl --job embed-v1 --endpoint embeddings --text-column body",
                 "batch.jsonl --job embed-v1   # OpenAI Batch lines of url /v1/embeddings",
                 "./saved-dataset --split train --job distill-v1",
                 "s3://bucket/prompts/ --job distill-v1 --output s3://bucket/runs")
    _add_input_flags(p)
    _add_generation_flags(p)
    _add_answer_flags(p)
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help=f"answers per batch (one per prompt unless --samples or sampling.n say "
                   f"more; default: answers/{MIN_BATCHES} within "
                   f"{MIN_DEFAULT_BATCH}..{MAX_DEFAULT_BATCH}, for embeddings within "
                   f"{MIN_DEFAULT_EMBEDDINGS_BATCH}..{MAX_DEFAULT_EMBEDDINGS_BATCH}; a resumed "
                   f"job keeps its own)")
    p.add_argument("--canary", default=None, metavar="SPEC",
                   help="quality thresholds over the defaults, e.g. "
                   "'empty_content=0.5,length=off,min_completions=100' (default: the canary's "
                   "defaults, docs/guides/running-a-job.md)")
    p.add_argument("--no-canary", action="store_true",
                   help="turn the quality canary off: never pause on bad answers")
    p.add_argument("--skip-invalid", action="store_true",
                   help="enqueue the valid lines; write the invalid ones to URI/JOB/rejects.jsonl "
                   "(default: an invalid line stops the enqueue before anything is written)")


def _add_input_flags(p: argparse.ArgumentParser) -> None:
    """enqueue's flags of where the prompts come from and where the job writes."""
    p.add_argument("input", metavar="INPUT",
                   help="a JSONL file (messages / prompt / OpenAI Batch lines), a .parquet file, "
                   "a folder of *.jsonl / *.parquet shards or a dataset saved with "
                   "save_to_disk, or the same in S3 (s3://bucket/key, s3://bucket/prefix/; the "
                   "output's endpoint and credentials); - reads stdin (needs --job)")
    p.add_argument("--prompt-column", metavar="NAME",
                   help="a table's prompt column when it is not prompt or messages (strings: "
                   "one user message each; lists: the messages)")
    p.add_argument("--id-column", metavar="NAME",
                   help="a table's id column when it is not id or custom_id")
    p.add_argument("--endpoint", choices=tuple(ENDPOINTS), default=None,
                   help="what each prompt asks: chat (/v1/chat/completions), completions "
                   "(/v1/completions: a prompt string continued), embeddings (/v1/embeddings: "
                   "a vector per text) or classify (/v1/classify, vLLM's /classify: a label and "
                   "its probabilities per text); one per job (default: the url of the input's OpenAI "
                   "Batch lines, else chat)")
    p.add_argument("--text-column", metavar="NAME",
                   help="with --endpoint completions or embeddings: the field of a plain JSONL "
                   "line, or a table's column, holding the text (default: "
                   + ", ".join(f"{field} for {name}" for name, field in TEXT_FIELDS.items())
                   + "); OpenAI Batch lines keep theirs in body")
    p.add_argument("--split", metavar="NAME",
                   help="the split of a saved dataset of several (a DatasetDict folder)")
    p.add_argument("--job", metavar="NAME",
                   help="the job's name (default: the input's name without extension)")
    p.add_argument("--output", default=None, metavar="URI",
                   help="the job's output, s3://bucket/prefix or a folder; the job writes under "
                   "URI/JOB/ (default: $FLEETGEN_OUTPUT or ./fleetgen-output)")


def _add_generation_flags(p: argparse.ArgumentParser) -> None:
    """enqueue's job-wide request defaults (GenerationParams) and where its batches run."""
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help="most tokens generated per prompt (a line's own max_tokens wins)")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, metavar="T",
                   help="sampling temperature (a line's own temperature wins)")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, metavar="P",
                   help="nucleus sampling top_p (a line's own top_p wins)")
    p.add_argument("--no-thinking", action="store_true",
                   help="send enable_thinking=false (default: thinking on; a line's own "
                   "chat_template_kwargs wins)")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="model name sent to the servers (default: each server's own model)")
    p.add_argument("--queue", default=keys.SHARED_QUEUE, metavar="Q",
                   help=f"{keys.SHARED_QUEUE}: every GPU takes the job; gpu3 pins it to GPU 3"
                   " (default: %(default)s)")


def _add_answer_flags(p: argparse.ArgumentParser) -> None:
    """enqueue's flags of how many answers a prompt gets and what program makes them."""
    p.add_argument("--samples", type=int, default=None, metavar="N",
                   help="answers per prompt, each its own record and export line, asked "
                   "with n where the server takes it "
                   f"(1..{MAX_SAMPLES}; a line's own sampling.n wins; default 1)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="the job's seed: an answer of a prompt of several whose line gives no "
                   "seed gets one drawn from it, the prompt's id and the answer's index "
                   "(default: drawn from the job's name)")
    p.add_argument("--rollout", default=None, metavar="MODULE:NAME",
                   help="run this program for each prompt instead of one request: an async "
                   "function (prompt, generate) -> dict, importable here and on every worker "
                   "node, e.g. fleetgen.rollouts:retry_unusable (docs/rollouts/)")
    p.add_argument("--rollout-options", default=None, metavar="JSON",
                   help="keyword arguments the rollout's class is built with, as a JSON "
                   "object, e.g. '{\"tries\": 5}'")
    p.add_argument("--keep-calls", action="store_true",
                   help="keep every call of each prompt's rollout (request and completion) "
                   "in its record and exports: the whole trajectory")


def _add_status(sub: Subparsers) -> None:
    p = _command(sub, "status", "progress, rate, ETA, tokens and workers of a job",
                 "distill-v1", "distill-v1 --watch", "distill-v1 --json")
    p.add_argument("job", metavar="JOB", help="the job's name")
    p.add_argument("--json", action="store_true",
                   help="print the same figures as one JSON object (one line per redraw with "
                   "--watch)")
    p.add_argument("--watch", action="store_true",
                   help="redraw every --interval seconds until the job is done or cancelled "
                   "(a paused one is watched on), or Ctrl-C; a job not enqueued yet is waited "
                   "for")
    p.add_argument("--interval", type=float, default=None, metavar="S",
                   help=f"seconds between --watch's redraws (default: {WATCH_INTERVAL_S:g})")
    p.add_argument("--no-servers", action="store_true",
                   help="leave out the live per-GPU table (no /metrics or /server_info requests; "
                   "fleet is null in --json)")


def _add_jobs(sub: Subparsers) -> None:
    _command(sub, "jobs", "list the jobs Redis holds (running, paused, and finished ones until "
             "FLEETGEN_JOB_RETENTION expires them) with their state and progress", "")


def _add_requeue(sub: Subparsers) -> None:
    p = _command(sub, "requeue", "send failed prompts again (e.g. after raising the context)",
                 "distill-v1 --failed")
    p.add_argument("job", help="the job's name")
    p.add_argument("--failed", action="store_true", required=True,
                   help="required: send every prompt whose newest outcome is a failure")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="prompts per new batch (default: the job's batch size)")


def _add_pause(sub: Subparsers) -> None:
    p = _command(sub, "pause", "start no new batches (running ones finish)", "distill-v1")
    p.add_argument("job", help="the job's name")


def _add_cancel(sub: Subparsers) -> None:
    p = _command(sub, "cancel", "stop the job: no new batches, running ones stop (resume runs "
                 "it again)", "distill-v1")
    p.add_argument("job", help="the job's name")


def _add_resume(sub: Subparsers) -> None:
    p = _command(sub, "resume", "run a paused or cancelled job again", "distill-v1")
    p.add_argument("job", help="the job's name")
    p.add_argument("--accept-quality", action="store_true",
                   help="go on although the quality canary paused the job")
    p.add_argument("--accept-failures", action="store_true",
                   help="after a failure breaker pause: keep its failed prompts as "
                   "failures (not sent again) and stop pausing the job for that cause")


def _add_export(sub: Subparsers) -> None:
    p = _command(sub, "export", "write one dataset with every input id (every answer) exactly "
                 "once",
                 "distill-v1 --to distill-v1.out.jsonl",
                 "best-of-4 --to best-of-4.jsonl --group-answers   # one line per prompt",
                 "distill-v1 --to distill-v1.parquet --format parquet --partial",
                 "distill-v1 --to distill-v1.out.jsonl --output s3://bucket/runs   # Redis lost it",
                 "embed-v1 --to embed-v1.parquet --format parquet --embedding-dtype float16")
    p.add_argument("job", help="the job's name")
    p.add_argument("--to", type=Path, required=True, metavar="PATH",
                   help="required: the file to write (never the job's input)")
    p.add_argument("--format", choices=FORMATS, default="jsonl", help="output format")
    p.add_argument("--group-answers", action="store_true",
                   help="one row per prompt, its answers in a list ordered by index (jsonl, "
                   "parquet; default: one row per answer, with its index in `sample` when a "
                   "prompt has several)")
    p.add_argument("--embedding-dtype", choices=EMBEDDING_DTYPES, default=None,
                   help="an embeddings job's Parquet: the type of its vector column (default "
                   "float32, the vectors as computed; float16 halves the file)")
    p.add_argument("--partial", action="store_true",
                   help="export what exists of a job that is not finished, or whose enqueue did "
                   "not finish")
    p.add_argument("--force", action="store_true", help="replace --to if it exists")
    p.add_argument("--json", action="store_true",
                   help="print the reconcile as one JSON object (other messages go to stderr)")
    p.add_argument("--output", default=None, metavar="URI",
                   help="the job's output, s3://bucket/prefix or a folder (default: the output "
                   "Redis has for it); a job Redis does not know is exported from there alone")


def _add_rebuild(sub: Subparsers) -> None:
    p = _command(sub, "rebuild", "rebuild a job's ledger in Redis from its output (after Redis "
                 "lost its data): what is done, its counts and requeue rounds; the rest runs "
                 "again", "distill-v1 --output s3://bucket/runs", "distill-v1")
    p.add_argument("job", help="the job's name")
    p.add_argument("--output", default=None, metavar="URI",
                   help="the job's output, s3://bucket/prefix or a folder (default: the output "
                   "Redis has for it); needed when Redis does not know the job")


def _add_report(sub: Subparsers) -> None:
    p = _command(sub, "report", "write one HTML page of a job: throughput per GPU, capacity, "
                 "latency, lengths, finish reasons, failures, canary",
                 "distill-v1", "distill-v1 --to /tmp/distill-v1.html --force")
    p.add_argument("job", help="the job's name")
    p.add_argument("--to", type=Path, default=None,
                   help="HTML file to write (default: ./JOB-report.html)")
    p.add_argument("--max-batches", type=int, default=report.DEFAULT_MAX_BATCHES,
                   help="read latency and lengths from at most this many written batches")
    p.add_argument("--force", action="store_true", help="replace --to if it exists")


def _add_upload(sub: Subparsers) -> None:
    p = _command(sub, "upload", "put local files into S3 with the producer's S3 endpoint and "
                 "credentials (AWS_*), for `enqueue s3://...` to read",
                 "prompts.jsonl s3://bucket/prompts/   # -> s3://bucket/prompts/prompts.jsonl",
                 "prompts.jsonl s3://bucket/in/mine.jsonl",
                 "shards/*.parquet s3://bucket/shards/")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="a local file to upload")
    p.add_argument("to", metavar="S3URI",
                   help="s3://bucket/prefix/ (each file keeps its name under it) or "
                   "s3://bucket/key (one file); the bucket must exist")
    p.add_argument("--force", action="store_true", help="replace an object that exists")


def _rollout(args: argparse.Namespace) -> RolloutSpec | None:
    """The job's rollout from --rollout, --rollout-options and --keep-calls, imported here to
    take its digest; CommandError saying why it cannot be used."""
    if args.rollout is None:
        return None
    options: Any = {}
    if args.rollout_options is not None:
        try:
            options = orjson.loads(args.rollout_options)
        except orjson.JSONDecodeError as exc:
            raise CommandError(f"--rollout-options is not JSON: {exc}", RET_BAD_INPUT) from None
        if not isinstance(options, dict):
            raise CommandError("--rollout-options must be a JSON object of keyword arguments, "
                               f"not {type(options).__name__}", RET_BAD_INPUT)
    # The user's module is looked up from where the command runs, as `python -m` does.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return RolloutSpec.of(args.rollout, options, keep_calls=args.keep_calls)
    except RolloutError as exc:
        raise CommandError(str(exc), RET_BAD_INPUT) from None


def cmd_enqueue(args: argparse.Namespace, settings: Settings) -> int:
    app = broker.make_app(settings)
    from_stdin = args.input == STDIN
    _check_input(args.input)
    output = absolute(args.output) if args.output is not None else _default_output(settings)
    new_folder = _missing_folder(output)
    try:
        params = GenerationParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            thinking=not args.no_thinking, model=args.model,
        )
    except JobError as exc:
        raise CommandError(str(exc), RET_BAD_INPUT) from None
    canary = Thresholds.parse(args.canary, enabled=not args.no_canary)
    rollout = _rollout(args)
    columns = Columns(prompt=args.prompt_column, id=args.id_column, text=args.text_column)
    with (_spooled_stdin() if from_stdin else nullcontext(args.input) as path,
          _opened(str(path), columns, args.split, STDIN_NAME if from_stdin else None) as source):
        request = EnqueueRequest(
            path=source, job=args.job or PurePosixPath(args.input.rstrip("/")).stem,
            output=output, params=params, queue=args.queue, batch_size=args.batch_size,
            skip_invalid=args.skip_invalid, canary=canary,
            samples=args.samples, seed=args.seed, rollout=rollout, endpoint=args.endpoint,
        )
        try:
            report = _enqueued(request, Ledger.connect(settings), app)
        except InputErrors as exc:
            print(str(exc), file=sys.stderr)
            print("nothing enqueued: fix the lines above, or pass --skip-invalid", file=sys.stderr)
            return RET_BAD_INPUT
        except EnqueueInterrupted as exc:
            _interrupted(exc.report, source.name)
            if new_folder is not None and new_folder.is_dir():
                print(f"created output folder {new_folder}", file=sys.stderr)
            return RET_INTERRUPTED
    if new_folder is not None and new_folder.is_dir():
        print(f"created output folder {new_folder}")
    _print_enqueued(report, request.queue, output)
    return RET_OK


def _check_input(spec: str) -> None:
    """CommandError when the input cannot be read twice from here: stdin from a terminal, or
    a local path that is no file (a folder or S3 is opened, and checked, by open_input)."""
    if spec == STDIN:
        if sys.stdin.isatty():
            raise CommandError("stdin is a terminal: pipe the prompts in, or name a file",
                               RET_BAD_INPUT)
        return
    if spec.startswith("s3://") or Path(spec).is_dir():
        return
    path = Path(spec)
    if not path.exists():
        raise CommandError(f"{path}: no such file", RET_BAD_INPUT)
    if not path.is_file():
        # A pipe such as <(zcat x.gz): enqueue reads its input twice, which a pipe cannot do.
        raise CommandError(f"{path}: not a regular file; pipe it to `enqueue - --job NAME`",
                           RET_BAD_INPUT)


def _enqueued(request: EnqueueRequest, ledger: Ledger, app: Celery) -> EnqueueReport:
    """Run enqueue with its progress bar, whose line is ended after (an interruption's
    message clears it instead); bad lines go to the caller, no prompts is a CommandError."""
    # SIGTERM (a closed terminal, a scheduler's kill) stops enqueue as Ctrl-C does: with a
    # report of what was stored, and the job left for the same command to finish.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        report = enqueue(request, ledger, app, _progress())
    except InputErrors:
        _end_progress_line()
        raise
    except NoPrompts as exc:
        _end_progress_line()
        if exc.rejects:
            print(str(InputErrors(exc.rejects, exc.rejected)), file=sys.stderr)
        raise CommandError(str(exc), RET_BAD_INPUT) from None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _end_progress_line()
    return report


def _end_progress_line() -> None:
    if sys.stderr.isatty():
        print(file=sys.stderr)  # off the progress bar's line


def _print_enqueued(report: EnqueueReport, queue: str, output: str) -> None:
    """What enqueue did: the job, its batches stored and queued, its rejects."""
    for note in report.notes:
        print(f"note: {note}")
    verb = "resumed" if report.resumed else "created"
    answers = f" ({report.answers:,} answers)" if report.answers != report.prompts else ""
    kind = f" for {ENDPOINTS[report.endpoint].path}" if report.endpoint != CHAT else ""
    print(f"job {report.job} {verb}: {report.prompts:,} prompts{answers}{kind} in "
          f"{report.batches:,} batches -> queue {queue}, output {output}")
    if report.rebuilt is not None:
        print(f"  Redis did not know the job: its ledger was rebuilt from {report.rebuilt.where}")
        for line in report.rebuilt.lines():
            print(f"    {line}")
    if report.uploaded or report.already_stored:
        print(f"  stored {report.uploaded:,} batch inputs"
              + (f" ({report.already_stored:,} were stored by an earlier run)"
                 if report.already_stored else ""))
    print(f"  enqueued {report.enqueued:,} batches; skipped {report.skipped_done + report.skipped_queued:,}"
          f" ({report.skipped_done:,} done, {report.skipped_queued:,} already queued or running)")
    if report.rejected:
        print(f"  rejected {report.rejected:,} invalid lines -> {report.rejects_at}")
    if report.enqueued == 0:
        print("  nothing to do")


def _default_output(settings: Settings) -> str:
    """The output of a command given no --output: $FLEETGEN_OUTPUT, else ./fleetgen-output (a
    folder as its absolute path)."""
    return absolute(settings.output or DEFAULT_OUTPUT)


def _missing_folder(output: str) -> Path | None:
    """The output's folder when it is a folder not there yet, which enqueue creates; None for
    S3 or a folder that exists."""
    parsed = urlparse(output)
    if parsed.scheme not in ("", "file"):
        return None
    folder = Path(parsed.path if parsed.scheme else output)
    return None if folder.exists() else folder


@contextmanager
def _opened(spec: str, columns: Columns, split: str | None,
            name: str | None) -> Iterator[InputSource]:
    """The input opened (open_input), closed after; one it cannot read is a bad input."""
    try:
        source = open_input(spec, columns=columns, split=split, name=name)
    except UnreadableInput as exc:
        raise CommandError(str(exc), RET_BAD_INPUT) from None
    with source:
        try:
            yield source
        except UnreadableInput as exc:
            raise CommandError(str(exc), RET_BAD_INPUT) from None


@contextmanager
def _spooled_stdin() -> Iterator[Path]:
    """Copy stdin to a temporary file as it is read, a megabyte at a time: enqueue reads its
    input twice (validate, then store) and hashes it, which a pipe cannot give."""
    with tempfile.TemporaryDirectory(prefix="fleetgen-stdin-") as folder:
        path = Path(folder) / "stdin.jsonl"
        with path.open("wb") as spool:
            shutil.copyfileobj(sys.stdin.buffer, spool, 1 << 20)
        yield path


def _interrupted(r: EnqueueReport, source: str) -> None:
    """What an interrupted enqueue stored and queued, and how to finish it: one count of the
    batch inputs in the output and one of the batches that reached the broker."""
    if sys.stderr.isatty():
        # Off the progress bar: the phase it was cut in shows a count of its last redraw.
        print("\r\x1b[K", end="", file=sys.stderr)
    if not r.batches:
        print(f"interrupted while checking {source}: nothing was stored or queued",
              file=sys.stderr)
        return
    if not r.complete:
        print(f"interrupted: job {r.job} was not started: {r.uploaded + r.already_stored:,} of "
              f"{r.batches:,} batch inputs are stored and no batch is queued (none runs until "
              "every input is stored). Run the same command again to store the rest and start "
              "it.", file=sys.stderr)
        return
    stored = f"interrupted: job {r.job} is running: all {r.batches:,} batch inputs are stored"
    if not r.to_queue:
        print(f"{stored}; this run had queued none of its batches yet. Run the same command "
              "again to queue them.", file=sys.stderr)
    elif r.enqueued < r.to_queue:
        print(f"{stored}; {r.enqueued:,} of the {r.to_queue:,} batches this run was queueing "
              f"are queued. Run the same command again to queue the other "
              f"{r.to_queue - r.enqueued:,} (none is queued twice).", file=sys.stderr)
    else:
        print(f"{stored}; all {r.to_queue:,} batches this run was queueing are queued: nothing "
              "is left to do.", file=sys.stderr)


# What each phase of enqueue does, on its progress bar.
PHASE_LABELS = {CHECKING: "checking the input", STORING: "storing batch inputs",
                QUEUEING: "queueing batches"}


def _progress() -> Progress:
    """A one-line progress bar on stderr per phase of enqueue (a terminal only): the file's
    bytes while it is checked and while its batch inputs are stored, then batches queued."""
    interactive = sys.stderr.isatty()
    state: dict[str, Any] = {"phase": None, "start": 0.0}

    def show(phase: str, done: int, total: int) -> None:
        if not interactive:
            return
        if phase != state["phase"]:
            if state["phase"] is not None:
                print(file=sys.stderr)  # the last phase's bar stays, finished
            state.update(phase=phase, start=time.monotonic())
        elapsed = max(1e-6, time.monotonic() - state["start"])
        total = max(1, total)
        eta = f"{(total - done) / (done / elapsed):.0f}s" if done else "-"
        filled = int(30 * done / total)
        amount = (f"{done:,} of {total:,} batches" if phase == QUEUEING
                  else f"{done / 1e6:,.1f} of {total / 1e6:,.1f} MB")
        print(f"\r{PHASE_LABELS[phase]:<20} [{'#' * filled}{'.' * (30 - filled)}] "
              f"{100 * done / total:5.1f}%  {amount}  eta {eta}    ",
              end="", file=sys.stderr, flush=True)

    return show


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    from fleetgen.jobview import STATE_DONE, job_status
    from producer.status import render

    interval = WATCH_INTERVAL_S if args.interval is None else args.interval
    ledger = Ledger.connect(settings)
    try:
        if args.watch:
            _wait_for_job(ledger, args.job, interval)
        else:
            ledger.jobs.load(args.job)  # a job Redis does not hold is an error (main says why)
        while True:
            status = job_status(ledger, args.job, live=not args.no_servers)
            # A done or cancelled job moves no more: its watch draws it once and ends. A
            # paused one is watched on: it may be resumed.
            ended = status.state in (STATE_DONE, STATE_CANCELLED)
            if args.json:
                # One object per line under --watch, so a reader can follow it line by line.
                option = 0 if args.watch else orjson.OPT_INDENT_2
                print(status.to_json(option=option).decode(), flush=True)
            else:
                text = render(status)
                if args.watch:
                    text = (f"\x1b[2J\x1b[H{text}\n\n  {time.strftime('%H:%M:%S')}, "
                            f"{_watch_footer(status.state, ended, interval)}")
                print(text, flush=True)
            if not args.watch or ended:
                return RET_OK
            time.sleep(interval)
    except KeyboardInterrupt:
        # Ctrl-C is how a watch ends; it is not an error.
        return RET_OK


def _wait_for_job(ledger: Ledger, job: str, interval: float) -> None:
    """Return once Redis holds `job`; until then say, once, that the watch waits for it (a
    watcher may be started before or while the job's enqueue runs)."""
    if ledger.jobs.exists(job):
        return
    print(f"waiting for job {job} to be enqueued … (Ctrl-C to stop)", file=sys.stderr,
          flush=True)
    while not ledger.jobs.exists(job):
        time.sleep(interval)


def _watch_footer(state: str, ended: bool, interval: float) -> str:
    from fleetgen.ledger import STATE_PAUSED

    if ended:
        return f"job {state}: the watch ends here"
    if state == STATE_PAUSED:
        return (f"every {interval:g}s, until the job is resumed and done, or cancelled; "
                "Ctrl-C to stop")
    return f"every {interval:g}s; Ctrl-C to stop"


def cmd_jobs(args: argparse.Namespace, settings: Settings) -> int:
    from fleetgen.jobview import job_status
    from producer.status import format_duration

    ledger = Ledger.connect(settings)
    active = ledger.jobs.active()
    # One filed both ways for a moment (enqueue run again on a finished job) shows once.
    finished = [row for row in _finished_rows(ledger, time.time()) if row[0] not in active]
    for down in sorted(ledger.shards.down):
        print(f"ledger shard {down} is out of reach: its jobs are not listed", file=sys.stderr)
    for stranger, jobs in sorted(ledger.shards.strangers().items()):
        named = ", ".join(sorted(jobs)[:3]) + (", ..." if len(jobs) > 3 else "")
        print(f"ledger shard {stranger} holds {len(jobs)} jobs not listed ({named}): "
              "FLEETGEN_LEDGER_URLS must list that shard's Redis", file=sys.stderr)
    if not active and not finished:
        print("no jobs")
        return RET_OK
    # Which Redis holds each job, where FLEETGEN_LEDGER_URLS spreads them over several.
    several = ledger.shards.several

    def shard(name: str) -> str:
        return f" {ledger.shards.name_of(name) if name else 'shard':<24}" if several else ""

    print(f"{'job':<32} {'state':<10} {'done':>10} {'failed':>8} {'total':>10} {'progress':>8}"
          f" {'prompts/s':>9} {'ETA':>8}{shard('')}  reason")
    for name in active:
        s = job_status(ledger, name)
        # Progress counts answers as they are checkpointed (done/failed: what is written).
        pct = 100.0 * (s.done + s.failed + s.checkpointed) / max(1, s.total)
        eta = "-" if s.eta_s is None else format_duration(s.eta_s)
        print(f"{name:<32} {s.state:<10} {s.done:>10,} {s.failed:>8,} {s.total:>10,}"
              f" {pct:>7.1f}% {s.rate.prompts_per_s_5m:>9.2f} {eta:>8}{shard(name)}"
              f"  {s.reason or ''}")
    for name, state, done, failed, total, reason in finished:
        pct = 100.0 * (done + failed) / max(1, total)
        print(f"{name:<32} {state:<10} {done:>10,} {failed:>8,} {total:>10,} {pct:>7.1f}%"
              f" {'-':>9} {'-':>8}{shard(name)}  {reason}")
    return RET_OK


def _finished_rows(ledger: Ledger, now: float) -> list[tuple[str, str, int, int, int, str]]:
    """(name, state, done, failed, total, reason) of each finished job not expired yet, newest
    first, read in one round trip: nothing moves in them, so no job view is needed."""
    from fleetgen.jobview import STATE_DONE
    from fleetgen.ledger import STATE_CANCELLED
    from producer.status import format_duration

    finished = sorted(ledger.jobs.finished().items(), key=lambda item: -item[1])
    rows = []
    summaries = ledger.jobs.finished_summaries([name for name, _ in finished])
    for (name, at), summary in zip(finished, summaries, strict=True):
        if summary is None:
            continue  # expired: it leaves the index when the next job finishes
        shown = STATE_CANCELLED if summary.state == STATE_CANCELLED else STATE_DONE
        why = f"finished {format_duration(max(0.0, now - at))} ago"
        if summary.reason:
            why += f"; {summary.reason}"
        rows.append((name, shown, summary.prompts_done, summary.prompts_failed,
                     summary.prompts, why))
    return rows


def cmd_requeue(args: argparse.Namespace, settings: Settings) -> int:
    from producer import control
    app = broker.make_app(settings)

    report = control.requeue_failed(Ledger.connect(settings), app, args.job, args.batch_size)
    if report.prompts == 0:
        print("Nothing to do: no failed prompts")
    else:
        print(f"job {args.job}: requeued {report.prompts:,} failed prompts in {report.batches} batches"
              f" (round {keys.round_name(report.round)})")
    return RET_OK


def cmd_pause(args: argparse.Namespace, settings: Settings) -> int:
    from producer import control

    control.pause(Ledger.connect(settings), args.job)
    print(f"job {args.job} paused: no new batches start; running batches finish")
    return RET_OK


def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    from producer import control

    control.cancel(Ledger.connect(settings), args.job)
    print(f"job {args.job} cancelled: running batches stop at their next heartbeat; "
          "finished prompts are kept (resume to go on)")
    return RET_OK


def cmd_resume(args: argparse.Namespace, settings: Settings) -> int:
    from producer import control
    app = broker.make_app(settings)

    # A breaker pause waits for the job's batches to stop; a dead worker's lease lapses in
    # a lease period.
    r = control.resume(Ledger.connect(settings), app, args.job,
                       accept_quality=args.accept_quality, accept_failures=args.accept_failures,
                       wait_s=settings.lease_ttl_s)
    if r.cause is None:
        print(f"job {args.job} running; re-dispatched {r.batches:,} batches")
    elif r.accepted:
        print(f"job {args.job} running; prompts that failed with {r.cause!r} stay failures and "
              f"no longer pause it; re-dispatched {r.batches:,} batches")
    else:
        print(f"job {args.job} running; sending again {r.resent:,} prompts that failed with "
              f"{r.cause!r}; re-dispatched {r.batches:,} batches")
    return RET_OK


def cmd_export(args: argparse.Namespace, settings: Settings) -> int:
    from producer import sinkview

    out = sys.stderr if args.json else sys.stdout
    unwritable = export.format_problem(args.format, grouped=args.group_answers,
                                       embedding_dtype=args.embedding_dtype)
    if unwritable:
        raise CommandError(unwritable, RET_BAD_INPUT)
    manifest, ledger = _exported_job(args, settings, out)
    unfit = export.job_problem(manifest.endpoint, grouped=args.group_answers,
                               embedding_dtype=args.embedding_dtype)
    if unfit:
        raise CommandError(f"job {args.job}: {unfit}", RET_BAD_INPUT)
    if ledger is not None:
        _check_quality(ledger, args)
    problem = export.target_problem(args.to, manifest.input, force=args.force)
    if problem:
        raise CommandError(problem)
    sink = open_sink(manifest.output)
    if sink.endpoint() is not None:
        print(f"reading {sink.describe(args.job + '/')} at S3 endpoint {sink.endpoint()}",
              file=out, flush=True)
    layout = sinkview.survey(sink, args.job)
    report = sinkview.Reconcile.of(manifest, layout)
    written: int | None = None
    with closing(sinkview.outcomes(sink, manifest, layout, report)) as rows:
        if not (args.partial or layout.finished(manifest)):
            sinkview.drain(rows)  # it will be refused: count, write nothing
        else:
            with export.Staged(args.to, force=args.force) as staged:
                written = export.write(staged.tmp, args.format, rows,
                                       manifest.params.model or "default",
                                       sampled=manifest.sampled, grouped=args.group_answers,
                                       rollout=manifest.rollout is not None,
                                       endpoint=manifest.endpoint,
                                       embedding_dtype=args.embedding_dtype)
                if (args.partial or report.problem() is None) and not staged.publish():
                    raise CommandError(f"--to {args.to} appeared during the export; nothing "
                                       "written (pass --force to replace it)")
    if args.json:
        print(orjson.dumps({**report.as_dict(), "written": written}).decode(), flush=True)
    else:
        print(f"reconcile: {report.line()}", flush=True)
    shortfall = report.problem(ledger.jobs.state(args.job)[0] if ledger is not None else None)
    if shortfall and not args.partial:
        reason, fix = shortfall
        raise CommandError(f"{reason}; {fix}, or pass --partial to export what exists")
    if shortfall:
        print(f"note: {shortfall[0]}; exported what exists, {report.missing:,} {report.unit} missing",
              file=out)
    print(f"wrote {written or 0:,} lines to {args.to} ({args.format})", file=out)
    return RET_OK


def _exported_job(args: argparse.Namespace, settings: Settings,
                  out: TextIO) -> tuple[JobManifest, Ledger | None]:
    """The job's manifest, and the ledger if Redis knows the job. With --output, a job Redis
    does not know (or a Redis that cannot be reached) is read from the sink alone."""
    if args.output is None:
        ledger = Ledger.connect(settings)
        return ledger.jobs.load(args.job), ledger
    try:
        ledger = Ledger.connect(settings)
        if ledger.jobs.exists(args.job):
            manifest = ledger.jobs.load(args.job)
            _same_output(args.job, manifest.output, args.output)
            return manifest, ledger
        why = "Redis does not know the job"
    except REDIS_ERRORS as exc:
        why = f"Redis cannot be reached ({redact(exc)})"
    manifest = _stored_manifest(args.job, args.output)
    print(f"note: {why}: read from {args.output} alone (the quality canary's verdict, kept in "
          "Redis, is not checked)", file=out)
    return manifest, None


def _check_quality(ledger: Ledger, args: argparse.Namespace) -> None:
    from fleetgen.jobview import job_status

    quality = job_status(ledger, args.job).quality
    if quality and not quality.accepted and not args.partial:
        # All its batches may be written (a small job is judged at its end): still not a
        # dataset to hand on without a look.
        state, reason = ledger.jobs.state(args.job)
        why = reason if reason.startswith("quality:") else (
            f"the canary paused it after {quality.detected_after} answers; it is {state} "
            f"now: {reason}")
        raise CommandError(
            f"job {args.job} failed its quality check ({why}); look at "
            f"the examples (`python -m producer status {args.job}`), then `python -m producer "
            f"resume {args.job} --accept-quality` to export it, or pass --partial")


def _same_output(job: str, known: str, given: str) -> None:
    if location(known) != location(given):
        raise CommandError(f"job {job} writes to {known}, not {given}")


def _stored_manifest(job: str, output: str) -> JobManifest:
    from producer.sinkview import stored_manifest

    sink = open_sink(output)
    manifest = stored_manifest(sink, job)
    if manifest is None:
        raise CommandError(f"no job {job} in {output}: {sink.describe(keys.sink_manifest(job))} "
                           "does not exist")
    return manifest


def _unknown_job(job: str, output: str) -> str | None:
    """What `output` says of a job Redis does not hold, or None when it holds no such job (a
    typo: the error alone says enough). A job that finished had its keys expire after
    FLEETGEN_JOB_RETENTION; any other was lost by Redis and can be rebuilt."""
    from fleetgen.jobview import STATE_DONE
    from producer.sinkview import stored_manifest, stored_state

    try:
        sink = open_sink(output)
        if stored_manifest(sink, job) is None:
            return None
        state = stored_state(sink, job)
    except FleetgenError:
        return None  # an output that cannot be read says nothing either way
    where = sink.describe(f"{job}/")
    export_it = f"`python -m producer export {job} --to FILE --output {output}`"
    if state is not None and state[0] in (STATE_DONE, STATE_CANCELLED):
        return (f"{where} holds job {job}, which finished ({state[0]}): Redis forgets a finished "
                f"job FLEETGEN_JOB_RETENTION after it finished, and its output keeps it all; "
                f"{export_it} exports it")
    return (f"{where} holds job {job}: if Redis lost its data, `python -m producer rebuild {job} "
            f"--output {output}` puts it back ({export_it} reads the output alone)")


def cmd_rebuild(args: argparse.Namespace, settings: Settings) -> int:
    from producer import control
    from producer.rebuild import rebuild
    app = broker.make_app(settings)
    from fleetgen.creation import JOB_LOCK_WAIT_S, job_lock

    ledger = Ledger.connect(settings)
    output = args.output
    if ledger.jobs.exists(args.job):
        known = ledger.jobs.load(args.job).output
        if output is not None:
            _same_output(args.job, known, output)
        output = known
    elif output is None:
        raise CommandError(f"Redis does not know job {args.job}: name its output, "
                           f"`python -m producer rebuild {args.job} --output URI`", RET_BAD_INPUT)
    manifest = _stored_manifest(args.job, output)
    # Its ledger shard as enqueue would choose it, before its lock (producer/rebuild.py).
    ledger.shards.place(args.job)
    with job_lock(ledger, args.job, "rebuild", wait_s=JOB_LOCK_WAIT_S):
        rebuilt = rebuild(ledger, manifest, open_sink(manifest.output))
        running = manifest.complete and ledger.jobs.state(args.job)[0] == STATE_RUNNING
        dispatched = (control.redispatch_idle(ledger, app, args.job, manifest.queue)
                      if running else 0)
    print(f"job {args.job} rebuilt from {rebuilt.where}")
    for line in rebuilt.lines():
        print(f"  {line}")
    if running:
        print(f"  re-dispatched {dispatched:,} batches")
    return RET_OK


def cmd_report(args: argparse.Namespace, settings: Settings) -> int:
    ledger = Ledger.connect(settings)
    manifest = ledger.jobs.load(args.job)
    to: Path = args.to or Path(f"{args.job}-report.html")
    problem = export.target_problem(to, manifest.input, force=args.force)
    if problem:
        raise CommandError(problem)
    if importlib.util.find_spec("matplotlib") is None:
        raise CommandError("report draws with matplotlib: pip install -e '.[perf]'")
    page = report.build_report(ledger, args.job, args.max_batches)
    with export.Staged(to, force=args.force) as staged:
        staged.tmp.write_text(page.html, encoding="utf-8")
        if not staged.publish():
            raise CommandError(f"--to {to} appeared meanwhile; nothing written (pass --force)")
    s = page.status
    print(f"wrote {to}: job {args.job} [{s.state}], {s.done:,} done, {s.failed:,} failed "
          f"of {s.total:,}")
    return RET_OK


def cmd_upload(args: argparse.Namespace, settings: Settings) -> int:
    try:
        for done in upload(args.files, args.to, force=args.force):
            at = f" at S3 endpoint {done.endpoint}" if done.endpoint else ""
            print(f"wrote {done.uri} ({done.size:,} bytes) from {done.path}{at}", flush=True)
    except UploadError as exc:
        raise CommandError(str(exc), RET_BAD_INPUT) from None
    return RET_OK


COMMANDS: dict[str, Callable[[argparse.Namespace, Settings], int]] = {
    "enqueue": cmd_enqueue,
    "status": cmd_status,
    "jobs": cmd_jobs,
    "requeue": cmd_requeue,
    "pause": cmd_pause,
    "cancel": cmd_cancel,
    "resume": cmd_resume,
    "export": cmd_export,
    "rebuild": cmd_rebuild,
    "report": cmd_report,
    "upload": cmd_upload,
}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        broken = broken_rule(args)
        if broken is not None:
            raise CommandError(broken, RET_BAD_INPUT)
        settings = Settings.from_env()
        code = COMMANDS[args.command](args, settings)
        sys.stdout.flush()  # a reader that went away shows here, not at exit
        return code
    except BrokenPipeError:
        # The reader of stdout went away (`status JOB | head -1`): what it wanted it has, so stop
        # quietly. Point stdout at devnull so Python's own flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return RET_BROKEN_PIPE
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except UnknownJobError as exc:
        print(f"error: {redact(exc)}", file=sys.stderr)
        found = _unknown_job(exc.job, getattr(args, "output", None) or _default_output(settings))
        if found:
            print(found, file=sys.stderr)
        return RET_ERROR
    except SettingsError as exc:  # bad input, like a bad flag; its text may quote a URL
        print(f"error: {redact(exc)}", file=sys.stderr)
        return RET_BAD_INPUT
    except FleetgenError as exc:
        print(f"error: {redact(exc)}", file=sys.stderr)
        return RET_ERROR
    except RedisAuthError as exc:
        print(f"error: {redisconn.auth_refused(settings.redis_url, exc)}", file=sys.stderr)
        return RET_ERROR
    except RedisNoPermissionError as exc:
        print(f"error: the Redis user of {redact(settings.redis_url)} may not do this ({exc}); "
              "its ACL lacks what the producer needs (docs/security.md)", file=sys.stderr)
        return RET_ERROR
    except RedisConnectionError as exc:
        print(f"error: cannot reach Redis at {redact(settings.redis_url)} ({redact(exc)}); start "
              "the embedded one with `python -m launcher redis` or set REDIS_URL", file=sys.stderr)
        return RET_ERROR
    except RedisProtocolError as exc:
        print(f"error: {redisconn.not_redis(settings.redis_url, exc)}", file=sys.stderr)
        return RET_ERROR
    except KeyboardInterrupt:
        return RET_INTERRUPTED
