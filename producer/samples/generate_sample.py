"""Write the bundled demo prompts, or a large synthetic file for benchmarks. Deterministic, offline.

Usage::

    python -m producer.samples.generate_sample          # rewrites producer/samples/sample.jsonl
    python -m producer.samples.generate_sample --lines 1000000 --out /tmp/big.jsonl  # ~1 KB lines
    python -m producer.samples.generate_sample --lines 5000 --out /tmp/capped.jsonl --canary-demo

The bulk lines leave `max_tokens` at the job's default (16,384) or set it as large, so a
thinking model has room to answer and the job stays healthy. `--canary-demo` caps them at
512 and 256 tokens instead: a thinking model spends those on thinking, the answers come back
empty, and the quality canary pauses the job (what it is there to show).
"""

import argparse
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from fleetgen.job import DEFAULT_MAX_TOKENS
from producer.samples import SAMPLE_PATH

SEED = 20240611
SAMPLE_MIX = {"plain": 50, "chat": 70, "tools": 45, "openai": 35}  # lines of each kind: 200
BULK_LINE_BYTES = 1000  # roughly; the benchmark target is "~1 KB lines"
_BULK_ENVELOPE_BYTES = 250  # a bulk line's JSON around its user text: id, system prompt, params
_WRITE_BATCH = 10_000  # lines joined per write: fewer syscalls, bounded memory
# max_tokens of the bulk lines that set one (sampling object, OpenAI Batch body): the job's
# default, room for a long thinking answer. --canary-demo: caps a thinking model spends on
# thinking alone, so most answers come back empty and the canary pauses the job.
BULK_MAX_TOKENS = (DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS)
CANARY_DEMO_MAX_TOKENS = (512, 256)
CANARY_DEMO_NOTE = ("these lines cap max_tokens at 512 and 256: a thinking model spends them on "
                    "thinking, and the quality canary pauses the job (--canary-demo; leave it "
                    "out for a healthy job)")

Json = dict[str, Any]

SYSTEM_PROMPTS = [
    "You are a helpful assistant. Answer concisely and say when you are unsure.",
    "You are a senior software engineer who reviews code carefully and explains trade-offs.",
    "You are a patient maths tutor. Show each step and check the final answer.",
    "You are a science communicator writing for curious high-school students.",
    "You are an editor. Keep the author's voice, fix grammar, and tighten the prose.",
]

PLAIN_PROMPTS = [
    "Write a Python function that merges overlapping intervals in a list of (start, end) pairs.",
    "Explain the difference between a process and a thread, with one example of each.",
    "What does the `yield` keyword do in Python? Give a short generator example.",
    "Write a SQL query that returns the top 3 customers by total order value in {year}.",
    'Convert this bash loop to Python: for f in *.log; do gzip "$f"; done',
    "Why is binary search O(log n)? Explain it to someone who knows basic algebra.",
    "Solve for x: {a}x + {b} = {c}. Show your working.",
    "Prove that the sum of the first n odd numbers is n squared.",
    "What is the derivative of x^{a} * sin(x)?",
    "A train leaves at {hour}:00 travelling {speed} km/h. How far has it gone by {later}:30?",
    (
        "Explain Bayes' theorem using a medical test that is {acc}% accurate for a disease "
        "affecting 1 in {rare} people."
    ),
    "Write a haiku about {subject}.",
    "Write a 150-word short story that begins with the sentence: 'The {subject} was late again.'",
    "Draft a polite email declining a meeting about {topic} next {day}.",
    "Suggest five titles for a blog post about {topic}.",
    "Why is the sky blue but sunsets are red?",
    "Explain how mRNA vaccines teach the immune system to recognise a virus.",
    "What causes the seasons on Earth? Address the common misconception about distance.",
    "Describe the Krebs cycle in plain language, in under 200 words.",
    "How do noise-cancelling headphones work?",
    "Review this function and point out bugs and style problems:\n\n{code}",
    "Summarise this passage in three bullet points, then suggest a title:\n\n{passage}",
    "Rewrite this passage for a ten-year-old reader:\n\n{passage}",
]

CODE = """def average(xs):
    total = 0
    for i in range(1, len(xs)):
        total += xs[i]
    return total / len(xs)


def read_config(path):
    f = open(path)
    data = eval(f.read())
    return data
"""

PASSAGES = [
    (
        "The Antikythera mechanism, recovered from a shipwreck off a Greek island in 1901, is a "
        "hand-powered bronze device from the second or first century BC. Its interlocking "
        "gears modelled the movements of the Sun and Moon, predicted eclipses decades ahead, and "
        "tracked the four-year cycle of athletic games. Nothing of comparable complexity "
        "survives from the following thousand years, which makes it a puzzle for historians of "
        "technology: either the knowledge was rare and lost, or similar devices existed and "
        "were melted down for metal."
    ),
    (
        "Urban heat islands form because asphalt, concrete and roofs absorb sunlight during the "
        "day and release it slowly at night, while buildings block the wind and there is little "
        "vegetation to cool the air through evaporation. On summer nights a dense city centre "
        "can be several degrees warmer than the surrounding countryside. Cities respond with "
        "reflective roofs, street trees, parks and water features, which also reduce energy use "
        "for cooling."
    ),
]

FILLS: dict[str, list[str]] = {
    "year": ["2021", "2022", "2023", "2024"],
    "subject": ["autumn rain", "a lighthouse", "the night bus", "a cat", "an old library", "snow"],
    "topic": ["quarterly budgets", "database migrations", "remote onboarding", "API versioning"],
    "day": ["Monday", "Tuesday", "Thursday", "Friday"],
    "code": [CODE],
    "passage": PASSAGES,
}

# Chat scripts, separated by blank lines: a SYSTEM_PROMPTS index, then turns alternating
# user/assistant, one per line. A sample chat is cut after one of its user turns.
_SCRIPTS = """
1
I keep getting 'list index out of range' in my loop. What usually causes that?
Usually the loop runs one step too far, or the list shrinks while you iterate over it.
Here is the loop: for i in range(len(items)): if items[i] < 0: items.pop(i)
That is the second case: pop() shortens the list, so the last indices no longer exist.
How would I rewrite it with a list comprehension?

2
Can you explain what a p-value is?
The probability of data at least this extreme if the null hypothesis were true.
So is p = 0.04 strong evidence?
Modest at best: it depends on prior plausibility, effect size and how many tests were run.
What should I report alongside it?

4
Tighten this: 'In order to be able to finish on time, we need to make sure all know the deadline.'
'To finish on time, everyone needs to know the deadline.'
Make it sound more formal.
'Timely completion requires that all team members are aware of the deadline.'
Now make it friendlier for a team chat.

3
What is the difference between weather and climate?
Weather is the atmosphere over hours or days; climate is the pattern of weather over decades.
Then how can a cold winter happen during global warming?
One winter is weather; the warming trend shows only in averages over years and the globe.
Give me a short analogy I can use with my class.

2
How do I compute the eigenvalues of [[2, 1], [1, 2]]?
Solve det(A - λI) = 0: (2 - λ)^2 - 1 = 0, so λ = 1 or λ = 3.
What are the eigenvectors?
For λ = 3, (1, 1); for λ = 1, (1, -1). Check: A(1, 1) = (3, 3).
Why are they orthogonal here?

0
I'm writing a cover letter for a junior data analyst job. How should I open it?
Open with the role, where you saw it, and one concrete result you are proud of.
Here is my draft opening: 'I am writing to apply for the job I saw online.'
Name the role and add a result, e.g. a weekly report you automated and the hours it saved.
Shorter, please, and less formal.

1
Should I use a dataclass or a TypedDict for rows read from a JSON file?
TypedDict if rows stay plain dicts; a dataclass for validation, methods or immutability.
The file has a million rows. Does that change the answer?
Slotted dataclasses are smaller than dicts, but converting costs time: measure on a sample.
Show me a slots dataclass with a from_json classmethod.

3
Why do we see only one side of the Moon?
The Moon is tidally locked: it turns once on its axis for every orbit of the Earth.
Did it always rotate like that?
No. Earth's pull on tidal bulges slowed the young Moon's spin until rotation matched orbit.
Is the Earth slowing down the same way?
"""
CONVERSATIONS: list[tuple[int, list[str]]] = [
    (int(block.split("\n")[0]), block.split("\n")[1:]) for block in _SCRIPTS.strip().split("\n\n")
]

TOOLS: dict[str, Json] = {
    "get_weather": {
        "description": "Get the current weather or a forecast for a city.",
        "parameters": {
            "city": {"type": "string", "description": "City name, e.g. 'Lisbon'"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days_ahead": {"type": "integer", "minimum": 0, "maximum": 7},
        },
        "required": ["city"],
    },
    "search_docs": {
        "description": "Search the internal product documentation.",
        "parameters": {
            "query": {"type": "string"},
            "top_k": {"type": "integer", "minimum": 1, "maximum": 20},
        },
        "required": ["query"],
    },
    "convert_currency": {
        "description": "Convert an amount between two ISO 4217 currencies at today's rate.",
        "parameters": {
            "amount": {"type": "number"},
            "from_currency": {"type": "string"},
            "to_currency": {"type": "string"},
        },
        "required": ["amount", "from_currency", "to_currency"],
    },
    "get_stock_price": {
        "description": "Get the latest price of a stock by ticker symbol.",
        "parameters": {"ticker": {"type": "string"}},
        "required": ["ticker"],
    },
}

# (tool, question, call arguments); an argument value naming a slot ("city") takes its value.
TOOL_QUESTIONS: list[tuple[str, str, Json]] = [
    ("get_weather", "Do I need an umbrella in {city} tomorrow?", {"city": "city", "days_ahead": 1}),
    (
        "get_weather",
        "What's the temperature in {city} right now, in fahrenheit?",
        {"city": "city", "unit": "fahrenheit"},
    ),
    ("search_docs", "How do I configure retries in the SDK?", {"query": "configure retries"}),
    ("search_docs", "Find the docs page about rotating API keys.", {"query": "rotate API keys"}),
    (
        "convert_currency",
        "How much is {amount} EUR in JPY?",
        {"amount": "amount", "from_currency": "EUR", "to_currency": "JPY"},
    ),
    (
        "get_stock_price",
        "What is {ticker} trading at, and is that up on the week?",
        {"ticker": "ticker"},
    ),
]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Montreal", "Reykjavik", "Santiago", "Hanoi"]
TICKERS = ["AAPL", "MSFT", "NVDA", "SAP", "TSM"]


def sample_lines(seed: int = SEED) -> Iterator[Json]:
    """Yield the demo prompts: plain, multi-turn, tool-calling and OpenAI Batch lines, mixed."""
    rng = random.Random(seed)
    kinds = [kind for kind, count in SAMPLE_MIX.items() for _ in range(count)]
    rng.shuffle(kinds)
    makers = {"plain": _plain, "chat": _chat, "tools": _tool_call, "openai": _openai}
    unnamed: set[str] = set()
    for n, kind in enumerate(kinds, 1):
        line = makers[kind](rng, n)
        if kind == "plain" and "id" not in line:
            # A repeated prompt without an id repeats its content-hash id, which the reader rejects.
            if line["prompt"] in unnamed:
                line = {"id": f"plain-{n:04d}", **line}
            unnamed.add(line["prompt"])
        yield line


def bulk_lines(count: int, seed: int = SEED,
               max_tokens: tuple[int, int] = BULK_MAX_TOKENS) -> Iterator[bytes]:
    """Yield ``count`` distinct JSONL lines of about BULK_LINE_BYTES each, in all three shapes;
    ``max_tokens`` is (chat lines' sampling, OpenAI Batch lines' body)."""
    rng = random.Random(seed)
    turns = [turn for _, script in CONVERSATIONS for turn in script]
    words = " ".join(_fill(rng, p) for p in PLAIN_PROMPTS + turns).split()
    texts = [_text(rng, words, BULK_LINE_BYTES - _BULK_ENVELOPE_BYTES) for _ in range(997)]
    for n in range(count):
        text = f"Request {n}: {texts[n % len(texts)]}"
        messages = [{"role": "system", "content": SYSTEM_PROMPTS[n % 5]}, _user(text)]
        if n % 10 < 6:
            sampling = {"max_tokens": max_tokens[0]}
            line: Json = {"id": f"bulk-{n}", "messages": messages, "sampling": sampling}
        elif n % 10 < 8:
            line = {"prompt": text}  # no id: exercises the content-hash path
        else:
            body = {"model": "default", "messages": messages, "max_tokens": max_tokens[1]}
            line = _batch_line(f"bulk-{n}", body)
        yield orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)


def write_sample(path: str | Path = SAMPLE_PATH, seed: int = SEED) -> int:
    """Write the demo prompts to ``path`` and return how many lines were written."""
    return _write(path, (orjson.dumps(line) + b"\n" for line in sample_lines(seed)))


def write_bulk(path: str | Path, count: int, seed: int = SEED, canary_demo: bool = False) -> int:
    """Write ``count`` synthetic ~1 KB prompt lines to ``path`` and return ``count``; with
    ``canary_demo``, lines the quality canary pauses (CANARY_DEMO_MAX_TOKENS)."""
    caps = CANARY_DEMO_MAX_TOKENS if canary_demo else BULK_MAX_TOKENS
    return _write(path, bulk_lines(count, seed, caps))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--lines", type=int, help="write this many ~1 KB synthetic lines")
    parser.add_argument("--out", type=Path, help=f"output path (default: {SAMPLE_PATH})")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--canary-demo", action="store_true",
                        help="with --lines: cap max_tokens at 512/256, so a thinking model's "
                        "answers come back empty and the quality canary pauses the job")
    args = parser.parse_args(argv)
    if args.lines is None:
        if args.canary_demo:
            parser.error("--canary-demo needs --lines")
        written = write_sample(args.out or SAMPLE_PATH, args.seed)
    elif args.out is None:
        parser.error("--lines needs --out")
    else:
        written = write_bulk(args.out, args.lines, args.seed, canary_demo=args.canary_demo)
    print(f"wrote {written} lines to {args.out or SAMPLE_PATH}")
    if args.canary_demo:
        print(f"note: {CANARY_DEMO_NOTE}")
    return 0


def _write(path: str | Path, lines: Iterator[bytes]) -> int:
    count = 0
    batch: list[bytes] = []
    with open(path, "wb") as out:
        for line in lines:
            batch.append(line)
            if len(batch) == _WRITE_BATCH:
                out.write(b"".join(batch))
                count += len(batch)
                batch.clear()
        out.write(b"".join(batch))
    return count + len(batch)


def _fill(rng: random.Random, template: str) -> str:
    values = {key: rng.choice(options) for key, options in FILLS.items()}
    values.update(
        a=str(rng.randint(2, 9)), b=str(rng.randint(1, 40)), c=str(rng.randint(41, 99)),
        hour=str(rng.randint(6, 11)), later=str(rng.randint(13, 18)),
        speed=str(rng.choice([80, 120, 160, 240])), acc=str(rng.choice([95, 99])),
        rare=str(rng.choice([100, 1000, 10000])), city=rng.choice(CITIES),
        amount=str(rng.choice([25, 250, 1200, 9999])), ticker=rng.choice(TICKERS),
    )  # fmt: skip
    return template.format(**values)


def _text(rng: random.Random, words: list[str], length: int) -> str:
    text = ""
    while len(text) < length:
        text += " " + rng.choice(words)
    return text.strip()


def _user(content: str) -> Json:
    return {"role": "user", "content": content}


def _plain(rng: random.Random, n: int) -> Json:
    line: Json = {"prompt": _fill(rng, rng.choice(PLAIN_PROMPTS))}
    if n % 3 == 0:
        line = {"id": n, **line}  # integer ids are allowed too
    elif n % 3 == 1:
        line = {"id": f"plain-{n:04d}", **line}
    return line  # the rest get content-hash ids


def _chat(rng: random.Random, n: int) -> Json:
    system, script = rng.choice(CONVERSATIONS)
    kept = script[: rng.choice(range(1, len(script) + 1, 2))]  # always ends on a user turn
    messages = [{"role": "system", "content": SYSTEM_PROMPTS[system]}]
    for i, text in enumerate(kept):
        messages.append({"role": "assistant" if i % 2 else "user", "content": text})
    line: Json = {"id": f"chat-{n:04d}", "messages": messages}
    if rng.random() < 0.5:
        line["sampling"] = {"temperature": rng.choice([0.0, 0.3, 0.7, 1.0]), "max_tokens": 8192}
    return line


def _tool_call(rng: random.Random, n: int) -> Json:
    name, template, arguments = rng.choice(TOOL_QUESTIONS)
    values = {
        "city": rng.choice(CITIES),
        "amount": rng.choice([25, 250, 1200]),
        "ticker": rng.choice(TICKERS),
    }
    question = template.format(**values)
    others = rng.sample([t for t in TOOLS if t != name], rng.randint(0, 2))
    tools = [_tool_schema(t) for t in [name, *others]]
    messages: list[Json] = [{"role": "system", "content": SYSTEM_PROMPTS[0]}, _user(question)]
    if rng.random() < 0.4:  # a finished tool round trip: the model now writes the final answer
        args = {key: values.get(value, value) for key, value in arguments.items()}
        function = {"name": name, "arguments": orjson.dumps(args).decode()}
        call = {"id": f"call_{n}", "type": "function", "function": function}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        result = {"ok": True, "source": name, "value": rng.randint(1, 40)}
        messages.append(
            {"role": "tool", "tool_call_id": f"call_{n}", "content": orjson.dumps(result).decode()}
        )
    return {"id": f"tools-{n:04d}", "messages": messages, "tools": tools}


def _tool_schema(name: str) -> Json:
    spec = TOOLS[name]
    parameters = {"type": "object", "properties": spec["parameters"], "required": spec["required"]}
    function = {"name": name, "description": spec["description"], "parameters": parameters}
    return {"type": "function", "function": function}


def _openai(rng: random.Random, n: int) -> Json:
    messages = [_user(_fill(rng, rng.choice(PLAIN_PROMPTS)))]
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    body = {"model": "default", "messages": messages, "max_tokens": rng.choice([4096, 8192, 16384])}
    if rng.random() < 0.3:
        body["temperature"] = 0.2
    return _batch_line(f"request-{n:04d}", body)


def _batch_line(custom_id: str, body: Json) -> Json:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


if __name__ == "__main__":
    raise SystemExit(main())
