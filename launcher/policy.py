"""The supervisor's timings and limits: ready deadline, backoff, crash loop, stop and drain."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    """Supervision timings and limits (seconds unless named otherwise)."""

    # A large model loads its weights and captures CUDA graphs in minutes; 30 min is a hang.
    ready_timeout_s: float = 1800.0
    # Each round reads the log tail and polls the process; a quarter second keeps restarts
    # quick at a negligible cost.
    poll_s: float = 0.25
    # SGLang logs the root cause a few lines after `Scheduler hit an exception`, then exits -9.
    fatal_grace_s: float = 5.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    crash_loop_count: int = 5
    crash_loop_window_s: float = 600.0
    # On shutdown, workers requeue unfinished batches, so a short deadline loses no work.
    stop_timeout_s: float = 30.0
    # A rolling restart lets in-flight requests finish: long thinking answers take minutes.
    drain_timeout_s: float = 300.0
    health_interval_s: float = 5.0
    # /health may take 20 s under load (§4.1); three minutes of failures is a hung server.
    unhealthy_restart_s: float = 180.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")
        if self.crash_loop_count < 1 or self.poll_s <= 0:
            raise ValueError("crash_loop_count must be >= 1 and poll_s > 0")

    def backoff(self, recent_crashes: int) -> float:
        """Delay before the next start: initial, doubled per recent crash, capped."""
        exponent = max(recent_crashes - 1, 0)
        return min(self.backoff_initial_s * 2.0**min(exponent, 30), self.backoff_max_s)
