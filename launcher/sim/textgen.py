"""Deterministic model outputs: the same request content and seed give the same tokens.

A request's content digest seeds every draw: the natural answer length (lognormal with the
configured mean), the share spent thinking, where in a fixed English-like corpus the text
starts, whether a tool is called and whether a boilerplate "OK." is given. The plan is then
cut by max_new_tokens / the context, `min_tokens`, `ignore_eos` and stop strings exactly as
SGLang's scheduler would: stop strings are searched in the whole raw output (thinking
included), the matched string is trimmed, and EOS counts as one completion token.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import zlib
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import orjson

from launcher.sim import tokenizer

EOS_ID = 151645  # Qwen's <|im_end|>: the `matched_stop` of a natural finish
THINK_END = "</think>"
THINK_END_ID = 151668
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PARAGRAPH = "\n\n"
MIN_NATURAL = 4
_WORDS_TEXT = (
    "the of and to in is that for it as with was on be by this are or from at which but not "
    "have an they you one all were we there can their has more if will each about when how "
    "up out them then she many some so these would other into time two make like him see "
    "could first way been people now find long down day did get come made may part number "
    "answer question result value model system data step check case point order sense need "
    "consider example given means next also because first second third note since both "
    "simple clear likely better rather total small large final whole"
)
_WORDS = tuple(_WORDS_TEXT.split())


def _piece_id(piece: str) -> int:
    return 1000 + zlib.crc32(piece.encode()) % 150000


def _build_corpus(n_pieces: int = 1 << 15) -> tuple[list[str], list[int], list[int]]:
    """Pieces of plain sentences, their token ids, and the indices where sentences start."""
    rng = random.Random(20260101)  # fixed: the corpus is part of the simulator, not of --seed
    pieces: list[str] = []
    starts: list[int] = []
    while len(pieces) < n_pieces:
        for _ in range(rng.randint(3, 6)):
            starts.append(len(pieces))
            words = rng.choices(_WORDS, k=rng.randint(5, 18))
            lead = "" if not pieces or pieces[-1] == PARAGRAPH else " "
            pieces.append(lead + words[0].capitalize())
            for i, word in enumerate(words[1:], 1):
                pieces.append(" " + word)
                if i % 7 == 0 and i < len(words) - 1:
                    pieces.append(",")
            pieces.append(".")
        pieces.append(PARAGRAPH)
    return pieces, [_piece_id(p) for p in pieces], starts


_CORPUS, _CORPUS_IDS, _STARTS = _build_corpus()


def _take(start: int, n: int) -> tuple[list[str], list[int]]:
    pieces, ids = _CORPUS[start:start + n], _CORPUS_IDS[start:start + n]
    while len(pieces) < n:
        more = n - len(pieces)
        pieces += _CORPUS[:more]
        ids += _CORPUS_IDS[:more]
    if pieces and pieces[0].startswith(" "):
        pieces[0] = pieces[0][1:]
    return pieces, ids


@dataclass(frozen=True)
class ToolCall:
    """One parsed function call."""

    name: str
    arguments: str  # a JSON string, as OpenAI sends it


@dataclass(frozen=True)
class TextRequest:
    """What decides an output: content digest, switches, and the cuts to apply."""

    key: bytes
    seed: int
    mean_tokens: float
    sigma: float
    limit: int
    thinking: bool = False
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: Any = "auto"
    tool_rate: float = 0.0
    parse_tools: bool = True
    boilerplate_rate: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = ()


@dataclass
class OutputPlan:
    """The generated tokens: visible text per token (stop string trimmed) and ids."""

    pieces: list[str]
    ids: list[int]
    thinking: bool
    think_end: int
    finish: str
    matched: int | str | None
    tool_call: ToolCall | None = None
    tool_span: tuple[int, int] | None = field(default=None)

    @property
    def n_tokens(self) -> int:
        """Completion tokens (reasoning included)."""
        return len(self.pieces)

    @property
    def reasoning_tokens(self) -> int:
        """Tokens up to and including </think> (all of them if cut while thinking)."""
        if not self.thinking:
            return 0
        return self.think_end + 1 if self.think_end >= 0 else self.n_tokens


def _arguments(function: dict[str, Any]) -> str:
    params = function.get("parameters") or {}
    props = params.get("properties") if isinstance(params, dict) else None
    samples = {"string": "example", "integer": 1, "number": 1.0, "boolean": True,
               "array": [], "object": {}}
    args = {}
    for name, schema in (props or {}).items():
        schema = schema if isinstance(schema, dict) else {}
        enum = schema.get("enum")
        args[name] = enum[0] if enum else samples.get(str(schema.get("type")), "example")
    return orjson.dumps(args).decode()


def _choose_tool(req: TextRequest, u: float, pick: int) -> ToolCall | None:
    choice = req.tool_choice
    if not req.tools or choice == "none" or (choice == "auto" and u >= req.tool_rate):
        return None
    functions = [t.get("function") or {} for t in req.tools]
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        functions = [f for f in functions if f.get("name") == wanted] or functions
    function = functions[pick % len(functions)]
    return ToolCall(str(function.get("name", "tool")), _arguments(function))


def plan_output(req: TextRequest) -> OutputPlan:
    """The deterministic output of `req`, already cut to its limits."""
    digest = hashlib.blake2b(req.key + b"|%d" % req.seed, digest_size=16).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    # lognormal with mean `mean_tokens`: mu = ln(mean) - sigma^2 / 2
    mu = math.log(req.mean_tokens) - req.sigma * req.sigma / 2
    natural = max(MIN_NATURAL, round(rng.lognormvariate(mu, req.sigma)))
    share, u_tool, u_boiler = rng.uniform(0.55, 0.9), rng.random(), rng.random()
    start_a, start_b = rng.choice(_STARTS), rng.choice(_STARTS)
    tool = _choose_tool(req, u_tool, rng.getrandbits(16))
    pieces: list[str] = []
    ids: list[int] = []
    think_end = -1
    if req.thinking:
        n_reason = max(1, min(int(natural * share), natural - MIN_NATURAL))
        pieces, ids = _take(start_a, min(n_reason, req.limit))
        think_end = len(pieces)
        pieces += [THINK_END, PARAGRAPH]
        ids += [THINK_END_ID, 271]
        natural -= n_reason + 2
    tool_span = None
    if tool is not None:
        body = orjson.dumps({"name": tool.name, "arguments": orjson.loads(tool.arguments)})
        text_pieces = [TOOL_OPEN, "\n", *tokenizer.split(body.decode()), "\n", TOOL_CLOSE]
        tool_span = (len(pieces), len(pieces) + len(text_pieces))
        pieces += text_pieces
        ids += [_piece_id(p) for p in text_pieces]
    elif req.boilerplate_rate and u_boiler < req.boilerplate_rate:
        pieces += ["OK", "."]
        ids += [11683, 13]
    else:
        more, more_ids = _take(start_b, min(max(1, natural - 1), req.limit))
        pieces += more
        ids += more_ids
    pieces.append("")
    ids.append(EOS_ID)
    return _cut(req, pieces, ids, think_end, tool, tool_span, start_b)


def _extend(pieces: list[str], ids: list[int], target: int, start: int) -> None:
    """Keep generating past a suppressed EOS until `target` tokens exist."""
    more, more_ids = _take(start, target - len(pieces))
    if more and pieces and not pieces[-1].endswith(("\n", " ")):
        more[0] = " " + more[0]
    pieces += more
    ids += more_ids


def _apply_eos_rules(req: TextRequest, pieces: list[str], ids: list[int], start: int) -> None:
    """ignore_eos: never stop, run to the limit. min_tokens: EOS is masked until then."""
    if req.ignore_eos:
        pieces.pop()
        ids.pop()
        _extend(pieces, ids, req.limit, start)
    elif len(pieces) - 1 < req.min_tokens:
        pieces.pop()
        ids.pop()
        _extend(pieces, ids, min(req.min_tokens, req.limit), start)
        pieces.append("")
        ids.append(EOS_ID)


def _cut(req: TextRequest, pieces: list[str], ids: list[int], think_end: int,
         tool: ToolCall | None, tool_span: tuple[int, int] | None, start: int) -> OutputPlan:
    _apply_eos_rules(req, pieces, ids, start)
    pieces, ids = pieces[:req.limit], ids[:req.limit]
    stop = _find_stop(pieces, req.stop, req.min_tokens) if req.stop else None
    finish: str = "length"
    matched: int | str | None = None
    if stop is not None:
        n_tokens, cut_at, matched = stop
        pieces, ids, finish = _trim(pieces[:n_tokens], cut_at), ids[:n_tokens], "stop"
    elif ids and ids[-1] == EOS_ID:
        finish, matched = "stop", EOS_ID
    if think_end >= len(pieces):
        think_end = -1
    complete = req.parse_tools and finish == "stop" and stop is None and tool_span is not None
    complete_tool = tool if complete else None
    if complete_tool is not None:
        finish, matched = "tool_calls", None
    return OutputPlan(pieces, ids, req.thinking, think_end, finish, matched,
                      complete_tool, tool_span if complete_tool else None)


def _find_stop(pieces: list[str], stops: tuple[str, ...],
               min_tokens: int) -> tuple[int, int, str] | None:
    """(tokens generated, char where the output is cut, stop) of the earliest stop match."""
    text = "".join(pieces)
    ends = list(accumulate(len(p) for p in pieces))
    best: tuple[int, int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        pos = text.find(stop)
        while pos >= 0:
            k = bisect.bisect_left(ends, pos + len(stop))
            if k + 1 >= min_tokens:
                if best is None or (k + 1, pos) < (best[0], best[1]):
                    best = (k + 1, pos, stop)
                break
            pos = text.find(stop, pos + 1)
    return best


def _trim(pieces: list[str], cut_at: int) -> list[str]:
    out: list[str] = []
    used = 0
    for piece in pieces:
        keep = max(0, min(len(piece), cut_at - used))
        out.append(piece[:keep])
        used += len(piece)
    return out
