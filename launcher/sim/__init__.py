"""fleetgen's SGLang simulator: a CPU stand-in for one SGLang server (docs/development/simulator.md)

Everything it raises on purpose has one root:

    SimError                  errors.py
      ConfigError             a flag or profile value the simulator cannot use (config.py)
      SimStartupError         a simulated start-up failure, or the server thread stopped (server.py)
      PortInUseError          --port is taken by another process, named (port.py)
      RequestError            an HTTP error answer, status and body as SGLang sends it (protocol.py)
      ContextLengthError      the input is longer than the context (wording.py)
      QueueFullError          --max-queued-requests reached (scheduler.py)
      WindowError             an --error-window or /sim/misbehave value it cannot use (stress.py)
"""

from launcher.sim.config import ConfigError, SimConfig
from launcher.sim.embeddings import embedding_of
from launcher.sim.errors import SimError
from launcher.sim.server import SimStartupError, run, serve_in_thread

__all__ = ["ConfigError", "SimConfig", "SimError", "SimStartupError", "embedding_of", "run",
           "serve_in_thread"]
