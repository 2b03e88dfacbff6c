"""The quality canary: each check over synthetic windows, the --canary spec, and end to end on
real parts (Valkey, SeaweedFS, the simulator, a Celery worker): a job whose answers are broken
pauses itself within K answers, a healthy one runs to done, and `resume --accept-quality`
finishes a paused one.

The e2e jobs run with the default thresholds (K = min_completions = 200): the detection point
is printed (`pytest -s`) as `canary: <mode> paused after N answers`.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import fields
from pathlib import Path

import orjson
import pytest

from fleetgen.canary import Sample, Thresholds, content_digest, evaluate, sample
from fleetgen.checkpoints import GROUP_RECORDS
from fleetgen.errors import JobError
from fleetgen.job import GenerationParams, InputInfo, JobManifest
from fleetgen.jobview import JobStatus, job_status
from fleetgen.ledger import Ledger
from fleetgen.poll import wait_until
from producer.cli import main
from tests.stack import Stack, chat_rows, wait_job_done, write_jsonl
from workers.quality import CANARY_EVERY

K = Thresholds().min_completions


def fact(i: int, *, empty: bool = False, length: bool = False, no_reasoning: bool = False,
         tokens: int = 200, content: str | None = None) -> Sample:
    """One canary sample as workers push it."""
    text = "" if empty else (content if content is not None else f"Answer number {i} is unique.")
    return Sample(f"p{i}", empty, length, no_reasoning, tokens,
                  content_digest(text) if text else "", text[:120])


def window(n: int = 200, empty: int = 0, length: int = 0, no_reasoning: int = 0) -> list[Sample]:
    """n healthy answers; the first `empty` of them are empty, and so on."""
    return [fact(i, empty=i < empty, length=i < length, no_reasoning=i < no_reasoning)
            for i in range(n)]


def test_a_healthy_window_passes_every_check() -> None:
    assert evaluate(window(), Thresholds()) is None


def test_too_many_empty_answers_pause_with_the_share_and_examples() -> None:
    verdict = evaluate(window(empty=50), Thresholds())
    assert verdict is not None
    assert (verdict.check, verdict.share, verdict.threshold) == ("empty_content", 0.25, 0.2)
    assert verdict.reason == ("quality: 25% of the last 200 answers have an empty content "
                              "(threshold 20%)")
    assert [e.id for e in verdict.examples] == ["p0", "p1", "p2"]


def test_a_share_exactly_at_the_threshold_does_not_pause() -> None:
    assert evaluate(window(empty=40), Thresholds()) is None


def test_answers_cut_at_max_tokens_pause_the_job() -> None:
    verdict = evaluate(window(length=61), Thresholds())
    assert verdict is not None and verdict.check == "length"
    assert "stopped at max_tokens (finish_reason=length)" in verdict.reason
    assert verdict.examples[0].length is True


def test_answers_without_reasoning_while_thinking_is_on_pause_the_job() -> None:
    verdict = evaluate(window(no_reasoning=101), Thresholds())
    assert verdict is not None and verdict.check == "missing_reasoning"
    assert "have no reasoning although thinking is on" in verdict.reason


def test_near_identical_answers_count_as_duplicates() -> None:
    samples = window()
    for i, text in enumerate(["OK.", "ok", "  OK!  ", "Ok."] * 15):
        samples[i] = fact(i, content=text, tokens=50)
    verdict = evaluate(samples, Thresholds())
    assert verdict is not None and verdict.check == "duplicate"
    assert verdict.share == 0.3
    assert "are the same answer ('OK.')" in verdict.reason


def test_answers_far_shorter_than_expected_pause_the_job() -> None:
    samples = [fact(i, tokens=3) for i in range(200)]
    verdict = evaluate(samples, Thresholds())
    assert verdict is not None and verdict.check == "min_mean_output_tokens"
    assert verdict.share == 3.0
    assert "average 3.0 output tokens (expected at least 16)" in verdict.reason


def test_the_first_crossed_check_is_the_one_reported() -> None:
    verdict = evaluate(window(empty=100, length=100), Thresholds())
    assert verdict is not None and verdict.check == "empty_content"


def test_a_check_turned_off_never_fires() -> None:
    assert evaluate(window(empty=200), Thresholds(empty_content=None, min_mean_output_tokens=None)) is None


def test_nothing_is_judged_before_min_completions_answers() -> None:
    assert evaluate(window(199, empty=199), Thresholds()) is None
    assert evaluate(window(200, empty=200), Thresholds()) is not None


def test_failed_prompts_are_not_answers_and_do_not_count_towards_the_window() -> None:
    failed = [sample({"custom_id": f"f{i}", "error": {"code": "server_error"}}, True) for i in range(100)]
    assert evaluate(failed + window(150, empty=150), Thresholds()) is None


def test_a_window_smaller_than_min_completions_is_judged_when_full() -> None:
    assert evaluate(window(50, empty=50), Thresholds(window=50)) is not None


def test_a_disabled_canary_never_pauses() -> None:
    assert evaluate(window(empty=200), Thresholds(enabled=False)) is None


def test_sample_reads_the_facts_of_one_answer() -> None:
    record = {"id": "a", "content": "", "reasoning_content": "hmm", "finish_reason": "length",
              "tool_calls": None, "usage": {"completion_tokens": 64}}
    assert sample(record, thinking=True).to_json() == b'["a",1,1,0,64,"",""]'
    record = {"id": "b", "content": "Hello there.", "reasoning_content": None, "finish_reason": "stop",
              "tool_calls": None, "usage": {"completion_tokens": 5}}
    assert sample(record, thinking=True) == Sample("b", False, False, True, 5,
                                                   content_digest("hello there"), "Hello there.")
    assert not sample(record, thinking=False).no_reasoning


def test_a_sample_reads_back_as_it_was_written() -> None:
    kept = Sample("p1", True, False, True, 7, "abc", "Hi")
    assert Sample.from_json(kept.to_json()) == kept


def test_a_tool_call_with_no_text_is_not_an_empty_answer() -> None:
    record = {"id": "c", "content": "", "reasoning_content": "r", "finish_reason": "tool_calls",
              "tool_calls": [{"function": {"name": "f"}}], "usage": {"completion_tokens": 20}}
    assert not sample(record, thinking=True).empty


def test_thresholds_parse_overrides_the_defaults() -> None:
    t = Thresholds.parse("empty_content=0.5, length=off,min_completions=100,window=150")
    assert (t.empty_content, t.length, t.min_completions, t.window) == (0.5, None, 100, 150)
    assert t.duplicate == Thresholds().duplicate and t.enabled


def test_thresholds_parse_of_nothing_is_the_defaults() -> None:
    assert Thresholds.parse(None) == Thresholds()
    assert Thresholds.parse("") == Thresholds()
    assert Thresholds.parse(None, enabled=False) == Thresholds(enabled=False)


@pytest.mark.parametrize(("spec", "message"), [
    ("emptyness=0.5", "unknown check 'emptyness'"),
    ("enabled=1", "unknown check 'enabled'"),
    ("empty_content=lots", "empty_content='lots' is not a number"),
    ("min_completions=1.5", "min_completions='1.5' is not a number"),
])
def test_thresholds_parse_names_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(JobError, match="--canary: " + message.replace("(", r"\(")):
        Thresholds.parse(spec)


# The job's thresholds in its manifest: typed in every process, the same JSON object as before.


def manifest_with(canary: Thresholds) -> JobManifest:
    return JobManifest(name="j", output="/tmp/o", input=InputInfo("in.jsonl", "0" * 64, 10, 1),
                       prompts=10, batch_size=10, batches=1, queue="fleetgen",
                       params=GenerationParams(), canary=canary)


def test_a_manifest_keeps_the_jobs_thresholds_as_an_object_of_their_fields() -> None:
    thresholds = Thresholds.parse("length=off,min_completions=50", enabled=False)
    raw = orjson.loads(manifest_with(thresholds).to_json())
    assert raw["canary"] == {**thresholds.to_dict(), "length": None, "min_completions": 50}
    assert set(raw["canary"]) == {f.name for f in fields(Thresholds)}
    assert JobManifest.from_json(orjson.dumps(raw)).canary == thresholds


@pytest.mark.parametrize("stored", [{}, {"length": None}, {"length": None, "later_check": 0.1}],
                         ids=["none-kept", "some-kept", "a-check-this-version-lacks"])
def test_a_manifests_thresholds_read_back_over_the_defaults(stored: dict[str, object]) -> None:
    """A manifest written before thresholds were kept holds `{}`: the defaults; a check this
    version does not know is left out, and the others still hold."""
    raw = orjson.loads(manifest_with(Thresholds()).to_json())
    raw["canary"] = stored
    read = JobManifest.from_json(orjson.dumps(raw)).canary
    assert read == Thresholds(length=None if "length" in stored else Thresholds().length)


def test_enqueue_stores_the_thresholds_of_its_canary_flag(
    ledger: Ledger, cli_env: None, tmp_path: Path,
) -> None:
    src = prompts(tmp_path, 5)
    assert main(["enqueue", str(src), "--job", "typed", "--output", str(tmp_path / "out"),
                 "--canary", "empty_content=0.5,duplicate=off"]) == 0
    assert ledger.jobs.load("typed").canary == Thresholds(empty_content=0.5, duplicate=None)
    assert main(["enqueue", str(src), "--job", "off", "--output", str(tmp_path / "out"),
                 "--no-canary"]) == 0
    assert ledger.jobs.load("off").canary == Thresholds(enabled=False)


# End to end: the simulator plays the two ways the job fleetgen was born from went wrong.

FAST_SIM = ("--max-running-requests", "16", "--decode-tps", "100", "--mean-output-tokens", "300",
            "--speed", "200")
# For the jobs the canary pauses. The worker judges the window once per group of answers it
# checkpoints, and a group holds what arrived in its window (up to GROUP_RECORDS): the pause
# lands within K + CANARY_EVERY answers and the rest of the group that crossed them. At most
# ~70 answers/s (4 slots, >= 57 ms of prefill for each 17-token prompt) keeps the groups to
# tens of answers, not FAST_SIM's ~1,000 a second.
PAUSED_SIM = ("--max-running-requests", "4", "--prefill-tps", "15", "--speed", "20")
PROMPTS = 400


def prompts(tmp_path: Path, n: int = PROMPTS) -> Path:
    rows = [{"id": f"q{i:05d}", "prompt": f"Explain idea number {i} step by step."} for i in range(n)]
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


def run_job(stack: Stack, tmp_path: Path, job: str, sim_flags: tuple[str, ...], *enqueue: str) -> Ledger:
    _, url = stack.sim("sim0", *FAST_SIM, *sim_flags)
    stack.worker(0, url)
    stack.producer("enqueue", str(prompts(tmp_path)), "--job", job, "--output",
                   str(tmp_path / "out"), "--batch-size", "10", *enqueue)
    return Ledger.from_url(stack.base_env["REDIS_URL"])


def wait_paused_and_idle(stack: Stack, ledger: Ledger, job: str) -> JobStatus:
    """The job paused and its last running batches finished."""
    def settled() -> bool:
        s = job_status(ledger, job)
        assert s.state != "done", f"job {job} ran to done: the canary never fired"
        return bool(s.state == "paused" and s.batches.running == 0)

    try:
        wait_until(settled, 90, what=f"job {job} paused by the canary")
    except TimeoutError:
        raise AssertionError(f"{job_status(ledger, job)}\n{stack.logs()}") from None
    return job_status(ledger, job)


@pytest.mark.e2e
def test_a_server_that_ignores_thinking_gets_its_job_paused_within_k_answers(
    stack: Stack, tmp_path: Path,
) -> None:
    ledger = run_job(stack, tmp_path, "thinking-off", (*PAUSED_SIM, "--mode", "thinking-off"))
    status = wait_paused_and_idle(stack, ledger, "thinking-off")
    detected = status.quality.detected_after
    print(f"\ncanary: thinking-off paused after {detected} answers "
          f"({status.done} done when the running batches finished)")
    assert detected <= K + CANARY_EVERY + GROUP_RECORDS and status.done < PROMPTS
    assert status.reason.startswith("quality: 100% of the last")
    assert "have no reasoning although thinking is on" in status.reason
    out = stack.producer("status", "thinking-off").stdout
    assert "[paused]  quality: 100% of the last" in out
    assert f"canary fired after {detected} answers" in out
    assert "resume thinking-off --accept-quality" in out


@pytest.mark.e2e
def test_a_job_whose_tokens_all_go_to_thinking_is_paused_and_accept_quality_finishes_it(
    stack: Stack, tmp_path: Path,
) -> None:
    ledger = run_job(stack, tmp_path, "tiny", PAUSED_SIM, "--max-tokens", "64")
    status = wait_paused_and_idle(stack, ledger, "tiny")
    detected = status.quality.detected_after
    print(f"\ncanary: max_tokens=64 paused after {detected} answers "
          f"({status.done} done when the running batches finished)")
    assert detected <= K + CANARY_EVERY + GROUP_RECORDS and status.done < PROMPTS
    assert "have an empty content" in status.reason
    assert all(e.content == "" and e.length for e in status.quality.examples)
    out = stack.producer("status", "tiny").stdout
    assert "[paused]  quality:" in out and "have an empty content" in out
    assert "(64 tokens, cut at max_tokens)" in out

    refused = stack.producer("resume", "tiny", check=False)
    assert refused.returncode == 1 and "--accept-quality" in refused.stderr
    stack.producer("resume", "tiny", "--accept-quality")
    final = wait_job_done(stack, "tiny", timeout=120)
    assert (final.done, final.failed) == (PROMPTS, 0)
    assert final.quality.accepted is True
    # The simulator's rare short answers end before 64 tokens; nearly all are cut.
    assert final.finish_reasons["length"] > 0.8 * PROMPTS


@pytest.mark.e2e
def test_a_healthy_job_is_judged_and_never_paused(stack: Stack, tmp_path: Path) -> None:
    ledger = run_job(stack, tmp_path, "healthy", ())
    final = wait_job_done(stack, "healthy", timeout=120,
                          on_tick=lambda s: _never_paused(s))
    assert (final.done, final.failed, final.quality) == (PROMPTS, 0, None)
    # The canary did look: it judged every answer past the first K, every 10 answers.
    assert job_status(ledger, "healthy").canary.answers_seen == PROMPTS > K


def _never_paused(status: JobStatus) -> None:
    assert status.state != "paused", status.reason


def test_long_answers_digest_as_if_normalized_whole() -> None:
    def whole(text: str) -> str:  # the definition: normalize everything, keep 300 chars
        norm = re.sub(r"\s+", " ", text.strip().lower()).rstrip(".!? ")[:300]
        return hashlib.blake2b(norm.encode(), digest_size=6).hexdigest()

    words = "Alpha  beta\tGamma\n\n delta. " * 400
    edges = ("a" * 299 + "!" * 200 + "b",  # a head whose stripped form is short
             "a" * 301 + "." * 300, "a" * 400 + " tail", "a " * 150 + "b" * 200,
             "x" * 401, " " * 399 + "y" * 2)
    for text in (words, "x" * 5000, "  " + " " * 3000 + words, words[:299] + "!!!", "Hi.  ",
                 *edges):
        assert content_digest(text) == whole(text), text[:40]
    assert content_digest(words + "tail A") == content_digest(words + "tail B")


@pytest.mark.e2e
def test_a_job_smaller_than_the_window_with_two_thirds_empty_answers_is_judged_at_its_end(
    stack: Stack, tmp_path: Path,
) -> None:
    _, url = stack.sim("sim0", *FAST_SIM)
    stack.worker(0, url)
    # Two lines in three take the job's 64 tokens, all spent thinking (empty content); every
    # third asks 3,000 tokens itself and gets a real answer.
    src = write_jsonl(tmp_path / "small.jsonl", chat_rows(60))
    stack.producer("enqueue", str(src), "--job", "small", "--output", str(tmp_path / "out"),
                   "--batch-size", "10", "--max-tokens", "64")
    ledger = Ledger.from_url(stack.base_env["REDIS_URL"])

    seen: dict[str, float] = {}

    def judged_and_written() -> bool:
        s = job_status(ledger, "small")
        assert s.state != "done", "a small job with 2/3 empty answers ended [done]"
        if s.done + s.failed + s.checkpointed == 60:
            seen.setdefault("answered", time.monotonic())
        if s.state == "paused":
            seen.setdefault("paused", time.monotonic())
        return bool(s.state == "paused" and s.done + s.failed == 60)

    wait_until(judged_and_written, 120, what="small job paused at its end")
    print(f"\ncanary: small job paused {seen['paused'] - seen.get('answered', seen['paused']):.1f}s"
          " after its last answer was seen")
    status = job_status(ledger, "small")
    assert status.quality.detected_after == 60
    # The simulator's rare short answers end before 64 tokens: a little under two thirds.
    share = re.match(r"quality: (\d+)% of the last 60 answers have an empty content",
                     status.reason)
    assert share and 50 <= int(share[1]) <= 67, status.reason
    assert "judged at the job's end (it has fewer than 200 prompts)" in status.reason
    out = stack.producer("status", "small").stdout
    assert "[paused]  quality:" in out and "resume small --accept-quality" in out
    refused = stack.producer("export", "small", "--to", str(tmp_path / "small-out.jsonl"),
                             check=False)
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: job small failed its quality check (quality: ")
    assert not (tmp_path / "small-out.jsonl").exists()
    stack.producer("resume", "small", "--accept-quality")
    wait_job_done(stack, "small", timeout=60)
    stack.producer("export", "small", "--to", str(tmp_path / "small-out.jsonl"))


@pytest.mark.e2e
def test_a_healthy_job_smaller_than_the_window_is_judged_at_its_end_and_says_so(
    stack: Stack, tmp_path: Path,
) -> None:
    _, url = stack.sim("sim0", *FAST_SIM)
    stack.worker(0, url)
    stack.producer("enqueue", str(prompts(tmp_path, 40)), "--job", "small-ok", "--output",
                   str(tmp_path / "out"), "--batch-size", "10")
    wait_job_done(stack, "small-ok", timeout=120, on_tick=_never_paused)
    wait_until(lambda: "judged all 40 answers at the job's end: healthy"
               in stack.producer("status", "small-ok").stdout, 30, what="end verdict shown")
