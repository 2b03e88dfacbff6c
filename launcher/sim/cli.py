"""`python -m launcher sim ...`: parse SGLang-like flags and run one simulated server."""

from __future__ import annotations

from launcher.sim.config import SimConfig
from launcher.sim.server import run


def main(argv: list[str]) -> int:
    """Run the simulator; argparse errors exit 2 with `usage: python -m launcher sim ...`."""
    try:
        config = SimConfig.from_argv(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad flag (2)
        return exc.code if isinstance(exc.code, int) else 2
    return run(config, argv)
