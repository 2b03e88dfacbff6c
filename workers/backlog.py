"""What this worker holds: batches in hand, batches still loading, prompts not yet sent, and
how many prompts it has sent so far (their rate sizes the reserve; gate.py).

The batch runner keeps the counts; the consumer gate reads them to take the next batch
*before* the server would go idle, and not earlier, so no worker hoards prompts another GPU
could be running.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


class Backlog:
    """The counts, shared by the pool threads and the loop (a lock guards each change)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches = 0
        self.loading = 0
        self.unsent = 0
        self.sent = 0

    def add(self, *, batches: int = 0, loading: int = 0, unsent: int = 0, sent: int = 0) -> None:
        with self._lock:
            self.batches += batches
            self.loading += loading
            self.unsent += unsent
            self.sent += sent


@dataclass
class Delivery:
    """One request on its way to the server, carrying `answers` answers: whether the backlog
    counts them sent, and how long its tries waited for slots."""

    backlog: Backlog
    answers: int = 1
    sent: bool = False
    queue_wait_s: float = 0.0

    def leaves(self) -> None:
        """Its request goes out now: the backlog counts it sent (once, whatever its tries)."""
        if not self.sent:
            self.sent = True
            self.backlog.add(unsent=-self.answers, sent=self.answers)

    def server_lost(self) -> None:
        """Its server went down: unsent again until the server is back, so the worker takes
        no new batch meanwhile (gate.py)."""
        if self.sent:
            self.sent = False
            self.backlog.add(unsent=self.answers)

    def hand_on(self) -> None:
        """Its answers go as requests of their own (the server refused `n`): theirs to count
        from here."""
        self.backlog.add(unsent=self.answers if self.sent else 0,
                         sent=-self.answers if self.sent else 0)
        self.answers, self.sent = 0, False

    def ends(self) -> None:
        """The request is done with (answered, failed or held): out of the unsent count."""
        if not self.sent:
            self.backlog.add(unsent=-self.answers)
