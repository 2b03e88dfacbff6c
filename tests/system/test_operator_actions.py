"""Operator actions and faults in random order, on a real stack: every prompt exactly once in the
export, and `status` tells the truth.

A Hypothesis state machine drives one fresh stack per sequence: its own Valkey (AOF on; it is
killed and restarted), its own SeaweedFS (stopped for outages), one simulator (killed and
restarted on its port; it fails some prompts for real: a poison marker gets a context 400, a
share of requests get a 500) and one or two Celery workers (SIGKILLed and restarted). Two jobs:
`alpha` writes to a folder, `beta` to S3. The rules are what an operator does (enqueue, possibly
interrupted by Ctrl-C or kill -9 and then re-run as the docs say; two enqueues of one job name at
once; pause, resume, cancel, `requeue --failed`, once or twice at once; an enqueue into another
job's folder, or of a reserved name, which is refused) and what breaks (worker, server, Redis, S3,
and Redis losing every key, FLUSHALL, after which the operator brings each job back with `rebuild`
or its enqueue, as docs/guides/failure-modes.md says). A job's requeue rounds may be numbered from
r99 on (its round counter set at its creation), so that its rounds cross r99 -> r100.

The final phase heals every fault, resumes what the operator paused or cancelled, re-runs every
interrupted enqueue, waits for each job to be done, then checks:
1. `export` holds every input id exactly once (answers `id`, failures `custom_id` + `error`);
2. every failure has a reason, and one never sent to a server (`tries == 0`) has a documented
   code (UNSENT_FAILURE_CODES) and a cause the harness really produced (worker deaths);
3. `status --json` agrees with `export --json`: total, done, failed, failures by code, state
   `done`, and the export dropped no duplicate (no prompt ran in two requeue rounds).
Mid-sequence, `status` never shows negative counts or more finished prompts than the job has; its
ETA is 0 only once every prompt is written, and then its figures equal a reading of the sink
(producer/sinkview.py, what `export` reads).

CI runs a few derandomized sequences (no shrinking); `FLEETGEN_STATEFUL_EXAMPLES=200` runs many
random ones, shrunk when one fails (`FLEETGEN_STATEFUL_SHRINK=0`: not, to hunt faster: each
replay of a sequence takes a minute), and `FLEETGEN_STATEFUL_STEPS` sets the steps per sequence.
With -s each sequence prints its steps and commands; its full report (with every process's log)
is in its folder as report.txt, and is printed for the failing sequence:

    FLEETGEN_STATEFUL_EXAMPLES=50 .venv/bin/python -m pytest -q \\
        tests/system/test_operator_actions.py -k keep_every -s --basetemp=/tmp/hunt

Every sequence that found a bug is kept below the machine as a plain test that replays its steps,
waiting for the moment the bug needs (a batch in hand of a live worker) so it fails every time.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import boto3
import orjson
import pytest
from hypothesis import HealthCheck, Phase, currently_in_test_context, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fleetgen import keys
from fleetgen.creation import JOB_LOCK_WAIT_S, job_lock
from fleetgen.errors import JobError, SinkError
from fleetgen.jobview import JobStatus, job_status
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from fleetgen.records import is_failure
from fleetgen.retry import REDIS_ERRORS
from fleetgen.sink import Sink, batch_records, open_sink
from launcher.services import RedisServer, S3Server
from producer import sinkview
from tests.stack import PYTHON, ROOT, Proc, Stack, chat_rows, write_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

# Failures of prompts never sent to a server (`tries == 0`) that the docs name: a batch whose
# workers died holding it more than FLEETGEN_BATCH_MAX_ATTEMPTS times has its unsent prompts
# failed with code batch_attempts_exhausted, "not sent: batch B was started N times and never
# finished ..." (docs/concepts.md#attempts; fleetgen/records.py). Nothing else may fail a prompt
# unsent.
UNSENT_FAILURE_CODES = frozenset({"batch_attempts_exhausted"})
INTERRUPTED = re.compile(r"was started (\d+) times and never finished")
# Reasons a prompt that reached a server may fail for here: the poison marker's context 400,
# and the simulator's 500s (or a reset when the server is killed) after every try.
POISON = "POISON-PILL"
POISON_CODES = frozenset({"context_length_exceeded"})
TRANSIENT_CODES = frozenset({"server_error", "timeout", "generation_failed"})

# About 0.5 s per answer, 8 at a time: a job of 60-300 prompts runs for 5-40 s, so operator
# actions land while it runs. 5% of requests get a 500; with 2 tries per prompt, 1 in 400
# prompts fails for that reason.
SIM_FLAGS = ("--max-running-requests", "8", "--decode-tps", "30", "--mean-output-tokens", "150",
             "--speed", "10", "--fail-rate", "0.05", "--fail-prompt", POISON)
# For replays: 2 slots and answers of about 1.6 s, so a batch of 12 runs for about 10 s and
# still has unsent prompts when the replay's next step comes.
SLOW_SIM_FLAGS = (*SIM_FLAGS, "--speed", "3", "--max-running-requests", "2")
# Worker deaths before a batch's prompts are failed: 2 (default 5) so that a sequence of a few
# steps can reach the limit, for real worker kills and for anything else that burns attempts.
WORKER_ENV = {"FLEETGEN_BATCH_MAX_ATTEMPTS": "2", "FLEETGEN_PROMPT_MAX_ATTEMPTS": "2"}
ENQUEUE_FLAGS = ("--batch-size", "12", "--max-tokens", "400", "--no-canary")
JOBS = ("alpha", "beta")
# A job's requeue round counter, set when the job is created: its next rounds are r99, r100, ...
# (round names grow a digit there, and batches sort by number, not by name).
NEAR_100 = 98
# What an operator might enqueue inside another job's output: a job in its folder (or below),
# and the names every job keeps in its folder, which no job may have.
NESTED_JOB = "nested"
RESERVED_NAMES = ("results", "errors", "inputs")
# Seconds a requeue waits for a failure to requeue: the first poisoned prompt is in a job's first
# batch, written a few seconds after the job starts.
FAILURE_WAIT = 10.0
ROUND_DONE = re.compile(r"\(round r(\d+)\)")
# Seconds: a command that should return at once; a job's end once every fault is healed; and
# how long no prompt may finish before the job counts as stuck.
COMMAND_TIMEOUT = 120.0
JOB_DEADLINE = 420.0
STALL = 120.0

EXAMPLES = int(os.environ.get("FLEETGEN_STATEFUL_EXAMPLES") or 0)
STEPS = int(os.environ.get("FLEETGEN_STATEFUL_STEPS") or 8)


class ReplayMissed(Exception):
    """A replay did not reach the moment its bug needs (timing), so it proves nothing."""


@dataclass
class JobModel:
    """What the operator knows about one job."""

    name: str
    output: str
    files: dict[str, Path]  # "main" and "other": two inputs, different ids
    ids: dict[str, list[str]]
    poison: set[str]
    owner: str | None = None  # the file the job was created from, once the stores say so
    touched: bool = False  # an enqueue of it ran
    rerun: bool = False  # its latest enqueue did not finish: the operator runs it again
    state: str = "running"  # what the operator last set
    rounds_from: int = 0  # its requeue round counter, set once it exists (0: left alone)
    rounds_set: bool = False
    rounds: set[int] = field(default_factory=set)  # requeue rounds the commands numbered
    verified: tuple[Any, ...] | None = None  # the status figures last found equal to the sink

    def enqueue_args(self, which: str) -> list[str]:
        return ["enqueue", str(self.files[which]), "--job", self.name, "--output", self.output,
                *ENQUEUE_FLAGS]


@dataclass
class Ran:
    """One producer command: what was run, how it ended, what it printed."""

    what: str
    code: int | None
    out: str
    err: str
    seconds: float

    def line(self) -> str:
        text = (self.out + self.err).strip().replace("\n", " | ")
        return f"  $ {self.what} -> exit {self.code} in {self.seconds:.1f}s: {text[:600]}"


@dataclass
class Services:
    redis: RedisServer
    s3: S3Server
    stack: Stack
    ledger: Ledger
    sim: Proc | None = None
    sim_port: int = 0
    workers: dict[int, Proc] = field(default_factory=dict)

    def sim_alive(self) -> bool:
        return self.sim is not None and self.sim.alive()


def last_words(proc: Proc) -> str:
    """Why a process ended, by its log: its CRITICAL lines, or the log's end."""
    text = proc.log_path.read_text(errors="replace") if proc.log_path.exists() else ""
    critical = [line for line in text.splitlines() if "CRITICAL" in line]
    return " | ".join(critical[-2:]) if critical else text[-600:]


def rows_for(prefix: str, count: int) -> tuple[list[dict[str, Any]], set[str]]:
    """`count` prompts with ids `{prefix}NNNNN`; every 23rd carries the poison marker."""
    rows, poison = [], set()
    for i, row in enumerate(chat_rows(count, prefix=prefix)):
        pid = row.get("id") or row["custom_id"]
        if i % 23 == 7:
            row = {"id": pid, "prompt": f"This one carries the {POISON} ({i})."}
            poison.add(pid)
        rows.append(row)
    return rows, poison


class OperatorActions(RuleBasedStateMachine):
    """One sequence of operator actions and faults on a fresh stack (see the module doc)."""

    sequences = itertools.count(1)

    def __init__(self, root: Path, sim_flags: tuple[str, ...] = SIM_FLAGS) -> None:
        super().__init__()
        self.sim_flags = sim_flags
        self.dir = root / f"seq{next(self.sequences):03d}"
        self.dir.mkdir(parents=True)
        self.services: Services | None = None
        self.jobs: dict[str, JobModel] = {}
        self.transcript: list[str] = []
        self.spawned: dict[subprocess.Popen[str], float] = {}  # producer commands -> start time
        self.worker_kills = 0
        self.restarts = itertools.count(1)
        self.broken = False
        self.began = time.monotonic()

    # The stack

    @initialize(workers=st.integers(1, 2), sizes=st.tuples(st.integers(60, 300), st.integers(60, 300)),
                first=st.sampled_from(JOBS),
                rounds_from=st.tuples(st.sampled_from((0, NEAR_100)), st.sampled_from((0, NEAR_100))))
    def start_stack(self, workers: int, sizes: tuple[int, int], first: str,
                    rounds_from: tuple[int, int] = (0, 0)) -> None:
        """Start the stack and enqueue the `first` job (so every sequence has work in flight);
        `rounds_from`: each job's requeue round counter once it exists."""
        with self.step(f"start_stack(workers={workers}, sizes={sizes}, first={first!r}, "
                       f"rounds_from={rounds_from})"):
            redis_server = RedisServer(data_dir=self.dir / "redis")
            s3_server = S3Server(data_dir=self.dir / "s3")
            stack = Stack(self.dir, {})
            # Registered before anything starts, so teardown stops whatever did start.
            self.services = Services(redis_server, s3_server, stack, Ledger.from_url("redis://"))
            redis_server.start()
            self.services.ledger = Ledger.from_url(redis_server.url)
            s3_server.start()
            stack.base_env.update({"REDIS_URL": redis_server.url, **s3_server.env()})
            sim, url = stack.sim("sim", *self.sim_flags)
            self.services.sim, self.services.sim_port = sim, int(url.rsplit(":", 1)[1])
            for slot in range(workers):
                self.services.workers[slot] = stack.worker(slot, url, extra_env=WORKER_ENV)
            for name, size, counter in zip(JOBS, sizes, rounds_from, strict=True):
                output = str(self.dir / "out") if name == "alpha" else f"s3://{s3_server.bucket}/runs"
                main, poison = rows_for(name[0], size)
                other, other_poison = rows_for(f"{name[0]}x", size)
                self.jobs[name] = JobModel(
                    name, output,
                    files={"main": write_jsonl(self.dir / f"{name}.jsonl", main),
                           "other": write_jsonl(self.dir / f"{name}-other.jsonl", other)},
                    ids={"main": [r.get("id") or r["custom_id"] for r in main],
                         "other": [r.get("id") or r["custom_id"] for r in other]},
                    poison=poison | other_poison,
                    rounds_from=counter,
                )
        self.enqueue(first, None, 0)

    @property
    def up(self) -> Services:
        assert self.services is not None
        return self.services

    def sim_url(self) -> str:
        return f"http://127.0.0.1:{self.up.sim_port}"

    def ledger(self) -> Ledger:
        return self.up.ledger

    # Rules: enqueue

    @rule(job=st.sampled_from(JOBS), stop=st.sampled_from([None, "SIGINT", "SIGKILL"]),
          tenths=st.integers(0, 40))
    def enqueue(self, job: str, stop: str | None, tenths: int) -> None:
        """Enqueue the job's file; with `stop`, Ctrl-C or kill -9 it after `tenths`/10 s."""
        model = self.jobs[job]
        which = model.owner or "main"
        with self.step(f"enqueue({job!r}, stop={stop!r}, tenths={tenths})"):
            proc = self.spawn(model.enqueue_args(which))
            if stop is not None:
                try:
                    proc.wait(tenths / 10)
                except subprocess.TimeoutExpired:
                    proc.send_signal(getattr(signal, stop))
            ran = self.finish(proc, f"enqueue {job} ({which}) stop={stop} after {tenths / 10}s")
            model.touched = True
            self.learn_owner(model)
            self.number_rounds(model)
            if stop is None:
                self.expect_enqueue_outcome(model, ran)
            model.rerun = ran.code != 0

    @rule(job=st.sampled_from(JOBS), other_file=st.booleans())
    def enqueue_twice_at_once(self, job: str, other_file: bool) -> None:
        """Two enqueues of one job name at once: at most one creates it; the other resumes the
        same file's job or fails with a clear error; a different file never joins the job."""
        model = self.jobs[job]
        with self.step(f"enqueue_twice_at_once({job!r}, other_file={other_file})"):
            existed = self.learn_owner(model) is not None
            first = model.owner or "main"
            second = ({"main": "other", "other": "main"}[first]) if other_file else first
            procs = [(w, self.spawn(model.enqueue_args(w))) for w in (first, second)]
            runs = [(w, self.finish(p, f"enqueue {job} ({w}), concurrent")) for w, p in procs]
            model.touched = True
            owner = self.learn_owner(model)
            self.number_rounds(model)
            lines = "\n".join(r.line() for _, r in runs)
            created = sum(1 for _, r in runs if r.code == 0 and f"job {job} created" in r.out)
            assert created <= (0 if existed else 1), f"{created} enqueues created {job}:\n{lines}"
            for which, ran in runs:
                if ran.code != 0:
                    assert "error:" in ran.err and "Traceback" not in ran.err, \
                        f"an enqueue failed without a clear error:\n{lines}"
                if ran.code == 0 and owner is not None:
                    assert which == owner, (
                        f"enqueue of {which} succeeded but job {job} was created from {owner}:\n"
                        f"{lines}")
            if other_file:
                assert not all(r.code == 0 for _, r in runs), \
                    f"two different files were both enqueued as job {job}:\n{lines}"
            mine = [r for w, r in runs if w == (owner or "main")]
            model.rerun = not any(r.code == 0 for r in mine)

    def number_rounds(self, model: JobModel) -> None:
        """Once the job exists, set its requeue round counter to `rounds_from`, as `requeue`
        numbers a round (Rounds.next, under the job's lock)."""
        ledger = self.ledger()
        if model.rounds_set or not model.rounds_from or not ledger.jobs.exists(model.name):
            return
        with job_lock(ledger, model.name, "test", wait_s=JOB_LOCK_WAIT_S):
            if int(ledger.r.hget(keys.job(model.name), keys.JOB_ROUNDS) or 0) < model.rounds_from:
                ledger.rounds.next(model.name, model.rounds_from - 1)
        model.rounds_set = True
        self.transcript.append(f"  {model.name}: requeue rounds numbered from "
                               f"{keys.round_name(model.rounds_from + 1)}")

    @precondition(lambda self: bool(self.touched()))
    @rule(data=st.data(), name=st.sampled_from((NESTED_JOB, *RESERVED_NAMES)),
          below=st.sampled_from(("", "results", "deep/er")))
    def pick_and_enqueue_nested(self, data: st.DataObject, name: str, below: str) -> None:
        self.enqueue_nested(data.draw(st.sampled_from(self.touched()), label="outer"), name, below)

    def enqueue_nested(self, outer: str, name: str, below: str) -> None:
        """Enqueue job `name` into `outer`'s folder (`below` it), or, for a reserved name, beside
        `outer` in its output: refused with a clear error, and nothing of it is created."""
        model = self.jobs[outer]
        if name == NESTED_JOB and self.learn_owner(model) is None:
            name = RESERVED_NAMES[0]  # no job there yet: only a reserved name is refused
        if name == NESTED_JOB:
            output = "/".join(p for p in (model.output, outer, below) if p)
        else:
            output = model.output
        with self.step(f"enqueue_nested({outer!r}, {name!r}, {below!r})"):
            ran = self.cli(["enqueue", str(model.files["main"]), "--job", name, "--output", output,
                            *ENQUEUE_FLAGS], f"enqueue {name} into {output}")
            assert ran.code not in (0, None) and "error:" in ran.err and "Traceback" not in ran.err, \
                f"an enqueue into another job's folder was not refused with a clear error:\n{ran.line()}"
            s3_down = output.startswith("s3://") and not self.up.s3.alive()
            if not s3_down:
                why = f"inside job {outer!r}" if name == NESTED_JOB else f"job name {name!r}"
                assert why in ran.err, f"the refusal does not say why ({why}):\n{ran.line()}"
            ledger = self.ledger()
            left = [k.decode() for k in ledger.r.scan_iter(match=f"{keys.job(name)}*")]
            assert not left and not ledger.r.sismember(keys.JOBS, name), \
                f"a refused enqueue of {name} left Redis keys: {left}"
            if not output.startswith("s3://"):
                assert not (Path(output) / name).exists(), \
                    f"a refused enqueue of {name} made {Path(output) / name}"
            elif (sink := self.open_output(output)) is not None:
                made = [*sink.list_keys(f"{name}/"), *sink.list_keys(f"{name}/inputs/")]
                assert not made, f"a refused enqueue of {name} wrote {made[:5]} to {output}"

    def expect_enqueue_outcome(self, model: JobModel, ran: Ran) -> None:
        s3_down = model.output.startswith("s3://") and not self.up.s3.alive()
        if s3_down:
            assert ran.code != 0 and "error:" in ran.err and "Traceback" not in ran.err, \
                f"enqueue to a stopped S3 must fail with a clear error:\n{ran.line()}"
        else:
            assert ran.code == 0, f"enqueue failed with every service up:\n{ran.line()}"

    # Rules: steering

    def touched(self) -> list[str]:
        return [name for name, model in self.jobs.items() if model.touched]

    @precondition(lambda self: bool(self.touched()))
    @rule(data=st.data(), action=st.sampled_from(["pause", "resume", "cancel"]))
    def pick_and_steer(self, data: st.DataObject, action: str) -> None:
        self.steer(data.draw(st.sampled_from(self.touched()), label="job"), action)

    def steer(self, job: str, action: str) -> None:
        model = self.jobs[job]
        with self.step(f"steer({job!r}, {action!r})"):
            ran = self.cli([action, job], f"{action} {job}")
            if not self.ledger().jobs.exists(job):
                assert ran.code == 1 and f"no job named '{job}'" in ran.err, ran.line()
                return
            assert ran.code == 0, ran.line()
            model.state = {"pause": "paused", "cancel": "cancelled", "resume": "running"}[action]

    @precondition(lambda self: bool(self.touched()))
    @rule(data=st.data())
    def pick_and_requeue_failed(self, data: st.DataObject) -> None:
        self.requeue_failed(data.draw(st.sampled_from(self.touched()), label="job"))

    def requeue_failed(self, job: str) -> None:
        with self.step(f"requeue_failed({job!r})"):
            ran = self.cli(["requeue", job, "--failed"], f"requeue {job} --failed")
            self.expect_requeue_outcome(self.jobs[job], [ran])

    @precondition(lambda self: bool(self.touched()))
    @rule(data=st.data(), failed=st.booleans())
    def pick_and_requeue_twice_at_once(self, data: st.DataObject, failed: bool) -> None:
        self.requeue_twice_at_once(data.draw(st.sampled_from(self.touched()), label="job"), failed)

    def requeue_twice_at_once(self, job: str, failed: bool = False) -> None:
        """Two `requeue --failed` of one job at once (with `failed`, once a failure is written,
        if one comes soon): they number two rounds, and no prompt goes into the second while
        the first still has it."""
        model = self.jobs[job]
        with self.step(f"requeue_twice_at_once({job!r}, failed={failed})"):
            working = self.up.sim_alive() and any(p.alive() for p in self.up.workers.values())
            if failed and working and model.state == "running":
                self.wait_for_a_failure(job)
            procs = [self.spawn(["requeue", job, "--failed"]) for _ in range(2)]
            runs = [self.finish(p, f"requeue {job} --failed, concurrent") for p in procs]
            rounds = self.expect_requeue_outcome(model, runs)
            if len(rounds) == 2:
                self.check_rounds_apart(model, *sorted(rounds))

    def wait_for_a_failure(self, job: str) -> None:
        """Until status counts a written failure of the job, for FAILURE_WAIT s at most (none
        may come: its failures requeued already, S3 stopped ...)."""
        def failed() -> bool:
            try:
                return bool(job_status(self.ledger(), job).failed)
            except (*REDIS_ERRORS, JobError):
                return False

        try:
            wait_until(failed, FAILURE_WAIT, interval=0.2, what=f"a failure of {job} written")
        except TimeoutError:
            self.transcript.append(f"  no failure of {job} written in {FAILURE_WAIT:.0f}s")

    def expect_requeue_outcome(self, model: JobModel, runs: list[Ran]) -> list[int]:
        """Check how requeues of the job ended; returns the rounds they numbered."""
        job = model.name
        lines = "\n".join(r.line() for r in runs)
        ledger = self.ledger()
        if not ledger.jobs.exists(job):
            assert all(r.code == 1 and f"no job named '{job}'" in r.err for r in runs), lines
            return []
        if (model.output.startswith("s3://") and not self.up.s3.alive()) \
                or ledger.jobs.state(job)[0] == "creating":
            # S3 stopped, or the job's enqueue was interrupted: a clear error, or nothing to do.
            assert all(r.code == 0 or ("error:" in r.err and "Traceback" not in r.err)
                       for r in runs), lines
        else:
            assert all(r.code == 0 for r in runs), lines
        rounds = [int(found[1]) for r in runs if r.code == 0 and (found := ROUND_DONE.search(r.out))]
        reused = sorted(set(rounds) & model.rounds) + sorted(n for n in set(rounds)
                                                             if rounds.count(n) > 1)
        assert not reused, f"{job}: requeue round(s) {reused} numbered twice:\n{lines}"
        model.rounds.update(rounds)
        if rounds and model.state == "cancelled":
            model.state = "running"  # requeue runs a cancelled job again (control.py)
        return rounds

    def check_rounds_apart(self, model: JobModel, first: int, second: int) -> None:
        """A prompt in both rounds was in the second only because the first had already written
        a failure for it (a prompt of a round not written yet has no outcome to requeue)."""
        sink = self.open_output(model.output)
        if sink is None:
            return
        job = model.name
        layout = sinkview.survey(sink, job)
        members: dict[int, dict[str, str]] = {first: {}, second: {}}  # round -> id -> batch
        for batch in layout.requeue:
            number = keys.requeue_round(batch)
            if number in members:
                for line in (sink.get(keys.sink_input(job, batch)) or b"").splitlines():
                    if line:
                        members[number][orjson.loads(line)["id"]] = batch
        both = set(members[first]) & set(members[second])
        for batch in sorted({members[first][i] for i in both}, key=keys.batch_order):
            failed = set()
            if batch in layout.done:
                failed = {r["custom_id"] for r in batch_records(sink, job, batch) if is_failure(r)}
            twice = sorted(i for i in both if members[first][i] == batch and i not in failed)
            assert not twice, (
                f"{job}: {len(twice)} prompts are in rounds {keys.round_name(first)} and "
                f"{keys.round_name(second)}, but {batch} of the first "
                f"{'wrote no failure for them' if batch in layout.done else 'is not written'}: "
                f"{twice[:5]}")

    # Rules: faults

    @precondition(lambda self: bool(self.services and self.services.workers))
    @rule(data=st.data())
    def kill_worker(self, data: st.DataObject) -> None:
        self.kill_worker_in(data.draw(st.sampled_from(sorted(self.up.workers)), label="slot"))

    def kill_worker_in(self, slot: int) -> None:
        with self.step(f"kill_worker({slot})"):
            self.up.workers.pop(slot).kill()
            self.worker_kills += 1

    @precondition(lambda self: self.services is not None and len(self.services.workers) < 2)
    @rule(data=st.data())
    def start_worker(self, data: st.DataObject) -> None:
        free = [s for s in (0, 1) if s not in self.up.workers]
        self.start_worker_in(data.draw(st.sampled_from(free), label="slot"))

    def start_worker_in(self, slot: int) -> None:
        with self.step(f"start_worker({slot})"):
            name = f"gpu{slot}r{next(self.restarts)}"
            self.up.workers[slot] = self.up.stack.worker(slot, self.sim_url(), WORKER_ENV, name=name)

    @precondition(lambda self: self.services is not None and self.services.sim_alive())
    @rule()
    def kill_server(self) -> None:
        with self.step("kill_server()"):
            assert self.up.sim is not None
            self.up.sim.kill()

    @precondition(lambda self: self.services is not None and not self.services.sim_alive())
    @rule()
    def start_server(self) -> None:
        with self.step("start_server()"):
            self.restart_sim()

    def restart_sim(self) -> None:
        name = f"sim-r{next(self.restarts)}"
        self.up.sim = self.up.stack.sim(name, *self.sim_flags, port=self.up.sim_port)[0]

    @precondition(lambda self: self.services is not None)
    @rule(tenths=st.integers(0, 30))
    def restart_redis(self, tenths: int) -> None:
        """kill -9 Redis, leave it down `tenths`/10 s, start it on its port and data dir."""
        with self.step(f"restart_redis(tenths={tenths})"):
            self.up.redis.kill()
            time.sleep(tenths / 10)
            self.up.redis.start()

    @precondition(lambda self: self.services is not None)
    @rule(data=st.data())
    def flushall_and_bring_back(self, data: st.DataObject) -> None:
        ways = {job: data.draw(st.sampled_from(("rebuild", "enqueue")), label=f"{job} back by")
                for job in self.touched()}
        self.flushall(ways)

    def flushall(self, ways: dict[str, str]) -> None:
        """Redis loses every key (FLUSHALL), and the operator brings each job back as the docs
        say: `rebuild JOB --output URI` or its enqueue run again (`ways`). What the loss may cost:
        answers checkpointed but not written (generated again), and a pause, cancel or resume
        run while S3 was down (the job comes back as its progress.json last recorded it); what
        it may not: anything written (its figures do not go down)."""
        with self.step(f"flushall({ways!r})"):
            ledger = self.ledger()
            before = {job: job_status(ledger, job) for job in ways if ledger.jobs.exists(job)}
            ledger.r.flushall()
            self.transcript.append("  FLUSHALL")
            for job, way in ways.items():
                model = self.jobs[job]
                model.verified = None
                if way == "enqueue":
                    ran = self.cli(model.enqueue_args(model.owner or "main"), f"enqueue {job} (again)")
                    self.learn_owner(model)
                    self.expect_enqueue_outcome(model, ran)
                    model.rerun = ran.code != 0
                else:
                    self.rebuild(model)
                if job in before and ledger.jobs.exists(job):
                    self.expect_nothing_written_lost(model, before[job], job_status(ledger, job))
                if ledger.jobs.exists(job) and ledger.jobs.state(job)[0] != "creating":
                    model.state = ledger.jobs.state(job)[0]

    def rebuild(self, model: JobModel) -> None:
        job = model.name
        ran = self.cli(["rebuild", job, "--output", model.output], f"rebuild {job}")
        if model.output.startswith("s3://") and not self.up.s3.alive():
            assert ran.code != 0 and "error:" in ran.err and "Traceback" not in ran.err, \
                f"rebuild from a stopped S3 must fail with a clear error:\n{ran.line()}"
            model.rerun = True  # the final phase's enqueue brings it back
        elif self.learn_owner(model) is None:
            # Its enqueue never stored a manifest: nothing to rebuild, it runs again.
            assert ran.code != 0 and f"no job {job} in" in ran.err, ran.line()
            model.rerun = True
        else:
            assert ran.code == 0 and f"job {job} rebuilt from" in ran.out, ran.line()
            if "did not finish" in ran.out:
                model.rerun = True

    def expect_nothing_written_lost(self, model: JobModel, before: JobStatus,
                                    after: JobStatus) -> None:
        was = (before.done, before.done + before.failed)
        now = (after.done, after.done + after.failed)
        assert now[0] >= was[0] and now[1] >= was[1], (
            f"{model.name}: FLUSHALL and its rebuild lost written prompts: status said {was[0]} "
            f"done, {was[1]} finished before, {now[0]} done, {now[1]} finished after")

    @precondition(lambda self: self.services is not None and self.services.s3.alive())
    @rule()
    def stop_s3(self) -> None:
        with self.step("stop_s3()"):
            self.up.s3.stop()

    @precondition(lambda self: self.services is not None and not self.services.s3.alive())
    @rule()
    def start_s3(self) -> None:
        with self.step("start_s3()"):
            self.up.s3.start()

    # Always true, after every step

    @invariant()
    def status_counts_stay_within_the_job(self) -> None:
        if self.services is None or self.broken:
            return
        ledger = self.ledger()
        for model in self.jobs.values():
            if not model.touched or not ledger.jobs.exists(model.name):
                continue
            status = job_status(ledger, model.name)
            manifest = ledger.jobs.load(model.name)
            assert status.total == manifest.prompts, status
            assert status.done >= 0 and status.failed >= 0, \
                f"{model.name}: negative count in status: done {status.done}, " \
                f"failed {status.failed}"
            assert status.done + status.failed <= status.total, \
                f"{model.name}: status counts more finished prompts than the job has: " \
                f"done {status.done} + failed {status.failed} > total {status.total}"
            expected = {"running": {"running", "done"}, "paused": {"paused"},
                        "cancelled": {"cancelled"}}[model.state]
            if model.rerun:
                expected = expected | {"creating"}  # its enqueue did not finish
            assert status.state in expected, \
                f"{model.name}: status says {status.state}, the operator made it {model.state}"

    @invariant()
    def eta_is_zero_only_once_the_sink_holds_every_outcome(self) -> None:
        """ETA 0 means every prompt is written; then nothing moves, so `status` must say what a
        reading of the sink (export's) says. Read again only when the figures changed."""
        if self.services is None or self.broken:
            return
        ledger = self.ledger()
        for model in self.jobs.values():
            if not model.touched or not ledger.jobs.exists(model.name):
                continue
            status = job_status(ledger, model.name)
            if status.eta_s != 0:
                assert status.eta_s is None or status.eta_s > 0, status.eta_s
                continue
            batches = status.batches
            assert batches.done == batches.total, (
                f"{model.name}: status says ETA 0, but {batches.done} of {batches.total} "
                "batches are written")
            figures = (status.done, status.failed, status.errors)
            if figures == model.verified:
                continue
            sink = self.open_output(model.output)
            if sink is None:
                continue
            try:
                _, found = sinkview.read(sink, ledger.jobs.load(model.name))
            except SinkError:
                if self.up.s3.alive():
                    raise
                continue
            assert found.missing == 0, (
                f"{model.name}: status says ETA 0, the sink has no outcome for {found.missing} "
                f"prompts (e.g. {found.missing_ids[:5]})")
            seen = (found.done, found.failed, dict(found.failed_by_code))
            assert figures == seen and not found.duplicates_dropped, (
                f"{model.name}: with every prompt written, status says done, failed, by code "
                f"{figures}; the sink holds {seen}, {found.duplicates_dropped} duplicates dropped")
            model.verified = figures

    def check_now(self) -> None:
        """What Hypothesis checks after each step, for a sequence driven by hand."""
        self.status_counts_stay_within_the_job()
        self.eta_is_zero_only_once_the_sink_holds_every_outcome()

    def open_output(self, output: str) -> Sink | None:
        """The sink at `output`, as the commands open it; None while S3 is stopped."""
        if not output.startswith("s3://"):
            return open_sink(output)
        if not self.up.s3.alive():
            return None
        # boto3's default session keeps the first credentials it finds, and each sequence's S3
        # has its own: a fresh session, with this stack's environment, for this sink alone.
        with mock.patch.object(boto3, "DEFAULT_SESSION", None), \
                mock.patch.dict(os.environ, self.up.stack.env()):
            return open_sink(output)

    # The final phase: heal, finish, check

    def teardown(self) -> None:
        try:
            if self.services is not None and not self.broken:
                with self.step("final phase: heal, resume, re-run enqueues, wait, check"):
                    self.heal()
                    for model in self.jobs.values():
                        if model.touched:
                            self.finish_job(model)
                    for model in self.jobs.values():
                        if model.touched:
                            self.check_job(model)
        finally:
            report = self.report()
            (self.dir / "report.txt").write_text(report)
            self.stop_everything()
            self.transcript.append(f"sequence took {time.monotonic() - self.began:.0f}s")
            if currently_in_test_context():
                note(report)
            elif self.broken:
                print(report)
            # One summary per sequence (shown with -s): what ran, how long, what it found.
            print(f"sequence {self.dir.name}: {len(self.steps())} steps, "
                  f"{time.monotonic() - self.began:.0f}s, {'FAILED' if self.broken else 'ok'}\n  "
                  + "\n  ".join(self.transcript), flush=True)

    def heal(self) -> None:
        # Only the harness kills workers (kill_worker): one that died on its own is a bug, and
        # would leave the jobs waiting for a worker that never comes.
        dead = {p.name: last_words(p) for p in self.up.workers.values() if not p.alive()}
        assert not dead, f"workers died on their own: {dead}"
        if not self.up.s3.alive():
            self.up.s3.start()
        if not self.up.sim_alive():
            self.restart_sim()
        if not self.up.workers:
            self.start_worker_in(0)

    def finish_job(self, model: JobModel) -> None:
        for _ in range(3):
            if not model.rerun:
                break
            ran = self.cli(model.enqueue_args(model.owner or "main"), f"enqueue {model.name} (re-run)")
            self.learn_owner(model)
            model.rerun = ran.code != 0
        assert not model.rerun, f"re-running the enqueue of {model.name} failed three times"
        # A job rebuilt by this enqueue has the state its progress.json recorded.
        if model.state != "running" or self.ledger().jobs.state(model.name)[0] != "running":
            ran = self.cli(["resume", model.name], f"resume {model.name}")
            assert ran.code == 0, ran.line()
            model.state = "running"
        self.wait_done(model)

    def wait_done(self, model: JobModel) -> JobStatus:
        """Wait for `done`; fail after JOB_DEADLINE, or after STALL s with no prompt finishing."""
        began = last_change = time.monotonic()
        seen: tuple[int, ...] = ()
        while True:
            now = time.monotonic()
            try:
                status = job_status(self.ledger(), model.name)
            except REDIS_ERRORS:
                time.sleep(0.5)
                continue
            if status.state == "done":
                self.transcript.append(f"  {model.name} done {now - began:.0f}s after healing")
                return status
            progress = (status.done, status.failed, status.batches.done)
            if progress != seen:
                seen, last_change = progress, now
            assert now - last_change < STALL and now - began < JOB_DEADLINE, (
                f"job {model.name} is not done {now - began:.0f}s after every fault was healed; "
                f"nothing finished for {now - last_change:.0f}s: "
                f"{status.state} {status.done}+{status.failed}/{status.total}, {status.batches}")
            time.sleep(0.5)

    def check_job(self, model: JobModel) -> None:
        owner = model.owner or "main"
        ids = model.ids[owner]
        path = self.dir / f"{model.name}-export.jsonl"
        ran = self.cli(["export", model.name, "--to", str(path), "--json", "--force"],
                       f"export {model.name}")
        assert ran.code == 0, ran.line()
        reconcile = orjson.loads(ran.out)
        lines = [orjson.loads(x) for x in path.read_bytes().splitlines() if x]
        answers = [x["id"] for x in lines if "custom_id" not in x]
        failures = [x for x in lines if "custom_id" in x]
        counts = collections.Counter(answers + [f["custom_id"] for f in failures])
        missing = sorted(set(ids) - set(counts))
        extra = sorted(set(counts) - set(ids))
        twice = sorted(i for i, n in counts.items() if n > 1)
        assert not (missing or extra or twice), (
            f"{model.name}: export is not every input id exactly once: {len(missing)} missing "
            f"{missing[:5]}, {len(extra)} not in the input {extra[:5]}, {len(twice)} twice "
            f"{twice[:5]}")
        for failure in failures:
            self.check_failure(model, failure)
        ran = self.cli(["status", model.name, "--json", "--no-servers"], f"status {model.name}")
        assert ran.code == 0, ran.line()
        status = orjson.loads(ran.out)
        seen = {"total": len(ids), "done": len(answers), "failed": len(failures), "state": "done"}
        told = {k: status[k] for k in seen}
        assert told == seen, f"{model.name}: status says {told}, the export holds {seen}"
        exported = {"done": reconcile["done"], "failed": reconcile["failed"],
                    "by code": reconcile["failed_by_code"],
                    "duplicates dropped": reconcile["duplicates_dropped"]}
        told = {"done": status["done"], "failed": status["failed"], "by code": status["errors"],
                "duplicates dropped": 0}
        assert told == exported, f"{model.name}: status says {told}, export --json says {exported}"

    def check_failure(self, model: JobModel, failure: dict[str, Any]) -> None:
        pid, error = failure["custom_id"], failure.get("error") or {}
        code, message, tries = error.get("code"), error.get("message") or "", failure.get("tries")
        assert message.strip(), f"{model.name}: {pid} failed without a reason: {failure}"
        if tries == 0:
            assert code in UNSENT_FAILURE_CODES, \
                f"{model.name}: {pid} failed unsent with an undocumented code: {failure}"
            found = INTERRUPTED.search(message)
            assert found is not None, f"{model.name}: {pid} failed unsent, no documented reason: {failure}"
            assert int(found.group(1)) <= self.worker_kills, (
                f"{model.name}: {pid} failed unsent after {found.group(1)} unfinished attempts, "
                f"but only {self.worker_kills} workers were killed: {failure}")
        elif pid in model.poison:
            assert code in POISON_CODES, f"{model.name}: poisoned {pid} failed as {code}: {failure}"
        else:
            assert code in TRANSIENT_CODES, \
                f"{model.name}: {pid} (not poisoned) failed as {code}: {failure}"

    # For replays: wait for the moment a found sequence needs, so the replay hits it every time

    def held_by_a_live_worker(self, job: str, batch: str) -> bool:
        token = self.ledger().leases.token(job, batch)
        live = {f"{proc.name}@test" for proc in self.up.workers.values() if proc.alive()}
        return token is not None and keys.lease_owner(token) in live

    def running_batch(self, job: str) -> str:
        """A batch of `job` that a live worker holds and that has no prompt finished yet, so
        most of its prompts are unsent (waits for one)."""
        found: list[str] = []

        def held() -> bool:
            ledger = self.ledger()
            running = ledger.batches.running(job)
            found[:] = [b for b in running if self.held_by_a_live_worker(job, b)
                        and not ledger.r.hlen(keys.checkpoint(job, b))]
            return bool(found)

        wait_until(held, COMMAND_TIMEOUT, interval=0.05, what=f"a running batch of {job}")
        return found[0]

    def wait_running(self, job: str, batch: str) -> None:
        """Wait until a live worker runs `batch` again (a dead one's lease does not count)."""
        ledger = self.ledger()

        def running() -> bool:
            if ledger.batches.is_done(job, batch):
                raise ReplayMissed(f"{job}/{batch} finished before the replay's next step")
            return self.held_by_a_live_worker(job, batch)

        wait_until(running, COMMAND_TIMEOUT, interval=0.05, what=f"{job}/{batch} running again")

    def wait_stopped(self, job: str, batch: str) -> None:
        ledger = self.ledger()
        wait_until(lambda: batch not in ledger.batches.running(job), COMMAND_TIMEOUT,
                   interval=0.05, what=f"{job}/{batch} handed back")

    def enqueue_killed_once_created(self, job: str) -> None:
        """kill -9 an enqueue the moment its job is in Redis (before its batches are queued)."""
        model = self.jobs[job]
        with self.step(f"enqueue_killed_once_created({job!r})"):
            proc = self.spawn(model.enqueue_args("main"))
            ledger = self.ledger()
            wait_until(lambda: ledger.jobs.exists(job) or proc.poll() is not None, COMMAND_TIMEOUT,
                       interval=0.005, what=f"job {job} created")
            proc.kill()
            self.finish(proc, f"enqueue {job} (main), killed once created")
            if ledger.batches.queued(job) or proc.returncode == 0:
                raise ReplayMissed(f"enqueue of {job} had queued its batches before the kill")
            model.touched = model.rerun = True
            model.owner = "main"

    # Plumbing

    @contextmanager
    def step(self, text: str) -> Iterator[None]:
        self.transcript.append(f"step: {text}")
        began = time.monotonic()
        try:
            yield
        except BaseException as exc:
            self.broken = True
            first = (str(exc).strip().splitlines() or [""])[0][:800]
            self.transcript.append(f"  FAILED after {time.monotonic() - began:.1f}s: "
                                   f"{type(exc).__name__}: {first}")
            raise

    def steps(self) -> list[str]:
        return [line for line in self.transcript if line.startswith("step: ")]

    def spawn(self, args: list[str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [PYTHON, "-m", "producer", *args], env=self.up.stack.env(), cwd=ROOT, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        )
        self.spawned[proc] = time.monotonic()
        return proc

    def finish(self, proc: subprocess.Popen[str], what: str) -> Ran:
        try:
            out, err = proc.communicate(timeout=COMMAND_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            self.transcript.append(Ran(what, None, out, err, COMMAND_TIMEOUT).line())
            raise AssertionError(f"{what}: still running after {COMMAND_TIMEOUT:.0f}s") from None
        ran = Ran(what, proc.returncode, out, err, time.monotonic() - self.spawned[proc])
        self.transcript.append(ran.line())
        return ran

    def cli(self, args: list[str], what: str) -> Ran:
        return self.finish(self.spawn(args), what)

    def learn_owner(self, model: JobModel) -> str | None:
        """Which of the job's files it was created from, by the manifest in Redis or the sink."""
        manifest = None
        ledger = self.ledger()
        if ledger.jobs.exists(model.name):
            manifest = ledger.jobs.load(model.name).to_json()
        elif model.output.startswith("s3://"):
            if self.up.s3.alive():
                s3 = self.up.s3.client()
                try:
                    manifest = s3.get_object(Bucket=self.up.s3.bucket,
                                             Key=f"runs/{model.name}/manifest.json")["Body"].read()
                except s3.exceptions.NoSuchKey:
                    manifest = None
                finally:
                    s3.close()
        else:
            path = Path(model.output) / model.name / "manifest.json"
            manifest = path.read_bytes() if path.exists() else None
        if manifest is not None:
            source = orjson.loads(manifest)["input"]["path"]
            model.owner = next(w for w, p in model.files.items() if str(p) == source)
        return model.owner if manifest is not None else None

    def report(self) -> str:
        parts = ["==== steps and commands ====", *self.transcript]
        if self.services is not None:
            parts.append(self.up.stack.logs())
            for server in (self.up.redis, self.up.s3):
                parts.append(f"==== {server.name} ====\n{server.log_tail(40)}")
        return "\n".join(parts)

    def stop_everything(self) -> None:
        stops: list[Callable[[], None]] = [p.kill for p in self.spawned if p.poll() is None]
        if self.services is not None:
            stops += [p.kill for p in self.up.stack.procs]
            stops += [self.up.s3.stop, self.up.redis.stop, self.up.ledger.r.close]
        errors = []
        for stop in stops:
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 -- every process must get its stop
                errors.append(exc)
        for proc in self.spawned:
            proc.wait(10)
        assert not errors, f"could not stop every process: {errors}"


def machine_settings() -> settings:
    """CI: a few derandomized sequences, no shrinking. FLEETGEN_STATEFUL_EXAMPLES: many random
    sequences, shrunk to a minimal one when they fail."""
    shrink = os.environ.get("FLEETGEN_STATEFUL_SHRINK", "1" if EXAMPLES else "0") == "1"
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        max_examples=EXAMPLES or 3, stateful_step_count=STEPS, deadline=None, database=None,
        derandomize=not EXAMPLES, phases=phases, suppress_health_check=list(HealthCheck),
    )


@pytest.mark.timeout(900 + 600 * (EXAMPLES or 3))
def test_operator_actions_and_faults_keep_every_prompt_exactly_once_and_status_true(
    tmp_path: Path, valkey_bin: Path, weed_bin: Path
) -> None:
    run_state_machine_as_test(lambda: OperatorActions(tmp_path), settings=machine_settings())  # type: ignore[arg-type]


# Replays of sequences the machine found failing, step by step.


@contextmanager
def replay(tmp_path: Path, workers: int, sizes: tuple[int, int], first: str,
           rounds_from: tuple[int, int] = (0, 0), sim_flags: tuple[str, ...] = SLOW_SIM_FLAGS,
           ) -> Iterator[OperatorActions]:
    """The machine (on slow answers unless told), driven by hand; its final phase runs on
    leaving."""
    machine = OperatorActions(tmp_path, sim_flags)
    try:
        machine.start_stack(workers=workers, sizes=sizes, first=first, rounds_from=rounds_from)
        yield machine
    finally:
        machine.teardown()


# Jobs of three batches of 12 for the slow replays: each step finds a batch with unsent prompts
# (a batch runs for about 10 s on the slow answers), and the final phase has little to finish.
REPLAY_SIZES = (36, 36)


def wait_status(m: OperatorActions, job: str, ok: Callable[[JobStatus], bool], what: str) -> None:
    wait_until(lambda: ok(job_status(m.ledger(), job)), COMMAND_TIMEOUT, interval=0.2,
               what=f"{job}: {what}")
    m.check_now()



def test_status_counts_the_prompts_of_a_batch_failed_after_two_worker_deaths(tmp_path: Path) -> None:
    # Found: start_stack(workers=2, sizes=(158, 278), first='alpha'), kill_worker(1),
    # start_worker(1), kill_worker(1): the export held 16 failures, `status` said 8.
    with replay(tmp_path, workers=1, sizes=REPLAY_SIZES, first="alpha") as m:
        batch = m.running_batch("alpha")
        m.kill_worker_in(0)
        m.start_worker_in(0)
        m.wait_running("alpha", batch)
        m.kill_worker_in(0)
        m.start_worker_in(0)


def test_two_redis_restarts_fail_no_prompt_as_a_worker_death(tmp_path: Path) -> None:
    # Found: start_stack(workers=1, sizes=(178, 121), first='alpha'), start_worker(1),
    # kill_worker(0), kill_server(), enqueue_twice_at_once('alpha', other_file=False),
    # start_server(), restart_redis(tenths=28), restart_redis(tenths=24): a batch's unsent
    # prompts failed as "interrupted 2 times (worker died holding it)" after one worker death.
    with replay(tmp_path, workers=1, sizes=REPLAY_SIZES, first="alpha") as m:
        batch = m.running_batch("alpha")
        m.restart_redis(tenths=50)  # down longer than the 4 s lease
        m.wait_running("alpha", batch)
        m.restart_redis(tenths=50)


def test_pausing_twice_fails_no_prompt_as_a_worker_death(tmp_path: Path) -> None:
    # Each pause lands on a batch a live worker is running with unsent prompts.
    with replay(tmp_path, workers=1, sizes=REPLAY_SIZES, first="alpha") as m:
        for _ in range(2):
            batch = m.running_batch("alpha")
            m.steer("alpha", "pause")
            m.wait_stopped("alpha", batch)
            m.steer("alpha", "resume")


def test_redis_restarts_leave_every_worker_alive(tmp_path: Path) -> None:
    # Found: start_stack(workers=2, sizes=(111, 125), first='beta'), steer('beta', 'resume') x2,
    # steer('beta', 'cancel'), steer('beta', 'resume') x2, steer('beta', 'cancel'),
    # steer('beta', 'pause'), restart_redis(tenths=23), restart_redis(tenths=0),
    # restart_redis(tenths=28), steer('beta', 'cancel'), steer('beta', 'resume'),
    # restart_redis(tenths=18), steer('beta', 'cancel'), steer('beta', 'pause'): both workers
    # exited ("consumer: Connection to broker lost ... Restoring 2 unacknowledged message(s)",
    # then "Unrecoverable error: AttributeError("'NoneType' object has no attribute
    # 'hostname'")" in kombu's restore_unacked), and the job waited for workers that never came.
    # Redis restarted every few seconds while both workers hold batches: both died at their
    # fourth (once the third) broker connection loss in 4 of 5 runs of this replay.
    with replay(tmp_path, workers=2, sizes=(111, 125), first="beta", sim_flags=SIM_FLAGS) as m:
        workers = list(m.up.workers.values())

        def back(times: int) -> bool:
            """Every worker on the broker `times` times (or dead)."""
            return all(not w.alive() or w.log_path.read_text(errors="replace")
                       .count("Connected to redis") >= times for w in workers)

        for lost in range(1, 7):
            m.restart_redis(tenths=5)
            wait_until(functools.partial(back, lost + 1), COMMAND_TIMEOUT,
                       what=f"the workers on the broker again after loss {lost}")
            m.steer("beta", "resume")


def test_interrupted_enqueue_then_resume_exports_every_prompt(tmp_path: Path) -> None:
    # No step waits on a running batch: the fast answers finish both jobs in seconds.
    with replay(tmp_path, workers=1, sizes=(60, 60), first="alpha", sim_flags=SIM_FLAGS) as m:
        m.enqueue_killed_once_created("beta")
        # The killed enqueue left a job that is `creating`: no reconciler round may dispatch
        # its batches (inputs are missing); the final phase re-runs the enqueue, which finishes
        # the upload and starts it.
        ledger = m.ledger()
        assert ledger.jobs.state("beta")[0] == "creating"
        wait_until(lambda: "interrupted" in (job_status(ledger, "beta").reason or ""),
                   COMMAND_TIMEOUT, what="status saying beta's enqueue was interrupted")
        assert not ledger.batches.queued("beta") and not ledger.batches.running("beta")


def test_requeue_rounds_past_r99_concurrent_requeues_and_a_flushall_keep_every_prompt_once(
    tmp_path: Path,
) -> None:
    # Every operation the machine gained, in one sequence, so that CI runs each of them: rounds
    # crossing r99 -> r100, two requeues at once, a FLUSHALL with a rebuild and an enqueue to
    # bring the jobs back while beta runs (then a round past the last one the sink holds), nested
    # outputs.
    with replay(tmp_path, workers=1, sizes=(60, 200), first="alpha", rounds_from=(NEAR_100, 0),
                sim_flags=SIM_FLAGS) as m:
        m.enqueue("beta", None, 0)
        wait_status(m, "alpha", lambda s: s.failed > 0, "a failure written")
        m.requeue_twice_at_once("alpha")
        m.check_now()
        wait_status(m, "alpha", lambda s: s.state == "done", "done, round r99 included")
        m.requeue_failed("alpha")
        assert {99, 100} <= m.jobs["alpha"].rounds, m.jobs["alpha"].rounds
        m.flushall({"alpha": "rebuild", "beta": "enqueue"})
        m.check_now()
        m.enqueue_nested("alpha", NESTED_JOB, "results")
        m.enqueue_nested("beta", NESTED_JOB, "")
        m.enqueue_nested("alpha", "results", "")
        wait_status(m, "alpha", lambda s: s.state == "done", "done again")
        m.requeue_failed("alpha")
        assert max(m.jobs["alpha"].rounds) > 100, m.jobs["alpha"].rounds
