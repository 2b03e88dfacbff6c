"""Ask for several answers to a prompt and have the model judge which is best.

`n` candidates are asked as `n` separate calls (a server may refuse `n` > 1, and the worker
sends a rollout's call as it is), then one judge call lists them as `[1] ...`, `[2] ...` and
asks for `BEST: <number>`. The chosen candidate is the prompt's answer.

    best_of_n = BestOfN()                          # --rollout fleetgen.rollouts:best_of_n
    BestOfN(n=8, temperature=1.0, judge="Which answer proves the claim correctly?")
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fleetgen.errors import RolloutError
from fleetgen.rollouts._asking import ask_in_turn, ask_together
from fleetgen.rollouts._contract import (
    Body,
    CallFailed,
    Generate,
    Prompt,
    completion_text,
    finish_reason,
    prompt_body,
)

_JUDGE_INSTRUCTION = ("Here are candidate answers to the same request. "
                     "Judge which one answers it best.")
# The judge's last line, word for word: the simulator answers a prompt ending so with
# "BEST: k", and the verdict is read back with _VERDICT.
_REPLY_FORMAT = 'Reply with the number of the best candidate as "BEST: <number>".'
_VERDICT = re.compile(r"BEST:\s*(\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class BestOfN:
    """Ask `n` candidate answers (at `temperature` when given, else the prompt's; each with its
    own `seed`), then one judge call; the candidate it names is the answer. `judge` replaces the judge's leading
    instruction. The calls go one after another, or the candidates all at once with
    `parallel`. A candidate the server refuses fails the prompt.

    Answer: `content` and `finish_reason` (the chosen candidate's), `chosen` (its number,
    from 1), `judged` (false when the judge named no candidate in range, so the first was
    taken) and `candidates` (their texts, in order).
    """

    n: int = 4
    judge: str | None = None
    temperature: float | None = None
    parallel: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 2:
            raise RolloutError(f"BestOfN: n must be an integer of 2 or more, not {self.n!r}")
        t = self.temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float)
                              or not 0 <= t <= 2):
            raise RolloutError(f"BestOfN: temperature must be a number in [0, 2] or null, "
                               f"not {t!r}")
        if self.judge is not None and (not isinstance(self.judge, str) or not self.judge.strip()):
            raise RolloutError(f"BestOfN: judge must be a non-empty string or null, "
                               f"not {self.judge!r}")

    async def __call__(self, prompt: Prompt, generate: Generate) -> dict[str, Any]:
        body = _one_answer(prompt_body(prompt))
        if self.temperature is not None:
            body["temperature"] = self.temperature
        bodies = [{**body, "seed": seed} for seed in _seeds(body, self.n, generate)]
        outcomes = await (ask_together(generate, bodies) if self.parallel
                          else ask_in_turn(generate, bodies, stop_at_failure=True))
        refused = [outcome for outcome in outcomes if isinstance(outcome, CallFailed)]
        if refused:
            raise refused[0]
        answers = [outcome for outcome in outcomes if not isinstance(outcome, CallFailed)]
        candidates = [completion_text(answer) for answer in answers]
        verdict = await generate(self.judge_body(prompt, candidates))
        chosen = _pick(completion_text(verdict), len(candidates))
        best = chosen or 1
        return {
            "content": candidates[best - 1],
            "finish_reason": finish_reason(answers[best - 1]),
            "chosen": best,
            "judged": chosen is not None,
            "candidates": candidates,
        }

    def judge_body(self, prompt: Prompt, candidates: list[str]) -> Body:
        """The judge call: one user message of the instruction, the request, the candidates
        as `[k] text` and the line asking for "BEST: <number>"; the prompt's sampling, without
        its tools."""
        parts = [self.judge or _JUDGE_INSTRUCTION]
        request = _request_text(prompt["messages"])
        if request:
            parts.append(f"Request:\n{request}")
        parts += [f"[{k}] {text}" for k, text in enumerate(candidates, 1)]
        parts.append(_REPLY_FORMAT)
        return _one_answer({**prompt.get("sampling", {}),
                            "messages": [{"role": "user", "content": "\n\n".join(parts)}]})


def _pick(verdict: str, count: int) -> int | None:
    """The candidate number the judge's reply names in its last `BEST: k`; None when it names
    none from 1 to `count`."""
    found = _VERDICT.findall(verdict)
    if not found:
        return None
    chosen = int(found[-1])
    return chosen if 1 <= chosen <= count else None


def _seeds(body: Body, n: int, generate: Generate) -> list[int]:
    """A seed per candidate, so that they differ: the line's own `seed` plus the candidate's
    index (as a job's several answers get theirs), else drawn from `generate.random`."""
    base = body.get("seed")
    if isinstance(base, int) and not isinstance(base, bool):
        return [base + k for k in range(n)]
    return [generate.random.randrange(2**31) for _ in range(n)]


def _one_answer(body: Body) -> Body:
    """`body` asking for a single choice: a line's own `n` would multiply every call."""
    return {**body, "n": 1} if "n" in body else dict(body)


def _request_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last user message (its text parts, when it has parts)."""
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "\n".join(str(part.get("text", "")) for part in content
                                 if isinstance(part, dict) and part.get("type") == "text")
            return content if isinstance(content, str) else ""
    return ""


best_of_n = BestOfN()
