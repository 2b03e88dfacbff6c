"""Guards: what the quality canary and the failure breaker found in a job, and what the
operator accepted. The workers write the findings from their loop (fleetgen/liveledger.py);
the job views read them and `resume --accept-*` settles them here."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import orjson
import redis

from fleetgen import keys
from fleetgen.ledger._replies import text
from fleetgen.ledger._shards import Shards


@dataclass(frozen=True)
class EndVerdict:
    """The canary's judgement of a job smaller than its window, at the job's end
    (workers/quality.py): the answers it had, whether they were enough, what it found."""

    answers: int
    judged: bool
    verdict: str | None


@dataclass(frozen=True)
class CanaryProgress:
    """Answers the canary has judged so far, and its end-of-job verdict once there is one."""

    seen: int
    end: EndVerdict | None


@dataclass(frozen=True)
class QualityExample:
    """One answer that made the canary pause the job (fleetgen/canary.py `_examples`)."""

    id: str
    content: str
    output_tokens: int
    length: bool


@dataclass(frozen=True)
class QualityPause:
    """What the canary found when it paused the job, and whether the operator accepted it."""

    examples: list[QualityExample]
    detected_after: int
    accepted: bool


@dataclass(frozen=True)
class FailureExample:
    """One failure of the cause that tripped the failure breaker (fleetgen/breaker.py)."""

    id: str
    code: str
    message: str


class Guards:
    """The canary's and the breaker's fields of the job's hash (keys.JOB_CANARY_*,
    JOB_QUALITY_*, JOB_BREAKER_*) and the breaker's window (fg:job:{job}:outcomes)."""

    def __init__(self, client: redis.Redis | Shards) -> None:
        self.shards = Shards.of(client)

    def canary_progress(self, name: str) -> CanaryProgress:
        seen, end = self.shards.client(name).hmget(keys.job(name), keys.JOB_CANARY_SEEN,
                                                   keys.JOB_CANARY_END)
        return CanaryProgress(int(seen or 0), EndVerdict(**orjson.loads(end)) if end else None)

    def quality_pause(self, name: str) -> QualityPause | None:
        """What the canary found when it paused the job; None if it never did."""
        examples, seen, accepted = self.shards.client(name).hmget(
            keys.job(name), keys.JOB_QUALITY_EXAMPLES, keys.JOB_QUALITY_SEEN,
            keys.JOB_QUALITY_ACCEPTED)
        if examples is None:
            return None
        return QualityPause([QualityExample(**e) for e in orjson.loads(examples)], int(seen or 0),
                            accepted is not None)

    def accept_quality(self, name: str, now: float) -> None:
        self.shards.client(name).hset(keys.job(name), keys.JOB_QUALITY_ACCEPTED, now)

    def breaker_trip(self, name: str) -> tuple[str | None, FailureExample | None]:
        """The cause that tripped the failure breaker and one failure of it (None, None while
        it holds no trip)."""
        cause, example = self.shards.client(name).hmget(
            keys.job(name), keys.JOB_BREAKER_CAUSE, keys.JOB_BREAKER_EXAMPLE)
        return (text(cause) if cause is not None else None,
                FailureExample(**orjson.loads(example)) if example else None)

    def breaker_cause(self, name: str) -> str | None:
        """The failure cause that paused the job (the breaker's), or None."""
        raw = self.shards.client(name).hget(keys.job(name), keys.JOB_BREAKER_CAUSE)
        return raw.decode() if isinstance(raw, bytes) else None

    def accepted_causes_raw(self, name: str) -> bytes | None:
        """The JSON list of failure causes the operator accepted for the job, as stored."""
        raw = self.shards.client(name).hget(keys.job(name), keys.JOB_BREAKER_ACCEPTED)
        return raw if isinstance(raw, bytes) else None

    def accept_causes(self, name: str, causes: Iterable[str]) -> None:
        self.shards.client(name).hset(keys.job(name), keys.JOB_BREAKER_ACCEPTED,
                                      orjson.dumps(sorted(causes)))

    def clear_breaker_window(self, name: str) -> None:
        """Forget the outcomes the breaker judged and the cause it paused on: a fresh window."""
        with self.shards.client(name).pipeline() as p:
            p.delete(keys.job_part(name, "outcomes"))
            p.hdel(keys.job(name), keys.JOB_BREAKER_CAUSE, keys.JOB_BREAKER_EXAMPLE)
            p.execute()
