"""Dating an SGLang log: the months each line format was printed in, and their text."""

from __future__ import annotations

from launcher.logparse import (
    CapWarning,
    CudaGraph,
    DecodeBatch,
    Event,
    Fatal,
    KVCache,
    PrefillBatch,
    WeightsLoaded,
)

# Months each format was printed in, (first, last), None when open
# (docs/reference/sglang.md §6.2-§6.4).
_PERIOD_TRAILING = {(".", False): (None, "2025-06"), (".", True): ("2025-07", "2025-10"),
                    (",", True): ("2025-10", "2026-01")}


def _era_mark(event: Event) -> tuple[str | None, str | None] | None:
    """The months a line's format was printed in, or None when it says nothing of the era."""
    if isinstance(event, (DecodeBatch, PrefillBatch)):
        if (event.sep, event.trailing_comma) in _PERIOD_TRAILING:
            return _PERIOD_TRAILING[(event.sep, event.trailing_comma)]
        if isinstance(event, PrefillBatch):
            return ("2026-04", None) if event.pending_token is not None else ("2026-01", "2026-04")
        return ("2026-01", None)
    if isinstance(event, KVCache):
        return (None, "2026-05") if event.dtype is None else ("2026-05", None)
    if isinstance(event, CudaGraph):
        return (None, "2026-06") if event.legacy else ("2026-06", None)
    if isinstance(event, WeightsLoaded):
        if event.elapsed_s is None:
            return (None, "2026-01")
        return ("2026-02", "2026-03") if event.dtype else ("2026-02", None)
    if isinstance(event, CapWarning) and event.kind == "mamba":
        return ("2026-07", None)
    if isinstance(event, Fatal) and event.kind == "watchdog":
        return ("2025-11", None) if "Scheduler watchdog" in event.message else (None, "2025-11")
    return None


def _era_text(era: tuple[str | None, str | None]) -> str | None:
    lo, hi = era
    if lo and hi and lo > hi:
        return f"mixed formats ({lo} or later, and up to {hi})"
    if lo and hi:
        return lo if lo == hi else f"{lo} to {hi}"
    if lo or hi:
        return f"{lo} or later" if lo else f"up to {hi}"
    return None
