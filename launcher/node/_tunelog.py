"""The tuning's record (`launcher tune`, `up --tune`): every step printed, kept in
`{run_dir}/tune.json` (which the supervisor copies into node.json) and published to the Redis
of the node's workers, where `producer status` shows it.

    log = TuneLog(run_dir / TUNE_FILE)
    log.add("baseline", 0, tokens_per_s=2300.0)   # printed, saved, published
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.node._rundir import (
    REQUEST_FILE,
    TuneRecord,
    TuneStep,
    pid_alive,
    read_state,
    write_atomic,
)

if TYPE_CHECKING:
    from fleetgen.fleet import TuningNote
    from fleetgen.ledger import Ledger

log = logging.getLogger(__name__)


@dataclass
class TuneLog:
    """The tuning's record, written to tune.json after each step."""

    path: Path
    record: TuneRecord = field(default_factory=TuneRecord)
    stop: threading.Event | None = None  # set when the node stops: signal the supervisor no more
    notes: TuningNotes = field(default_factory=lambda: NODE_NOTES)
    # The wall clock each step is stamped with (the tuning's own, a fake one in tests).
    wall: Callable[[], float] = time.time

    def add(self, kind: str, gpu: int | Sequence[int] | None, *,
            flags: Sequence[str] | None = None, tokens_per_s: float | None = None,
            share: float | None = None, share_before: float | None = None,
            expected: float | None = None, until: float | None = None,
            note: str | None = None) -> None:
        """Record one step, print it and save the record."""
        step = TuneStep(at=self.wall(), kind=kind,
                        gpu=gpu if gpu is None or isinstance(gpu, int) else tuple(gpu),
                        flags=tuple(flags) if flags is not None else None,
                        tokens_per_s=tokens_per_s, share=share, share_before=share_before,
                        expected=expected, until=until, note=note)
        self.record.steps.append(step)
        print(step.describe(), flush=True)
        self.save()

    def save(self) -> None:
        write_atomic(self.path, self.record.to_json())
        self.notes.publish(self.record)
        # SIGHUP without a restart request makes the supervisor republish node.json with it.
        state = read_state(self.path.parent)
        pid = state.supervisor_pid if state else None
        if pid is not None and pid_alive(pid) and not self.stopped \
                and not (self.path.parent / REQUEST_FILE).exists():
            os.kill(pid, signal.SIGHUP)

    @property
    def stopped(self) -> bool:
        """Whether the node is stopping (`up --tune`): no more restarts or signals."""
        return self.stop is not None and self.stop.is_set()


class TuningNotes:
    """Publishes what the tuning does to the Redis of the node's workers (fg:tuning), where
    `producer status` shows it, and beats while it runs: the note of a running or waiting
    tuning is published again every REGISTRY_BEAT_S for as long as the thread that published
    it (the tuner) is alive, so the note of a tuning that died leaves `status` as a dead
    worker's entry does (fleetgen/fleet.py `TuningNote`). A Redis out of reach costs a note,
    never the tuning: it is tried again after RETRY_S, and each try waits TIMEOUT_S at most.

    `ledger`: where to publish (default: the Redis of REDIS_URL, connected at the first note);
    `beat_s`: the beat (default REGISTRY_BEAT_S). `close()` stops the beats, and so does the
    end of the tuner's thread. A node runs one tuning at a time: a process's share NODE_NOTES."""

    RETRY_S, TIMEOUT_S = 30.0, 2.0

    def __init__(self, ledger: Ledger | None = None, beat_s: float | None = None) -> None:
        self._ledger = ledger
        self._beat_s = beat_s
        self.failed_at: float | None = None
        # Held while a note is sent, so that a beat never lands after the note that ended it.
        self._lock = threading.Lock()
        self._note: TuningNote | None = None
        self._tuner: threading.Thread | None = None
        self._beating = False
        self._closed = threading.Event()

    @property
    def beating(self) -> bool:
        """Whether the latest note is published again every beat."""
        with self._lock:
            return self._beating

    def publish(self, record: TuneRecord) -> None:
        if not record.steps:
            return
        from fleetgen.fleet import THIS_HOST, TuningNote

        steps = record.steps
        line = "; ".join(dataclasses.replace(s, until=None).describe().removeprefix("tune: ")
                         for s in record.current)
        if record.chosen:
            line += f" (chosen `{' '.join(record.chosen)}`)"
        note = TuningNote(THIS_HOST, steps[-1].at, time.time(), record.state, line,
                          steps[-1].until)
        with self._lock:
            self._note, self._tuner = note, threading.current_thread()
            self._send(note)
            start = note.live and not self._beating and not self._closed.is_set()
            self._beating = self._beating or start
        if start:
            threading.Thread(target=self._beat, name="tuning-note", daemon=True).start()

    def close(self) -> None:
        """Publish no more beats (what was published expires on its own)."""
        self._closed.set()

    def _beat(self) -> None:
        from fleetgen.fleet import REGISTRY_BEAT_S

        beat_s = REGISTRY_BEAT_S if self._beat_s is None else self._beat_s
        while not self._closed.wait(beat_s):
            with self._lock:
                note, tuner = self._note, self._tuner
                if note is None or not note.live or tuner is None or not tuner.is_alive():
                    break
                self._send(dataclasses.replace(note, updated=time.time()))
        with self._lock:
            self._beating = False

    def _send(self, note: TuningNote) -> None:
        if self.failed_at is not None and time.monotonic() - self.failed_at < self.RETRY_S:
            return
        from fleetgen import redisconn
        from fleetgen.errors import FleetgenError
        from fleetgen.fleet import TUNING_SHOWN_S
        from fleetgen.ledger import Ledger
        from fleetgen.settings import Settings

        try:
            if self._ledger is None:
                settings = Settings.from_env()
                self._ledger = Ledger(redisconn.client(
                    settings.redis_url, settings.redis_master_name,
                    socket_timeout=self.TIMEOUT_S, socket_connect_timeout=self.TIMEOUT_S))
            why = self._ledger.registry.publish_tuning(note.node, note.to_json(), TUNING_SHOWN_S)
        except FleetgenError as exc:
            why = str(exc)
        self.failed_at = None if why is None else time.monotonic()
        if why is not None:
            log.info("tune: the note for `producer status` not published: %s", why)


# The one note of this process's tunings: `up --tune`'s wait for work and the tuning after it
# are two logs of one tuner, and one beat.
NODE_NOTES: TuningNotes = TuningNotes()
