"""A prompt's answers: how one prompt line becomes the work items of a batch input.

A job asks `n` answers of each prompt: the line's own `sampling.n`, else `enqueue --samples`
(default 1). Each answer is one work item of a batch input, so it is its own checkpoint, record
and export line, counted, retried, requeued and rebuilt once, keyed by its prompt's id and its
index (`fleetgen.records.answer_key`); the worker sends a prompt's answers as one request with
`n` where its server takes it (workers/batch.py). A batch holds a number of answers,
not of prompts, so a job of four answers per prompt has four times the batches, each as long
as a one-answer job's.

The work item of a batch input (`{output}/{job}/inputs/{batch}.jsonl`, one per line):

    {"id": str, "sample"?: int, "line": int, "body": {...}}

`sample` (0..n-1) is on every item of a job where some prompt has several answers
(`JobManifest.sampled`), and on none of a job of one answer per prompt, whose inputs and
records are as they always were.

Seeds: the answers of a prompt of several must differ, and the same job must ask the same
again. The answer of index i gets the seed its line gives plus i, else a seed drawn from the
job's seed, the prompt's id and i (`sample_seed`). The job's seed is `enqueue --seed`, else
drawn from the job's name (`job_seed`), and is kept in its manifest; a prompt of one answer gets
no seed it did not ask for.

    seed = job_seed("distill-v1", None)
    for item in work_items(record, samples=4, seed=seed, sampled=True): ...
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from producer.inputs import PromptRecord

if TYPE_CHECKING:  # the servers' package loads httpx, which enqueue never needs
    from fleetgen.servers import RequestBody

# Drawn seeds fit in 31 bits: a non-negative signed 32-bit integer, which every engine's
# `seed` takes (SGLang and vLLM take more; a 32-bit C int is the narrowest seen).
SEED_BITS = 31


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One answer to generate: its prompt's id and line, its index (None in a job of one answer
    per prompt) and the request body the line gave (the job's defaults are merged at storing)."""

    id: str
    sample: int | None
    line: int
    body: RequestBody


def job_seed(job: str, given: int | None) -> int:
    """The job's seed: `given` (`enqueue --seed`), else one drawn from the job's name."""
    return given if given is not None else _draw(job)


def sample_seed(seed: int, prompt_id: str, sample: int) -> int:
    """The seed of answer `sample` of prompt `prompt_id` in a job of seed `seed`, when its line
    gives none: distinct across the answers and prompts of a job, the same on every run."""
    return _draw(f"{seed}\0{prompt_id}\0{sample}")


def work_items(record: PromptRecord, *, samples: int, seed: int | None,
               sampled: bool, keep_n: bool = False) -> Iterator[WorkItem]:
    """The answers of one prompt in index order: its line's own n, else `samples`. With
    `sampled` each carries its index; with several, each its own seed (the module doc says
    which, from the job's `seed`). With `keep_n` (a rollout's job) the prompt is one item
    whose body keeps its line's `n`, for the rollout to read."""
    n = record.samples or samples
    if keep_n:
        body = record.body if record.samples is None else {**record.body, "n": record.samples}
        yield WorkItem(record.id, None, record.line, body)
        return
    if not sampled:
        yield WorkItem(record.id, None, record.line, record.body)
        return
    for index in range(n):
        body = record.body
        if n > 1:
            own = body.get("seed")
            drawn = (own + index if own is not None
                     else sample_seed(_seed_of(seed), record.id, index))
            body = {**body, "seed": drawn}
        yield WorkItem(record.id, index, record.line, body)


def _seed_of(seed: int | None) -> int:
    if seed is None:
        raise ValueError("a prompt of several answers needs the job's seed")
    return seed


def _draw(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)
