"""A server's arguments: profile file, per-GPU layers, flag names per SGLang release, argv.

A profile is TOML (YAML too when PyYAML is installed):

    model = "/dev/shm/Qwen3.6-27B"
    args = ["--mem-fraction-static", "0.93", "--speculative-algorithm", "NEXTN"]
    [gpu.3]
    args = ["--max-running-requests", "32"]

Layers are merged flag by flag, later ones winning: profile `args` < `[gpu.N] args` < the
arguments after `--` on the command line. SGLang renamed flags between releases (docs/reference/sglang.md#flags),
so `adapt_flags` rewrites either spelling to the one the installed version accepts. Then the
server's kind (launcher/node/_kind.py) adds the entry point, model, ports and the launcher's
defaults. Wherever an argv is
logged or published it goes through `fleetgen.redact.redact_argv`, the one place secrets are masked.

    profile = load_profile(Path("node.toml"))
    model, args = profile.for_gpu(3, cli_args=["--log-level", "info"])
    args, notes = adapt_flags(args, sglang_version())
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.node._errors import ProfileError

# The newest release the contract was read from; assumed when SGLang is not installed here.
NEWEST_SGLANG = "0.5.23"
# (old flag, new flag, first release taking the new one). Upstream renamed both in June 2026
# (#28937 era); 0.5.15 is the first release the contract saw with the new names, and 0.5.23
# rejects the old ones (argparse exit 2), so a launcher must spell them per version.
RENAMES: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", (0, 5, 15)),
    ("--mamba-scheduler-strategy", "--mamba-radix-cache-strategy", (0, 5, 15)),
)
_TOP_KEYS = {"model", "args", "env", "gpu", "command", "sglang_version"}
_GPU_KEYS = {"model", "args", "env"}
# A profile `command` for another engine (`transformers serve`, vLLM) takes the model, port
# and host where that engine wants them: tokens holding these are filled in per server, and
# no SGLang flag is added (launcher/node/_kind.py CommandLaunch).
PLACEHOLDERS = ("{model}", "{port}", "{host}")


@dataclass(frozen=True)
class GpuOverride:
    """What one `[gpu.N]` table changes for that GPU."""

    model: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Profile:
    """Server settings for every GPU of a node, plus per-GPU overrides."""

    model: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    gpu: Mapping[int, GpuOverride] = field(default_factory=dict)
    # Replaces `sglang serve` (e.g. another venv), or names another engine (PLACEHOLDERS).
    command: tuple[str, ...] | None = None
    sglang_version: str | None = None  # forces flag spelling when SGLang is elsewhere

    def for_gpu(self, index: int, cli_args: Sequence[str] = (),
                cli_model: str | None = None) -> tuple[str | None, list[str]]:
        """The model and merged argument list of GPU `index`."""
        override = self.gpu.get(index, GpuOverride())
        model = cli_model or override.model or self.model
        return model, merge_args(self.args, override.args, cli_args)

    def env_for_gpu(self, index: int) -> dict[str, str]:
        """Extra environment of GPU `index`'s server (profile `env`, then `[gpu.N] env`)."""
        return {**self.env, **self.gpu.get(index, GpuOverride()).env}


def load_profile(path: Path) -> Profile:
    """Read a TOML (or, with PyYAML, YAML) profile; raises ProfileError naming what is wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    data = _parse(path, text)
    return profile_from_mapping(data, str(path))


def _parse(path: Path, text: str) -> Mapping[str, Any]:
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # optional: TOML needs nothing beyond the standard library
        except ImportError:
            raise ProfileError(f"{path}: YAML profiles need PyYAML (pip install pyyaml); "
                               "or write the profile as TOML") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ProfileError(f"{path}: invalid YAML: {exc}") from None
        if not isinstance(data, Mapping):
            raise ProfileError(f"{path}: expected a mapping at the top level")
        return data
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: invalid TOML: {exc}") from None


def profile_from_mapping(data: Mapping[str, Any], where: str = "profile") -> Profile:
    """Validate a parsed profile and build it."""
    _no_unknown(data, _TOP_KEYS, where)
    overrides: dict[int, GpuOverride] = {}
    gpus = data.get("gpu", {})
    if not isinstance(gpus, Mapping):
        raise ProfileError(f"{where}: `gpu` must be a table of [gpu.N] sections")
    for key, table in gpus.items():
        if not str(key).isdigit() or not isinstance(table, Mapping):
            raise ProfileError(f"{where}: [gpu.{key}] must be a table named by a GPU index")
        _no_unknown(table, _GPU_KEYS, f"{where} [gpu.{key}]")
        overrides[int(key)] = GpuOverride(
            model=_str(table, "model", where), args=_args(table, f"{where} [gpu.{key}]"),
            env=_env(table, where))
    command = data.get("command")
    if command is not None:
        command = _args({"args": command}, f"{where} command")
    return Profile(model=_str(data, "model", where), args=_args(data, where),
                   env=_env(data, where), gpu=overrides, command=command,
                   sglang_version=_str(data, "sglang_version", where))


def _no_unknown(table: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(map(str, table)) - known)
    if unknown:
        known_text = ", ".join(sorted(known))
        raise ProfileError(f"{where}: unknown key {unknown[0]!r} (known: {known_text})")


def _str(table: Mapping[str, Any], key: str, where: str) -> str | None:
    value = table.get(key)
    if value is not None and not isinstance(value, str):
        raise ProfileError(f"{where}: `{key}` must be a string")
    return value


def _args(table: Mapping[str, Any], where: str) -> tuple[str, ...]:
    value = table.get("args", [])
    if not isinstance(value, list) or not all(isinstance(a, (str, int, float)) for a in value):
        raise ProfileError(f"{where}: `args` must be a list of strings, "
                           'e.g. ["--mem-fraction-static", "0.93"]')
    return tuple(str(a) for a in value)


def _env(table: Mapping[str, Any], where: str) -> dict[str, str]:
    value = table.get("env", {})
    if not isinstance(value, Mapping):
        raise ProfileError(f"{where}: `env` must be a table of NAME = \"value\"")
    return {str(k): str(v) for k, v in value.items()}


def merge_args(*layers: Sequence[str]) -> list[str]:
    """Concatenate argument layers; a flag given in a later layer drops its earlier values."""
    merged: list[tuple[str | None, list[str]]] = []
    for layer in layers:
        items = split_flags(layer)
        given = {_canonical(flag) for flag, _ in items if flag is not None}
        merged = [(f, t) for f, t in merged if f is None or _canonical(f) not in given] + items
    return [token for _, tokens in merged for token in tokens]


def _canonical(flag: str) -> str:
    """One name per flag, so an alias or the other release's spelling still overrides."""
    aliases = {"--model": "--model-path", "--tensor-parallel-size": "--tp-size",
               "--data-parallel-size": "--dp-size"}
    aliases.update({old: new for old, new, _ in RENAMES})
    return aliases.get(flag, flag)


def version_tuple(version: str) -> tuple[int, ...]:
    """`0.5.10.post1` → (0, 5, 10); the leading numeric parts only."""
    parts = []
    for piece in version.split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:
            break
    return tuple(parts)


def sglang_version() -> str | None:
    """The installed SGLang version, or None when this Python has no SGLang."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def adapt_flags(args: Sequence[str], version: str | None) -> tuple[list[str], list[str]]:
    """Rename flags to the spelling `version` accepts (the newest when None).

    Returns the new list and one note per rename, e.g.
    `--cuda-graph-max-bs → --cuda-graph-max-bs-decode (sglang 0.5.23)`.
    """
    have = version_tuple(version or NEWEST_SGLANG)
    out, notes = [], []
    for arg in args:
        name, eq, value = arg.partition("=")
        for old, new, since in RENAMES:
            wrong, right = (old, new) if have >= since else (new, old)
            if name == wrong:
                notes.append(f"{wrong} → {right} (sglang {version or NEWEST_SGLANG})")
                arg = right + eq + value
        out.append(arg)
    return out, notes


def sglang_command(profile: Profile) -> list[str]:
    """The server entry point: the profile's `command`, `sglang serve`, or the old module.

    `sglang serve` when the installed SGLang declares the `sglang` console script (or, with no
    SGLang in this Python, when `sglang` is on PATH); `python -m sglang.launch_server` for
    releases from before that script.
    """
    if profile.command:
        return list(profile.command)
    beside = Path(sys.executable).with_name("sglang")
    script = str(beside) if beside.is_file() else shutil.which("sglang")
    if sglang_version() is None:
        if script:
            return [script, "serve"]
        raise ProfileError("SGLang is not installed in this Python and `sglang` is not on "
                           "PATH: install it, set `command = [...]` in the profile, or use --sim")
    if script and _declares_cli():
        return [script, "serve"]
    return [sys.executable, "-m", "sglang.launch_server"]


def _declares_cli() -> bool:
    scripts = importlib.metadata.distribution("sglang").entry_points.select(group="console_scripts")
    return any(entry.name == "sglang" for entry in scripts)


# The argument list itself: its flags and their values.

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
