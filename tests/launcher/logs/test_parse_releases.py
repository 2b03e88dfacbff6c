"""Every SGLang release from 0.5.1 to 0.5.23 is read: lines built from each release's own source.

The format strings below are copied from the released wheels (`pip download sglang==X
--no-deps`), file and release noted; the values are made up. They feed the same parser the
launcher's readiness and `explain` use. docs/reference/sglang.md#releases lists the eras.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from launcher.logs import CudaGraph, DecodeBatch, LogReport, Summary, parse_line

TS = "[2026-10-10 11:59:41]"
RELEASES = [
    "0.5.1", "0.5.2", "0.5.3", "0.5.4", "0.5.5", "0.5.6", "0.5.7", "0.5.8", "0.5.9", "0.5.10",
    "0.5.11", "0.5.12", "0.5.13", "0.5.14", "0.5.15", "0.5.16", "0.5.17", "0.5.18", "0.5.19",
    "0.5.20", "0.5.21", "0.5.22", "0.5.23",
]


def minor(release: str) -> int:
    return int(release.split(".")[2])


@dataclass(frozen=True)
class Values:
    running: int = 16
    queue: int = 112
    full_num_used: int = 51200
    full_token_usage: float = 0.07
    mamba_used: int = 16
    mamba_usage: float = 0.2
    accept_len: float = 2.9
    accept_rate: float = 0.73
    gen_throughput: float = 2300.0


def decode_line(release: str, v: Values, iteration: int = 4000) -> str:
    """A hybrid-Mamba speculative decode line as `release` prints it."""
    n = minor(release)
    if n < 4:
        # 0.5.1-0.5.3 scheduler_metrics_mixin.py: no Mamba variant; the plain KV form.
        usage = f"#token: {v.full_num_used}, token usage: {v.full_token_usage:.2f}, "
    else:
        # 0.5.4-0.5.9 scheduler_metrics_mixin.py (`elif self.is_hybrid_gdn`), 0.5.10-0.5.12
        # observability/scheduler_metrics_mixin.py, 0.5.13+ pool_stats_observer.py
        # get_decode_usage_msg_parts joined with ", " and a trailing ", ".
        usage = (f"#full token: {v.full_num_used}, full token usage: {v.full_token_usage:.2f}, "
                 f"mamba num: {v.mamba_used}, mamba usage: {v.mamba_usage:.2f}, ")
    if n < 4:
        msg = f"Decode batch. #running-req: {v.running}, {usage}"
        msg += f"accept len: {v.accept_len:.2f}, "
    else:
        iter_msg = f" [{iteration}]" if n == 4 else ""  # 0.5.4 always prints the iteration
        msg = f"Decode batch{iter_msg}, #running-req: {v.running}, {usage}"
        msg += f"accept len: {v.accept_len:.2f}, accept rate: {v.accept_rate:.2f}, "
    if n >= 16:
        msg += f"cap len: {v.accept_len:.2f}, "  # 0.5.16+ metrics_reporter.py
    if n >= 21:
        msg += "#host-receive-req: 0, "  # 0.5.21+
    if n >= 9:
        msg += "waiting-image-req: 0, "
    msg += (f"cuda graph: {True}, gen throughput (token/s): {v.gen_throughput:.2f}, "
            f"#queue-req: {v.queue}")
    if n < 9:
        msg += ", "  # 0.5.1-0.5.8 end on a trailing comma
    if n >= 10:
        msg += (", est. decode TFLOPS/s (per GPU): 1.23, est. read BW (GB/s per GPU): 456.70, "
                "est. write BW (GB/s per GPU): 8.90")
    if n >= 11:
        msg += f", fwd occupancy: {97.5:.2f}%"
    return f"{TS} {msg}"


def summary_line(release: str) -> str:
    """scheduler.py of every release 0.5.1-0.5.23: the summary is a line of its own."""
    return (f"{TS} max_total_num_tokens={412160}, chunked_prefill_size={8192}, "
            f"max_prefill_tokens={16384}, max_running_requests={16}, context_len={262144}, "
            f"available_gpu_mem={4.49:.2f} GB")


def graph_end_line(release: str) -> str:
    if minor(release) < 14:
        # 0.5.1 model_runner.py (and the cuda graph runner up to 0.5.13)
        return (f"{TS} Capture cuda graph end. Time elapsed: {9.12:.2f} s. "
                f"mem usage={0.61:.2f} GB. avail mem={4.49:.2f} GB.")
    # 0.5.14+ cuda_graph_setup.py capture_decode_graph
    return (f"{TS} Capture target verify CUDA graph end. bs={[1, 2, 4, 8, 16, 24, 32]}, "
            f"elapsed={9.12:.2f} s, mem usage={0.61:.2f} GB, avail mem={4.49:.2f} GB.")


@pytest.mark.parametrize("release", RELEASES)
def test_decode_line_of_each_release_gives_running_queue_and_mamba_figures(release: str) -> None:
    event = parse_line(decode_line(release, Values()))
    assert isinstance(event, DecodeBatch), release
    assert (event.running, event.queue, event.kv_usage) == (16, 112, 0.07)
    assert (event.accept_len, event.gen_throughput, event.cuda_graph) == (2.9, 2300.0, True)
    if minor(release) >= 4:
        assert (event.mamba_num, event.mamba_usage) == (16, 0.2)


@pytest.mark.parametrize("release", RELEASES)
def test_summary_and_graph_lines_of_each_release_make_a_server_ready_to_size(
    release: str,
) -> None:
    report = LogReport("gpu0.log")
    for line in (graph_end_line(release), summary_line(release)):
        event = parse_line(line)
        assert event is not None, line
        report.add(event)
    summary = report.run.summary
    assert summary is not None
    assert (summary.max_total_num_tokens, summary.max_running_requests) == (412160, 16)
    assert (summary.chunked_prefill_size, summary.max_prefill_tokens) == (8192, 16384)
    assert (summary.context_len, summary.available_gpu_mem_gb) == (262144, 4.49)


def test_summary_fields_appended_to_the_graph_end_line_are_read_as_the_summary() -> None:
    line = (f"{TS} Capture target decode CUDA graph end. bs=[1, 2, 4, 8, 16], elapsed=9.12 s, "
            "mem usage=0.61 GB, avail mem=4.49 GB. max_total_num_tokens=412160, "
            "chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=16, "
            "context_len=262144, available_gpu_mem=4.49 GB")
    event = parse_line(line)
    assert isinstance(event, CudaGraph)
    assert (event.max_bs, event.avail_gb, event.mem_gb) == (16, 4.49, 0.61)
    assert isinstance(event.summary, Summary)
    assert (event.summary.max_running_requests, event.summary.context_len) == (16, 262144)
    report = LogReport("gpu0.log")
    report.add(event)
    assert report.run.summary == event.summary and report.run.graph_bs == 16


def test_legacy_graph_end_line_with_appended_summary_keeps_both() -> None:
    line = (f"{TS} Capture cuda graph end. Time elapsed: 9.12 s. mem usage=0.61 GB. "
            "avail mem=4.49 GB. max_total_num_tokens=1000, max_running_requests=40, "
            "available_gpu_mem=4.00 GB")
    event = parse_line(line)
    assert isinstance(event, CudaGraph) and event.summary is not None
    assert (event.elapsed_s, event.avail_gb) == (9.12, 4.49)
    assert (event.summary.max_running_requests, event.summary.available_gpu_mem_gb) == (40, 4.0)
