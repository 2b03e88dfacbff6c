"""A job: its name, output location, generation parameters and manifest.

The manifest is written to Redis and to `{output}/{job}/manifest.json`, so the output location
alone describes the job and Redis can be rebuilt from it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict, cast

import orjson

from fleetgen.canary import Thresholds
from fleetgen.endpoints import CHAT, Endpoint, endpoint
from fleetgen.errors import JobError
from fleetgen.keys import JOB_ENTRIES, JOB_NAME
from fleetgen.rollouts import RolloutSpec

if TYPE_CHECKING:  # the servers' package loads httpx, which enqueue never needs
    from fleetgen.servers import RequestBody

# A job's state as the ledger keeps it (fleetgen/ledger STATE_*): `creating` while enqueue
# stores its inputs, then `running`, `paused` or `cancelled` as the operator and the canary
# and breaker set it.
JobState = Literal["creating", "running", "paused", "cancelled"]
# What the views show (fleetgen/jobview.py): a running job whose batches are all written is done.
ShownState = Literal[JobState, "done"]

# A cap that leaves room for long thinking: the job fleetgen was born from lost a dataset to
# a 512-token cap spent entirely on reasoning. The quality canary watches finish_reason=length.
DEFAULT_MAX_TOKENS = 16384
DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_P = 0.95
# Bounds of the job defaults, shared with the checks of a prompt line's own values
# (producer/inputs/_line.py). Token counts are int32 in SGLang; anything near the limit is a
# typo, and a float such as 1e15 is not a count at all. Temperature keeps OpenAI's [0, 2]
# (SGLang alone takes any value >= 0): above 2 the output is noise, so it is a typo too.
MAX_TOKENS_LIMIT = 2**31 - 1
MAX_TEMPERATURE = 2.0
# Most answers one prompt may ask for (`sampling.n`, `enqueue --samples`): best-of-n and RL
# rollouts ask tens; thousands would be a typo that multiplies the job.
MAX_SAMPLES = 1024


@dataclass(frozen=True)
class GenerationParams:
    """Job-wide request defaults; a prompt line's own values win."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    thinking: bool = True
    model: str | None = None

    def __post_init__(self) -> None:
        if type(self.max_tokens) is not int or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise JobError(
                f"--max-tokens must be an integer in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}"
            )
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise JobError(
                f"--temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise JobError(f"--top-p must be in (0, 1], got {self.top_p}")

    def request_body(self, line_body: RequestBody) -> RequestBody:
        """The stored chat-completions body of one prompt: job defaults under the line's values.

        Neutral: OpenAI's chat schema plus the line's own fields. What one engine takes beyond
        that (SGLang's `separate_reasoning`, `chat_template_kwargs` for thinking) and the
        served model when the job names none are added at send time, for that server only
        (fleetgen/servers)."""
        body: RequestBody = {"model": self.model} if self.model else {}
        if "max_completion_tokens" not in line_body:
            body["max_tokens"] = self.max_tokens
        body["temperature"] = self.temperature
        body["top_p"] = self.top_p
        body.update(line_body)
        body.pop("stream", None)
        return body

    def thinking_of(self, body: RequestBody) -> bool:
        """Whether thinking is on for one stored body: the line's own
        `chat_template_kwargs.enable_thinking`, else the job's."""
        kwargs = body.get("chat_template_kwargs")
        if isinstance(kwargs, dict) and "enable_thinking" in kwargs:
            return bool(kwargs["enable_thinking"])
        return self.thinking


class InputLine(TypedDict):
    """One line of a stored batch input (`{job}/inputs/{batch}.jsonl`): an answer to generate,
    `sample` its index in a job of several answers per prompt, `body` its stored request.
    Written by `input_line`, read back by `read_input_line`."""

    id: str
    sample: NotRequired[int]
    line: int
    body: RequestBody


def input_line(prompt_id: str, line: int, body: RequestBody, sample: int | None) -> InputLine:
    if sample is None:
        return {"id": prompt_id, "line": line, "body": body}
    return {"id": prompt_id, "sample": sample, "line": line, "body": body}


def read_input_line(raw: bytes | str) -> InputLine:
    return cast(InputLine, orjson.loads(raw))


@dataclass(frozen=True)
class InputInfo:
    path: str
    sha256: str
    lines: int
    bytes: int


@dataclass(frozen=True)
class JobManifest:
    name: str
    output: str
    input: InputInfo
    prompts: int
    batch_size: int
    batches: int
    queue: str
    params: GenerationParams
    rejected: int = 0
    # The quality canary's thresholds; in the JSON, Thresholds.to_dict's object (`{}` in a
    # manifest written before they were kept: the defaults).
    canary: Thresholds = field(default_factory=Thresholds)
    # How the job's end is cut into smaller batches (batch_sizes): 0 not at all or TAPER. A
    # job keeps its plan for life.
    taper: int = 0
    created_at: float = field(default_factory=time.time)
    version: int = 1
    # False while `enqueue` is still storing batch inputs: the job is `creating`, no worker runs
    # it and export refuses it. Set last, after every input is durable.
    complete: bool = True
    # Answers asked of the prompts: the sum of each prompt's `n` (its own `sampling.n`, else
    # `samples`). The job's outcomes, batches and counters count answers; 0 (a manifest
    # written before answers were counted) reads as one per prompt.
    answers: int = 0
    samples: int = 1  # answers per prompt when a line does not say (`enqueue --samples`)
    # The job's seed, from which the seed of each answer of a prompt of several is derived
    # when its line gives none (producer/answers.py); None: no answer needed one.
    seed: int | None = None
    # The program each prompt runs (fleetgen.rollouts.RolloutSpec as a dict: its name, the
    # digest of its module, its options); None: one request per answer.
    rollout: dict[str, Any] | None = None
    # What each request asks (fleetgen/endpoints.py): chat, completions or embeddings.
    endpoint: str = CHAT

    def __post_init__(self) -> None:
        validate_job_name(self.name)
        if self.answers == 0:
            object.__setattr__(self, "answers", self.prompts)
        try:
            endpoint(self.endpoint)
        except ValueError as exc:
            raise JobError(f"job {self.name}: {exc}") from None

    @property
    def kind(self) -> Endpoint:
        """The job's endpoint: its path, and whether its answers are text."""
        return endpoint(self.endpoint)

    @property
    def rollout_spec(self) -> RolloutSpec | None:
        return RolloutSpec.from_dict(self.rollout) if self.rollout is not None else None

    @property
    def sampled(self) -> bool:
        """Whether some prompt has several answers: then every answer carries its `sample`
        index (records, batch inputs, exports), and the job's figures say answers."""
        return self.answers != self.prompts

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, data: bytes | str) -> JobManifest:
        raw = orjson.loads(data)
        try:
            raw["input"] = InputInfo(**raw["input"])
            raw["params"] = GenerationParams(**raw["params"])
            raw["canary"] = Thresholds.from_dict(raw.get("canary") or {})
            return cls(**raw)
        except (KeyError, TypeError) as exc:
            raise JobError(f"job manifest is not readable: {exc}") from exc


# The taper new jobs get (batch_sizes).
TAPER = 2


def validate_job_name(name: str) -> str:
    """`name`, or JobError saying why a job cannot have it; a job may not be named like what
    every job keeps in its folder either (`results`: its folder inside another job's output
    would be taken for that job's results)."""
    if not JOB_NAME.match(name):
        raise JobError(
            f"job name {name!r}: use letters, digits, '.', '_' or '-' (at most 128), "
            "starting with a letter or digit"
        )
    if name.lower() in JOB_ENTRIES:
        raise JobError(
            f"job name {name!r}: every job keeps its own {name!r} in {{output}}/{{job}}/, so a "
            f"job of that name could be taken for part of another; choose another name "
            f"(not one of {', '.join(JOB_ENTRIES)})"
        )
    return name


def batch_sizes(prompts: int, size: int, *, taper: int) -> list[int]:
    """Prompts per batch, in order: a pure function of the job, so re-enqueueing resumes.

    Tapering cuts the job's end finer, so when the queue runs dry no GPU is left holding many
    more prompts than the others while they drain (tests/perf: saturation, makespan, tail):
    - 1: the last eighth of the job in quarter-size batches;
    - 2 (TAPER): the same, but the last quarter of that eighth in sixteenth-size batches.
    """
    tail = prompts // 8 if taper and prompts >= 8 * size else 0
    finest = tail // 4 if taper >= 2 else 0
    head = prompts - tail
    return (_cut(head, size) + _cut(tail - finest, max(1, size // 4))
            + _cut(finest, max(1, size // 16)))


def _cut(prompts: int, size: int) -> list[int]:
    return [size] * (prompts // size) + ([prompts % size] if prompts % size else [])
