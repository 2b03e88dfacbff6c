"""Programs per prompt: the rollout contract and the rollouts fleetgen ships.

    Rollout, Generate, Prompt, Body, Completion
                         _contract.py: a rollout is `async def f(prompt, generate) -> dict`;
                         `generate(body)` is one call to the job's server
    RolloutSpec          _contract.py: a job's rollout as its manifest keeps it (name, digest
                         of its module, options), loaded and checked on each worker
    CallFailed           _contract.py: a call that failed for good, as a rollout sees it
    prompt_body, rollout_prompt, completion_message, completion_text, finish_reason, request_digest
                         _contract.py: the helpers rollouts are written with

The rollouts fleetgen ships, each a class built with its options and a default instance:

    RetryUnusable, retry_unusable
                         _retry.py: re-ask an empty or cut answer with a larger token cap
    Chunked, chunked     _chunked.py: a long text sent in pieces, the answers stitched
    BestOfN, best_of_n   _judge.py: n candidates, then a judge call picks the best
    ToolLoop, tool_schema
                         _tools.py: the model calls Python functions until it answers (no
                         default instance: the user gives the tools)

The worker runs rollouts durably (workers/rollouts.py); the producer names one at enqueue
(`--rollout module:attribute`); docs/rollouts/ has a page per shipped rollout and one on
writing your own.
"""

from fleetgen.rollouts._chunked import Chunked, chunked
from fleetgen.rollouts._contract import (
    Body,
    CallFailed,
    Completion,
    Generate,
    Prompt,
    Rollout,
    RolloutSpec,
    completion_message,
    completion_text,
    finish_reason,
    prompt_body,
    request_digest,
    rollout_prompt,
)
from fleetgen.rollouts._judge import BestOfN, best_of_n
from fleetgen.rollouts._retry import RetryUnusable, retry_unusable
from fleetgen.rollouts._tools import ToolLoop, tool_schema

__all__ = [
    "BestOfN",
    "Body",
    "CallFailed",
    "Chunked",
    "Completion",
    "Generate",
    "Prompt",
    "RetryUnusable",
    "Rollout",
    "RolloutSpec",
    "ToolLoop",
    "best_of_n",
    "chunked",
    "completion_message",
    "completion_text",
    "finish_reason",
    "prompt_body",
    "request_digest",
    "retry_unusable",
    "rollout_prompt",
    "tool_schema",
]
