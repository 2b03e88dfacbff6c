"""Rollouts the end-to-end tests run (tests/system/test_rollouts.py, tests/perf/rollouts.py):
importable as `tests.rollout_flows` by the producer and by every worker the tests start."""

from __future__ import annotations

import random
import time
from typing import Any

from fleetgen.rollouts import Generate, Prompt, ToolLoop, completion_text, prompt_body


async def revise(prompt: Prompt, generate: Generate) -> dict[str, Any]:
    """Draft, critique, revise: three calls, each built from the answers before it."""
    draft = completion_text(await generate(prompt_body(prompt)))
    ask = [*prompt["messages"], {"role": "assistant", "content": draft}]
    critique = completion_text(await generate(prompt_body(
        prompt, messages=[*ask, {"role": "user", "content": "Critique that answer."}])))
    final = await generate(prompt_body(prompt, messages=[
        *ask, {"role": "user", "content": f"Revise it given this critique: {critique}"}]))
    return {"content": completion_text(final), "draft": draft, "critique": critique}


async def unstable(prompt: Prompt, generate: Generate) -> dict[str, Any]:
    """Asks its second call with a draw from the process's own random state, not
    `generate.random`: run again after a crash that came between its second and third calls,
    it asks another second call than the journal holds."""
    first = completion_text(await generate(prompt_body(prompt)))
    again = [*prompt["messages"], {"role": "assistant", "content": first},
             {"role": "user", "content": f"Again, variant {random.random()}"}]
    second = completion_text(await generate(prompt_body(prompt, messages=again)))
    third = await generate(prompt_body(prompt, messages=[
        *again, {"role": "assistant", "content": second}, {"role": "user", "content": "Once more."}]))
    return {"content": completion_text(third)}


async def crashes(prompt: Prompt, generate: Generate) -> dict[str, Any]:
    """A bug every prompt meets after its first call."""
    answer = await generate(prompt_body(prompt))
    return {"content": answer["choices"][0]["message"]["no such field"]}


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def slow_lookup(query: str) -> str:
    """Look a word up in a slow local index."""
    time.sleep(0.5)
    return f"entry for {query}"


tools = ToolLoop(tools={"add": add})
slow_tools = ToolLoop(tools={"slow_lookup": slow_lookup})
