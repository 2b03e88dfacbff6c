"""launcher.logs.parse_line: one SGLang log line in, one typed event (or None) out.

Lines are copied from the formats of docs/reference/sglang.md#logs, one per era.
"""

from __future__ import annotations

from datetime import datetime
from typing import TypeVar

import pytest

from launcher.logs import (
    CapWarning,
    CudaGraph,
    DecodeBatch,
    Draining,
    Fatal,
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

TS = "[2026-10-10 11:59:41]"
T = TypeVar("T")


def parsed(line: str, kind: type[T]) -> T:
    event = parse_line(line)
    assert isinstance(event, kind), f"{line!r} gave {event!r}"
    return event


def test_timestamp_comes_from_the_prefix_with_or_without_milliseconds() -> None:
    assert parsed(f"{TS} The server is fired up and ready to roll!", Ready).ts == datetime(
        2026, 10, 10, 11, 59, 41
    )
    with_ms = parsed("[2026-10-10 11:59:41.250] The server is fired up and ready to roll!", Ready)
    assert with_ms.ts == datetime(2026, 10, 10, 11, 59, 41, 250000)
    comma_ms = parsed("[2026-10-10 11:59:41,5] The server is fired up and ready to roll!", Ready)
    assert comma_ms.ts == datetime(2026, 10, 10, 11, 59, 41, 500000)


def test_rank_prefixes_are_kept_and_do_not_hide_the_message() -> None:
    line = ("[2025-03-01 10:00:00 DP1 PP0 TP3 EP3] Decode batch. #running-req: 3, #token: 100, "
            "token usage: 0.01, gen throughput (token/s): 50.00, #queue-req: 0")
    event = parsed(line, DecodeBatch)
    assert event.ranks == ("DP1", "PP0", "TP3", "EP3")
    assert event.running == 3


DECODE_ERAS = {
    "2025-06 period": "Decode batch. #running-req: 7, #token: 900, token usage: 0.05, "
    "cuda graph: True, gen throughput (token/s): 321.50, #queue-req: 2",
    "2025-07 period and trailing comma": "Decode batch. #running-req: 7, #token: 900, "
    "token usage: 0.05, cuda graph: True, gen throughput (token/s): 321.50, #queue-req: 2, ",
    "2025-10 comma and trailing comma": "Decode batch, #running-req: 7, #token: 900, "
    "token usage: 0.05, cuda graph: True, gen throughput (token/s): 321.50, #queue-req: 2, ",
    "2026-01 and later": "Decode batch, #running-req: 7, #token: 900, token usage: 0.05, "
    "cuda graph: True, gen throughput (token/s): 321.50, #queue-req: 2",
    "fields in another order": "Decode batch, #queue-req: 2, gen throughput (token/s): 321.50, "
    "cuda graph: True, token usage: 0.05, #token: 900, #running-req: 7",
}


@pytest.mark.parametrize("message", DECODE_ERAS.values(), ids=DECODE_ERAS.keys())
def test_decode_line_of_every_era_gives_the_same_figures(message: str) -> None:
    event = parsed(f"{TS} {message}", DecodeBatch)
    assert (event.running, event.queue, event.tokens) == (7, 2, 900)
    assert (event.token_usage, event.kv_usage, event.gen_throughput) == (0.05, 0.05, 321.5)
    assert event.cuda_graph is True
    assert event.accept_len is None and event.mamba_usage is None


def test_decode_line_records_its_separator_and_trailing_comma_for_the_era_guess() -> None:
    old = parsed(f"{TS} {DECODE_ERAS['2025-07 period and trailing comma']}", DecodeBatch)
    new = parsed(f"{TS} {DECODE_ERAS['2026-01 and later']}", DecodeBatch)
    assert (old.sep, old.trailing_comma) == (".", True)
    assert (new.sep, new.trailing_comma) == (",", False)


def test_hybrid_mamba_decode_line_reports_full_token_and_mamba_usage() -> None:
    line = (f"{TS} Decode batch, #running-req: 16, #full token: 51200, full token usage: 0.12, "
            "mamba num: 80, mamba usage: 1.00, cuda graph: True, "
            "gen throughput (token/s): 1234.56, #queue-req: 112")
    event = parsed(line, DecodeBatch)
    assert (event.running, event.queue, event.tokens, event.mamba_num) == (16, 112, 51200, 80)
    assert (event.token_usage, event.full_token_usage, event.kv_usage) == (None, 0.12, 0.12)
    assert event.mamba_usage == 1.0


def test_hybrid_swa_and_mamba_decode_line_reports_every_pool() -> None:
    line = (f"{TS} Decode batch, #running-req: 4, #full token: 100, full token usage: 0.01, "
            "#swa token: 50, swa token usage: 0.02, mamba num: 12, mamba usage: 0.15, "
            "cuda graph: False, gen throughput (token/s): 10.00, #queue-req: 0")
    event = parsed(line, DecodeBatch)
    assert (event.full_token_usage, event.swa_token_usage, event.mamba_usage) == (0.01, 0.02, 0.15)
    assert event.cuda_graph is False


def test_speculative_decode_line_reports_accept_length_and_rate() -> None:
    line = (f"{TS} Decode batch, #running-req: 48, #token: 9000, token usage: 0.30, "
            "accept len: 3.12, accept rate: 0.71, cuda graph: True, "
            "gen throughput (token/s): 2500.00, #queue-req: 5")
    event = parsed(line, DecodeBatch)
    assert (event.accept_len, event.accept_rate) == (3.12, 0.71)


def test_iteration_label_and_cpu_graph_label_are_understood() -> None:
    line = (f"{TS} Decode batch [1234], #running-req: 2, #token: 10, token usage: 0.00, "
            "cpu graph: False, gen throughput (token/s): 1.50, #queue-req: 0")
    event = parsed(line, DecodeBatch)
    assert (event.iteration, event.cuda_graph, event.running) == (1234, False, 2)


def test_a_field_that_is_not_a_number_becomes_none_instead_of_failing() -> None:
    line = f"{TS} Decode batch, #running-req: many, #token: 10, token usage: n/a, #queue-req: 0"
    event = parsed(line, DecodeBatch)
    assert (event.running, event.token_usage, event.queue) == (None, None, 0)


PREFILL_ERAS = {
    "early 2025 with cache hit rate": "Prefill batch. #new-seq: 2, #new-token: 700, "
    "#cached-token: 64, cache hit rate: 12.33%, token usage: 0.04, #running-req: 5, "
    "#queue-req: 9",
    "2025-07 trailing comma": "Prefill batch. #new-seq: 2, #new-token: 700, #cached-token: 64, "
    "token usage: 0.04, #running-req: 5, #queue-req: 9, ",
    "2026-01 input throughput first": "Prefill batch, #new-seq: 2, #new-token: 700, "
    "#cached-token: 64, token usage: 0.04, #running-req: 5, #queue-req: 9, "
    "input throughput (token/s): 4000.00, cuda graph: False",
    "2026-04 pending-token": "Prefill batch, #new-seq: 2, #new-token: 700, #cached-token: 64, "
    "token usage: 0.04, #running-req: 5, #queue-req: 9, #pending-token: 0, cuda graph: False, "
    "input throughput (token/s): 4000.00",
}


@pytest.mark.parametrize("message", PREFILL_ERAS.values(), ids=PREFILL_ERAS.keys())
def test_prefill_line_of_every_era_gives_the_same_figures(message: str) -> None:
    event = parsed(f"{TS} {message}", PrefillBatch)
    assert (event.new_seq, event.new_token, event.cached_token) == (2, 700, 64)
    assert (event.running, event.queue, event.token_usage) == (5, 9, 0.04)


def test_prefill_line_keeps_every_field_and_the_new_ones() -> None:
    event = parsed(f"{TS} {PREFILL_ERAS['2026-04 pending-token']}", PrefillBatch)
    assert (event.pending_token, event.input_throughput, event.cuda_graph) == (0, 4000.0, False)
    assert event.fields["#queue-req"] == "9"


def test_hybrid_mamba_prefill_line_reports_mamba_usage() -> None:
    line = (f"{TS} Prefill batch [7], #new-seq: 1, #new-token: 7, #cached-token: 0, "
            "full token usage: 0.00, mamba usage: 0.01, #running-req: 0, #queue-req: 0, "
            "#pending-token: 0, cuda graph: False, input throughput (token/s): 12.34")
    event = parsed(line, PrefillBatch)
    assert (event.full_token_usage, event.mamba_usage, event.iteration) == (0.0, 0.01, 7)


def test_load_weight_begin_reports_free_memory() -> None:
    assert parsed(f"{TS} Load weight begin. avail mem=78.50 GB", WeightsLoading).avail_gb == 78.5


@pytest.mark.parametrize(
    ("message", "elapsed", "dtype", "quant"),
    [
        (("Load weight end. type=Qwen3ForCausalLM, dtype=torch.bfloat16, avail mem=62.10 GB, "
         "mem usage=15.30 GB."), None, "torch.bfloat16", None),
        (("Load weight end. elapsed=12.34 s, type=Qwen3ForCausalLM, dtype=torch.bfloat16, "
         "avail mem=62.10 GB, mem usage=15.30 GB."), 12.34, "torch.bfloat16", None),
        (("Load weight end. elapsed=12.34 s, type=Qwen3ForCausalLM, quant=fp8, fmt=e4m3, "
         "avail mem=62.10 GB, mem usage=15.30 GB."), 12.34, None, "fp8"),
        (("Load weight end. elapsed=12.34 s, type=Qwen3ForCausalLM, avail mem=62.10 GB, "
         "mem usage=15.30 GB."), 12.34, None, None),
    ],
    ids=["2026-01 dtype", "2026-02 elapsed and dtype", "2026-03 quant", "[R] plain"],
)
def test_load_weight_end_of_every_era_reports_class_and_memory(
    message: str, elapsed: float | None, dtype: str | None, quant: str | None
) -> None:
    event = parsed(f"{TS} {message}", WeightsLoaded)
    assert (event.model_class, event.avail_gb, event.mem_usage_gb) == (
        "Qwen3ForCausalLM", 62.1, 15.3)
    assert (event.elapsed_s, event.dtype, event.quant, event.is_draft) == (
        elapsed, dtype, quant, False)


def test_mtp_draft_model_weights_are_marked_as_draft() -> None:
    line = (f"{TS} Load weight end. elapsed=1.20 s, type=Qwen3_5ForCausalLMMTP, "
            "avail mem=10.00 GB, mem usage=2.10 GB.")
    assert parsed(line, WeightsLoaded).is_draft is True


def test_kv_cache_line_with_dtype_sums_k_and_v() -> None:
    line = (f"{TS} KV Cache is allocated. dtype: torch.bfloat16, #tokens: 412160, "
            "K size: 2.36 GB, V size: 2.36 GB")
    event = parsed(line, KVCache)
    assert (event.tokens, event.dtype, event.k_gb, event.v_gb, event.kv_gb) == (
        412160, "torch.bfloat16", 2.36, 2.36, 4.72)


def test_kv_cache_line_before_dtype_was_logged_and_mla_single_buffer() -> None:
    event = parsed(f"{TS} KV Cache is allocated. #tokens: 1000, KV size: 8.00 GB", KVCache)
    assert (event.tokens, event.dtype, event.k_gb, event.kv_gb) == (1000, None, None, 8.0)


def test_kv_cache_va_upper_bound_wording_is_recognised() -> None:
    line = f"{TS} KV Cache VA upper bound. dtype: torch.float8_e4m3fn, #tokens: 9, KV size: 1.00 GB"
    event = parsed(line, KVCache)
    assert (event.upper_bound, event.dtype, event.tokens) == (True, "torch.float8_e4m3fn", 9)


def test_mamba_cache_line_reports_slots_and_state_sizes() -> None:
    line = (f"{TS} Mamba Cache is allocated. max_mamba_cache_size: 80, conv_state size: 0.12GB, "
            "ssm_state size: 3.45GB ")
    event = parsed(line, MambaCache)
    assert (event.max_mamba_cache_size, event.conv_gb, event.ssm_gb) == (80, 0.12, 3.45)
    assert event.intermediate_ssm_gb is None


def test_mamba_cache_line_with_speculative_buffers_reports_them_too() -> None:
    line = (f"{TS} Mamba Cache is allocated. max_mamba_cache_size: 40, conv_state size: 0.06GB, "
            "ssm_state size: 1.72GB  intermediate_ssm_state_cache size: 1.40GB "
            "intermediate_conv_window_cache size: 0.05GB ")
    event = parsed(line, MambaCache)
    assert (event.ssm_gb, event.intermediate_ssm_gb, event.intermediate_conv_gb) == (
        1.72, 1.40, 0.05)


def test_new_cuda_graph_end_line_reports_batch_sizes_time_and_memory() -> None:
    line = (f"{TS} Capture target decode CUDA graph end. bs=[1, 2, 4, 8, 16, 24, 32], "
            "elapsed=9.12 s, mem usage=0.61 GB, avail mem=4.49 GB.")
    event = parsed(line, CudaGraph)
    assert (event.max_bs, event.bs_list[:3], event.elapsed_s, event.mem_gb) == (
        32, (1, 2, 4), 9.12, 0.61)
    assert (event.role, event.stage, event.done, event.legacy) == ("target", "decode", True, False)


def test_new_cuda_graph_begin_line_and_draft_verify_graph() -> None:
    begin = parsed(f"{TS} Capture target decode CUDA graph begin. backend=full, "
                   "num_tokens_per_req=1, avail mem=5.10 GB", CudaGraph)
    draft = parsed(f"{TS} Capture draft verify CPU graph end. bs=[1, 2], elapsed=1.00 s, "
                   "mem usage=0.10 GB, avail mem=4.00 GB.", CudaGraph)
    assert (begin.done, begin.max_bs, begin.avail_gb) == (False, None, 5.1)
    assert (draft.role, draft.stage, draft.max_bs) == ("draft", "verify", 2)


def test_old_cuda_graph_lines_report_batch_sizes_and_time() -> None:
    begin = parsed(f"{TS} Capture cuda graph begin. This can take up to several minutes. "
                   "avail mem=70.00 GB", CudaGraph)
    sizes = parsed(f"{TS} Capture cuda graph bs [1, 2, 4, 8, 160]", CudaGraph)
    end = parsed(f"{TS} Capture cuda graph end. Time elapsed: 12.34 s. mem usage=1.23 GB. "
                 "avail mem=10.00 GB.", CudaGraph)
    assert (begin.legacy, begin.done, begin.avail_gb) == (True, False, 70.0)
    assert (sizes.max_bs, sizes.legacy) == (160, True)
    assert (end.done, end.elapsed_s, end.mem_gb) == (True, 12.34, 1.23)


def test_intermediate_builds_that_list_batch_sizes_in_the_begin_line_are_read() -> None:
    line = f"{TS} Capture cuda graph begin. bs=[1, 2, 4, 8, 256], avail mem=20.00 GB"
    assert parsed(line, CudaGraph).max_bs == 256


def test_summary_line_reports_the_effective_max_running_requests() -> None:
    line = (f"{TS} max_total_num_tokens=412160, chunked_prefill_size=8192, "
            "max_prefill_tokens=16384, max_running_requests=16, context_len=262144, "
            "available_gpu_mem=4.49 GB")
    event = parsed(line, Summary)
    assert (event.max_total_num_tokens, event.chunked_prefill_size, event.max_prefill_tokens) == (
        412160, 8192, 16384)
    assert (event.max_running_requests, event.context_len, event.available_gpu_mem_gb) == (
        16, 262144, 4.49)


def test_short_inclusionai_summary_line_leaves_missing_keys_none() -> None:
    line = (f"{TS} max_total_num_tokens=800000, chunked_prefill_size=16384, context_len=131072, "
            "available_gpu_mem=12.00 GB")
    event = parsed(line, Summary)
    assert (event.max_total_num_tokens, event.context_len) == (800000, 131072)
    assert (event.max_running_requests, event.max_prefill_tokens) == (None, None)


def test_cpu_summary_line_reports_available_cpu_memory() -> None:
    line = f"{TS} max_total_num_tokens=100, max_running_requests=4, available_cpu_mem=3.00 GB"
    assert parsed(line, Summary).available_gpu_mem_gb == 3.0


def test_server_args_dict_of_recent_releases_is_read() -> None:
    line = (f"{TS} server_args={{'model_path': 'Qwen/Qwen3.5-35B-A3B', 'max_running_requests': "
            "128, 'mamba_radix_cache_strategy': 'auto', 'disable_radix_cache': False, "
            "'speculative_algorithm': None, 'json_model_override_args': '{}'}")
    args = parsed(line, ServerArgs).args
    assert args["model_path"] == "Qwen/Qwen3.5-35B-A3B"
    assert (args["max_running_requests"], args["disable_radix_cache"]) == (128, False)
    assert args["speculative_algorithm"] is None


def test_server_args_dataclass_repr_of_older_releases_is_read() -> None:
    line = (f"{TS} server_args=ServerArgs(model_path='Qwen/Qwen3-8B', tp_size=1, "
            "max_running_requests=None, dtype=torch.bfloat16)")
    args = parsed(line, ServerArgs).args
    assert (args["model_path"], args["tp_size"], args["max_running_requests"]) == (
        "Qwen/Qwen3-8B", 1, None)
    assert args["dtype"] == "torch.bfloat16"


def test_server_args_with_an_unparseable_repr_still_give_the_simple_values() -> None:
    line = (f"{TS} server_args={{'model_path': 'x', 'load_format': <LoadFormat.AUTO: 'auto'>, "
            "'max_running_requests': 64}")
    args = parsed(line, ServerArgs).args
    assert (args["model_path"], args["max_running_requests"]) == ("x", 64)


def test_mamba_cap_warning_names_the_slots_and_ratio() -> None:
    line = (f"{TS} max_running_requests is capped to 16 by the mamba state cache "
            "(max_mamba_cache_size=80, 5 state slots per request). To raise it: increase "
            "--mamba-full-memory-ratio or --max-mamba-cache-size, or halve the state size with "
            "--mamba-ssm-dtype bfloat16.")
    assert parsed(line, CapWarning) == CapWarning(
        "mamba", None, 16, 80, 5, ts=datetime(2026, 10, 10, 11, 59, 41))


def test_kv_cap_warning_names_requested_and_effective() -> None:
    line = (f"{TS} max_running_requests was reduced from the requested 128 to 16 (per dp worker) "
            "due to the available KV cache capacity.")
    event = parsed(line, CapWarning)
    assert (event.kind, event.requested, event.effective) == ("kv", 128, 16)


def test_speculative_default_warning_sets_the_request_to_48() -> None:
    line = (f"{TS} Max running requests is reset to 48 for speculative decoding. You can "
            "override this by explicitly setting --max-running-requests.")
    event = parsed(line, CapWarning)
    assert (event.kind, event.requested, event.effective) == ("spec", 48, None)


FATALS = {
    "kv_no_memory": "RuntimeError: Not enough memory. Please try to increase "
    "--mem-fraction-static. Current value: mem_fraction_static=0.80",
    "weights_no_memory": "ValueError: Loaded weights leave no GPU memory for the KV cache under "
    "--mem-fraction-static=0.8. Raise --mem-fraction-static above 0.912 (minimum viable = "
    "1 - available/pre = 0.9120).",
    "zero_requests": "AssertionError: max_running_request is zero",
    "pool_too_small": "AssertionError: Memory pool size is too small",
    "mamba_no_memory": "RuntimeError: Not enough GPU memory for hybrid (mamba/linear-attention) "
    "state cache. Computed max_mamba_cache_size=0 (total_rest_memory=0.50 GB, "
    "mamba_cache_per_req=44.00 MB).",
    "mamba_too_small": "RuntimeError: Hybrid (mamba/linear-attention) state cache is too small "
    "to serve any requests. max_mamba_cache_size=4, mamba_ratio=5, resulting max_num_reqs=0.",
    "cuda_graph": "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate "
    "20.00 MiB. GPU 0 has a total capacity of 79.11 GiB",
    "cuda_oom": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    "watchdog": "Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)",
    "scheduler_exception": "Scheduler hit an exception: Traceback (most recent call last):",
    "scheduler_died": "RuntimeError: Rank 0 scheduler died during initialization (exit code: -9). "
    "If exit code is -9 (SIGKILL), a common cause is the OS OOM killer.",
    "warmup_failed": "Initialization failed. warmup error: Traceback (most recent call last):",
    "init_failed": "RuntimeError: Initialization failed. Please see the error messages above.",
    "health_check": "Health check failed. Server couldn't get a response from detokenizer for "
    "last 20 seconds. tic start time: 12:00:01. last_heartbeat time: 11:59:40",
    "port_in_use": "ERROR:    [Errno 98] error while attempting to bind on address "
    "('127.0.0.1', 30000): address already in use",
    "sigquit": "Received sigquit from a child process. It usually means the child failed.",
}


@pytest.mark.parametrize(("kind", "message"), FATALS.items(), ids=FATALS.keys())
def test_fatal_pattern_is_recognised_with_and_without_a_prefix(kind: str, message: str) -> None:
    bare = parsed(message, Fatal)
    prefixed = parsed(f"[2026-10-10 12:00:00 TP0] {message}", Fatal)
    assert (bare.kind, bare.ts, bare.message) == (kind, None, message)
    assert (prefixed.kind, prefixed.ts) == (kind, datetime(2026, 10, 10, 12, 0))


def test_other_fatal_wordings_are_recognised() -> None:
    assert parsed("Watchdog timeout (self.watchdog_timeout=300)", Fatal).kind == "watchdog"
    serving_sigquit = "SIGQUIT received. signum=3, frame=None. It usually means one child failed."
    assert parsed(f"{TS} {serving_sigquit}", Fatal).kind == "sigquit"
    assert parsed("Exception: Capture CUDA graph failed: boom", Fatal).kind == "cuda_graph"
    assert parsed("torch.cuda.OutOfMemoryError: CUDA out of memory.", Fatal).kind == "cuda_oom"


def test_scheduler_died_line_carries_the_exit_code() -> None:
    assert parsed(FATALS["scheduler_died"], Fatal).exit_code == -9


def test_a_soft_watchdog_is_not_fatal() -> None:
    assert parse_line(f"{TS} Scheduler watchdog timeout (self.watchdog_timeout=60, "
                      "self.soft=True)") is None


def test_sigterm_and_graceful_exit_lines_mean_draining() -> None:
    sigterm = parsed(f"{TS} SIGTERM received. signum=15 frame=None Draining requests and "
                     "shutting down...", Draining)
    remaining = parsed(f"{TS} Gracefully exiting... Remaining number of requests 3", Draining)
    assert (sigterm.remaining, remaining.remaining) == (None, 3)


@pytest.mark.parametrize(
    "line",
    [
        ('[2026-04-05 20:02:51] INFO:     127.0.0.1:40052 - "POST /v1/chat/completions HTTP/1.1" '
        "200 OK"),
        "INFO:     Started server process [4242]",
        ("[2026-04-05 20:02:51] INFO:     Uvicorn running on http://127.0.0.1:30000 "
        "(Press CTRL+C to quit)"),
        "Capturing batches (bs=128 avail_mem=5.05 GB): 100%|##########| 20/20 [00:09<00:00]",
        "Loading safetensors checkpoint shards: 100% Completed | 14/14 [00:12<00:00,  1.10it/s]",
        ("/venv/lib/python3.11/site-packages/sglang/launch_server.py:12: UserWarning: 'python -m "
        "sglang.launch_server' is still supported, but 'sglang serve' is the recommended "
        "entrypoint."),
        f"{TS} Capture cuda graph num tokens [8, 16, 32]",
        f"{TS} Memory pool end. avail mem=5.20 GB",
        (f"{TS} Using default chat sampling params from model generation config: "
        "{'temperature': 0.6}"),
        f"{TS} ",
        "",
    ],
)
def test_lines_the_launcher_does_not_need_give_none(line: str) -> None:
    assert parse_line(line) is None


def test_colour_codes_and_carriage_returns_are_ignored() -> None:
    line = "\x1b[32m[2026-10-10 11:59:41]\x1b[0m The server is fired up and ready to roll!\r\n"
    assert isinstance(parse_line(line), Ready)
