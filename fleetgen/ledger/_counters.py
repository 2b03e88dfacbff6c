"""Counters: a job's figures as the workers move them (live, written, per worker, per minute),
and the turn to publish them in progress.json."""

from __future__ import annotations

import redis

from fleetgen import keys
from fleetgen.ledger._replies import floats
from fleetgen.ledger._shards import Shards


class Counters:
    """The job's counters: live (fg:job:{job}:stats, moved per prompt at its checkpoint),
    written (:written, moved once per written batch), per worker (:workers) and per minute
    (:minutes, :worker_minutes); and progress.json's turn (:progress_due) and last word
    (:progress_mark). What the job views read (fleetgen/jobview.py, fleetgen/progress.py,
    producer/report.py)."""

    def __init__(self, client: redis.Redis | Shards) -> None:
        self.shards = Shards.of(client)

    def stats(self, name: str) -> dict[str, float]:
        """Live counters, moved by each prompt as it reaches the checkpoint."""
        return floats(self.shards.client(name).hgetall(keys.job_part(name, "stats")))

    def counts(self, name: str) -> tuple[dict[str, float], dict[str, float], int, int]:
        """Written counters, live counters, batches done and requeue batches, read in one
        transaction: a batch finishing between two reads would make a job look done with its
        last batch's prompts missing."""
        with self.shards.client(name).pipeline(transaction=True) as p:
            p.hgetall(keys.job_part(name, "written"))
            p.hgetall(keys.job_part(name, "stats"))
            p.scard(keys.job_part(name, "done"))
            p.scard(keys.job_part(name, "extra"))
            written, stats, done, extra = p.execute()
        return floats(written), floats(stats), int(done), int(extra)

    def minutes(self, name: str) -> dict[int, dict[str, float]]:
        """Unix minute -> prompts finished (`prompts`) and output tokens written (`tokens`)."""
        out: dict[int, dict[str, float]] = {}
        r = self.shards.client(name)
        raw: dict[bytes, bytes] = r.hgetall(keys.job_part(name, "minutes"))  # type: ignore[assignment]
        for k, v in raw.items():
            minute, _, kind = k.decode().partition("|")
            slot = out.setdefault(int(minute), {"prompts": 0.0, "tokens": 0.0})
            slot["tokens" if kind == "tokens" else "prompts"] += float(v)
        return out

    def worker_minutes(self, name: str) -> dict[str, dict[int, dict[str, float]]]:
        """Worker -> unix minute -> `prompts` and `tokens` it finished in that minute."""
        out: dict[str, dict[int, dict[str, float]]] = {}
        r = self.shards.client(name)
        raw: dict[bytes, bytes] = r.hgetall(keys.job_part(name, "worker_minutes"))  # type: ignore[assignment]
        for k, v in raw.items():
            worker, minute, kind = k.decode().rsplit("|", 2)
            slot = out.setdefault(worker, {}).setdefault(int(minute), {"prompts": 0.0, "tokens": 0.0})
            slot[kind] += float(v)
        return out

    def workers(self, name: str) -> dict[str, dict[str, float]]:
        """Worker -> the job's counters it moved (prompts_done, prompts_failed, output_tokens,
        batches_done): only those it moved, as the workers record them."""
        out: dict[str, dict[str, float]] = {}
        r = self.shards.client(name)
        raw: dict[bytes, bytes] = r.hgetall(keys.job_part(name, "workers"))  # type: ignore[assignment]
        for k, v in raw.items():
            worker, _, counter = k.decode().partition("|")
            out.setdefault(worker, {})[counter] = float(v)
        return out

    def claim_progress_turn(self, name: str, now: float, every_s: int) -> bool:
        """True for the first caller in each `every_s` window: it writes the job's progress.json."""
        return bool(self.shards.client(name).set(keys.job_part(name, "progress_due"), now, nx=True,
                                                 ex=every_s))

    def progress_mark(self, name: str) -> bytes | None:
        """What the job's last progress.json said, as `set_progress_mark` stored it."""
        raw = self.shards.client(name).get(keys.job_part(name, "progress_mark"))
        return raw if isinstance(raw, bytes) else None

    def set_progress_mark(self, name: str, mark: bytes) -> None:
        self.shards.client(name).set(keys.job_part(name, "progress_mark"), mark)
