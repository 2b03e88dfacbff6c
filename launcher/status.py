"""The `launcher status` table: node.json annotated with liveness and rendered as text."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from launcher.rundir import pid_alive


def annotate(state: dict[str, Any]) -> None:
    """Add `supervisor_alive` and each process's `pid_alive`."""
    state["supervisor_alive"] = pid_alive(state.get("supervisor_pid"))
    for gpu in state.get("gpus", []):
        gpu["pid_alive"] = pid_alive(gpu.get("pid"))
        if gpu.get("worker"):
            gpu["worker"]["pid_alive"] = pid_alive(gpu["worker"].get("pid"))


def render_status(state: Mapping[str, Any], now: float | None = None) -> str:
    """The status table: GPU, port, pid, state, uptime, restarts, capacity, why."""
    now = time.time() if now is None else now
    sup = state.get("supervisor_pid")
    head = f"supervisor pid {sup} " + ("running" if state.get("supervisor_alive") else
                                       "NOT running: the state below is stale")
    head += f"; updated {_ago(now - float(state.get('updated_at') or now))} ago"
    rows: list[tuple[str, ...]] = [
        ("GPU", "PORT", "PID", "STATE", "UPTIME", "RESTARTS", "CAPACITY", "WHY")]
    for g in state.get("gpus", []):
        rows.append(_row(g, now))
        worker = g.get("worker")
        if worker:
            rows.append(_row({**worker, "gpu": f"  w{g['gpu']}", "port": "-"}, now))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1]
                      for r in rows]
    rollout = state.get("rollout")
    if rollout:
        lines.append(_rollout_text(rollout))
    return "\n".join(line.rstrip() for line in lines)


def _row(g: Mapping[str, Any], now: float) -> tuple[str, ...]:
    alive, state = g.get("pid_alive", True), str(g.get("state"))
    pid = "-" if g.get("pid") is None or state == "stopped" else str(g["pid"])
    if pid != "-" and not alive:
        pid, state = f"{pid} (gone)", f"{state}?"
    up = _ago(now - g["since"]) if g.get("state") in ("ready", "running") and alive else "-"
    cap = g.get("capacity") or {}
    capacity = "-"
    if cap.get("effective") is not None:
        capacity = f"{cap['effective']} (asked {cap.get('requested') or 'auto'})"
    # A ready server explains its capacity; any other state explains itself.
    why = cap.get("reason") if g.get("state") in ("ready", "running") else g.get("last_reason")
    return (str(g.get("gpu")), str(g.get("port")), pid, state, up, str(g.get("restarts", 0)),
            capacity, why or "")


def _rollout_text(r: Mapping[str, Any]) -> str:
    text = f"restart {r.get('id')}: {r.get('state')}, done GPU {r.get('done')}"
    if r.get("current") is not None:
        text += f", now GPU {r['current']}"
    if r.get("reason"):
        text += f": {r['reason']}"
    if r.get("rejected"):
        text += f"\nrestart {r['rejected']['id']}: rejected: {r['rejected']['reason']}"
    return text


def _ago(seconds: float) -> str:
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
