"""A small deterministic tokenizer: token counts that behave like a real BPE's, cheaply.

Rule (a simplified GPT-2 pre-tokenizer, each piece counted as one token):
  * an English contraction suffix ('s, 't, 're, 've, 'm, 'll, 'd);
  * one CJK / kana / hangul character;
  * a run of letters, with at most one leading space;
  * one digit, with at most one leading space (Qwen and Llama-3 split numbers per digit);
  * a run of other symbols, with at most one leading space;
  * a run of whitespace.
The pieces partition the text, so `"".join(split(t)) == t`. English prose comes out at about
one token per 5 characters, a little coarser than a real BPE; CJK text at one per character.

The chat prompt count adds Qwen's ChatML template overhead: 4 tokens per message
(`<|im_start|>role\\n ... <|im_end|>\\n`), 3 for the assistant generation prompt, 4 more when
thinking is disabled (the empty `<think>\\n\\n</think>\\n\\n` block), and the tools' JSON
schema plus 10 tokens of instructions when tools are given.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

_PIECE = re.compile(
    r"'(?:s|t|re|ve|m|ll|d)"
    r"|[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]"
    r"| ?[^\W\d_\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]+"
    r"| ?\d"
    r"| ?[^\s\w]+"
    r"| ?_+"
    r"|\s+"
)
PER_MESSAGE = 4
GENERATION_PROMPT = 3
THINKING_OFF_BLOCK = 4
TOOLS_PREAMBLE = 10


def split(text: str) -> list[str]:
    """The token pieces of `text`, in order."""
    return _PIECE.findall(text)


def count(text: str) -> int:
    """The number of tokens in `text`."""
    return len(_PIECE.findall(text))


def content_text(content: Any) -> str:
    """The text of an OpenAI message `content`: a string, or a list of parts with `text`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = [p.get("text") or "" for p in content if isinstance(p, dict)]
    return "\n".join(t for t in texts if isinstance(t, str))


def chat_prompt_tokens(texts: Sequence[str], tools: Iterable[Any] | None, thinking: bool) -> int:
    """Prompt tokens of a chat request whose messages have these texts, template included."""
    total = sum(count(t) for t in texts) + PER_MESSAGE * len(texts) + GENERATION_PROMPT
    if not thinking:
        total += THINKING_OFF_BLOCK
    if tools:
        total += TOOLS_PREAMBLE + count(orjson.dumps(list(tools)).decode())
    return total
