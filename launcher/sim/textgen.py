"""Deterministic model outputs: the same request content and seed give the same tokens.

A request's content digest seeds every draw: the natural answer length (lognormal with the
configured mean), the share spent thinking, where in a fixed English-like corpus the text
starts, whether a tool is called and with which arguments, and whether a boilerplate "OK." is
given. The plan is then cut by max_new_tokens / the context, `min_tokens`, `ignore_eos` and
stop strings exactly as SGLang's scheduler would: stop strings are searched in the whole raw
output (thinking included), the matched string is trimmed, and EOS counts as one completion
token.

Multi-step programs get answers they can act on (docs/development/simulator.md#programs): a
tool call's arguments conform to the tool's JSON schema, an answer after tool results quotes
the last one, a tool loop ends after `max_tool_turns` results, and a best-of-n judge prompt
(`BEST:` and candidates marked `[1]`, `[2]`, ...) is answered `BEST: k`.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import re
import zlib
from collections.abc import Sequence
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
# Tool-call string arguments: short words a registered Python function can take as they are.
_ARG_WORDS = ("paris", "london", "tokyo", "apple", "river", "green", "north", "python",
              "report", "summer")
# A string parameter so named gets an arithmetic expression a calculator tool can evaluate.
_EXPRESSION_NAMES = frozenset(("expression", "expr", "formula", "equation", "calculation",
                               "math", "arithmetic"))
SMALL_SPAN = 9  # integers are drawn from [low, low + 9]: small, within the schema's bounds
TOOL_RESULT_ROLES = ("tool", "function")
JUDGE_MARK = "BEST:"
_CANDIDATE = re.compile(r"^[ \t]*\[(\d+)\]", re.MULTILINE)


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
class Conversation:
    """What a chat's messages ask of the answer beyond their digest.

    `judge_candidates` is None unless the last user message is a best-of-n judge prompt;
    then it is the number of distinct candidate markers (`[1]`, `[2]`, ... at line starts),
    at least 1."""

    tool_results: int = 0
    last_tool_result: str | None = None
    judge_candidates: int | None = None


def read_conversation(messages: Sequence[tuple[str, str]]) -> Conversation:
    """The tool results and judge prompt in `messages`, given as (role, text) pairs."""
    results = [text for role, text in messages if role in TOOL_RESULT_ROLES]
    users = [text for role, text in messages if role == "user"]
    judge = None
    if users and JUDGE_MARK in users[-1]:
        judge = max(1, len(set(_CANDIDATE.findall(users[-1]))))
    return Conversation(len(results), results[-1] if results else None, judge)


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
    max_tool_turns: int = 3
    parse_tools: bool = True
    conversation: Conversation = field(default_factory=Conversation)
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


def _schema_type(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):  # ["string", "null"]: the first type that is not null
        kind = next((k for k in kind if k != "null"), "null")
    if isinstance(kind, str):
        return kind
    return "object" if "properties" in schema else "string"


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str, step: int) -> float | None:
    """A numeric bound of `schema`, an exclusive one moved `step` inside."""
    for key, shift in ((inclusive, 0), (exclusive, step)):
        value = schema.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value + shift
    return None


def _small_int(schema: dict[str, Any], rng: random.Random) -> int:
    low_bound = _bound(schema, "minimum", "exclusiveMinimum", 1)
    high_bound = _bound(schema, "maximum", "exclusiveMaximum", -1)
    high = None if high_bound is None else math.floor(high_bound)
    default_low = 1 if high is None else min(1, high)
    low = default_low if low_bound is None else math.ceil(low_bound)
    high = low + SMALL_SPAN if high is None else max(low, min(high, low + SMALL_SPAN))
    return rng.randint(low, high)


def _string(schema: dict[str, Any], name: str, rng: random.Random) -> str:
    word, day = rng.choice(_ARG_WORDS), rng.randint(10, 28)
    formats = {"date": f"2026-01-{day}", "date-time": f"2026-01-{day}T10:30:00Z",
               "email": f"{word}@example.com", "uri": f"https://example.com/{word}"}
    if schema.get("format") in formats:
        return formats[str(schema["format"])]
    if name.lower() in _EXPRESSION_NAMES:
        return f"{rng.randint(2, 20)} {rng.choice('+-*')} {rng.randint(2, 20)}"
    min_length, max_length = schema.get("minLength"), schema.get("maxLength")
    if isinstance(min_length, int) and len(word) < min_length:
        word = (word * min_length)[:min_length]
    return word[:max_length] if isinstance(max_length, int) else word


def sample_value(schema: Any, name: str, rng: random.Random) -> Any:
    """A value that conforms to the JSON schema `schema` of a parameter called `name`:
    a short word (an arithmetic expression for names such as "expression"), a small
    number within the bounds, a boolean, one of the enum's values, or an object or array
    of such values. `const`, `enum`, `anyOf`/`oneOf` (the first branch that is not null) and
    `allOf` (merged) are honoured; `$ref` and `pattern` are not."""
    schema = schema if isinstance(schema, dict) else {}
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return rng.choice(enum)
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            typed = [b for b in branches if not (isinstance(b, dict) and b.get("type") == "null")]
            return sample_value((typed or branches)[0], name, rng)
    parts = schema.get("allOf")
    if isinstance(parts, list) and parts:
        merged = {k: v for part in parts if isinstance(part, dict) for k, v in part.items()}
        return sample_value({**schema, **merged, "allOf": None}, name, rng)
    kind = _schema_type(schema)
    if kind == "object":
        return _object(schema, rng)
    if kind == "array":
        min_items = schema.get("minItems")
        count = max(1, min_items) if isinstance(min_items, int) else 1
        if schema.get("maxItems") == 0:
            count = 0
        return [sample_value(schema.get("items"), name, rng) for _ in range(count)]
    if kind == "integer":
        return _small_int(schema, rng)
    if kind == "number":
        value = float(_small_int(schema, rng))
        high = _bound(schema, "maximum", "exclusiveMaximum", -1)
        return value + 0.5 if high is None or value + 0.5 <= high else value
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return _string(schema, name, rng)


def _object(schema: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Every listed property, and every required one (a word where none is described)."""
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    required = schema.get("required")
    names = [*props, *(r for r in required or () if isinstance(r, str) and r not in props)]
    return {name: sample_value(props.get(name), name, rng) for name in names}


def tool_arguments(parameters: Any, rng: random.Random) -> str:
    """The JSON arguments of a call to a function whose schema is `parameters`: an object
    that the schema accepts, so `function(**json.loads(arguments))` runs."""
    value = _object(parameters if isinstance(parameters, dict) else {}, rng)
    return orjson.dumps(value).decode()


def _choose_tool(req: TextRequest, u: float, pick: int, rng: random.Random) -> ToolCall | None:
    """The call this answer makes, if any. The cap on tool results wins over
    `tool_choice: "required"`, so that every tool loop ends."""
    choice = req.tool_choice
    if not req.tools or choice == "none" or (choice == "auto" and u >= req.tool_rate):
        return None
    if req.conversation.tool_results >= req.max_tool_turns:
        return None
    functions = [t.get("function") or {} for t in req.tools]
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        functions = [f for f in functions if f.get("name") == wanted] or functions
    function = functions[pick % len(functions)]
    return ToolCall(str(function.get("name", "tool")),
                    tool_arguments(function.get("parameters"), rng))


def _answer_pieces(req: TextRequest, rng: random.Random) -> list[str] | None:
    """The content a program asked for: a judge's `BEST: k`, or the last tool result quoted;
    None when the prompt asks for neither."""
    conv = req.conversation
    if conv.judge_candidates is not None:
        return tokenizer.split(f"{JUDGE_MARK} {rng.randint(1, conv.judge_candidates)}")
    if conv.last_tool_result is not None:
        return tokenizer.split(f"The tool returned: {conv.last_tool_result}.")
    return None


def plan_output(req: TextRequest) -> OutputPlan:
    """The deterministic output of `req`, already cut to its limits."""
    digest = hashlib.blake2b(req.key + b"|%d" % req.seed, digest_size=16).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    # lognormal with mean `mean_tokens`: mu = ln(mean) - sigma^2 / 2
    mu = math.log(req.mean_tokens) - req.sigma * req.sigma / 2
    natural = max(MIN_NATURAL, round(rng.lognormvariate(mu, req.sigma)))
    share, u_tool, u_boiler = rng.uniform(0.55, 0.9), rng.random(), rng.random()
    start_a, start_b = rng.choice(_STARTS), rng.choice(_STARTS)
    # The arguments and the judge's pick have a stream of their own, so they leave the
    # lengths and texts drawn above as they were.
    program_rng = random.Random(digest + b"|program")
    tool = _choose_tool(req, u_tool, rng.getrandbits(16), program_rng)
    answer = _answer_pieces(req, program_rng)
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
        if answer is not None and req.conversation.judge_candidates is None:
            # the quote goes before the call; the parser strips the line break between them
            pieces += answer
            ids += [_piece_id(p) for p in answer]
            text_pieces.insert(0, "\n")
        tool_span = (len(pieces), len(pieces) + len(text_pieces))
        pieces += text_pieces
        ids += [_piece_id(p) for p in text_pieces]
    elif req.boilerplate_rate and u_boiler < req.boilerplate_rate:
        pieces += ["OK", "."]
        ids += [11683, 13]
    elif answer is not None:
        pieces += answer
        ids += [_piece_id(p) for p in answer]
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
