"""`python -m producer rebuild JOB`: a job's ledger rebuilt from its sink.

Redis holds the ledger for speed and visibility; the sink is the truth. When Redis loses its
data (restarted without AOF or RDB, a failover that lost writes, FLUSHALL), or the ledger is in
doubt, one reading of the sink (producer/sinkview.py) gives back all it says of written work:

- the manifest, and the job's state: a job Redis did not know gets the pause or the cancel
  its progress.json last recorded (`pause`, `cancel` and `resume` write it at once, the
  workers within a minute of their own pauses), else it runs;
- the done set: every batch with a result object;
- the written counters: the reading's done, failed and failures by code, which `export` counts
  and `status` shows;
- the requeue rounds: every requeue batch stored, and the round counter at the last round (no
  round name is used twice); those not written yet are the job's again, so they run;
- the live counters: the written figures, plus what the checkpoints of unwritten batches hold.

The job is placed on its ledger shard before its lock is taken (the lock lives there), as
enqueue places it (`Shards.place`): where fg:placement still says, else on the shard that still
holds its hash, else on the reachable shard with the fewest active jobs; never on REDIS_URL's
server only because fg:placement lost it. The caller holds the job's lock and dispatches every
batch neither done nor waiting. A loss
costs the answers that were checkpointed in Redis but not in a written batch (they are
generated again); it never costs anything written, and every prompt still ends exactly once in
the export. Running workers may write batches meanwhile: a batch written after the reading is
not in the rebuilt done set, so its worker's record (or its next delivery, which finds the
result) counts it then, once.

    rebuilt = rebuild(ledger, manifest, sink)
    print("\n".join(rebuilt.lines()))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from fleetgen import keys
from fleetgen.job import JobManifest, JobState
from fleetgen.ledger import STATE_CANCELLED, STATE_PAUSED, Ledger
from fleetgen.records import OutputRecord, counters, read_record, written_counts
from fleetgen.sink import Sink, batch_records
from producer import sinkview


@dataclass
class Rebuilt:
    """What a rebuild found in the sink and put back in the ledger."""

    job: str
    where: str  # the job's folder in the sink
    complete: bool  # its enqueue finished
    enqueued: int  # batches enqueue made
    requeued: int  # batches `requeue --failed` made (inputs stored)
    written: int  # batches with a result object, of both kinds
    last_round: int  # the last requeue round's number (0: none)
    found: sinkview.Reconcile
    checkpointed: int  # prompts kept in the checkpoints of unwritten batches
    stopped: tuple[JobState, str] | None = None  # the pause or cancel (and reason) kept from the sink

    def lines(self) -> list[str]:
        total = self.enqueued + self.requeued
        out = [f"batches: {total:,} ({self.enqueued:,} enqueued, {self.requeued:,} requeued), "
               f"{self.written:,} written, {total - self.written:,} to run"]
        if self.last_round:
            out.append(f"requeue rounds: {keys.round_name(1)} to "
                       f"{keys.round_name(self.last_round)}; the next is "
                       f"{keys.round_name(self.last_round + 1)}")
        f = self.found
        text = (f"{f.unit}: {f.total:,}: {f.done:,} done, {f.failed:,} failed, {f.missing:,} "
                "to go")
        if f.failed_by_code:
            text += f" (failed by code: {f.codes()})"
        out.append(text)
        if self.checkpointed:
            out.append(f"kept {self.checkpointed:,} prompts checkpointed in Redis (their batches "
                       "are not written yet)")
        if self.stopped is not None:
            state, reason = self.stopped
            out.append(f"{state} as its output recorded ({reason or 'no reason given'}): "
                       f"`python -m producer resume {self.job}` runs it again")
        if not self.complete:
            out.append(f"enqueue of job {self.job} did not finish ({f.input_batches:,} of "
                       f"{self.enqueued:,} batch inputs stored): run the same enqueue command "
                       "to finish it")
        return out


def rebuild(ledger: Ledger, manifest: JobManifest, sink: Sink) -> Rebuilt:
    """Put back the ledger's record of `manifest`'s job from its sink (see the module doc);
    the caller holds the job's lock."""
    job = manifest.name
    known = ledger.jobs.exists(job)
    live: Counter[str] = Counter()
    thinking = manifest.params.thinking  # a line's own setting lives in its input only

    def tally(record: OutputRecord) -> None:
        live.update(counters(record, thinking=thinking))

    layout, found = sinkview.read(sink, manifest, tally)
    unwritten = [b for b in _batches(manifest, layout.requeue) if b not in layout.done]
    checkpointed = 0
    for raw in ledger.batches.checkpointed_records(job, unwritten):
        checkpointed += 1
        tally(read_record(raw))
    live["batches_done"] = len(layout.done)
    ledger.rounds.restore(manifest, done=layout.done, rounds=layout.requeue,
                   last_round=layout.last_round, written=found.written(), live=live)
    stopped = None if known or not manifest.complete else _stopped(sink, job)
    if stopped is not None:
        ledger.jobs.set_state(job, *stopped)
    return Rebuilt(job=job, where=sink.describe(f"{job}/"), complete=manifest.complete,
                   enqueued=manifest.batches, requeued=len(layout.requeue),
                   written=len(layout.done), last_round=layout.last_round, found=found,
                   checkpointed=checkpointed, stopped=stopped)


def _stopped(sink: Sink, job: str) -> tuple[JobState, str] | None:
    """The pause or cancel the job's output recorded last, or None (it ran, or finished)."""
    stored = sinkview.stored_state(sink, job)
    if stored is None:
        return None
    state, reason = stored
    if state in (STATE_PAUSED, STATE_CANCELLED):
        return state, reason
    return None


def _batches(manifest: JobManifest, requeue: list[str]) -> list[str]:
    return [keys.batch_id(i) for i in range(1, manifest.batches + 1)] + requeue


def count_written(ledger: Ledger, sink: Sink, job: str, in_sink: Iterable[str]) -> set[str]:
    """Record the batches of `in_sink` (written: they have a result object) that the ledger has
    not counted, from their objects: their worker died between writing and recording, or Redis
    lost the record. Returns the done set. Recording is once per batch
    (Batches.finish_and_settle), so a worker recording the same batch meanwhile counts nothing
    twice."""
    done = ledger.batches.done(job)
    for batch in sorted(set(in_sink) - done, key=keys.batch_order):
        counts = written_counts(batch_records(sink, job, batch))
        ledger.batches.finish_and_settle(job, batch, counts, "", [])
        done.add(batch)
    return done
