"""`python -m launcher explain LOGFILE [--json]`: what an SGLang log says about its server.

Streams the log through `parse_line` and folds the events into a `LogReport`: format era,
model, memory pools, requested vs effective max_running_requests and why, readiness, the
latest Decode batch, and the fatal error with a hint; prints it as JSON or as the compact
aligned text of `render_text`. Exit codes: 0 normally, 1 when the log shows a fatal error, 2
on bad usage or an unreadable file.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping

from fleetgen.commandline import CommandParser
from launcher.logs._report import read_log

EXIT_OK, EXIT_FATAL, EXIT_USAGE = 0, 1, 2


def explain(argv: list[str] | None = None) -> int:
    """Entry point of `python -m launcher explain LOGFILE [--json]`; returns the exit code."""
    parser = CommandParser(
        prog="python -m launcher explain",
        description="Explain what an SGLang server log says about its server.",
        epilog="examples:\n  python -m launcher explain logs/gpu0.log\n"
        "  python -m launcher explain logs/gpu0.log --json | jq .max_running_requests",
    )
    parser.add_argument("logfile", help="an SGLang server log (stdout and stderr merged)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        report = read_log(args.logfile)
    except OSError as exc:
        print(f"explain: cannot read {args.logfile}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    data = report.to_json()
    print(json.dumps(data, indent=2) if args.json else render_text(data))
    return EXIT_FATAL if data["fatal"] is not None else EXIT_OK


def render_text(data: Mapping[str, object]) -> str:
    """The compact aligned report `explain` prints without --json."""
    cap = data["max_running_requests"]
    assert isinstance(cap, Mapping)
    rows = [
        ("file", data["file"]), ("state", _state_text(data)), ("era", data["era"]),
        ("model", _join(data["model_class"], data["draft_model_class"], " + draft ")),
        ("model path", data["model_path"]),
        ("weights", _units((data["weights_gb"], " GB"), (data["weights_load_s"], " s to load"))),
        ("kv cache", _units((data["kv_tokens"], " tokens"), (data["kv_dtype"], ""),
                            (data["kv_cache_gb"], " GB"))),
        ("mamba cache", _units((data["mamba_slots"], " slots"), (data["mamba_cache_gb"], " GB"))),
        ("max_total_num_tokens", data["max_total_num_tokens"]),
        ("context length", data["context_len"]), ("chunked prefill", data["chunked_prefill_size"]),
        ("cuda graph max bs", data["cuda_graph_max_bs"]),
        ("max running requests", _cap_text(cap)),
        ("why", cap["reason"]), ("last decode", _decode_text(data["last_decode"])),
        ("peak running", data["peak_running"]),
    ]
    fatal = data["fatal"]
    if isinstance(fatal, Mapping):
        message = str(fatal["message"])
        rows += [("fatal", f"{fatal['kind']} at {_v(fatal['at'])}: {message[:160]}"),
                 ("hint", fatal["hint"])]
    else:
        rows.append(("fatal", "none"))
    return "\n".join(f"{label:<21} {_v(value)}" for label, value in rows)


def _cap_text(cap: Mapping[str, object]) -> str:
    ratio = f", {cap['ratio']} Mamba slots per request" if cap["ratio"] is not None else ""
    asked = f"{_v(cap['effective'])} (asked {_v(cap['requested'])})"
    return f"{asked}, bound by {_v(cap['binding'])}{ratio}"


def _state_text(data: Mapping[str, object]) -> str:
    if data["ready_at"] is None:
        return str(data["state"])
    startup = f" (startup {data['startup_s']} s)" if data["startup_s"] is not None else ""
    return f"{data['state']}; ready at {data['ready_at']}{startup}"


def _decode_text(d: object) -> str | None:
    if not isinstance(d, Mapping):
        return None
    figures = {"running": d["running"], "queue": d["queue"], "token usage": d["token_usage"],
               "mamba": _mamba_text(d["mamba_num"], d["mamba_usage"]),
               "accept len": d["accept_len"], "accept rate": d["accept_rate"],
               "gen throughput": d["gen_throughput"], "cuda graph": d["cuda_graph"]}
    text = ", ".join(f"{name} {_v(value)}" for name, value in figures.items() if value is not None)
    return f"{_v(d['at'])}: {text}"


def _mamba_text(num: object, usage: object) -> str | None:
    """`16 slots (usage 0.2)`: the Mamba state slots held (`mamba num`) and their share."""
    if num is None:
        return None if usage is None else f"usage {usage}"
    return f"{num} slots" + (f" (usage {usage})" if usage is not None else "")


def _units(*pairs: tuple[object, str]) -> str | None:
    return ", ".join(f"{value}{unit}" for value, unit in pairs if value is not None) or None


def _join(a: object, b: object, sep: str) -> object:
    return f"{_v(a)}{sep}{b}" if b is not None else a


def _v(value: object) -> str:
    return "-" if value is None else str(value)
