"""Reading SGLang server logs: what a log says about its server, and why (`launcher explain`).

    _parse.py     parse_line: one log line in, one typed Event (or None) out, every era
    _report.py    LogReport: a log's events folded into its latest start; era, HINTS, JSON
    _capacity.py  why max_running_requests is what it is, from a log or a /server_info body
    _explain.py   the `explain` command and its text form

    from launcher.logs import read_log
    read_log("logs/sglang_gpu0.log").to_json()["max_running_requests"]["reason"]
"""

from launcher.logs._capacity import (
    Binding,
    CapacityFacts,
    CapacityReading,
    ServerReading,
    as_float,
    as_int,
    facts_from_args,
    from_server_info,
    read_capacity,
)
from launcher.logs._explain import explain, render_text
from launcher.logs._parse import (
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
    parse_line,
)
from launcher.logs._report import HINTS, LogReport, ServerStart, fold, read_log

__all__ = [
    "HINTS",
    "Binding",
    "CapKind",
    "CapWarning",
    "CapacityFacts",
    "CapacityReading",
    "CudaGraph",
    "DecodeBatch",
    "Draining",
    "Event",
    "Fatal",
    "FatalKind",
    "KVCache",
    "LogReport",
    "MambaCache",
    "PrefillBatch",
    "Ready",
    "ServerArgs",
    "ServerReading",
    "ServerStart",
    "Summary",
    "WeightsLoaded",
    "WeightsLoading",
    "as_float",
    "as_int",
    "explain",
    "facts_from_args",
    "fold",
    "from_server_info",
    "parse_line",
    "read_capacity",
    "read_log",
    "render_text",
]
