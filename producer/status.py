"""`producer status` for people: the job view (fleetgen/jobview.py) as a screenful of text.

    status = job_status(ledger, "distill-v1", live=True)
    print(render(status))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleetgen.ledger import STATE_RUNNING
from fleetgen.records import ROLLOUT_CALLS_COUNTED

# Types only: the job view brings httpx and the fleet reader, which the commands that use
# `format_duration` alone need not load.
if TYPE_CHECKING:
    from fleetgen.fleet import FleetRow
    from fleetgen.jobview import JobStatus, Rollouts, Stalled


def render(status: JobStatus) -> str:
    """The status as a screenful of text."""
    s = status
    lines = [
        f"job {s.job}  [{s.state}]{'  ' + s.reason if s.reason else ''}  -> {s.output}",
        *_render_stalled(s.stalled),
        *_render_progress(s),
        *_render_rollouts(s.rollouts),
        *_render_quality(s),
        *_render_breaker(s),
    ]
    if s.errors:
        lines.append("  errors    " + ", ".join(f"{k} {v:,}" for k, v in s.errors.items()))
    lines.append(f"  written   {_bytes(s.bytes_written)}")
    if s.fleet is not None:
        lines += ["", *(render_fleet(s.fleet) if s.fleet else ["  no workers registered"])]
    elif s.workers:
        lines += ["", f"  {'worker':<28} {'done':>8} {'failed':>7} {'out tokens':>12} {'batches':>8}"]
        for name, w in sorted(s.workers.items()):
            lines.append(
                f"  {name:<28} {int(w.get('prompts_done', 0)):>8,} {int(w.get('prompts_failed', 0)):>7,}"
                f" {int(w.get('output_tokens', 0)):>12,} {int(w.get('batches_done', 0)):>8,}")
    lines += [f"  {note.describe(s.updated_at)}" for note in s.tuning]
    if s.worker_errors:
        lines += ["", "  last errors of workers:"]
        for e in s.worker_errors:
            # An error of no job (its server, at start) is the worker's own.
            about = f"job {e.job}: " if e.job else ""
            lines.append(f"  {e.worker:<22} {_ago(e.age_s):>8} ago  {about}{e.error}")
    return "\n".join(lines)


def _render_stalled(stalled: Stalled | None) -> list[str]:
    if stalled is None:
        return []
    if stalled.reason == "no_consumer":
        live = ", ".join(stalled.live_queues or []) or "none: no live worker"
        return [f"  stalled: no worker consumes queue {stalled.queue} (live workers "
                f"consume {live})"]
    line = f"  stalled: no batch finished for {_ago(stalled.idle_s or 0.0)}"
    error = stalled.last_error
    if error is None and stalled.not_ready:
        return [line + f"; servers not ready for {', '.join(stalled.not_ready)}"]
    if error is None:
        return [line + "; no worker reported an error (are any running?)"]
    return [f"{line}; last error on {error.worker} ({_ago(error.age_s)} ago): {error.error}"]


def _ago(seconds: float) -> str:
    """`45 s`, `3 min`, `2 h`: how long, as a person says it."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _render_progress(s: JobStatus) -> list[str]:
    total = s.total or 1
    # Progress counts every answer as it is checkpointed; `done` and `failed` are what the
    # sink holds (written batches), which export reconciles.
    finished = s.done + s.failed + s.checkpointed
    pct = 100.0 * finished / total
    r, t, b = s.rate, s.tokens, s.batches
    if s.eta_s is not None:
        eta = format_duration(s.eta_s)
    else:
        eta = s.state if s.state != STATE_RUNNING else "unknown"
        if s.eta_reason:
            eta += f" ({s.eta_reason})"
    # A done, paused or cancelled job's clock stopped (fleetgen/jobview.py `_clock_end`), and
    # its recent window with it.
    stopped = s.clock_stopped
    waiting = f"queued {s.queued:,}" + (f"  held {s.held:,} ({s.state})" if s.held else "")
    # Every figure counts answers; a job of one answer per prompt calls them prompts.
    unit = "answers" if s.total != s.prompts else "prompts"
    lines = [
        (f"  {unit:<9} {finished:,}/{s.total:,} ({pct:.1f}%)  done {s.done:,}"
         f"  failed {s.failed:,}  checkpointed {s.checkpointed:,}"
         f"  in flight {s.in_flight:,}  in hand {s.in_hand - s.in_flight:,}  {waiting}"),
        f"  batches   {b.done:,}/{b.total:,} done, {b.running:,} running, {b.queued:,} queued",
        (f"  rate      last {format_duration(r.window_s)}{' before it stopped' if stopped else ''}"
         f" {r.prompts_per_s_5m:,.2f} {unit}/s,"
         f" {r.output_tokens_per_s_5m:,.0f} out tok/s;  overall {r.prompts_per_s_all:,.2f}"
         f" {unit}/s, {r.output_tokens_per_s_all:,.0f} out tok/s (all GPUs)"),
        f"  time      elapsed {format_duration(s.elapsed_s)}{' (stopped)' if stopped else ''}"
        f"   ETA {eta}",
        (f"  tokens    in {t.input:,}  out {t.output:,}  avg out {t.avg_output or 0:,.0f}"
         f"  reasoning share {100 * (t.reasoning_share or 0):.0f}%"),
        "  finish    " + (", ".join(f"{k} {v:,}" for k, v in s.finish_reasons.items()) or "-")
        + f"   empty content {s.empty_content:,}",
    ]
    if unit == "answers":
        lines.insert(1, f"  prompts   {s.prompts:,}, {s.total / (s.prompts or 1):,.3g} answers each"
                     " on average")
    return lines


def _render_rollouts(r: Rollouts | None) -> list[str]:
    """A rollout job's programs: how many ended and run, their calls, what they raised."""
    if r is None:
        return []
    calls = "no calls yet"
    if r.calls_mean is not None and r.calls_max is not None:
        most = f"{r.calls_max}+" if r.calls_max >= ROLLOUT_CALLS_COUNTED else str(r.calls_max)
        spread = ", ".join(f"{k}: {v:,}" for k, v in r.by_calls.items())
        calls = f"calls a rollout: mean {r.calls_mean:,.2f}, max {most} ({spread})"
    lines = [f"  rollouts  {r.name}: {r.ended:,} ended, {r.running:,} running, "
             f"{r.calls_in_flight:,} calls in flight, {r.calls:,} calls made",
             f"            {calls}"]
    if r.raised:
        lines.append("            raised " + ", ".join(f"{k} {v:,}" for k, v in r.raised.items()))
    return lines


def _render_quality(s: JobStatus) -> list[str]:
    q, c = s.quality, s.canary
    if not q:
        end = c.end_verdict
        if c.enabled and end:
            if not end.judged:
                return [f"  canary    not judged: the job ended with {end.answers:,} answers,"
                        " too few to tell"]
            return [f"  canary    judged all {end.answers:,} answers at the job's end: healthy"]
        if c.enabled and c.judged_at_end:
            return [(f"  canary    watching: {c.answers_seen:,} answers seen (the job is"
                     f" smaller than {c.min_completions:,}: judged at its end)")]
        if c.enabled:
            return [(f"  canary    watching: {c.answers_seen:,} answers seen"
                     f" (judges from {c.min_completions:,})")]
        return ["  canary    off"]
    lines = [(f"  quality   canary fired after {q.detected_after:,} answers"
              f"{' (accepted by user: going on)' if q.accepted else ''}; examples:")]
    for ex in q.examples:
        lines.append(f"            {ex.id}: {ex.content!r} ({ex.output_tokens} tokens"
                     f"{', cut at max_tokens' if ex.length else ''})")
    if not q.accepted and s.state == "paused":
        lines.append(f"            go on anyway: python -m producer resume {s.job} --accept-quality")
    return lines


def _render_breaker(s: JobStatus) -> list[str]:
    b = s.breaker
    if not b:
        return []
    lines = []
    if b.cause and s.state == "paused":
        lines.append("  failures  the failure breaker paused the job; example:")
        if b.example:
            ex = b.example
            lines.append(f"            {ex.id}: {ex.message[:200]} ({ex.code})")
        lines += [f"            fix the cause, then send them again: python -m producer resume "
                  f"{s.job}",
                  f"            or keep them as failures: python -m producer resume {s.job} "
                  "--accept-failures"]
    lines += [f"  failures  accepted, not pausing the job: {cause}" for cause in b.accepted]
    return lines


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} TB"


def format_duration(seconds: float) -> str:
    """`1h05m` or `4m09s`."""
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def render_fleet(rows: list[FleetRow]) -> list[str]:
    """The per-GPU table for people, grouped by node when there are several; a server that did
    not answer shows `down`.

    Two limits are shown, each named for whose it is: `srv run/max` is the server's running
    requests of its max running requests (`asked` the max_running_requests it was asked for,
    when it runs fewer, e.g. Mamba slots); the line under the table gives each worker's
    in-flight limit, the requests it keeps at its server at once (the ones beyond the server's
    max wait in its queue).
    """
    lines = [f"  {'worker':<22} {'state':<12} {'server':<22} {'srv run/max':>11} {'asked':>5}"
             f" {'queue':>5} {'tok use':>7} {'mamba':>5} {'gen tok/s':>9} {'accept':>6}"
             f" | {'job done':>8} {'job tok/s':>9}"]
    hosts = {row.host for row in rows}
    host: object = object()
    for row in rows:
        if len(hosts) > 1 and row.host != host:
            host = row.host
            lines.append(f"  node {host or '?'}")
        server = (row.server or "-").removeprefix("http://").removeprefix("https://")
        asked = row.requested_max if row.requested_max != row.effective_max else None
        if row.server_state == "up":
            run_max = f"{_num(row.running)}/{_num(row.effective_max)}"
            live = (f"{run_max:>11} {_num(asked) if asked else '':>5} {_num(row.queue):>5}"
                    f" {_pct(row.token_usage):>7} {_pct(row.mamba_usage):>5}"
                    f" {_num(row.gen_throughput):>9} {_dec(row.accept_length):>6}")
        else:
            live = f"{row.server_state:>11} {'':>5} {'':>5} {'':>7} {'':>5} {'':>9} {'':>6}"
        lines.append(
            f"  {row.worker[:22]:<22} {row.worker_state:<12} {server[:22]:<22} {live} |"
            f" {row.job_prompts_done:>8,} {_num(row.job_output_tokens_per_s):>9}"
        )
    lines += [f"  {row.worker}: {row.server_kind}; worker in-flight limit {_num(row.limit)} "
              f"({row.capacity_source})"
              for row in rows if row.server_kind and row.capacity_source]
    # What a server did to its worker's requests, only where it was more than answer them.
    lines += [f"  {row.worker}: {said}" for row in rows if row.health is not None
              for said in row.health.summary()]
    return lines + _render_tuning(rows)


def _render_tuning(rows: list[FleetRow]) -> list[str]:
    """One line when live servers run different caps: a node trying flags on one GPU (`launcher
    up --tune`, `launcher tune`) or rolling them out; its node's `launcher status` says which."""
    caps: dict[int, list[str]] = {}
    for row in rows:
        if row.server_state == "up" and row.effective_max is not None:
            caps.setdefault(row.effective_max, []).append(row.worker.partition("@")[0])
    if len(caps) < 2:
        return []
    spread = "; ".join(f"{cap} on {', '.join(names)}" for cap, names in sorted(caps.items()))
    return [f"  tuning: servers run different caps ({spread}): `launcher status` on their "
            "node names the flags"]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _dec(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
