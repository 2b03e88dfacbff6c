"""A server's argument list: reading flags from it, masking secrets, building the full argv."""

from __future__ import annotations

from collections.abc import Sequence

from launcher.errors import ProfileError
from workers.redact import MASK, is_secret_name, redact

HOST = "127.0.0.1"
# SGLang's; any flag whose name says it holds a secret is masked too (workers/redact.py).
SECRET_FLAGS = ("--api-key", "--admin-api-key")


def split_flags(args: Sequence[str]) -> list[tuple[str | None, list[str]]]:
    """Group an argument list into (flag, tokens) items: `--x 1 2` and `--y=3` are one each."""
    items: list[tuple[str | None, list[str]]] = []
    for arg in args:
        if arg.startswith("--"):
            items.append((arg.partition("=")[0], [arg]))
        elif items:
            items[-1][1].append(arg)
        else:
            items.append((None, [arg]))
    return items


def flag_value(args: Sequence[str], *names: str) -> str | None:
    """The last value given for any of `names` (`--x v` or `--x=v`); "" for a bare flag."""
    value: str | None = None
    for flag, tokens in split_flags(args):
        if flag in names:
            _, eq, inline = tokens[0].partition("=")
            value = inline if eq else (tokens[1] if len(tokens) > 1 else "")
    return value


def redacted(argv: Sequence[str]) -> list[str]:
    """`argv` with secret values masked (secret flags' values, credentials in URLs), for logs
    and the state file."""
    out = [redact(word) for word in argv]
    for i, word in enumerate(out):
        name, eq, _ = word.partition("=")
        if name.startswith("--") and (name in SECRET_FLAGS or is_secret_name(name)):
            if eq:
                out[i] = f"{name}={MASK}"
            elif i + 1 < len(out) and not out[i + 1].startswith("--"):
                out[i + 1] = MASK
    return out


def build_argv(command: Sequence[str], model: str | None, port: int, nccl_port: int,
               args: Sequence[str]) -> list[str]:
    """The server's full argv: entry point, model, ports, launcher defaults, then `args`."""
    for flag in ("--port", "--nccl-port", "--base-gpu-id"):
        if flag_value(args, flag) is not None:
            raise ProfileError(f"{flag} is set per GPU by the launcher (ports: --base-port); "
                               "remove it from the server arguments")
    for flags in (("--tp-size", "--tensor-parallel-size", "--tp"),
                  ("--dp-size", "--data-parallel-size", "--dp")):
        value = flag_value(args, *flags)
        if value not in (None, "1"):
            raise ProfileError(f"{flags[0]} {value}: the launcher runs one server per GPU, "
                               "so tensor and data parallelism must be 1")
    argv = list(command)
    if model and flag_value(args, "--model-path", "--model") is None:
        argv += ["--model-path", model]
    argv += ["--port", str(port), "--nccl-port", str(nccl_port)]
    # --log-level warning would hide the lines readiness and capacity are read from (§1).
    for flag, value in (("--host", HOST), ("--log-level", "info")):
        if flag_value(args, flag) is None:
            argv += [flag, value]
    if flag_value(args, "--enable-metrics") is None:
        argv.append("--enable-metrics")
    return argv + list(args)
