"""`LogReport`: everything one log file says, folded from its events, and its JSON form."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime

from launcher.capacity import CapacityReading, as_int, facts_from_args, read_capacity
from launcher.era import _era_text
from launcher.hints import HINTS
from launcher.logparse import (
    DecodeBatch,
    Event,
    Fatal,
    MambaCache,
    ServerArgs,
    WeightsLoading,
    parse_line,
)
from launcher.starts import _fold, _note_era, _restarts, _Run


@dataclass
class LogReport:
    """Everything read from one log file so far; `add` folds one event in."""

    file: str
    lines: int = 0
    recognised: int = 0
    starts: int = 0
    run: _Run = field(default_factory=_Run)

    def add(self, event: Event) -> None:
        """Fold one parsed event into the report."""
        self.recognised += 1
        run = self.run
        if _restarts(run, event):
            self.run = run = _Run()
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


def _state(run: _Run) -> str:
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
        "mamba_usage": d.mamba_usage, "accept_len": d.accept_len, "accept_rate": d.accept_rate,
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
