"""The quality canary: a job checks its own answers as they arrive and pauses itself when they
look broken (the job fleetgen was born from ran for days on 87% empty answers).

Workers push one small sample per finished prompt to a capped Redis list (the last `window`
answers); every few completions one of them evaluates the window against the job's thresholds.
Once `min_completions` answers exist, a crossed threshold pauses the job with the reason and
examples; `python -m producer resume JOB --accept-quality` goes on anyway.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import orjson

from fleetgen.errors import JobError
from fleetgen.records import OutputRecord, is_failure

if TYPE_CHECKING:  # a job's manifest holds its Thresholds, and the ledger loads manifests
    from fleetgen.ledger import QualityExample

_DIGEST_CHARS = 300
# Text normalized first; plain prose keeps ~85% of its characters when spacing is collapsed.
_DIGEST_HEAD = 400


@dataclass(frozen=True)
class Thresholds:
    """Shares of the recent window above which a job is paused (None turns a check off).

    A job's own, from `enqueue --canary`, travel in its manifest (`JobManifest.canary`) as
    the object `to_dict` writes and `from_dict` reads back:

        Thresholds.from_dict(Thresholds.parse("length=off").to_dict()).length is None
    """

    min_completions: int = 200
    window: int = 200
    empty_content: float | None = 0.2
    length: float | None = 0.3
    missing_reasoning: float | None = 0.5
    duplicate: float | None = 0.2
    # Mean output tokens below this is "far below expectation" (a boilerplate "OK." is ~3).
    min_mean_output_tokens: float | None = 16.0
    enabled: bool = True

    @classmethod
    def parse(cls, spec: str | None, *, enabled: bool = True) -> Thresholds:
        """`"empty_content=0.5,length=off,min_completions=100"` over the defaults."""
        base = cls(enabled=enabled)
        if not spec:
            return base
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for part in spec.split(","):
            name, _, raw = part.strip().partition("=")
            if name not in known or name == "enabled":
                raise JobError(f"--canary: unknown check {name!r}; known: {', '.join(known)}")
            if raw.lower() in ("off", "none", ""):
                values[name] = None
            else:
                try:
                    values[name] = int(raw) if name in ("min_completions", "window") else float(raw)
                except ValueError:
                    raise JobError(f"--canary: {name}={raw!r} is not a number") from None
        return cls(**{**asdict(base), **values})

    def to_dict(self) -> dict[str, Any]:
        """The thresholds as the manifest's JSON keeps them: every field by name."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Thresholds:
        """Thresholds from a manifest's JSON. Fields it lacks are the defaults (`{}`: a job
        enqueued before thresholds were kept); one this version does not know is left out,
        so an older worker still judges a newer job by the checks it has."""
        known = {f.name for f in fields(cls)}
        return cls(**{name: value for name, value in raw.items() if name in known})


def content_digest(content: str) -> str:
    """Near-identical answers share a digest: case, spacing and trailing punctuation ignored."""
    # Only the first 300 normalized characters count, and normalizing a head of the text
    # gives a prefix of the whole text's normal form: a head whose stripped form is longer
    # than that is enough. A short or mostly blank head means the whole text. (The head was
    # 4x300 characters, normalized twice for most answers: 2% of a worker's CPU.)
    head = content[:_DIGEST_HEAD]
    norm = " ".join(head.lower().split()).rstrip(".!? ")
    if len(head) < len(content) and len(norm) <= _DIGEST_CHARS:
        norm = " ".join(content.lower().split()).rstrip(".!? ")
    return hashlib.blake2b(norm[:_DIGEST_CHARS].encode(), digest_size=6).hexdigest()


# The snippet of a failure's sample: the canary judges answers, and counts failures apart.
FAILED = "(failed)"


@dataclass(frozen=True)
class Sample:
    """The few facts of one answer the canary looks at. Kept in the job's window (a Redis
    list) as a JSON array, `[id, empty, length, no-reasoning, output tokens, digest, snippet]`
    with the flags as 0/1: `to_json` writes it, `from_json` reads it back."""

    id: str
    empty: bool
    length: bool
    no_reasoning: bool
    output_tokens: int
    digest: str
    snippet: str

    @property
    def failed(self) -> bool:
        return self.snippet == FAILED

    def to_json(self) -> bytes:
        return orjson.dumps([self.id, int(self.empty), int(self.length), int(self.no_reasoning),
                             self.output_tokens, self.digest, self.snippet])

    @classmethod
    def from_json(cls, raw: bytes | str) -> Sample:
        id_, empty, length, no_reasoning, output_tokens, digest, snippet = orjson.loads(raw)
        return cls(id_, bool(empty), bool(length), bool(no_reasoning), output_tokens, digest,
                   snippet)


def sample(record: OutputRecord, thinking: bool) -> Sample:
    """What the canary keeps of one finished prompt (a failure is marked, and not judged)."""
    if is_failure(record):
        return Sample(record["custom_id"], False, False, False, 0, "", FAILED)
    content = record["content"] or ""
    empty = not content.strip() and not record.get("tool_calls")
    return Sample(
        record["id"],
        empty,
        record["finish_reason"] == "length",
        thinking and not record.get("reasoning_content"),
        record["usage"]["completion_tokens"],
        content_digest(content) if content.strip() else "",
        content[:120],
    )


@dataclass(frozen=True)
class Verdict:
    check: str
    share: float
    threshold: float
    reason: str
    examples: list[QualityExample]


def evaluate(samples: list[Sample], t: Thresholds,
             min_answers: int | None = None) -> Verdict | None:
    """The first crossed threshold over the window, or None if the answers look healthy.

    Nothing is judged on fewer than `min_answers` answers (default: the thresholds' own
    minimum; a job smaller than that is judged at its end on a smaller one, quality.py)."""
    answers = [s for s in samples if not s.failed]
    need = min(t.min_completions, t.window) if min_answers is None else min_answers
    if not t.enabled or not answers or len(answers) < need:
        return None
    n = len(answers)

    def share(flag: str) -> tuple[float, list[Sample]]:
        hits = [s for s in answers if getattr(s, flag)]
        return len(hits) / n, hits

    checks: list[tuple[str, float | None, float, list[Sample], str]] = []
    for name, flag, text in (("empty_content", "empty", "have an empty content"),
                             ("length", "length", "stopped at max_tokens (finish_reason=length)"),
                             ("missing_reasoning", "no_reasoning",
                              "have no reasoning although thinking is on")):
        value, hits = share(flag)
        checks.append((name, getattr(t, name), value, hits, text))
    digests = collections.Counter(s.digest for s in answers if s.digest)
    if digests:
        top, count = digests.most_common(1)[0]
        hits = [s for s in answers if s.digest == top]
        snippet = hits[0].snippet[:40]
        checks.append(("duplicate", t.duplicate, count / n, hits, f"are the same answer ({snippet!r})"))
    for name, limit, value, hits, text in checks:
        if limit is not None and value > limit:
            return Verdict(name, value, limit,
                           f"quality: {value:.0%} of the last {n} answers {text} "
                           f"(threshold {limit:.0%})", _examples(hits))
    mean_tokens = sum(s.output_tokens for s in answers) / n
    if t.min_mean_output_tokens is not None and mean_tokens < t.min_mean_output_tokens:
        return Verdict("min_mean_output_tokens", mean_tokens, t.min_mean_output_tokens,
                       f"quality: the last {n} answers average {mean_tokens:.1f} output tokens "
                       f"(expected at least {t.min_mean_output_tokens:.0f})", _examples(answers))
    return None


def _examples(hits: list[Sample], count: int = 3) -> list[QualityExample]:
    from fleetgen.ledger import QualityExample  # the ledger loads manifests, which hold Thresholds

    return [QualityExample(s.id, s.snippet, s.output_tokens, s.length) for s in hits[:count]]
