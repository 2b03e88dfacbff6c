"""SGLang's log lines (docs/reference/sglang.md#logs), in the current [R] format or an older era's.

Pure formatting functions plus the logging configuration of a simulator process. Eras
(`--log-format`) differ in the Prefill/Decode separator, trailing `, `, `#pending-token`,
`accept rate`, and in a few start-up lines, so log parsers can be tested against each:
  r        current: `Prefill batch, ... #pending-token: N, cuda graph: X, input throughput ...`
  2026-01  no #pending-token; `input throughput ..., cuda graph: X` appended
  2025-10  comma after `batch`, trailing `, `, no input throughput
  2025-07  period after `batch`, trailing `, `, no accept rate
  2025-06  period after `batch`, no trailing `, `
"""

from __future__ import annotations

import logging
import logging.config
from dataclasses import dataclass

SCHEDULER_LOGGER = "launcher.sim.scheduler"  # lines a real scheduler process would print
DATEFMT = "%Y-%m-%d %H:%M:%S"
NEW_STARTUP_ERAS = ("r",)  # eras after 2026-06 (new CUDA graph and KV lines)


@dataclass(frozen=True)
class BatchStats:
    """What one Prefill or Decode line reports."""

    running: int
    queued: int
    tokens: int
    token_usage: float
    new_seq: int = 0
    new_tokens: int = 0
    pending_tokens: int = 0
    throughput: float = 0.0
    cuda_graph: bool = True
    mamba_num: int | None = None  # set for hybrid models
    mamba_usage: float = 0.0
    accept_len: float | None = None  # set with speculative decoding
    accept_rate: float = 0.0


def _sep(era: str) -> str:
    return "." if era in ("2025-07", "2025-06") else ","


def _tail(era: str) -> str:
    return ", " if era in ("2025-10", "2025-07") else ""


def prefill_line(era: str, s: BatchStats) -> str:
    """`Prefill batch...` for one admission batch."""
    usage = (f"full token usage: {s.token_usage:.2f}, mamba usage: {s.mamba_usage:.2f}"
             if s.mamba_num is not None else f"token usage: {s.token_usage:.2f}")
    head = (f"Prefill batch{_sep(era)} #new-seq: {s.new_seq}, #new-token: {s.new_tokens}, "
            f"#cached-token: 0, {usage}, #running-req: {s.running}, #queue-req: {s.queued}")
    graph = f"cuda graph: {s.cuda_graph}"
    if era == "r":
        return (f"{head}, #pending-token: {s.pending_tokens}, {graph}, "
                f"input throughput (token/s): {s.throughput:.2f}")
    if era == "2026-01":
        return f"{head}, input throughput (token/s): {s.throughput:.2f}, {graph}"
    return head + _tail(era)


def decode_line(era: str, s: BatchStats) -> str:
    """`Decode batch...`, logged every decode-log-interval decode iterations."""
    if s.mamba_num is not None:
        usage = (f"#full token: {s.tokens}, full token usage: {s.token_usage:.2f}, "
                 f"mamba num: {s.mamba_num}, mamba usage: {s.mamba_usage:.2f}")
    else:
        usage = f"#token: {s.tokens}, token usage: {s.token_usage:.2f}"
    spec = ""
    if s.accept_len is not None:
        spec = f"accept len: {s.accept_len:.2f}, "
        if era not in ("2025-07", "2025-06"):
            spec += f"accept rate: {s.accept_rate:.2f}, "
    return (f"Decode batch{_sep(era)} #running-req: {s.running}, {usage}, {spec}"
            f"cuda graph: {s.cuda_graph}, gen throughput (token/s): {s.throughput:.2f}, "
            f"#queue-req: {s.queued}" + _tail(era))


def load_weight_end(era: str, model_class: str, avail: float, usage: float) -> str:
    """The `Load weight end` line (the elapsed= form appeared in 2026-02)."""
    if era in NEW_STARTUP_ERAS:
        return (f"Load weight end. elapsed=9.87 s, type={model_class}, avail mem={avail:.2f} GB, "
                f"mem usage={usage:.2f} GB.")
    return (f"Load weight end. type={model_class}, dtype=torch.bfloat16, avail mem={avail:.2f} GB, "
            f"mem usage={usage:.2f} GB.")


def mamba_line(k: int, conv_gb: float, ssm_gb: float, spec_gb: float | None) -> str:
    """`Mamba Cache is allocated...` (note SGLang's trailing space)."""
    line = (f"Mamba Cache is allocated. max_mamba_cache_size: {k}, conv_state size: "
            f"{conv_gb:.2f}GB, ssm_state size: {ssm_gb:.2f}GB ")
    if spec_gb is not None:
        line += (f"intermediate_ssm_state_cache size: {spec_gb * 0.9:.2f}GB "
                 f"intermediate_conv_window_cache size: {spec_gb * 0.1:.2f}GB ")
    return line


def kv_line(era: str, tokens: int, kv_gb: float) -> str:
    """`KV Cache is allocated...` (the `dtype:` part appeared in 2026-05)."""
    dtype = "dtype: torch.bfloat16, " if era in NEW_STARTUP_ERAS else ""
    half = kv_gb / 2
    return f"KV Cache is allocated. {dtype}#tokens: {tokens}, K size: {half:.2f} GB, V size: {half:.2f} GB"


def cuda_graph_lines(era: str, role: str, tokens_per_req: int, bs: tuple[int, ...],
                     avail: float, usage: float) -> list[str]:
    """Decode (or verify) CUDA graph capture lines, new or pre-2026-06 style."""
    phase = "verify" if tokens_per_req > 1 else "decode"
    after = avail - usage
    if era in NEW_STARTUP_ERAS:
        begin = (f"Capture {role} {phase} CUDA graph begin. backend=full, "
                 f"num_tokens_per_req={tokens_per_req}, avail mem={avail:.2f} GB")
        end = (f"Capture {role} {phase} CUDA graph end. bs={list(bs)}, elapsed=4.21 s, "
               f"mem usage={usage:.2f} GB, avail mem={after:.2f} GB.")
        return [begin, end]
    begin = f"Capture cuda graph begin. This can take up to several minutes. avail mem={avail:.2f} GB"
    end = (f"Capture cuda graph end. Time elapsed: 4.21 s. mem usage={usage:.2f} GB. "
           f"avail mem={after:.2f} GB.")
    return [begin, f"Capture cuda graph bs {list(bs)}", end]


def summary_line(tokens: int, chunked: int, max_prefill: int, running: int, ctx: int,
                 avail: float) -> str:
    """The scheduler's summary; max_running_requests here is the effective value."""
    return (f"max_total_num_tokens={tokens}, chunked_prefill_size={chunked}, "
            f"max_prefill_tokens={max_prefill}, max_running_requests={running}, "
            f"context_len={ctx}, available_gpu_mem={avail:.2f} GB")


def scheduler_exception(error: str, where: str) -> str:
    """`Scheduler hit an exception:` with a traceback ending in `error`."""
    return ("Scheduler hit an exception: Traceback (most recent call last):\n"
            '  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 6368, '
            "in run_scheduler_process\n"
            f"    {where}\n"
            '  File "/sgl-workspace/sglang/python/sglang/srt/model_executor/model_runner.py", '
            "line 1712, in forward\n"
            "    return self._forward_raw(forward_batch, skip_attn_backend_init, pp_proxy_tensors)\n"
            f"{error}")


class SglangFormatter(logging.Formatter):
    """`[YYYY-mm-dd HH:MM:SS] msg`, with ` TP0` after the time for scheduler lines if asked."""

    def __init__(self, tp_prefix: bool = False) -> None:
        super().__init__("[%(asctime)s%(rank)s] %(message)s", datefmt=DATEFMT)
        self.tp_prefix = tp_prefix

    def format(self, record: logging.LogRecord) -> str:
        scheduler = record.name.startswith(SCHEDULER_LOGGER)
        record.rank = " TP0" if self.tp_prefix and scheduler else ""
        return super().format(record)


def configure_logging(log_level: str, http_level: str | None, tp_prefix: bool) -> None:
    """Configure a simulator process's logging: everything to stdout, one line per record."""
    level = log_level.upper()
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "sglang": {"()": SglangFormatter, "tp_prefix": tp_prefix},
            "uvicorn": {"()": "uvicorn.logging.DefaultFormatter", "use_colors": False,
                        "fmt": "[%(asctime)s] %(levelprefix)s %(message)s", "datefmt": DATEFMT},
        },
        "handlers": {
            "sglang": {"class": "logging.StreamHandler", "formatter": "sglang",
                       "stream": "ext://sys.stdout"},
            "uvicorn": {"class": "logging.StreamHandler", "formatter": "uvicorn",
                        "stream": "ext://sys.stdout"},
        },
        "loggers": {
            "launcher.sim": {"handlers": ["sglang"], "level": level, "propagate": False},
            "uvicorn": {"handlers": ["uvicorn"], "level": (http_level or log_level).upper(),
                        "propagate": False},
            "uvicorn.access": {"handlers": ["uvicorn"], "level": "INFO", "propagate": False},
        },
    })
