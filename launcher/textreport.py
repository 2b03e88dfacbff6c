"""The compact aligned text form of a `LogReport`'s JSON, as `explain` prints it."""

from __future__ import annotations

from collections.abc import Mapping


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
    names = ("running", "queue", "token_usage", "mamba_usage", "accept_len", "accept_rate",
             "gen_throughput", "cuda_graph")
    figures = ", ".join(f"{n.replace('_', ' ')} {_v(d[n])}" for n in names if d[n] is not None)
    return f"{_v(d['at'])}: {figures}"


def _units(*pairs: tuple[object, str]) -> str | None:
    return ", ".join(f"{value}{unit}" for value, unit in pairs if value is not None) or None


def _join(a: object, b: object, sep: str) -> object:
    return f"{_v(a)}{sep}{b}" if b is not None else a


def _v(value: object) -> str:
    return "-" if value is None else str(value)
