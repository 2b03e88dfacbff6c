"""`python -m producer report JOB`: one self-contained HTML page with a job's figures and plots.

Nothing is measured anew; the page shows what fleetgen already holds:

- the job's status (`job_status`, Redis): counts, rates, tokens, finish reasons, failures by
  code, what the quality canary saw and whether it paused the job;
- `fg:job:{job}:worker_minutes` (written by each worker's checkpoints): prompts and output
  tokens per worker per minute, the throughput over time of each GPU, each minute over the
  seconds of it the job's clock ran (`jobview.per_second`, the clock of `status`);
- the worker registry (`fg:workers`): each server's running requests against its capacity
  as its worker last registered them (a snapshot taken when the report is made);
- the sink's `results/` and `errors/` objects: latency and output length of each answer, and
  one example message per failure code (at most `max_batches` batches are read).

The summary's rates are `status`'s own figures, labelled: totals of all GPUs, over the job's
clock or the recent window; the per-GPU figures are the same totals per worker.

The plots are matplotlib figures embedded as base64 PNG: the file opens anywhere, offline.

    page = build_report(ledger, "distill-v1")
    Path("distill-v1.html").write_text(page.html)
"""

from __future__ import annotations

import base64
import html
import io
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from fleetgen import keys
from fleetgen.ledger import STATE_CANCELLED, STATE_PAUSED, Ledger
from fleetgen.records import OutputRecord, is_failure
from fleetgen.sink import Sink, batch_records, open_sink
from producer.status import format_duration

# Types only: build_report imports the job view when it runs (it brings httpx).
if TYPE_CHECKING:
    from fleetgen.fleet import WorkerEntry
    from fleetgen.jobview import Canary, JobStatus, Rate
    from fleetgen.ledger import QualityPause

# The job's clock stopped: the rates stay put (fleetgen/jobview.py `_clock_end`).
STOPPED = ("done", STATE_PAUSED, STATE_CANCELLED)
# Reading every result object of a million-prompt job would take minutes; the distributions
# need far fewer answers than that.
DEFAULT_MAX_BATCHES = 400


@dataclass
class Answers:
    """What the sink's records say about the answers read (a sample when the job is large)."""

    batches_read: int = 0
    batches_total: int = 0
    latency_s: list[float] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    failure_examples: dict[str, str] = field(default_factory=dict)

    def add(self, record: OutputRecord) -> None:
        if is_failure(record):
            error = record["error"]
            self.failure_examples.setdefault(error["code"], error["message"])
            return
        self.latency_s.append(float(record["latency_s"]))
        self.output_tokens.append(record["usage"]["completion_tokens"])
        self.finish_reasons[str(record["finish_reason"])] += 1


@dataclass(frozen=True)
class Report:
    job: str
    html: str
    status: JobStatus


def read_answers(sink: Sink, job: str, batches: Iterable[str], max_batches: int) -> Answers:
    """Latency, length and finish reason of the answers in the first `max_batches` batches."""
    names = sorted(batches, key=keys.batch_order)
    answers = Answers(batches_total=len(names))
    for batch in names[:max_batches]:
        for record in batch_records(sink, job, batch):
            answers.add(record)
        answers.batches_read += 1
    return answers


def build_report(ledger: Ledger, job: str, max_batches: int = DEFAULT_MAX_BATCHES,
                 now: float | None = None) -> Report:
    # Imported here: the producer's command line loads this module for its defaults, and the
    # job view brings httpx and the fleet reader, ~0.2 s before `enqueue` queues anything.
    from fleetgen.fleet import registry
    from fleetgen.jobview import job_status

    now = time.time() if now is None else now
    status = job_status(ledger, job, now=now)
    sink = open_sink(status.output)
    answers = read_answers(sink, job, ledger.batches.done(job), max_batches)
    servers = registry(ledger, now)
    minutes = ledger.counters.worker_minutes(job)
    return Report(job, render_html(status, answers, servers, minutes, now), status)


# --- the page ---------------------------------------------------------------------------------


def render_html(status: JobStatus, answers: Answers, servers: Mapping[str, WorkerEntry],
                minutes: Mapping[str, Mapping[int, Mapping[str, float]]], now: float) -> str:
    s = status
    tokens = s.tokens
    rate = s.rate
    figures = [
        ("Throughput per GPU", throughput_plot(throughput_series(minutes, rate)),
         "Prompts and output tokens finished per second, per worker (one GPU each), by minute of "
         "the job (the workers' checkpoint counters): each minute's count over the seconds the "
         "job's clock ran in it, so a part-minute (the job's first, its last, this one) is not "
         "divided by 60. A minute's rates of all GPUs add up to the job's total rate."),
        ("Running vs capacity per server", capacity_plot(servers),
         "Requests each server was running and its capacity (effective max_running_requests), "
         "as its worker last registered them; a snapshot at the report's time."),
        ("Latency and output length", distributions_plot(answers),
         f"From the answers of {answers.batches_read:,} of {answers.batches_total:,} written "
         "batches (the sink's results objects)."),
        ("Finish reasons and failures", reasons_plot(s.finish_reasons, s.errors),
         "Finish reasons of every answer; failed prompts by error code (the job's counters)."),
    ]
    summary = [
        ("state", f"{s.state}" + (f" ({s.reason})" if s.reason else "")),
        ("prompts", f"{s.prompts:,}"),
        *([("answers", f"{s.total:,}")] if s.total != s.prompts else []),
        ("done", f"{s.done:,}"),
        ("failed", f"{s.failed:,}"),
        ("not finished", f"{s.total - s.done - s.failed:,}"),
        ("batches", f"{s.batches.done:,} of {s.batches.total:,} written"),
        ("elapsed", _span(s.elapsed_s) + (" (the clock stopped)" if s.state in STOPPED else "")),
        *rates_summary(s),
        ("tokens", f"in {tokens.input:,}, out {tokens.output:,}, "
                   f"avg out {tokens.avg_output or 0:,.0f}"),
        ("empty answers", f"{s.empty_content:,}"),
        ("output", s.output),
    ]
    rows = "\n".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in summary)
    sections = "\n".join(
        f"<section><h2>{_e(title)}</h2><p class=note>{_e(note)}</p>{image}</section>"
        for title, image, note in figures)
    return PAGE.format(
        job=_e(s.job), made=_e(time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(now))),
        summary=rows, sections=sections, canary=canary_html(s.canary, s.quality),
        failures=failures_html(s.errors, answers.failure_examples),
        workers=workers_html(s.workers, s.elapsed_s))


def rates_summary(status: JobStatus) -> list[tuple[str, str]]:
    """The summary's rate rows: `status`'s figures, each labelled total or per GPU and with its
    window (the job's clock, or the recent window that ends now or where the job stopped)."""
    rate, gpus = status.rate, _gpus(status.workers)
    clock = f"over the job's {_span(status.elapsed_s)}"
    recent = (f"over the last {_span(rate.window_s)}"
              + (" before it stopped" if status.clock_stopped else ""))
    per_gpu = (f" = {rate.output_tokens_per_s_all / gpus:,.0f} per GPU on average"
               if gpus > 1 else "")
    return [
        ("prompts/s", f"{rate.prompts_per_s_all:,.2f} total {clock}; "
                      f"{rate.prompts_per_s_5m:,.2f} total {recent}"),
        ("output tokens/s", f"{rate.output_tokens_per_s_all:,.0f} total of {gpus} GPU"
                            f"{'s' if gpus != 1 else ''} {clock}{per_gpu}; "
                            f"{rate.output_tokens_per_s_5m:,.0f} total {recent}"),
    ]


def _gpus(workers: Mapping[str, Mapping[str, float]]) -> int:
    """Workers (one GPU each) that finished a prompt of the job."""
    return sum(1 for w in workers.values() if w.get("prompts_done") or w.get("prompts_failed"))


def _span(seconds: float) -> str:
    """`2.5 s` under a minute (a short job's rate hangs on it), else `4m09s`."""
    return f"{seconds:.1f} s" if seconds < 60 else format_duration(seconds)


def canary_html(canary: Canary, quality: QualityPause | None) -> str:
    if not canary.enabled:
        lines = ["The quality canary was off for this job (--no-canary)."]
    else:
        lines = [f"It saw {canary.answers_seen:,} answers; it judges once it has "
                 f"{canary.min_completions:,}."]
    if quality:
        lines.append(f"It paused the job after {quality.detected_after:,} answers"
                     + (" (then the pause was accepted with resume --accept-quality)."
                        if quality.accepted else "."))
        lines += [f"example: {asdict(example)}" for example in quality.examples[:5]]
    elif canary.enabled:
        lines.append("It never paused the job.")
    if canary.enabled:
        lines += _canary_end_words(canary)
    return "\n".join(f"<p>{_e(line)}</p>" for line in lines)


def _canary_end_words(canary: Canary) -> list[str]:
    """The end-of-job judgement in words (status's `judged_at_end` and `end_verdict`)."""
    end = canary.end_verdict
    if end:
        if not end.judged:
            return [f"At the job's end it had {end.answers:,} answers, too few to judge."]
        verdict = end.verdict
        return [f"It judged all {end.answers:,} answers at the job's end: "
                + (verdict if verdict else "healthy.")]
    if canary.judged_at_end:
        return [f"The job has fewer than {canary.min_completions:,} prompts: it is judged "
                "once, at its end (not yet)."]
    return []


def failures_html(errors: Mapping[str, int], examples: Mapping[str, str]) -> str:
    if not errors:
        return "<p>No prompt failed.</p>"
    rows = "\n".join(f"<tr><td>{_e(code)}</td><td class=num>{count:,}</td>"
                     f"<td>{_e(examples.get(code, ''))}</td></tr>"
                     for code, count in sorted(errors.items(), key=lambda kv: -kv[1]))
    return f"<table><tr><th>code</th><th>prompts</th><th>example</th></tr>{rows}</table>"


def workers_html(workers: Mapping[str, Mapping[str, float]], elapsed_s: float) -> str:
    if not workers:
        return "<p>No worker has finished a prompt of this job.</p>"
    from fleetgen.fleet import fleet_rows  # here, as in build_report: it brings httpx

    # Per GPU over the job's clock: the `job tok/s` column of `status`, by the same code.
    per_s = {row.worker: row.job_output_tokens_per_s
             for row in fleet_rows({}, {}, workers, elapsed_s)}
    rows = "\n".join(
        f"<tr><td>{_e(name)}</td><td class=num>{int(w.get('prompts_done', 0)):,}</td>"
        f"<td class=num>{int(w.get('prompts_failed', 0)):,}</td>"
        f"<td class=num>{int(w.get('output_tokens', 0)):,}</td>"
        f"<td class=num>{per_s[name] or 0:,.0f}</td>"
        f"<td class=num>{int(w.get('batches_done', 0)):,}</td></tr>"
        for name, w in sorted(workers.items()))
    return ("<table><tr><th>worker</th><th>done</th><th>failed</th><th>out tokens</th>"
            "<th>out tokens/s (this GPU, over the job's clock)</th>"
            f"<th>batches</th></tr>{rows}</table>")


# --- plots ------------------------------------------------------------------------------------


def _figure(rows: int, cols: int, height: float = 3.2) -> Any:
    # Imported here: only `report` needs matplotlib (the `perf` extra), the other commands not.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, height * rows), squeeze=False)
    return fig, axes


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=96)
    plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img alt="plot" src="data:image/png;base64,{data}">'


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


Series = dict[str, list[tuple[int, float, float]]]


def throughput_series(minutes: Mapping[str, Mapping[int, Mapping[str, float]]],
                      rate: Rate) -> Series:
    """worker -> (minute of the job, prompts/s, output tokens/s) of this GPU, each minute over
    the seconds of it on the job's clock (`jobview.per_second`, the clock `status` reports)."""
    from fleetgen.jobview import per_second

    first = min((m for per in minutes.values() for m in per), default=0)
    out: Series = {}
    for worker, per in sorted(minutes.items()):
        span = {m: per.get(m, {"prompts": 0.0, "tokens": 0.0}) for m in range(first, max(per) + 1)}
        rates = per_second(span, rate.clock_start, rate.clock_end)
        out[worker] = [(m - first, r["prompts"], r["tokens"]) for m, r in sorted(rates.items())]
    return out


def throughput_plot(series: Series) -> str:
    fig, axes = _figure(1, 2)
    (prompts_ax, tokens_ax) = axes[0]
    if not series:
        # No prompt of the job finished yet.
        _empty(prompts_ax, "no per-GPU counts recorded")
        _empty(tokens_ax, "no per-GPU counts recorded")
    elif all(len(points) == 1 for points in series.values()):
        # A job within one minute is one point per GPU: a line of one dot says nothing.
        return _one_minute_bars(fig, prompts_ax, tokens_ax, series)
    for worker, points in series.items():
        x = [p[0] for p in points]
        prompts_ax.plot(x, [p[1] for p in points], marker="o", label=worker)
        tokens_ax.plot(x, [p[2] for p in points], marker="o", label=worker)
    from matplotlib.ticker import MaxNLocator

    for ax, what in ((prompts_ax, "prompts/s"), (tokens_ax, "output tokens/s")):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{what} per GPU")
        ax.set_xlabel("minute of the job")
        ax.set_ylabel(f"{what} of one GPU")
        if series:
            ax.legend(fontsize="small")
    return _png(fig)


def _one_minute_bars(fig: Any, prompts_ax: Any, tokens_ax: Any, series: Series) -> str:
    """One bar per GPU: its rate over the job's only minute."""
    names = list(series)
    for ax, index, what in ((prompts_ax, 1, "prompts/s"), (tokens_ax, 2, "output tokens/s")):
        ax.bar(names, [series[n][0][index] for n in names], color="#3b6fb6")
        ax.set_title(f"{what} per GPU (the job ran within one minute)")
        ax.set_ylabel(f"{what} of one GPU")
        ax.tick_params(axis="x", labelrotation=20)
    return _png(fig)


def capacity_plot(servers: Mapping[str, WorkerEntry]) -> str:
    fig, axes = _figure(1, 1, height=max(2.4, 0.5 * len(servers) + 1.2))
    ax = axes[0][0]
    if not servers:
        _empty(ax, "no worker registered")
        return _png(fig)
    names = sorted(servers)
    labels = [f"{n}\n{servers[n].server or ''}" for n in names]
    running = [float(servers[n].reading.running or servers[n].in_flight or 0) for n in names]
    capacity = [float(servers[n].effective_max_running_requests or 0) for n in names]
    ax.barh(labels, capacity, color="#d9e2ef", label="capacity")
    ax.barh(labels, running, color="#3b6fb6", height=0.5, label="running")
    ax.set_xlabel("requests")
    ax.legend(fontsize="small")
    return _png(fig)


def distributions_plot(answers: Answers) -> str:
    fig, axes = _figure(1, 2)
    (latency_ax, length_ax) = axes[0]
    for ax, values, what in ((latency_ax, answers.latency_s, "latency (s)"),
                             (length_ax, answers.output_tokens, "output tokens")):
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 5)), color="#3b6fb6")
            ax.set_ylabel("answers")
        else:
            _empty(ax, "no answer read")
        ax.set_title(what)
    return _png(fig)


def reasons_plot(finish_reasons: Mapping[str, int], errors: Mapping[str, int]) -> str:
    fig, axes = _figure(1, 2)
    for ax, counts, what, color in ((axes[0][0], finish_reasons, "finish reasons", "#3b6fb6"),
                                    (axes[0][1], errors, "failed prompts by code", "#c0392b")):
        if counts:
            names = sorted(counts, key=lambda k: -counts[k])
            ax.barh(names, [counts[n] for n in names], color=color)
            ax.invert_yaxis()
            ax.set_xlabel("prompts")
        else:
            _empty(ax, "none")
        ax.set_title(what)
    return _png(fig)


def _e(value: object) -> str:
    return html.escape(str(value))


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>fleetgen report: {job}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin: .5em 0; }}
th, td {{ text-align: left; padding: .2em .8em; border-bottom: 1px solid #ddd; }}
td.num {{ text-align: right; }}
p.note {{ color: #666; font-size: .9em; }}
img {{ max-width: 100%; }}
</style></head>
<body>
<h1>Job {job}</h1>
<p class=note>fleetgen report made {made} from the ledger (Redis) and the job's output.</p>
<table id="summary">
{summary}
</table>
{sections}
<section><h2>Workers</h2>{workers}</section>
<section><h2>Failures</h2>{failures}</section>
<section><h2>Quality canary</h2>{canary}</section>
</body></html>
"""
