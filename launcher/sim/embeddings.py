"""POST /v1/embeddings: an embedding model's answer, in SGLang's or vLLM's shape.

Only an embedding server (--is-embedding; vLLM: `--runner pooling`) answers it; a generation
server answers its engine's refusal (protocol.wrong_mode). `input` is a string, a list of
strings, a token-id list or a list of them: each input is one sequence in the scheduler, so
a request with 64 inputs takes 64 running slots and runs as one forward of 64 sequences
(scheduler.py). The vector of a text is a function of the text, --seed and the length alone
(`embedding_of`), so a test can tell which text a vector belongs to: the components drawn
from SHAKE-256 of the text, scaled to unit length. `dimensions` keeps the first N components
and scales them to unit length again, as both engines' poolers do with a Matryoshka model.

`encoding_format` "base64" sends each vector as base64 of its little-endian float32 bytes.
The checks come in each engine's order: SGLang's `_validate_request` (format, empty inputs),
then its tokenizer manager (context length, embedding model, `dimensions`); vLLM's pydantic
model (format), then its renderer (context length) and pooling params (`dimensions`).
"""

from __future__ import annotations

import array
import base64
import hashlib
import math
import struct
import time
import uuid
from typing import Any

import orjson
from fastapi import Request, Response

from launcher.sim import protocol, tokenizer
from launcher.sim.protocol import EmbeddingRequest, RequestError, bad_request
from launcher.sim.scheduler import SimRequest
from launcher.sim.simulator import Simulator
from launcher.sim.stress import answered

JSON = "application/json"
_INT32 = 2.0**31


def embedding_of(text: str | list[int], dim: int = 1024, seed: int = 0,
                 dimensions: int | None = None) -> list[float]:
    """The unit-length float32 vector the simulator answers for `text` (a string or token
    ids), `dim` long (--embedding-dim), cut to `dimensions` and scaled again when asked."""
    key = text.encode() if isinstance(text, str) else ",".join(map(str, text)).encode()
    raw = array.array("i")
    raw.frombytes(hashlib.shake_256(b"%d\x00" % seed + key).digest(4 * dim))
    values = [v / _INT32 for v in raw[:dimensions or dim]]
    norm = math.sqrt(math.fsum(v * v for v in values)) or 1.0
    scaled = struct.pack(f"<{len(values)}f", *(v / norm for v in values))
    return list(struct.unpack(f"<{len(values)}f", scaled))  # float32 values, as the GPU's


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def sglang_check(req: EmbeddingRequest) -> None:
    """SGLang's serving_embedding `_validate_request`."""
    if req.encoding_format not in ("float", "base64"):
        raise bad_request("encoding_format must be either 'float' or 'base64', "
                          f"got {req.encoding_format!r}")
    sglang_check_input(req.input)


def sglang_check_input(given: str | list[str] | list[int] | list[list[int]]) -> None:
    """The `input` half of SGLang's `_validate_request` (serving_embedding, serving_classify)."""
    if not given:
        raise bad_request("Input cannot be empty")
    if isinstance(given, str):
        if not given.strip():
            raise bad_request("Input cannot be empty or whitespace only")
        return
    for i, item in enumerate(given):
        if isinstance(item, str) and not item.strip():
            raise bad_request(f"Input at index {i} cannot be empty or whitespace only")
        if isinstance(item, int) and item < 0:
            raise bad_request(f"Token ID at index {i} must be non-negative")


def check_length(sim: Simulator, tokens: int) -> None:
    context = sim.cfg.context_len
    if sim.cfg.flavor == "vllm" and tokens > context:
        raise bad_request(f"This model's maximum context length is {context} tokens. However, "
                          f"your request has {tokens} input tokens. Please reduce the length "
                          "of the input messages.", "vllm")
    if sim.cfg.flavor == "sglang" and tokens >= context:
        raise bad_request(f"The input ({tokens} tokens) is longer than the model's context "
                          f"length ({context} tokens).")


def _check_dimensions(sim: Simulator, dimensions: int | None) -> None:
    """`dimensions` as each engine takes it (SGLang's `_validate_for_matryoshka_dim`, vLLM's
    `PoolingParams.verify`): the model must be a Matryoshka one (--matryoshka)."""
    cfg = sim.cfg
    if dimensions is None:
        return
    if not cfg.matryoshka:
        if cfg.flavor == "vllm":
            raise bad_request(f'Model "{cfg.served_name}" does not support matryoshka '
                              "representation, changing output dimensions will lead to poor "
                              "results.", "vllm")
        raise bad_request(f"Model '{cfg.model_path}' does not support matryoshka "
                          "representation, changing output dimensions will lead to poor "
                          "results.")
    if dimensions < 1:
        raise bad_request("Dimensions must be greater than 0" if cfg.flavor == "vllm"
                          else "Requested dimensions must be greater than 0", cfg.flavor)
    if cfg.flavor == "sglang" and dimensions > cfg.embedding_dim:
        raise bad_request("Provided dimensions are greater than max embedding dimension: "
                          f"{cfg.embedding_dim}")


def tokens_of(item: str | list[int]) -> int:
    return tokenizer.count(item) if isinstance(item, str) else len(item)


def _body(sim: Simulator, req: EmbeddingRequest, vectors: list[list[float]],
          prompt_tokens: int, rid: str) -> dict[str, Any]:
    cfg = sim.cfg
    if cfg.flavor == "vllm":
        data: list[dict[str, Any]] = [
            {"index": i, "object": "embedding", "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
        return {"id": rid, "object": "list", "created": int(time.time()),
                "model": cfg.served_name, "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                          "completion_tokens": 0, "prompt_tokens_details": None}}
    data = [{"embedding": _encode(v, req.encoding_format), "index": i, "object": "embedding"}
            for i, v in enumerate(vectors)]
    # SGLang names the model by its path (tokenizer_manager.model_path), whatever was asked
    return {"data": data, "model": cfg.model_path, "object": "list",
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None,
                      "reasoning_tokens": 0, "completion_tokens_details": None}}


def _submit_all(sim: Simulator, rid: str, lengths: list[int]) -> list[SimRequest]:
    """One sequence per input; refused whole if the server refuses any."""
    sreqs: list[SimRequest] = []
    try:
        for i, tokens in enumerate(lengths):
            sreq = SimRequest(f"{rid}-{i}" if i else rid, tokens, 0, False, sim.scheduler.loop)
            sim.submit(sreq)
            sreqs.append(sreq)
    except RequestError:
        for sreq in sreqs:
            sim.scheduler.abort_request(sreq)
        raise
    return sreqs


async def forward(sim: Simulator, request: Request, inputs: list[str | list[int]],
                  lengths: list[int], index: int, rid: str) -> None:
    """The pooling forward of a request's sequences (`inputs`, of `lengths` tokens; the
    `index`th request): a drawn failure first (--fail-rate), then each sequence queued and
    waited for, refused whole if any is; 500 "Aborted" when one was aborted. Embeddings and
    classify run it alike."""
    key = b"\x00".join(i.encode() if isinstance(i, str) else repr(i).encode() for i in inputs)
    sim.fail_if_drawn(key, index)
    sreqs = _submit_all(sim, rid, lengths)
    for sreq in sreqs:
        await sim.wait_done(sreq, request)
    if any(sreq.aborted for sreq in sreqs):
        raise protocol.flavor_error(sim.cfg.flavor, 500, "Aborted", "InternalServerError")


async def _answer(sim: Simulator, request: Request) -> bytes:
    cfg, flavor = sim.cfg, sim.cfg.flavor
    req = protocol.parse_embedding(request.headers.get("content-type"), await request.body(),
                                   flavor)
    if flavor == "vllm" and not cfg.is_embedding:  # the route's handler is missing
        raise protocol.wrong_mode(flavor, "embeddings")
    if flavor == "sglang":
        sglang_check(req)
    inputs = protocol.one_per_sequence(req.input)
    lengths = [tokens_of(item) for item in inputs]
    index = sim.count_request()
    for tokens in lengths:
        check_length(sim, tokens)
    if not cfg.is_embedding:
        raise protocol.wrong_mode(flavor, "embeddings")
    _check_dimensions(sim, req.dimensions)
    rid = ("embd-" + (request.headers.get("x-request-id") or req.request_id
                      or uuid.uuid4().hex)) if flavor == "vllm" else uuid.uuid4().hex
    await forward(sim, request, inputs, lengths, index, rid)
    vectors = [embedding_of(item, cfg.embedding_dim, cfg.seed, req.dimensions)
               for item in inputs]
    return orjson.dumps(_body(sim, req, vectors, sum(lengths), rid))


async def embeddings(sim: Simulator, request: Request) -> Response:
    """The route handler."""
    return await answered(sim, request, _answer)
