"""How the launcher starts each kind of server: the launcher's side of fleetgen's server kinds
(fleetgen/servers, which say how a worker talks to one).

    ServerLaunch        the interface: command, argv, flag version, which checks apply
      SGLangLaunch      `sglang serve` (or the profile's `command` without placeholders):
                        SGLang's flags added, checked against its release's flag table
      SimulatorLaunch   `launcher sim`, which takes SGLang's flags as the newest release does
      CommandLaunch     the profile's `command` with PLACEHOLDERS: another engine (vLLM,
                        `transformers serve`) given the model, port and host where it wants them

    launch = launch_for(profile, sim=False)
    argv = launch.argv(launch.command(profile), "/m", 30000, 31000, ["--tp-size", "2"])

Readiness (`/health`) and the log are read alike for every kind (launcher/node/_watch.py): a
server that writes no SGLang lines shows no log figures, and its worker learns what it is at
first contact (fleetgen.servers.detect).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import ClassVar

from fleetgen.ports import HOST
from launcher.node._args import (
    NEWEST_SGLANG,
    PLACEHOLDERS,
    Profile,
    flag_value,
    sglang_command,
    sglang_version,
)
from launcher.node._errors import ProfileError
from launcher.node._flags import check_args

SIM_COMMAND = (sys.executable, "-m", "launcher", "sim")
# Set per server by the launcher, never by the server arguments.
LAUNCHER_FLAGS = ("--port", "--nccl-port", "--base-gpu-id")


class ServerLaunch:
    """One kind of server as the launcher starts it. Subclasses set the class attributes;
    instances carry no state."""

    name: ClassVar[str]
    # Whether the server is SGLang's own, so its release's flag table says which flags apply.
    checks_sglang_flags: ClassVar[bool] = False
    # Whether a server of this kind cannot start without a model.
    needs_model: ClassVar[bool] = True

    def command(self, profile: Profile, assume: bool = False) -> tuple[str, ...]:
        """The entry point; `assume` (a dry run) names one instead of refusing."""
        raise NotImplementedError

    def version(self, profile: Profile) -> str:
        """The SGLang release whose flag names the arguments are spelled in."""
        return profile.sglang_version or sglang_version() or NEWEST_SGLANG

    def describe(self, profile: Profile) -> str:
        """What runs and which release the flags are spelled for, for the dry run."""
        raise NotImplementedError

    def argv(self, command: Sequence[str], model: str | None, port: int,
             nccl_port: int | None, args: Sequence[str], host: str = HOST) -> list[str]:
        """The server's full argv: entry point, what the launcher sets per server, `args`.
        `host` is where it listens unless `args` say `--host` themselves; `nccl_port` None
        leaves the NCCL ports to the server (a data-parallel SGLang takes one per DP rank)."""
        for flag in LAUNCHER_FLAGS:
            if flag_value(args, flag) is not None:
                raise ProfileError(f"{flag} is set per server by the launcher (ports: "
                                   "--base-port; GPUs: CUDA_VISIBLE_DEVICES); remove it from "
                                   "the server arguments")
        return self._argv(command, model, port, nccl_port, args, host)

    def _argv(self, command: Sequence[str], model: str | None, port: int,
              nccl_port: int | None, args: Sequence[str], host: str) -> list[str]:
        raise NotImplementedError

    def ports_text(self, nccl_port: str | None) -> str:
        """The dry run's word on the server's NCCL ports."""
        return f"nccl port {nccl_port}" if nccl_port else \
            "nccl ports picked by SGLang, one per DP rank"

    def warnings(self, server_args: Sequence[str], version: str) -> list[str]:
        """Flags the release in use would reject (only SGLang's own flags are known)."""
        return check_args(server_args, version) if self.checks_sglang_flags else []

    def __repr__(self) -> str:
        return self.name


class SGLangLaunch(ServerLaunch):
    """SGLang: `sglang serve` or the profile's command, with the flags the launcher needs."""

    name = "sglang"
    checks_sglang_flags = True

    def command(self, profile: Profile, assume: bool = False) -> tuple[str, ...]:
        try:
            return tuple(sglang_command(profile))
        except ProfileError:
            if assume:
                return ("sglang", "serve")
            raise

    def describe(self, profile: Profile) -> str:
        if profile.sglang_version:
            return f"sglang {profile.sglang_version} (the profile's sglang_version)"
        installed = sglang_version()
        if installed:
            return f"sglang {installed} (installed)"
        return (f"SGLang is not installed here: flags spelled and checked for sglang "
                f"{NEWEST_SGLANG}, the newest release the flags table was made from")

    def _argv(self, command: Sequence[str], model: str | None, port: int,
              nccl_port: int | None, args: Sequence[str], host: str) -> list[str]:
        argv = list(command)
        if model and flag_value(args, "--model-path", "--model") is None:
            argv += ["--model-path", model]
        argv += ["--port", str(port)]
        if nccl_port is not None:
            argv += ["--nccl-port", str(nccl_port)]
        # --log-level warning would hide the lines readiness and capacity are read from (§1).
        for flag, value in (("--host", host), ("--log-level", "info")):
            if flag_value(args, flag) is None:
                argv += [flag, value]
        if flag_value(args, "--enable-metrics") is None:
            argv.append("--enable-metrics")
        return argv + list(args)


class SimulatorLaunch(SGLangLaunch):
    """The SGLang simulator (`--sim`): started as SGLang is, its flags those of the newest
    release, its own flags unknown to SGLang's table."""

    name = "simulator"
    checks_sglang_flags = False
    needs_model = False

    def command(self, profile: Profile, assume: bool = False) -> tuple[str, ...]:
        return SIM_COMMAND

    def version(self, profile: Profile) -> str:
        return NEWEST_SGLANG

    def describe(self, profile: Profile) -> str:
        return f"simulator (flags of sglang {NEWEST_SGLANG})"


class CommandLaunch(ServerLaunch):
    """Another engine, run by the profile's `command`: its PLACEHOLDERS are filled in and the
    server arguments follow, nothing else added.

        CommandLaunch().argv(["transformers", "serve", "{model}", "--port", "{port}"], "/m",
                             30000, None, ["--continuous-batching"])
        # ["transformers", "serve", "/m", "--port", "30000", "--continuous-batching"]
    """

    name = "command"

    def command(self, profile: Profile, assume: bool = False) -> tuple[str, ...]:
        return profile.command or ()

    def describe(self, profile: Profile) -> str:
        return f"{shlex.join((profile.command or ())[:2])} (the profile's command)"

    def _argv(self, command: Sequence[str], model: str | None, port: int,
              nccl_port: int | None, args: Sequence[str], host: str) -> list[str]:
        values = dict(zip(PLACEHOLDERS, (model or "", str(port), flag_value(args, "--host")
                                         or host), strict=True))
        return [_fill(token, values) for token in command] + list(args)

    def ports_text(self, nccl_port: str | None) -> str:
        return f"nccl port {nccl_port}" if nccl_port else "no NCCL port (another engine)"


SGLANG, SIMULATOR, COMMAND = SGLangLaunch(), SimulatorLaunch(), CommandLaunch()


def launch_for(profile: Profile, sim: bool = False) -> ServerLaunch:
    """The kind `up` starts: the simulator with --sim, another engine when the profile's
    `command` holds a placeholder, else SGLang."""
    if sim:
        return SIMULATOR
    return launch_for_command(profile.command or ())


def launch_for_command(command: Sequence[str]) -> ServerLaunch:
    """A command holding one of PLACEHOLDERS runs another engine than SGLang."""
    return COMMAND if any(p in token for token in command for p in PLACEHOLDERS) else SGLANG


def build_argv(command: Sequence[str], model: str | None, port: int, nccl_port: int | None,
               args: Sequence[str], host: str = HOST) -> list[str]:
    """The argv of the server `command` starts (its kind: `launch_for_command`)."""
    return launch_for_command(command).argv(command, model, port, nccl_port, args, host)


def _fill(token: str, values: Mapping[str, str]) -> str:
    for placeholder, value in values.items():
        token = token.replace(placeholder, value)
    return token
