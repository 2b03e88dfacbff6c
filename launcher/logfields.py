"""Field readers for SGLang log messages: `key: value` pairs, numbers, GB sizes, server_args.

Private helpers shared by the line parsers in `launcher.logparse`.
"""

from __future__ import annotations

import ast
import re
import warnings

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
