"""SGLang server log lines in, typed events out: `parse_line(str) -> Event | None`.

Every recognised line becomes a frozen dataclass (one per kind of line, below). Each one
carries `ts`, the time in the `[YYYY-mm-dd HH:MM:SS(.ms)( DP0| TP0 ...)]` prefix, and `ranks`.
Lines without the prefix (tracebacks, `RuntimeError: ...`) are still checked for fatal
patterns, with `ts=None`. Formats follow docs/reference/sglang.md#logs for every
release from 2025 to 0.5.23. Fields are read as `key: value` / `key=value` pairs, never by
position, because their order and presence changed between releases.

    >>> parse_line("[2026-10-10 11:59:41] The server is fired up and ready to roll!")
    Ready(ts=datetime.datetime(2026, 10, 10, 11, 59, 41), ranks=())
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, cast

FatalKind = Literal[
    "kv_no_memory", "weights_no_memory", "zero_requests", "pool_too_small", "mamba_no_memory",
    "mamba_too_small", "cuda_graph", "cuda_oom", "watchdog", "scheduler_exception",
    "scheduler_died", "warmup_failed", "init_failed", "health_check", "port_in_use", "sigquit",
]
CapKind = Literal["mamba", "kv", "spec"]


@dataclass(frozen=True, kw_only=True)
class Event:
    """Base of every parsed line: when it was logged (None without a prefix) and by which ranks."""

    ts: datetime | None = None
    ranks: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerArgs(Event):
    """`server_args={...}` ([R]) or `server_args=ServerArgs(...)` (older): the resolved args."""

    args: Mapping[str, object]


@dataclass(frozen=True)
class WeightsLoading(Event):
    """`Load weight begin. avail mem=X GB`."""

    avail_gb: float | None


@dataclass(frozen=True)
class WeightsLoaded(Event):
    """`Load weight end. ...`; a draft/MTP model logs a second one (`is_draft`)."""

    elapsed_s: float | None
    model_class: str | None
    avail_gb: float | None
    mem_usage_gb: float | None
    is_draft: bool
    dtype: str | None = None
    quant: str | None = None


@dataclass(frozen=True)
class MambaCache(Event):
    """`Mamba Cache is allocated. max_mamba_cache_size: N, ...`: state slots per DP shard."""

    max_mamba_cache_size: int | None
    conv_gb: float | None
    ssm_gb: float | None
    intermediate_ssm_gb: float | None = None
    intermediate_conv_gb: float | None = None


@dataclass(frozen=True)
class KVCache(Event):
    """`KV Cache is allocated. [dtype: D, ]#tokens: N, K size/V size | KV size`.

    `kv_gb` is the printed `KV size` (MLA) or K + V; `dtype` is None before 2026-05-24.
    """

    tokens: int | None
    dtype: str | None
    k_gb: float | None
    v_gb: float | None
    kv_gb: float | None
    upper_bound: bool = False


@dataclass(frozen=True)
class CudaGraph(Event):
    """A CUDA (or CPU/NPU) graph capture line: begin, the old `bs [...]` line, or end.

    `stage` is decode/verify/prefill/piecewise, or "" in the old format that names none;
    `legacy` marks the format used before 2026-06-22.
    """

    max_bs: int | None
    bs_list: tuple[int, ...]
    elapsed_s: float | None
    mem_gb: float | None
    avail_gb: float | None = None
    role: str = "target"
    stage: str = ""
    done: bool = False
    legacy: bool = False


@dataclass(frozen=True)
class Summary(Event):
    """`max_total_num_tokens=N, ...`; `max_running_requests` is the effective per-DP cap."""

    max_total_num_tokens: int | None
    chunked_prefill_size: int | None
    max_prefill_tokens: int | None
    max_running_requests: int | None
    context_len: int | None
    available_gpu_mem_gb: float | None
    fields: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Ready(Event):
    """`The server is fired up and ready to roll!`."""


@dataclass(frozen=True)
class _Batch(Event):
    fields: Mapping[str, str]
    running: int | None
    queue: int | None
    token_usage: float | None
    full_token_usage: float | None
    swa_token_usage: float | None
    mamba_usage: float | None
    cuda_graph: bool | None
    iteration: int | None
    sep: str  # "." before 2025-10-26, "," after
    trailing_comma: bool  # 2025-07 to 2026-01

    @property
    def kv_usage(self) -> float | None:
        """KV usage whichever way it was printed (`token usage` or hybrid `full token usage`)."""
        return self.token_usage if self.token_usage is not None else self.full_token_usage


@dataclass(frozen=True)
class PrefillBatch(_Batch):
    """`Prefill batch[ [iter]][.,] ...`, every era and hybrid variant."""

    new_seq: int | None = None
    new_token: int | None = None
    cached_token: int | None = None
    pending_token: int | None = None
    input_throughput: float | None = None


@dataclass(frozen=True)
class DecodeBatch(_Batch):
    """`Decode batch[ [iter]][.,] ...`, every era, hybrid Mamba/SWA and speculative variant."""

    tokens: int | None = None
    mamba_num: int | None = None
    accept_len: float | None = None
    accept_rate: float | None = None
    gen_throughput: float | None = None


@dataclass(frozen=True)
class CapWarning(Event):
    """A warning that max_running_requests was lowered (mamba, kv) or defaulted (spec, 48)."""

    kind: CapKind
    requested: int | None
    effective: int | None
    slots: int | None = None
    per_request: int | None = None


@dataclass(frozen=True)
class Fatal(Event):
    """A line that means the server failed or is about to die (§6.4)."""

    kind: FatalKind
    message: str
    exit_code: int | None = None


@dataclass(frozen=True)
class Draining(Event):
    """SIGTERM received or `Gracefully exiting... Remaining number of requests N`."""

    remaining: int | None = None


# The parser.

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


# Field readers: `key: value` pairs, numbers, GB sizes, the server_args dict.

_NUM = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_LOOSE_ARG = re.compile(
    r"""['"]?(\w+)['"]?(?:\s*:\s*|=)('[^']*'|"[^"]*"|-?\d[\w.+-]*|True|False|None)(?=\s*[,)}])"""
)


def _server_args(text: str) -> dict[str, object]:
    """Read the args dict ([R]) or `ServerArgs(k=v, ...)` repr; values ast cannot read stay text."""
    text = text.strip()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # odd escapes in paths must not warn
            node = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        node = None
    if isinstance(node, ast.Dict):
        pairs = [(_literal(k, text), v) for k, v in zip(node.keys, node.values) if k is not None]
        return {str(k): _literal(v, text) for k, v in pairs}
    if isinstance(node, ast.Call):
        return {kw.arg: _literal(kw.value, text) for kw in node.keywords if kw.arg}
    # Reprs of enums or objects (`<X: 1>`) break ast; keep the simple scalar pairs.
    return {k: _literal_text(v) for k, v in _LOOSE_ARG.findall(text)}


def _literal(node: ast.expr, text: str) -> object:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return ast.get_source_segment(text, node)


def _literal_text(value: str) -> object:
    try:
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return value


def _pairs(text: str, sep: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split(", "):
        key, found, value = part.partition(sep)
        if found:
            out[key.strip()] = value.strip()
    return out


def _grab(pattern: str, text: str) -> str | None:
    m = re.search(pattern, text)
    return m.group(1) if m else None


def _gb(name: str, text: str) -> float | None:
    return _float(_grab(name + r" size: ([\d.]+)\s*GB", text))


def _float(text: str | None) -> float | None:
    m = _NUM.search(text) if text else None
    return float(m.group()) if m else None


def _int(text: str | None) -> int | None:
    number = _float(text)
    return int(number) if number is not None else None
