"""The servers fleetgen talks to: one module per kind, one interface, and what the worker
learns about one server.

    ServerKind              the interface (_kind.py): fields it takes, gauges it shows
      SGLang                _sglang.py: /server_info states its concurrency
      VLLM                  _vllm.py: /metrics shows requests running and waiting
      OpenAICompatible      _openai.py: anything else that speaks /v1/chat/completions
    Server, detect          _server.py: a server as found at first contact; request shaping;
                            what its refusals taught (fields it refuses, its pinned model)
    QueueWatch, Gradient    _limits.py: the concurrency of a server that does not state it
"""

from workers.servers._kind import ServerKind
from workers.servers._limits import Gradient, QueueWatch
from workers.servers._openai import OpenAICompatible
from workers.servers._server import KINDS, Server, detect
from workers.servers._sglang import SGLang
from workers.servers._vllm import VLLM

__all__ = [
    "KINDS",
    "VLLM",
    "Gradient",
    "OpenAICompatible",
    "QueueWatch",
    "SGLang",
    "Server",
    "ServerKind",
    "detect",
]
