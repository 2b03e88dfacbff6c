"""fleetgen's SGLang simulator: a CPU stand-in for one SGLang server (see README "simulator")."""

from launcher.sim.config import ConfigError, SimConfig
from launcher.sim.server import SimStartupError, run, serve_in_thread

__all__ = ["ConfigError", "SimConfig", "SimStartupError", "run", "serve_in_thread"]
