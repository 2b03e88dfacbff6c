"""One server start in a log (`_Run`) and how each parsed event folds into it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from launcher.era import _era_mark
from launcher.logparse import (
    CapWarning,
    CudaGraph,
    DecodeBatch,
    Draining,
    Event,
    Fatal,
    KVCache,
    MambaCache,
    Ready,
    ServerArgs,
    Summary,
    WeightsLoaded,
    WeightsLoading,
)

# Root causes outrank the generic lines that follow them (traceback header, OOM, sigquit).
_FATAL_RANK: dict[str, int] = {"sigquit": 0, "init_failed": 1, "scheduler_exception": 1,
                               "cuda_oom": 2}


@dataclass
class _Run:
    """What one server start logged; a new `server_args=` line after startup begins another."""

    first_ts: datetime | None = None
    last_ts: datetime | None = None
    args: Mapping[str, object] = field(default_factory=dict)
    weights: WeightsLoaded | None = None
    draft: WeightsLoaded | None = None
    kv: KVCache | None = None
    mamba: MambaCache | None = None
    graph_bs: int | None = None
    summary: Summary | None = None
    caps: dict[str, CapWarning] = field(default_factory=dict)
    ready: bool = False
    ready_at: datetime | None = None
    decode: DecodeBatch | None = None
    peak_running: int | None = None
    fatal: Fatal | None = None
    fatal_at: datetime | None = None
    draining: bool = False
    era: tuple[str | None, str | None] = (None, None)
    began: bool = False  # counted in LogReport.starts


def _restarts(run: _Run, event: Event) -> bool:
    """Whether `event` opens a new server start (the launcher appends restarts to one log)."""
    if isinstance(event, ServerArgs):
        return any((run.weights, run.summary, run.ready, run.fatal))
    # A draft model loads its weights after the target's, so only a finished start counts here.
    return isinstance(event, WeightsLoading) and (run.ready or run.fatal is not None)


def _fold(run: _Run, event: Event) -> None:
    if isinstance(event, WeightsLoaded):
        if event.is_draft or run.weights is not None:
            run.draft = event
        else:
            run.weights = event
    elif isinstance(event, KVCache):
        run.kv = event
    elif isinstance(event, MambaCache):
        run.mamba = event
    elif isinstance(event, CudaGraph):
        if event.role == "target" and event.stage in ("", "decode") and event.max_bs is not None:
            run.graph_bs = event.max_bs
    elif isinstance(event, Summary):
        run.summary = event
    elif isinstance(event, CapWarning):
        run.caps[event.kind] = event
    elif isinstance(event, Ready):
        run.ready, run.ready_at = True, event.ts
    elif isinstance(event, DecodeBatch):
        run.decode = event
        if event.running is not None:
            run.peak_running = max(run.peak_running or 0, event.running)
    elif isinstance(event, Draining):
        run.draining = True
    elif isinstance(event, Fatal) and _outranks(event, run.fatal):
        run.fatal, run.fatal_at = event, event.ts or run.last_ts


def _outranks(new: Fatal, old: Fatal | None) -> bool:
    return old is None or _FATAL_RANK.get(new.kind, 3) > _FATAL_RANK.get(old.kind, 3)


def _note_era(run: _Run, event: Event) -> None:
    mark = _era_mark(event)
    if mark is not None:
        lo, hi = run.era
        run.era = (max(filter(None, (lo, mark[0])), default=None),
                   min(filter(None, (hi, mark[1])), default=None))
