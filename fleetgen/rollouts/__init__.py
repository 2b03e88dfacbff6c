"""Programs per prompt: the rollout contract and the rollouts fleetgen ships.

    Rollout, Generate, Prompt, Body, Completion
                         _contract.py: a rollout is `async def f(prompt, generate) -> dict`;
                         `generate(body)` is one call to the job's server
    RolloutSpec          _contract.py: a job's rollout as its manifest keeps it (name, digest
                         of its module, options), loaded and checked on each worker
    CallFailed           _contract.py: a call that failed for good, as a rollout sees it
    prompt_body, rollout_prompt, completion_text, finish_reason, request_digest
                         _contract.py: the helpers rollouts are written with

The worker runs rollouts durably (workers/rollouts.py); the producer names one at enqueue
(`--rollout module:attribute`).
"""

from fleetgen.rollouts._contract import (
    Body,
    CallFailed,
    Completion,
    Generate,
    Prompt,
    Rollout,
    RolloutSpec,
    completion_text,
    finish_reason,
    prompt_body,
    request_digest,
    rollout_prompt,
)

__all__ = [
    "Body",
    "CallFailed",
    "Completion",
    "Generate",
    "Prompt",
    "Rollout",
    "RolloutSpec",
    "completion_text",
    "finish_reason",
    "prompt_body",
    "request_digest",
    "rollout_prompt",
]
