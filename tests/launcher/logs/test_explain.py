"""`python -m launcher explain`: logs in, a report of what the server did and why, out.

Also covers the capacity reading in launcher.logs, the "why" of the effective
max_running_requests, both from a log and from a `/server_info` body.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleetgen.servers import parse_server_info
from launcher.logs import CapacityFacts, capacity_from_server_info, read_capacity
from launcher.logs import explain as main

ROOT = Path(__file__).resolve().parents[3]
MAMBA_REASON = ("asked 128, got 16: 80 Mamba slots / 5 per request (extra_buffer); "
                "raise --max-mamba-cache-size or --mamba-full-memory-ratio")

HYBRID_START = """\
[2026-10-10 11:58:00] server_args={'model_path': 'Qwen/Qwen3.5-35B-A3B', 'max_running_requests': 128, 'mamba_radix_cache_strategy': 'auto', 'disable_radix_cache': False, 'speculative_algorithm': None}
[2026-10-10 11:58:05] Load weight begin. avail mem=78.50 GB
[2026-10-10 11:58:18] Load weight end. elapsed=12.34 s, type=Qwen3_5MoeForConditionalGeneration, avail mem=12.10 GB, mem usage=66.40 GB.
[2026-10-10 11:58:19] Mamba Cache is allocated. max_mamba_cache_size: 80, conv_state size: 0.12GB, ssm_state size: 3.45GB 
[2026-10-10 11:58:19] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 412160, K size: 2.36 GB, V size: 2.36 GB
[2026-10-10 11:58:29] Capture target decode CUDA graph end. bs=[1, 2, 4, 8, 16, 32, 64, 128], elapsed=9.12 s, mem usage=0.61 GB, avail mem=4.49 GB.
"""
MAMBA_WARNING = "[2026-10-10 11:58:30] max_running_requests is capped to 16 by the mamba state cache (max_mamba_cache_size=80, 5 state slots per request). To raise it: increase --mamba-full-memory-ratio or --max-mamba-cache-size, or halve the state size with --mamba-ssm-dtype bfloat16.\n"
HYBRID_SERVING = """\
[2026-10-10 11:58:30] max_total_num_tokens=412160, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=16, context_len=262144, available_gpu_mem=4.49 GB
[2026-10-10 11:58:31] INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)
[2026-10-10 11:58:32] Prefill batch, #new-seq: 1, #new-token: 7, #cached-token: 0, full token usage: 0.00, mamba usage: 0.01, #running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 0.00
[2026-10-10 11:58:33] The server is fired up and ready to roll!
[2026-10-10 12:01:10] Decode batch, #running-req: 16, #full token: 51200, full token usage: 0.12, mamba num: 80, mamba usage: 1.00, cuda graph: True, gen throughput (token/s): 1234.56, #queue-req: 112
"""

# Before 2026-06 the cap was silent: no warning, only max_running_requests=16 in the summary.
SILENT_HYBRID = """\
[2026-03-02 09:00:00] server_args=ServerArgs(model_path='Qwen/Qwen3-Next-80B-A3B-Instruct', max_running_requests=128, mamba_scheduler_strategy='auto', disable_radix_cache=False)
[2026-03-02 09:00:40] Load weight end. elapsed=40.00 s, type=Qwen3NextForCausalLM, avail mem=30.00 GB, mem usage=48.00 GB.
[2026-03-02 09:00:41] Mamba Cache is allocated. max_mamba_cache_size: 80, conv_state size: 0.20GB, ssm_state size: 5.00GB 
[2026-03-02 09:00:41] KV Cache is allocated. #tokens: 900000, K size: 10.00 GB, V size: 10.00 GB
[2026-03-02 09:00:42] Capture cuda graph begin. This can take up to several minutes. avail mem=4.00 GB
[2026-03-02 09:00:42] Capture cuda graph bs [1, 2, 4, 8, 16, 24, 32, 64, 128]
Capturing batches (bs=1 avail_mem=3.90 GB): 100%|##########| 9/9 [00:05<00:00]\r
[2026-03-02 09:00:47] Capture cuda graph end. Time elapsed: 5.00 s. mem usage=0.40 GB. avail mem=3.50 GB.
[2026-03-02 09:00:48] max_total_num_tokens=900000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=16, context_len=262144, available_gpu_mem=3.50 GB
[2026-03-02 09:00:52] The server is fired up and ready to roll!
[2026-03-02 09:05:00] Decode batch, #running-req: 16, #full token: 4096, full token usage: 0.00, mamba num: 48, mamba usage: 0.60, cuda graph: True, gen throughput (token/s): 800.00, #queue-req: 40
"""

DENSE = """\
[2026-02-01 08:00:00 TP0] server_args=ServerArgs(model_path='Qwen/Qwen3-8B', tp_size=2, max_running_requests=256, context_length=None)
[2026-02-01 08:00:10 TP0] Load weight end. elapsed=8.50 s, type=Qwen3ForCausalLM, dtype=torch.bfloat16, avail mem=60.00 GB, mem usage=8.20 GB.
[2026-02-01 08:00:11 TP0] KV Cache is allocated. #tokens: 700000, K size: 24.00 GB, V size: 24.00 GB
[2026-02-01 08:00:20 TP0] max_total_num_tokens=700000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=256, context_len=40960, available_gpu_mem=6.10 GB
[2026-02-01 08:00:25 TP0] The server is fired up and ready to roll!
[2026-02-01 08:10:00 TP0] Decode batch, #running-req: 256, #token: 300000, token usage: 0.43, cuda graph: True, gen throughput (token/s): 5100.00, #queue-req: 9000
[2026-02-01 08:10:05 TP0] Decode batch, #running-req: 200, #token: 250000, token usage: 0.36, cuda graph: True, gen throughput (token/s): 4800.50, #queue-req: 8800
"""

STARTUP_OOM = """\
[2026-10-10 11:58:00] server_args={'model_path': 'Qwen/Qwen3-235B-A22B', 'max_running_requests': None}
[2026-10-10 11:58:50] Load weight end. elapsed=50.00 s, type=Qwen3MoeForCausalLM, avail mem=1.20 GB, mem usage=77.30 GB.
[2026-10-10 11:58:51] Scheduler hit an exception: Traceback (most recent call last):
  File "/sglang/srt/managers/scheduler.py", line 6372, in run_scheduler_process
    raise RuntimeError(
RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: mem_fraction_static=0.80

[2026-10-10 11:58:51] Received sigquit from a child process. It usually means the child failed.
"""

CRASH_SERVING = """\
[2026-10-10 12:00:00] The server is fired up and ready to roll!
[2026-10-10 12:05:00] Decode batch, #running-req: 64, #token: 90000, token usage: 0.80, cuda graph: True, gen throughput (token/s): 2000.00, #queue-req: 7
[2026-10-10 12:05:09] Scheduler hit an exception: Traceback (most recent call last):
  File "/sglang/srt/managers/scheduler.py", line 6372, in run_scheduler_process
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.2 GiB is free.
[2026-10-10 12:05:10] SIGQUIT received. signum=3, frame=None. It usually means one child failed.
[2026-10-10 12:05:10] kill_process_tree called: parent_pid=100, include_parent=True, pid=100
"""

TOP_KEYS = {
    "file", "state", "era", "ready", "ready_at", "startup_s", "model_path", "model_class",
    "draft_model_class", "speculative_algorithm", "weights_gb", "weights_load_s", "kv_tokens",
    "kv_dtype", "kv_cache_gb", "mamba_slots", "mamba_cache_gb", "max_total_num_tokens",
    "context_len", "chunked_prefill_size", "max_prefill_tokens", "cuda_graph_max_bs",
    "available_gpu_mem_gb", "max_running_requests", "last_decode", "peak_running", "fatal",
    "starts", "lines", "recognised_lines",
}


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str

    def json(self) -> dict[str, object]:
        data = json.loads(self.out)
        assert isinstance(data, dict)
        return data


Explain = Callable[..., Run]


@pytest.fixture
def explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Explain:
    """Write `log` to gpu0.log and run `explain` on it with `flags`."""

    def run(log: str, *flags: str) -> Run:
        path = tmp_path / "gpu0.log"
        path.write_text(log, encoding="utf-8")
        code = main([str(path), *flags])
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run


def part(data: dict[str, object], key: str) -> dict[str, object]:
    """A nested object of the report, asserting it is one."""
    value = data[key]
    assert isinstance(value, dict), f"{key} is {value!r}"
    return value


def cap_of(run: Run) -> dict[str, object]:
    return part(run.json(), "max_running_requests")


def test_dense_server_reports_its_pools_readiness_and_that_the_request_binds(
    explain: Explain,
) -> None:
    run = explain(DENSE, "--json")
    data = run.json()
    assert run.code == 0
    assert (data["state"], data["ready"], data["ready_at"], data["startup_s"]) == (
        "ready", True, "2026-02-01 08:00:25", 25.0)
    assert (data["model_class"], data["weights_gb"], data["kv_tokens"], data["kv_cache_gb"]) == (
        "Qwen3ForCausalLM", 8.2, 700000, 48.0)
    assert (data["context_len"], data["chunked_prefill_size"], data["mamba_slots"]) == (
        40960, 8192, None)
    assert cap_of(run) == {
        "requested": 256, "effective": 256, "binding": "request", "ratio": None,
        "reason": "asked 256, got 256: the request binds (KV pool allows 350000)"}


def test_dense_server_reports_the_latest_decode_batch_and_the_peak(explain: Explain) -> None:
    data = explain(DENSE, "--json").json()
    assert data["last_decode"] == {
        "at": "2026-02-01 08:10:05", "running": 200, "queue": 8800, "token_usage": 0.36,
        "mamba_num": None, "mamba_usage": None, "accept_len": None, "accept_rate": None,
        "gen_throughput": 4800.5, "cuda_graph": True,
    }
    assert data["peak_running"] == 256


def test_dense_text_report_is_aligned_and_names_the_binding_limit(explain: Explain) -> None:
    run = explain(DENSE)
    lines = run.out.splitlines()
    assert run.code == 0
    assert all(line[21] == " " and line[22] != " " for line in lines), run.out
    assert "max running requests  256 (asked 256), bound by request" in lines
    assert "last decode           2026-02-01 08:10:05: running 200, queue 8800, token usage " \
        "0.36, gen throughput 4800.5, cuda graph True" in lines
    assert lines[-1] == "fatal                 none"


def test_the_last_decode_shows_the_mamba_slots_held_beside_their_usage(explain: Explain) -> None:
    # Before 2026-06 the cap was silent; `mamba num: 48` is what the 16 running requests held.
    run = explain(SILENT_HYBRID)
    assert "last decode           2026-03-02 09:05:00: running 16, queue 40, token usage 0.0, " \
        "mamba 48 slots (usage 0.6), gen throughput 800.0, cuda graph True" in run.out.splitlines()
    decode = part(explain(SILENT_HYBRID, "--json").json(), "last_decode")
    assert (decode["mamba_num"], decode["mamba_usage"]) == (48, 0.6)


def test_hybrid_capped_by_the_mamba_pool_says_so_from_the_warning(explain: Explain) -> None:
    run = explain(HYBRID_START + MAMBA_WARNING + HYBRID_SERVING, "--json")
    data = run.json()
    assert cap_of(run) == {"requested": 128, "effective": 16, "binding": "mamba", "ratio": 5,
                           "reason": MAMBA_REASON}
    assert (data["mamba_slots"], data["mamba_cache_gb"], data["cuda_graph_max_bs"]) == (
        80, 3.57, 128)
    assert data["era"] == "2026-07 or later"


def test_hybrid_capped_without_the_warning_derives_the_reason_from_slots_and_summary(
    explain: Explain,
) -> None:
    run = explain(HYBRID_START + HYBRID_SERVING, "--json")
    assert cap_of(run)["reason"] == MAMBA_REASON
    assert cap_of(run)["binding"] == "mamba"


def test_silent_cap_era_log_is_explained_and_dated(explain: Explain) -> None:
    run = explain(SILENT_HYBRID, "--json")
    data = run.json()
    assert cap_of(run)["reason"] == MAMBA_REASON
    assert (data["era"], data["cuda_graph_max_bs"], data["kv_dtype"]) == (
        "2026-02 to 2026-05", 128, None)
    assert (data["model_path"], data["state"]) == ("Qwen/Qwen3-Next-80B-A3B-Instruct", "ready")


def test_misleading_kv_warning_of_mid_2026_is_still_read_as_a_mamba_cap(explain: Explain) -> None:
    kv_warning = ("[2026-07-20 10:00:00] max_running_requests was reduced from the requested 128 "
                  "to 16 (per dp worker) due to the available KV cache capacity.\n")
    run = explain(HYBRID_START + kv_warning + HYBRID_SERVING, "--json")
    assert cap_of(run)["binding"] == "mamba"


def test_short_summary_line_falls_back_on_the_cap_warning(explain: Explain) -> None:
    short = ("[2026-10-10 11:58:30] max_total_num_tokens=412160, chunked_prefill_size=8192, "
             "context_len=262144, available_gpu_mem=4.49 GB\n")
    run = explain(HYBRID_START + MAMBA_WARNING + short, "--json")
    assert (cap_of(run)["effective"], cap_of(run)["reason"]) == (16, MAMBA_REASON)
    assert run.json()["max_prefill_tokens"] is None


def test_kv_bound_server_is_told_to_raise_mem_fraction_static(explain: Explain) -> None:
    log = ("[2026-10-10 11:58:00] server_args={'max_running_requests': 128}\n"
           "[2026-10-10 11:58:30] max_total_num_tokens=128, chunked_prefill_size=2048, "
           "max_prefill_tokens=16384, max_running_requests=64, context_len=4096, "
           "available_gpu_mem=0.50 GB\n")
    assert cap_of(explain(log, "--json"))["reason"] == (
        "asked 128, got 64: KV pool of 128 tokens allows 64 (tokens // 2); "
        "raise --mem-fraction-static or lower --context-length")


def test_speculative_server_without_the_flag_runs_the_default_48(explain: Explain) -> None:
    log = ("[2026-10-10 11:58:00] Max running requests is reset to 48 for speculative decoding. "
           "You can override this by explicitly setting --max-running-requests.\n"
           "[2026-10-10 11:58:00] server_args={'max_running_requests': 48, "
           "'speculative_algorithm': 'EAGLE'}\n"
           "[2026-10-10 11:58:10] Load weight end. elapsed=5.00 s, type=Qwen3ForCausalLM, "
           "avail mem=60.00 GB, mem usage=16.00 GB.\n"
           "[2026-10-10 11:58:12] Load weight end. elapsed=1.00 s, type=Qwen3ForCausalLMEagle3, "
           "avail mem=59.00 GB, mem usage=1.00 GB.\n"
           "[2026-10-10 11:58:30] max_total_num_tokens=500000, max_running_requests=48\n"
           "[2026-10-10 11:59:00] Decode batch, #running-req: 48, #token: 9000, token usage: 0.02, "
           "accept len: 3.12, accept rate: 0.71, cuda graph: True, gen throughput (token/s): "
           "2500.00, #queue-req: 5\n")
    run = explain(log, "--json")
    data = run.json()
    assert (cap_of(run)["binding"], cap_of(run)["requested"]) == ("spec-default", 48)
    assert (data["model_class"], data["draft_model_class"]) == (
        "Qwen3ForCausalLM", "Qwen3ForCausalLMEagle3")
    assert part(data, "last_decode")["accept_len"] == 3.12


def test_a_log_without_server_args_does_not_guess_the_speculative_default(
    explain: Explain,
) -> None:
    log = ("[2026-10-10 11:58:30] max_total_num_tokens=500000, max_running_requests=32\n"
           "[2026-10-10 11:59:00] Decode batch, #running-req: 32, #token: 9000, token usage: 0.02, "
           "accept len: 3.12, accept rate: 0.71, cuda graph: True, gen throughput (token/s): "
           "2500.00, #queue-req: 5\n")
    assert cap_of(explain(log, "--json")) == {
        "requested": None, "effective": 32, "binding": None, "ratio": None,
        "reason": "asked unknown, got 32: the log does not show what was asked "
        "(KV pool allows 250000)"}


def test_speculative_reset_warning_alone_shows_the_ask(explain: Explain) -> None:
    log = ("[2026-10-10 11:58:00] Max running requests is reset to 48 for speculative decoding. "
           "You can override this by explicitly setting --max-running-requests.\n"
           "[2026-10-10 11:58:30] max_total_num_tokens=500000, max_running_requests=48\n")
    assert cap_of(explain(log, "--json"))["binding"] == "spec-default"


def test_fatal_startup_oom_exits_1_with_the_root_cause_and_a_hint(explain: Explain) -> None:
    run = explain(STARTUP_OOM, "--json")
    data = run.json()
    assert run.code == 1
    assert (data["state"], data["ready"], data["ready_at"]) == ("failed", False, None)
    assert data["fatal"] == {
        "kind": "kv_no_memory",
        "message": "RuntimeError: Not enough memory. Please try to increase "
        "--mem-fraction-static. Current value: mem_fraction_static=0.80",
        "hint": "no room for the KV cache: raise --mem-fraction-static, or use more GPUs (tp)",
        "at": "2026-10-10 11:58:51", "exit_code": None,
    }
    assert cap_of(run)["reason"] == (
        "asked auto; the effective value is not known yet (no summary line)")


def test_fatal_startup_oom_text_report_ends_with_the_error_and_the_hint(explain: Explain) -> None:
    run = explain(STARTUP_OOM)
    lines = run.out.splitlines()
    assert run.code == 1
    assert lines[-2].startswith("fatal                 kv_no_memory at 2026-10-10 11:58:51: "
                                "RuntimeError: Not enough memory.")
    assert lines[-1].startswith("hint                  no room for the KV cache")


def test_crash_while_serving_keeps_the_last_decode_and_names_the_oom(explain: Explain) -> None:
    run = explain(CRASH_SERVING, "--json")
    data = run.json()
    fatal = part(data, "fatal")
    assert run.code == 1
    assert (fatal["kind"], fatal["at"]) == ("cuda_oom", "2026-10-10 12:05:09")
    assert (data["state"], data["ready"]) == ("failed", True)
    assert part(data, "last_decode")["running"] == 64


def test_capture_failure_outranks_the_oom_in_its_traceback(explain: Explain) -> None:
    log = ("[2026-10-10 11:58:51] Scheduler hit an exception: Traceback (most recent call last):\n"
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.\n"
           "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 20.00 MiB.\n"
           "Possible solutions:\n"
           "[2026-10-10 11:58:52] Received sigquit from a child process. It usually means the "
           "child failed.\n")
    fatal = part(explain(log, "--json").json(), "fatal")
    assert fatal["kind"] == "cuda_graph"
    assert "--cuda-graph-max-bs-decode" in str(fatal["hint"])


def test_scheduler_killed_during_init_reports_the_exit_code(explain: Explain) -> None:
    log = ("RuntimeError: Rank 0 scheduler died during initialization (exit code: -9). If exit "
           "code is -9 (SIGKILL), a common cause is the OS OOM killer.\n")
    run = explain(log, "--json")
    assert run.code == 1
    assert part(run.json(), "fatal")["exit_code"] == -9


def test_a_restart_in_the_same_log_reports_the_latest_start(explain: Explain) -> None:
    run = explain(STARTUP_OOM + DENSE, "--json")
    data = run.json()
    assert run.code == 0
    assert (data["starts"], data["fatal"], data["model_class"]) == (2, None, "Qwen3ForCausalLM")


def test_a_restart_without_server_args_is_seen_by_its_weight_loading(explain: Explain) -> None:
    restart = ("[2026-10-10 12:10:00] Load weight begin. avail mem=78.50 GB\n"
               "[2026-10-10 12:10:30] The server is fired up and ready to roll!\n")
    run = explain(CRASH_SERVING + restart, "--json")
    data = run.json()
    assert (run.code, data["starts"], data["state"], data["fatal"]) == (0, 1, "ready", None)


def test_server_args_logged_twice_before_loading_is_one_start(explain: Explain) -> None:
    data = explain(HYBRID_START.replace("\n", "\n" + HYBRID_START.splitlines()[0] + "\n", 1),
                   "--json").json()
    assert data["starts"] == 1


def test_sigterm_after_ready_means_draining(explain: Explain) -> None:
    log = DENSE + ("[2026-02-01 09:00:00 TP0] SIGTERM received. signum=15 frame=None Draining "
                   "requests and shutting down...\n")
    run = explain(log, "--json")
    assert (run.code, run.json()["state"]) == (0, "draining")


def test_oldest_format_is_dated_up_to_mid_2025(explain: Explain) -> None:
    log = ("[2025-05-01 10:00:00 TP0] Decode batch. #running-req: 3, #token: 100, token usage: "
           "0.01, cuda graph: True, gen throughput (token/s): 50.00, #queue-req: 0\n")
    assert explain(log, "--json").json()["era"] == "up to 2025-06"


def test_json_field_names_are_stable_and_null_where_the_log_is_silent(explain: Explain) -> None:
    run = explain("just some text\nINFO:     Started server process [1]\n", "--json")
    data = run.json()
    assert run.code == 0
    assert set(data) == TOP_KEYS
    assert set(cap_of(run)) == {"requested", "effective", "binding", "ratio", "reason"}
    silent = TOP_KEYS - {"file", "state", "ready", "max_running_requests", "starts", "lines",
                         "recognised_lines"}
    assert {key: data[key] for key in silent} == dict.fromkeys(silent)
    assert (data["state"], data["ready"], data["lines"], data["recognised_lines"]) == (
        "unknown", False, 2, 0)


def test_nested_json_objects_keep_their_field_names(explain: Explain) -> None:
    served = explain(CRASH_SERVING, "--json").json()
    assert set(part(served, "last_decode")) == {
        "at", "running", "queue", "token_usage", "mamba_num", "mamba_usage", "accept_len",
        "accept_rate", "gen_throughput", "cuda_graph"}
    assert set(part(served, "fatal")) == {"kind", "message", "hint", "at", "exit_code"}


def test_unreadable_file_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.log"
    assert main([str(missing)]) == 2
    assert f"cannot read {missing}" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    assert f"cannot read {tmp_path}" in capsys.readouterr().err


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["a.log", "--colour"]) == 2
    assert "usage: python -m launcher explain" in capsys.readouterr().err


def test_python_m_launcher_explain_runs_as_a_command(tmp_path: Path) -> None:
    log = tmp_path / "gpu0.log"
    log.write_text(STARTUP_OOM, encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "launcher", "explain", str(log), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["fatal"]["kind"] == "kv_no_memory"


def test_docs_examples_are_what_explain_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = (ROOT / "docs" / "guides" / "explain.md").read_text(encoding="utf-8")
    blocks = dict(re.findall(r"<!-- example: (\w+) -->\n```\w*\n(.*?)```", doc, re.DOTALL))
    (tmp_path / "gpu0.log").write_text(blocks["log"], encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert main(["gpu0.log"]) == 0
    assert capsys.readouterr().out == blocks["text"]
    assert main(["gpu0.log", "--json"]) == 0
    assert capsys.readouterr().out == blocks["json"]


@pytest.mark.parametrize(
    ("facts", "binding", "reason"),
    [
        (CapacityFacts(requested=None, effective=4096, max_total_num_tokens=2_000_000), "auto",
         ("asked auto, got 4096: flag unset, so sized as min(clamp(tokens / context_len * 512, "
         "2048, 4096), tokens // 2) (KV pool allows 1000000)")),
        (CapacityFacts(requested=256, effective=1024), "auto",
         ("asked 256, got 1024: more than asked, so the server never saw the request; check the "
         "launch command")),
        (CapacityFacts(requested=40, effective=8, max_mamba_cache_size=40, strategy="extra_buffer",
                       speculative=True), "mamba",
         ("asked 40, got 8: 40 Mamba slots / 5 per request (extra_buffer); raise "
         "--max-mamba-cache-size or --mamba-full-memory-ratio")),
        (CapacityFacts(requested=128, effective=96, max_mamba_cache_size=96,
                       disable_radix_cache=True), "mamba",
         ("asked 128, got 96: 96 Mamba slots / 1 per request (radix cache off); raise "
         "--max-mamba-cache-size or --mamba-full-memory-ratio")),
        (CapacityFacts(requested=256, effective=64, attn_dp_size=4), "request",
         "asked 256, got 64: the request binds per DP worker (256 // 4 attention-DP ranks)"),
        (CapacityFacts(requested=8192, effective=4096, max_total_num_tokens=10**7), "auto",
         ("asked 8192, got 4096: releases before 2026-06 clip the request to the auto estimate "
         "clamp(tokens / context_len * 512, 2048, 4096)")),
        (CapacityFacts(requested=128, effective=100, max_total_num_tokens=10**6), None,
         ("asked 128, got 100: not explained by the KV pool or the Mamba pool (KV pool allows "
         "500000)")),
        (CapacityFacts(requested_known=False, effective=300), None,
         "asked unknown, got 300: the log does not show what was asked"),
    ],
    ids=["auto", "more-than-asked", "spec-mamba", "radix-off", "dp", "old-clip", "unexplained",
         "unknown-ask"],
)
def test_capacity_reading_names_the_binding_limit(
    facts: CapacityFacts, binding: str | None, reason: str
) -> None:
    reading = read_capacity(facts)
    assert (reading.binding, reading.reason) == (binding, reason)


def server_info(**overrides: object) -> dict[str, object]:
    """A /server_info body shaped like 0.5.23's (docs/reference/sglang.md#server-info)."""
    info: dict[str, object] = {
        "model_path": "Qwen/Qwen3.5-35B-A3B", "served_model_name": "qwen", "version": "0.5.23",
        "max_running_requests": 128, "context_length": None, "chunked_prefill_size": 8192,
        "speculative_algorithm": None, "disable_radix_cache": False, "dp_size": 1,
        "mamba_radix_cache_strategy": "auto", "max_total_num_tokens": 412160,
        "max_req_input_len": 262140,
        "launch_command": ["python", "-m", "sglang.launch_server", "--max-running-requests", "128"],
        "internal_states": [{
            "max_mamba_cache_size": 80, "mamba_radix_cache_strategy": "extra_buffer",
            "effective_max_running_requests_per_dp": 16, "last_gen_throughput": 1234.5,
            "memory_usage": {"weight": 66.4, "kvcache": 4.72, "token_capacity": 412160},
        }],
    }
    return info | overrides


def test_server_info_gives_the_real_concurrency_and_why() -> None:
    reading = parse_server_info(server_info())
    assert (reading.concurrency, capacity_from_server_info(reading).reason) == (16, MAMBA_REASON)
    assert (reading.version, reading.weight_gb, reading.last_gen_throughput) == (
        "0.5.23", 66.4, 1234.5)


def test_server_info_sums_the_cap_over_data_parallel_ranks() -> None:
    states = [{"effective_max_running_requests_per_dp": 64}, {
        "effective_max_running_requests_per_dp": 64}]
    reading = parse_server_info(server_info(internal_states=states, launch_command="sglang serve "
                                            "--dp-size 2 --max-running-requests=64"))
    assert (reading.concurrency, capacity_from_server_info(reading).requested) == (128, 64)


def test_server_info_before_2026_has_no_effective_cap_so_concurrency_is_unknown() -> None:
    reading = parse_server_info(server_info(internal_states=[{"last_gen_throughput": 0.0}]))
    assert reading.concurrency is None
    assert capacity_from_server_info(reading).effective is None
