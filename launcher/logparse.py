"""Pure parser for SGLang server log lines: `parse_line(str) -> Event | None`.

Every recognised line becomes a frozen dataclass. Each one carries `ts`, the time in the
`[YYYY-mm-dd HH:MM:SS(.ms)( DP0| TP0 ...)]` prefix, and `ranks`. Lines without the prefix
(tracebacks, `RuntimeError: ...`) are still checked for fatal patterns, with `ts=None`.
Formats follow docs/reference/sglang.md#logs for every release from 2025 to 0.5.23.
Fields are read as `key: value` / `key=value` pairs, never by position, because their order
and presence changed between releases.

    >>> parse_line("[2026-10-10 11:59:41] The server is fired up and ready to roll!")
    Ready(ts=datetime.datetime(2026, 10, 10, 11, 59, 41), ranks=())
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import cast

from launcher.logevents import (
    CapKind,
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
)
from launcher.logfields import _float, _gb, _grab, _int, _pairs, _server_args

__all__ = [
    "CapKind",
    "CapWarning",
    "CudaGraph",
    "DecodeBatch",
    "Draining",
    "Event",
    "Fatal",
    "FatalKind",
    "KVCache",
    "MambaCache",
    "PrefillBatch",
    "Ready",
    "ServerArgs",
    "Summary",
    "WeightsLoaded",
    "WeightsLoading",
    "parse_line",
]

_PREFIX = re.compile(
    r"\[(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:[.,](\d{1,6}))?((?: [A-Z][A-Z_]*\d+)*)\] ?"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BATCH = re.compile(r"(Prefill|Decode) batch(?: \[([^\]]*)\])?([.,]) ?(.*)")
_GRAPH = re.compile(
    r"Capture (?:(target|draft) )?(?:(decode|verify|prefill|piecewise) )?[A-Za-z]+ graph "
    r"(begin|end|bs)\b[.,]? ?(.*)"
)
_DRAFT_CLASS = re.compile(r"MTP|NextN|Eagle|Draft", re.IGNORECASE)
# One alternation, searched anywhere in the message, so traceback lines match too and an
# uninteresting line costs one scan. Leftmost wins: "Capture cuda graph failed: CUDA out of
# memory" is a capture failure, not a serving OOM.
_SPECIAL = re.compile("|".join(f"(?P<{name}>{pattern})" for name, pattern in {
    "kv_no_memory": r"Not enough memory\. Please try to increase --mem-fraction-static",
    "weights_no_memory": r"Loaded weights leave no GPU memory",
    "zero_requests": r"max_running_request is zero",
    "pool_too_small": r"Memory pool size is too small",
    "mamba_no_memory": r"Not enough GPU memory for hybrid",
    "mamba_too_small": r"state cache is too small to serve any requests",
    "cuda_graph": r"(?i:capture cuda graph failed)",
    "cuda_oom": r"CUDA out of memory|OutOfMemoryError",
    "watchdog": r"(?:Scheduler watchdog|Watchdog) timeout \(",
    "scheduler_exception": r"Scheduler hit an exception",
    "scheduler_died": r"scheduler died during initialization",
    "warmup_failed": r"Initialization failed\. warmup error",
    "init_failed": r"Initialization failed\. Please see the error messages above",
    "health_check": r"Health check failed\.",
    "port_in_use": r"error while attempting to bind on address",
    "sigquit": r"Received sigquit from a child process|SIGQUIT received\.",
    "cap_mamba": r"max_running_requests is capped to (?P<m_n>\d+) by the mamba state cache "
    r"\(max_mamba_cache_size=(?P<m_k>\d+), (?P<m_r>\d+) state slots per request",
    "cap_kv": r"max_running_requests was reduced from the requested (?P<k_a>\d+) to (?P<k_b>\d+)",
    "cap_spec": r"Max running requests is reset to (?P<s_n>\d+) for speculative decoding",
    "sigterm": r"SIGTERM received",
    "graceful": r"Gracefully exiting\.\.\. Remaining number of requests (?P<g_n>\d+)",
}.items()))


def parse_line(line: str) -> Event | None:
    """Parse one log line; None when it says nothing the launcher needs (uvicorn, tqdm, ...)."""
    line = _ANSI.sub("", line) if "\x1b" in line else line
    line = line.rstrip("\r\n")
    ts: datetime | None = None
    ranks: tuple[str, ...] = ()
    prefix = _PREFIX.match(line)
    if prefix:
        y, mo, d, h, mi, s, ms, rank_text = prefix.groups()
        micro = int(ms.ljust(6, "0")) if ms else 0
        ts = datetime(int(y), int(mo), int(d), int(h), int(mi), int(s), micro)
        ranks = tuple(rank_text.split())
        msg = line[prefix.end():].strip()
    else:
        msg = line.strip()
    if not msg or msg.startswith(("INFO:", "DEBUG:", "Capturing batches")):
        return None  # uvicorn access/lifecycle lines and tqdm progress
    return _by_start(msg, ts, ranks) or _special(msg, ts, ranks)


def _by_start(msg: str, ts: datetime | None, ranks: tuple[str, ...]) -> Event | None:
    if msg.startswith(("Decode batch", "Prefill batch")):
        return _batch(msg, ts, ranks)
    if msg.startswith("Load weight "):
        return _weights(msg, ts, ranks)
    if msg.startswith("Capture "):
        return _graph(msg, ts, ranks)
    if msg.startswith("KV Cache "):
        return _kv(msg, ts, ranks)
    if msg.startswith("Mamba Cache is allocated"):
        return MambaCache(
            _int(_grab(r"max_mamba_cache_size: (\d+)", msg)), _gb("conv_state", msg),
            _gb("ssm_state", msg), _gb("intermediate_ssm_state_cache", msg),
            _gb("intermediate_conv_window_cache", msg), ts=ts, ranks=ranks,
        )
    if msg.startswith("max_total_num_tokens="):
        f = _pairs(msg, "=")
        return Summary(
            _int(f.get("max_total_num_tokens")), _int(f.get("chunked_prefill_size")),
            _int(f.get("max_prefill_tokens")), _int(f.get("max_running_requests")),
            _int(f.get("context_len")),
            _float(f.get("available_gpu_mem", f.get("available_cpu_mem"))), f, ts=ts, ranks=ranks,
        )
    if msg.startswith("server_args="):
        return ServerArgs(_server_args(msg[len("server_args="):]), ts=ts, ranks=ranks)
    if "The server is fired up and ready to roll" in msg:
        return Ready(ts=ts, ranks=ranks)
    return None


def _special(msg: str, ts: datetime | None, ranks: tuple[str, ...]) -> Event | None:
    m = _SPECIAL.search(msg)
    if m is None or m.lastgroup is None:
        return None
    kind = m.lastgroup
    if kind == "cap_mamba":
        return CapWarning("mamba", None, _int(m["m_n"]), _int(m["m_k"]), _int(m["m_r"]),
                          ts=ts, ranks=ranks)
    if kind == "cap_kv":
        return CapWarning("kv", _int(m["k_a"]), _int(m["k_b"]), ts=ts, ranks=ranks)
    if kind == "cap_spec":
        # The 48 becomes the request; the effective cap is decided later, from memory.
        return CapWarning("spec", _int(m["s_n"]), None, ts=ts, ranks=ranks)
    if kind in ("sigterm", "graceful"):
        return Draining(_int(m["g_n"]) if kind == "graceful" else None, ts=ts, ranks=ranks)
    if kind == "watchdog" and "soft=True" in msg:
        return None  # a soft watchdog only dumps debug info; the server keeps running
    code = _int(_grab(r"exit code: (-?\d+)", msg)) if kind == "scheduler_died" else None
    return Fatal(cast(FatalKind, kind), msg, code, ts=ts, ranks=ranks)


def _batch(msg: str, ts: datetime | None, ranks: tuple[str, ...]) -> Event | None:
    m = _BATCH.fullmatch(msg)
    if m is None:
        return None
    body = m[4].rstrip()
    f = _pairs(body.rstrip(", "), ": ")
    graph = next((v for k, v in f.items() if k.endswith(" graph")), None)
    base = (
        f, _int(f.get("#running-req")), _int(f.get("#queue-req")), _float(f.get("token usage")),
        _float(f.get("full token usage")), _float(f.get("swa token usage")),
        _float(f.get("mamba usage")), {"True": True, "False": False}.get(graph or ""),
        _int(m[2]), m[3], body.endswith(","),
    )
    if m[1] == "Prefill":
        return PrefillBatch(
            *base, new_seq=_int(f.get("#new-seq")), new_token=_int(f.get("#new-token")),
            cached_token=_int(f.get("#cached-token")), pending_token=_int(f.get("#pending-token")),
            input_throughput=_float(f.get("input throughput (token/s)")), ts=ts, ranks=ranks,
        )
    return DecodeBatch(
        *base, tokens=_int(f.get("#token", f.get("#full token"))),
        mamba_num=_int(f.get("mamba num")), accept_len=_float(f.get("accept len")),
        accept_rate=_float(f.get("accept rate")),
        gen_throughput=_float(f.get("gen throughput (token/s)")), ts=ts, ranks=ranks,
    )


def _weights(msg: str, ts: datetime | None, ranks: tuple[str, ...]) -> Event | None:
    if msg.startswith("Load weight begin"):
        return WeightsLoading(_float(_grab(r"avail mem=([\d.]+)", msg)), ts=ts, ranks=ranks)
    if not msg.startswith("Load weight end"):
        return None
    f = _pairs(msg[len("Load weight end."):].rstrip(" ."), "=")
    model_class = f.get("type")
    return WeightsLoaded(
        _float(f.get("elapsed")), model_class, _float(f.get("avail mem")),
        _float(f.get("mem usage")), bool(model_class and _DRAFT_CLASS.search(model_class)),
        f.get("dtype"), f.get("quant"), ts=ts, ranks=ranks,
    )


def _graph(msg: str, ts: datetime | None, ranks: tuple[str, ...]) -> Event | None:
    m = _GRAPH.fullmatch(msg)
    if m is None:
        return None  # e.g. "Capture cuda graph num tokens [...]"; failures are matched later
    role, stage, what, rest = m[1], m[2], m[3], m[4]
    listed = _grab(r"\[([\d,\s]*)\]", rest)
    bs = tuple(int(x) for x in listed.replace(",", " ").split()) if listed else ()
    return CudaGraph(
        max(bs) if bs else None, bs, _float(_grab(r"(?:elapsed=|Time elapsed: )([\d.]+)", rest)),
        _float(_grab(r"mem usage=([\d.]+)", rest)), _float(_grab(r"avail mem=([\d.]+)", rest)),
        role or "target", stage or "", what == "end", legacy=role is None,
        ts=ts, ranks=ranks,
    )


def _kv(msg: str, ts: datetime | None, ranks: tuple[str, ...]) -> Event | None:
    if not msg.startswith(("KV Cache is allocated", "KV Cache VA upper bound")):
        return None
    k, v, kv = _gb(r"\bK", msg), _gb(r"\bV", msg), _gb("KV", msg)
    return KVCache(
        _int(_grab(r"#tokens: (\d+)", msg)), _grab(r"dtype: ([\w.]+)", msg), k, v,
        kv if kv is not None else (k + v if k is not None and v is not None else None),
        "VA upper bound" in msg, ts=ts, ranks=ranks,
    )
