"""The servers fleetgen talks to: one module per kind, one interface, and what the worker
learns about one server.

    ServerKind              the interface (_kind.py): fields it takes, gauges it shows
      SGLang                _sglang.py: /server_info states its concurrency
      VLLM                  _vllm.py: /metrics shows requests running and waiting
      OpenAICompatible      _openai.py: anything else that speaks /v1/chat/completions
      Router                _openai.py: a server of servers (sglang-router, a gateway)
    Server, detect          _server.py: a server as found at first contact; request shaping;
                            what its refusals taught (fields it refuses, its pinned model)
    RequestBody, ChatCompletion
                            _chat.py: OpenAI's chat schema, what is sent and read back
    ServerInfo, fetch_server_info, server_capacity
                            _server_info.py: what a server says about itself (SGLang's
                            /server_info), and the concurrency it states

The worker, the operator's views and the launcher all read servers, so the kinds live in the
domain; how many requests the worker keeps in flight is the worker's (workers/limits.py).
"""

from fleetgen.servers._chat import ChatCompletion, ChatTemplateKwargs, RequestBody
from fleetgen.servers._kind import ServerKind
from fleetgen.servers._openai import OpenAICompatible, Router
from fleetgen.servers._server import KINDS, Server, detect
from fleetgen.servers._server_info import (
    CONFIGURED,
    NO_SUCH_ENDPOINT,
    SERVER_INFO_PATHS,
    ServerCapacity,
    ServerInfo,
    as_float,
    as_int,
    fetch_server_info,
    parse_server_info,
    server_capacity,
    stated_capacity,
)
from fleetgen.servers._sglang import SGLang
from fleetgen.servers._vllm import VLLM

__all__ = [
    "CONFIGURED",
    "KINDS",
    "NO_SUCH_ENDPOINT",
    "SERVER_INFO_PATHS",
    "VLLM",
    "ChatCompletion",
    "ChatTemplateKwargs",
    "OpenAICompatible",
    "RequestBody",
    "Router",
    "SGLang",
    "Server",
    "ServerCapacity",
    "ServerInfo",
    "ServerKind",
    "as_float",
    "as_int",
    "detect",
    "fetch_server_info",
    "parse_server_info",
    "server_capacity",
    "stated_capacity",
]
