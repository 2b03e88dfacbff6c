"""Split a long text into pieces the model can take, ask each, and stitch the answers.

The prompt's last user message holds the text (a book to translate, a log to summarise). It is
cut into pieces of at most `size` characters or tokens, at a paragraph, line, sentence or word
boundary where one lies in the second half of the piece, and each piece is sent in that
message's place, the other messages kept. The answers are joined in the pieces' order.

    chunked = Chunked()                            # --rollout fleetgen.rollouts:chunked
    Chunked(size=2000, by="tokens", tokenizer="/models/qwen3/tokenizer.json",
            instruction="Translate to French:")
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from fleetgen.errors import RolloutError
from fleetgen.rollouts._asking import ask_in_turn, ask_together
from fleetgen.rollouts._contract import (
    CallFailed,
    Generate,
    Prompt,
    completion_text,
    finish_reason,
    prompt_body,
)

# Where a piece may end, most preferred first: after a blank line, a line, a sentence, a word.
_BOUNDARIES = (
    re.compile(r"\n[ \t]*\n\s*"),
    re.compile(r"\n\s*"),
    re.compile(r"[.!?。！？][\"')\]»”’]*\s+|[。！？]"),
    re.compile(r"\s+"),
)
_WHITESPACE = re.compile(r"\s")


@dataclass(frozen=True)
class Chunked:
    """Send the last user message's text in pieces of at most `size` units and join the
    answers with `joiner`.

    `by` is "chars" or "tokens" (counted with `tokenizer`: a tokenizer.json, a model folder
    holding one, or a Hugging Face model id, read with the `tokenizers` library); `overlap`
    units of the previous piece start the next one; `instruction` goes before each piece
    ("Translate to French:"). Pieces are asked one after another, or all at once with
    `parallel`. A piece the server refuses fails the prompt, unless `skip_failed`: then it is
    left out of the stitched text and its index listed in `failed`.

    Answer: `content` (the stitched answers), `finish_reason` ("length" when any piece's
    answer was cut at the token cap, else "stop"), `pieces`, `finish_reasons` (one per piece,
    null for a failed one) and `failed` (the indices of the pieces left out).
    """

    size: int = 4000
    by: str = "chars"
    overlap: int = 0
    instruction: str | None = None
    tokenizer: str | None = None
    joiner: str = "\n\n"
    parallel: bool = False
    skip_failed: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise RolloutError(f"Chunked: size must be a positive integer, not {self.size!r}")
        if self.by not in ("chars", "tokens"):
            raise RolloutError(f'Chunked: by must be "chars" or "tokens", not {self.by!r}')
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, int) \
                or not 0 <= self.overlap < self.size:
            raise RolloutError(f"Chunked: overlap must be an integer from 0 to size - 1 "
                               f"({self.size - 1}), not {self.overlap!r}")
        for name in ("instruction", "tokenizer"):
            if not isinstance(getattr(self, name), str | None):
                raise RolloutError(f"Chunked: {name} must be a string or null")
        if not isinstance(self.joiner, str):
            raise RolloutError(f"Chunked: joiner must be a string, not {self.joiner!r}")
        if self.by == "tokens":
            if not self.tokenizer:
                raise RolloutError('Chunked: by="tokens" counts with the served model\'s '
                                   "tokenizer: name it (tokenizer: a tokenizer.json, a model "
                                   "folder or a Hugging Face model id)")
            if importlib.util.find_spec("tokenizers") is None:
                raise RolloutError('Chunked: by="tokens" needs the tokenizers library, not '
                                   "installed here: pip install 'fleetgen[rollouts]' (on the producer's "
                                   "machine and every worker node)")

    async def __call__(self, prompt: Prompt, generate: Generate) -> dict[str, Any]:
        messages: list[dict[str, Any]] = list(prompt["messages"])
        where = _last_user(messages)
        pieces = await generate.run(self.split, _text_of(messages[where]))
        bodies = [prompt_body(prompt, messages=[
            *messages[:where], {**messages[where], "content": self._content(piece)},
            *messages[where + 1:]]) for piece in pieces]
        if self.parallel:
            outcomes = await ask_together(generate, bodies)
        else:
            outcomes = await ask_in_turn(generate, bodies, stop_at_failure=not self.skip_failed)
        errors = [outcome for outcome in outcomes if isinstance(outcome, CallFailed)]
        if errors and not self.skip_failed:
            raise errors[0]
        reasons = [None if isinstance(o, CallFailed) else finish_reason(o) for o in outcomes]
        return {
            "content": self.joiner.join(completion_text(outcome) for outcome in outcomes
                                        if not isinstance(outcome, CallFailed)),
            # What the prompt's record shows: "length" when any piece's answer was cut.
            "finish_reason": "length" if "length" in reasons else "stop",
            "pieces": len(pieces),
            "finish_reasons": reasons,
            "failed": [k for k, outcome in enumerate(outcomes) if isinstance(outcome, CallFailed)],
        }

    def split(self, text: str) -> list[str]:
        """The pieces of `text`, in order; without overlap they join back into `text`, less
        any piece of whitespace alone."""
        if self.by == "chars":
            spans = _spans(text, range(len(text)), self.size, self.overlap)
        else:
            encoding = self._tokenizer.encode(text, add_special_tokens=False)
            starts = [start for start, _ in encoding.offsets]
            spans = _spans(text, starts, self.size, self.overlap)
        return [text[begin:end] for begin, end in spans if text[begin:end].strip()]

    def _content(self, piece: str) -> str:
        piece = piece.strip()
        return f"{self.instruction}\n\n{piece}" if self.instruction else piece

    @cached_property
    def _tokenizer(self) -> Any:
        """The tokenizer named by `tokenizer`, loaded once, counting a whole text."""
        tokenizers = importlib.import_module("tokenizers")
        name = str(self.tokenizer)
        path = os.path.join(name, "tokenizer.json") if os.path.isdir(name) else name
        try:
            if os.path.isfile(path):
                loaded = tokenizers.Tokenizer.from_file(path)
            else:
                loaded = tokenizers.Tokenizer.from_pretrained(name)
        except Exception as exc:  # noqa: BLE001 (the library's own errors say why)
            raise RolloutError(f"Chunked: cannot load tokenizer {name!r} ({exc}); give a "
                               "tokenizer.json, a model folder holding one, or a Hugging Face "
                               "model id this node can fetch") from None
        # A tokenizer.json may cap or pad encodings (for training); counting needs neither.
        loaded.no_truncation()
        loaded.no_padding()
        return loaded


def _last_user(messages: list[dict[str, Any]]) -> int:
    for k in range(len(messages) - 1, -1, -1):
        if messages[k].get("role") == "user":
            return k
    raise ValueError("Chunked: the prompt has no user message to hold the text to split")


def _text_of(message: dict[str, Any]) -> str:
    """A message's text: its string content, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text" for part in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise ValueError("Chunked: the last user message must hold text (a string, or text parts "
                     "only), not images or other parts")


def _spans(text: str, starts: Sequence[int], size: int,
           overlap: int) -> list[tuple[int, int]]:
    """Where to cut `text` into pieces of at most `size` units, unit k starting at character
    `starts[k]`, each next piece starting `overlap` units before the last one's end: the
    pieces' (start, end) character offsets."""
    count = len(starts)

    def bound(k: int) -> int:
        return starts[k] if k < count else len(text)

    spans: list[tuple[int, int]] = []
    first = done = 0  # the unit the piece starts at; the unit up to which text is covered
    while done < count:
        end = first + size
        cut = count
        if end < count:
            low, high = bound(first), bound(end)
            # A boundary counts only past half the piece (no crumbs) and past what is done.
            floor = max(bound(done) + 1, low + (high - low) // 2)
            at = _boundary(text, low, high, floor)
            cut = end if at is None else bisect_left(starts, at)
            # A character split into several tokens starts them all: cut before the first of
            # them, or past them all when not one whole character fits in `size` tokens.
            cut = bisect_left(starts, bound(cut))
            if bound(cut) <= bound(done) and first < done:
                first = done  # the overlap leaves no room: this piece goes without it
                continue
            if bound(cut) <= bound(done):
                cut = bisect_right(starts, bound(done))
        spans.append((bound(first), bound(cut)))
        first, done = (_overlap_start(text, starts, first, cut, overlap)
                       if overlap and cut < count else cut), cut
    return spans


def _boundary(text: str, low: int, high: int, floor: int) -> int | None:
    """The character index just past the most preferred boundary in text[low:high] that
    ends at or past `floor`; None when there is none."""
    for pattern in _BOUNDARIES:
        ends = [m.end() for m in pattern.finditer(text, low, high) if m.end() >= floor]
        if ends:
            return ends[-1]
    return None


def _overlap_start(text: str, starts: Sequence[int], first: int, done: int,
                   overlap: int) -> int:
    """The unit the next piece starts at: `overlap` units back from `done` (after `first`,
    where the last piece started), moved forward past the first whitespace there so that it
    starts at a word."""
    back = bisect_left(starts, starts[max(done - overlap, first + 1)])
    if starts[back] <= starts[first]:
        return done
    space = _WHITESPACE.search(text, starts[back], starts[done])
    if space is None:
        return back
    return min(done, bisect_left(starts, space.end()))


chunked = Chunked()
