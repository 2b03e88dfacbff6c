"""`LogReport`: everything one SGLang log file says, folded from its parsed events.

A log holds one or more server starts (the launcher appends each restart to the same file);
the report keeps the latest start (`ServerStart`) whole and counts the others. From it come
the requested vs effective max_running_requests and why (`capacity()`), the months the line
formats date the server to (its era), the fatal error with what to do about it (`HINTS`), and
the JSON form `explain --json` prints.

    report = read_log("logs/sglang_gpu0.log")
    report.to_json()["max_running_requests"]["reason"]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime

from fleetgen.servers import as_int
from launcher.logs._capacity import CapacityReading, facts_from_args, read_capacity
from launcher.logs._parse import (
    CapWarning,
    CudaGraph,
    DecodeBatch,
    Draining,
    Event,
    Fatal,
    FatalKind,
    KVCache,
    MambaCache,
    PrefillBatch,
    Ready,
    ServerArgs,
    Summary,
    WeightsLoaded,
    WeightsLoading,
    parse_line,
)

# One server start and how each event folds into it.

# Root causes outrank the generic lines that follow them (traceback header, OOM, sigquit).
_FATAL_RANK: dict[str, int] = {"sigquit": 0, "init_failed": 1, "scheduler_exception": 1,
                               "cuda_oom": 2}


@dataclass
class ServerStart:
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


def _restarts(run: ServerStart, event: Event) -> bool:
    """Whether `event` opens a new server start (the launcher appends restarts to one log)."""
    if isinstance(event, ServerArgs):
        return any((run.weights, run.summary, run.ready, run.fatal))
    # A draft model loads its weights after the target's, so only a finished start counts here.
    return isinstance(event, WeightsLoading) and (run.ready or run.fatal is not None)


def _fold(run: ServerStart, event: Event) -> None:
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
        if event.summary is not None:
            run.summary = event.summary
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


def _note_era(run: ServerStart, event: Event) -> None:
    mark = _era_mark(event)
    if mark is not None:
        lo, hi = run.era
        run.era = (max(filter(None, (lo, mark[0])), default=None),
                   min(filter(None, (hi, mark[1])), default=None))


# The report.

@dataclass
class LogReport:
    """Everything read from one log file so far; `add` folds one event in."""

    file: str
    lines: int = 0
    recognised: int = 0
    starts: int = 0
    run: ServerStart = field(default_factory=ServerStart)

    def add(self, event: Event) -> None:
        """Fold one parsed event into the report."""
        self.recognised += 1
        run = self.run
        if _restarts(run, event):
            self.run = run = ServerStart()
        if isinstance(event, (ServerArgs, WeightsLoading)) and not run.began:
            run.began = True
            self.starts += 1
        if isinstance(event, ServerArgs):
            run.args = event.args
        if event.ts is not None:
            run.first_ts = run.first_ts or event.ts
            run.last_ts = event.ts
        _note_era(run, event)
        _fold(run, event)

    def capacity(self) -> CapacityReading:
        """The requested vs effective max_running_requests and why, from what the log said."""
        run = self.run
        kv_cap, mamba_cap = run.caps.get("kv"), run.caps.get("mamba")
        facts = facts_from_args(run.args)
        requested = facts.requested if run.args or not kv_cap else kv_cap.requested
        if not run.args and "spec" in run.caps:
            requested = run.caps["spec"].requested
        effective = run.summary.max_running_requests if run.summary else None
        slots = run.mamba.max_mamba_cache_size if run.mamba else None
        return read_capacity(replace(
            facts, requested=requested,
            requested_known=bool(run.args) or kv_cap is not None or "spec" in run.caps,
            effective=_first(effective, *(c.effective for c in (mamba_cap, kv_cap) if c)),
            max_total_num_tokens=_first(
                run.summary.max_total_num_tokens if run.summary else None,
                run.kv.tokens if run.kv else None),
            max_mamba_cache_size=_first(slots, mamba_cap.slots if mamba_cap else None,
                                        facts.max_mamba_cache_size),
            speculative=facts.speculative or run.draft is not None or "spec" in run.caps
            or (run.decode is not None and run.decode.accept_len is not None),
            per_request=mamba_cap.per_request if mamba_cap else None,
        ))

    def to_json(self) -> dict[str, object]:
        """The report as one JSON object: stable snake_case keys, None where the log is silent."""
        run, cap = self.run, self.capacity()
        args, summary, w, kv, mamba = run.args, run.summary, run.weights, run.kv, run.mamba
        return {
            "file": self.file, "state": _state(run), "era": _era_text(run.era),
            "ready": run.ready, "ready_at": _stamp(run.ready_at),
            "startup_s": _seconds(run.first_ts, run.ready_at),
            "model_path": _text(args.get("model_path")),
            "model_class": w.model_class if w else None,
            "draft_model_class": run.draft.model_class if run.draft else None,
            "speculative_algorithm": _text(args.get("speculative_algorithm")),
            "weights_gb": w.mem_usage_gb if w else None,
            "weights_load_s": w.elapsed_s if w else None,
            "kv_tokens": kv.tokens if kv else None, "kv_dtype": kv.dtype if kv else None,
            "kv_cache_gb": kv.kv_gb if kv else None,
            "mamba_slots": mamba.max_mamba_cache_size if mamba else None,
            "mamba_cache_gb": _sum_gb(mamba),
            "max_total_num_tokens": summary.max_total_num_tokens if summary else None,
            "context_len": _first(summary.context_len if summary else None,
                                  as_int(args.get("context_length"))),
            "chunked_prefill_size": _first(summary.chunked_prefill_size if summary else None,
                                           as_int(args.get("chunked_prefill_size"))),
            "max_prefill_tokens": summary.max_prefill_tokens if summary else None,
            "cuda_graph_max_bs": run.graph_bs,
            "available_gpu_mem_gb": summary.available_gpu_mem_gb if summary else None,
            "max_running_requests": {
                "requested": cap.requested, "effective": cap.effective,
                "binding": cap.binding, "ratio": cap.ratio, "reason": cap.reason,
            },
            "last_decode": _decode_json(run.decode), "peak_running": run.peak_running,
            "fatal": _fatal_json(run.fatal, run.fatal_at),
            "starts": self.starts, "lines": self.lines, "recognised_lines": self.recognised,
        }


def _state(run: ServerStart) -> str:
    if run.fatal:
        return "failed"
    if run.draining:
        return "draining"
    if run.ready:
        return "ready"
    return "starting" if run.first_ts or run.args else "unknown"


def _decode_json(d: DecodeBatch | None) -> dict[str, object] | None:
    if d is None:
        return None
    return {
        "at": _stamp(d.ts), "running": d.running, "queue": d.queue, "token_usage": d.kv_usage,
        "mamba_num": d.mamba_num, "mamba_usage": d.mamba_usage, "accept_len": d.accept_len,
        "accept_rate": d.accept_rate,
        "gen_throughput": d.gen_throughput, "cuda_graph": d.cuda_graph,
    }


def _fatal_json(f: Fatal | None, at: datetime | None) -> dict[str, object] | None:
    if f is None:
        return None
    return {"kind": f.kind, "message": f.message, "hint": HINTS[f.kind], "at": _stamp(at),
            "exit_code": f.exit_code}


def _sum_gb(m: MambaCache | None) -> float | None:
    parts = [] if m is None else [m.conv_gb, m.ssm_gb, m.intermediate_ssm_gb,
                                  m.intermediate_conv_gb]
    known = [p for p in parts if p is not None]
    return round(sum(known), 2) if known else None


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _stamp(ts: datetime | None) -> str | None:
    return ts.isoformat(sep=" ", timespec="seconds") if ts else None


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return round((end - start).total_seconds(), 1) if start and end else None


def fold(events: Iterable[Event | None], file: str = "-") -> LogReport:
    """Fold parsed events (None for unrecognised lines) into a report."""
    report = LogReport(file)
    for event in events:
        report.lines += 1
        if event is not None:
            report.add(event)
    return report


def read_log(path: str) -> LogReport:
    """Read a log file line by line (never whole) and fold it. Raises OSError if unreadable."""
    # Universal newlines split tqdm's carriage-return updates into lines of their own.
    with open(path, encoding="utf-8", errors="replace") as lines:
        return fold((parse_line(line) for line in lines), path)


# The era: which months the line formats were printed in.

# Months each format was printed in, (first, last), None when open (docs/reference/sglang.md#logs, §6.2-§6.4).
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


# What to do about each kind of fatal error, keyed by `FatalKind`.

HINTS: dict[FatalKind, str] = {
    "kv_no_memory": "no room for the KV cache: raise --mem-fraction-static, or use more GPUs (tp)",
    "weights_no_memory": "the weights fill the GPU: raise --mem-fraction-static to the minimum "
    "the message names, quantize, or use more GPUs (tp)",
    "zero_requests": "no request fits: raise --mem-fraction-static or lower --context-length",
    "pool_too_small": "the KV pool is smaller than one request: raise --mem-fraction-static "
    "or lower --context-length",
    "mamba_no_memory": "no room for the Mamba state: lower --max-running-requests or "
    "--speculative-num-draft-tokens, or raise --mem-fraction-static",
    "mamba_too_small": "the Mamba state pool cannot hold one request: raise "
    "--max-mamba-cache-size or --mem-fraction-static",
    "cuda_graph": "graph capture ran out of memory: lower --mem-fraction-static (e.g. 0.8) or "
    "--cuda-graph-max-bs-decode (e.g. 16)",
    "cuda_oom": "CUDA OOM: lower --mem-fraction-static, --max-running-requests or "
    "--chunked-prefill-size",
    "watchdog": "a batch made no progress for --watchdog-timeout seconds: the GPU or NCCL hung; "
    "restart the server",
    "scheduler_exception": "the scheduler crashed: read the traceback that follows this line",
    "scheduler_died": "a scheduler died while starting; exit code -9 is usually the OS OOM "
    "killer (dmesg -T | grep -i oom)",
    "warmup_failed": "the warmup request failed: read the traceback that follows this line",
    "init_failed": "a scheduler failed to start: read the errors above this line",
    "health_check": "the detokenizer stopped answering: the server is hung; restart it",
    "port_in_use": "the HTTP port is taken: pick a free --port",
    "sigquit": "a child process failed: look for its traceback above this line",
}
