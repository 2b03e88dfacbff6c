"""Re-ask a prompt whose answer came back unusable, with room to finish.

A thinking model given a small `max_tokens` can spend all of it on reasoning and return an
empty `content` cut at "length": the reference job lost 87% of its answers that way. This
rollout sends the prompt as its line asked, and while the answer is unusable (empty or
whitespace content, or cut at the token cap) asks again with the cap multiplied by `growth`.

    retry_unusable = RetryUnusable()              # --rollout fleetgen.rollouts:retry_unusable
    RetryUnusable(tries=5, max_tokens_limit=32768)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetgen.errors import RolloutError
from fleetgen.rollouts._contract import (
    Body,
    CallFailed,
    Completion,
    Generate,
    Prompt,
    completion_message,
    completion_text,
    finish_reason,
    prompt_body,
)

# The two names a body may give its token cap; the newer OpenAI one is grown when present.
_CAP_KEYS = ("max_completion_tokens", "max_tokens")


@dataclass(frozen=True)
class RetryUnusable:
    """Send the prompt; re-ask it with a larger token cap while its answer is unusable, up to
    `tries` calls in all. `growth` multiplies the cap at each re-ask; `max_tokens_limit`, when
    given, is the most a re-ask asks for.

    Answer: `content`, `reasoning_content`, `finish_reason` (of the last call), `attempts`
    (calls made), `reasked` and `usable`. A prompt never answered usably is not failed: its
    last answer is kept with `usable` false. A re-ask the server refuses (a cap past the
    context, say) ends the retries the same way, its reason in `error`.
    """

    tries: int = 3
    growth: float = 4
    max_tokens_limit: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tries, bool) or not isinstance(self.tries, int) or self.tries < 1:
            raise RolloutError(f"RetryUnusable: tries must be an integer of 1 or more, "
                               f"not {self.tries!r}")
        if isinstance(self.growth, bool) or not isinstance(self.growth, int | float) \
                or self.growth < 1:
            raise RolloutError(f"RetryUnusable: growth must be a number of 1 or more, "
                               f"not {self.growth!r}")
        limit = self.max_tokens_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise RolloutError(f"RetryUnusable: max_tokens_limit must be a positive integer "
                               f"or null, not {limit!r}")

    async def __call__(self, prompt: Prompt, generate: Generate) -> dict[str, Any]:
        body = prompt_body(prompt)
        completion = await generate(body)
        attempts, error = 1, None
        while not _usable(completion) and attempts < self.tries:
            body = self._grown(body, completion)
            try:
                completion = await generate(body)
            except CallFailed as exc:
                # The answer in hand stays the prompt's: a larger ask being refused (past the
                # context, say) does not make the prompt a failure.
                error = f"{exc.code}: {exc.message}"
                break
            attempts += 1
        answer = {
            "content": completion_text(completion),
            "reasoning_content": completion_message(completion).get("reasoning_content"),
            "finish_reason": finish_reason(completion),
            "attempts": attempts,
            "reasked": attempts > 1,
            "usable": _usable(completion),
        }
        if error is not None:
            answer["error"] = error
        return answer

    def _grown(self, body: Body, completion: Completion) -> Body:
        """`body` with its token cap times `growth` (within `max_tokens_limit`). A body with
        no cap grows what the answer spent; with neither, it is sent again as it was."""
        key = next((k for k in _CAP_KEYS if k in body), "max_tokens")
        current = body.get(key)
        if not isinstance(current, int):
            spent = (completion.get("usage") or {}).get("completion_tokens")
            if not isinstance(spent, int) or spent < 1:
                return body
            current = spent
        grown = int(current * self.growth)
        if self.max_tokens_limit is not None:
            # Never below what was already asked: the line's own cap may exceed the limit.
            grown = max(current, min(grown, self.max_tokens_limit))
        return {**body, key: grown}


def _usable(completion: Completion) -> bool:
    """An answer with text in its content that was not cut at the token cap."""
    return bool(completion_text(completion).strip()) and finish_reason(completion) != "length"


retry_unusable = RetryUnusable()
