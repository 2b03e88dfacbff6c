"""POST /v1/classify (SGLang) and /classify (vLLM): a classifier's or reward model's answer.

Only an embedding server (--is-embedding; vLLM: `--runner pooling`) answers it, as both
engines serve a sequence-classification model in their pooling mode; a generation server
answers its engine's refusal: SGLang's tokenizer manager refuses a generation model (400),
vLLM has no classification handler (its NotImplementedError, 501). `input` is read as an
embedding's, one sequence per text (scheduler.py), and the answer has one entry per text,
`{"index", "label", "probs", "num_classes"}`, under `data`.

A text's logits are a function of the text, --seed and --labels alone (`logits_of`), so a test
can tell which text an entry belongs to. The probabilities are each engine's: SGLang's
serving_classify takes the softmax of the logits (one label: always [1.0]); vLLM's classify
pooler a softmax for two labels or more, a sigmoid for one (a reward model's score), and the
logits themselves with `use_activation: false`.
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
import uuid
from typing import Any

import orjson
from fastapi import Request, Response

from launcher.sim import protocol
from launcher.sim.embeddings import check_length, forward, sglang_check_input, tokens_of
from launcher.sim.protocol import ClassifyRequest, RequestError, bad_request
from launcher.sim.simulator import Simulator
from launcher.sim.stress import answered

# SGLang's and vLLM's routes for it.
SGLANG_PATH = "/v1/classify"
VLLM_PATH = "/classify"


def logits_of(text: str | list[int], labels: int, seed: int = 0) -> list[float]:
    """The logits the simulator answers for `text` (a string or token ids): `labels` values
    within [-4, 4), drawn from SHAKE-256 of the text and the seed."""
    key = text.encode() if isinstance(text, str) else ",".join(map(str, text)).encode()
    raw = hashlib.shake_256(b"classify\x00%d\x00" % seed + key).digest(4 * labels)
    return [8.0 * v / 2.0**32 - 4.0 for v in struct.unpack(f"<{labels}I", raw)]


def probs_of(logits: list[float], flavor: str, use_activation: bool | None) -> list[float]:
    """The probabilities each engine answers for `logits` (see the module's docstring)."""
    if flavor == "vllm" and use_activation is False:
        return logits
    if flavor == "vllm" and len(logits) == 1:
        return [1.0 / (1.0 + math.exp(-logits[0]))]
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    whole = math.fsum(exps)
    return [e / whole for e in exps]


def not_a_classifier(flavor: str) -> RequestError:
    """What a generation server answers on the classify route."""
    if flavor == "vllm":
        return protocol.flavor_error("vllm", 501, "The model does not support Classification API",
                                     "NotImplementedError")
    return bad_request("This model does not appear to be an embedding model by default. Please "
                       "add `--is-embedding` when launching the server or try another model.")


def _body(sim: Simulator, req: ClassifyRequest, logits: list[list[float]], prompt_tokens: int,
          rid: str) -> dict[str, Any]:
    cfg = sim.cfg
    names = cfg.label_names
    data = []
    for i, values in enumerate(logits):
        probs = probs_of(values, cfg.flavor, req.use_activation)
        data.append({"index": i, "label": names[values.index(max(values))], "probs": probs,
                     "num_classes": len(probs)})
    return {"id": rid, "object": "list", "created": int(time.time()),
            # SGLang names the model by its path when no served name is given
            "model": cfg.served_name if cfg.flavor == "vllm" else cfg.model_path, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None}}


async def _answer(sim: Simulator, request: Request) -> bytes:
    cfg, flavor = sim.cfg, sim.cfg.flavor
    req = protocol.parse_classify(request.headers.get("content-type"), await request.body(),
                                  flavor)
    if not cfg.is_embedding:
        raise not_a_classifier(flavor)
    if flavor == "sglang":
        sglang_check_input(req.input)
    inputs = protocol.one_per_sequence(req.input)
    lengths = [tokens_of(item) for item in inputs]
    index = sim.count_request()
    for tokens in lengths:
        check_length(sim, tokens)
    rid = "classify-" + uuid.uuid4().hex
    await forward(sim, request, inputs, lengths, index, rid)
    labels = len(cfg.label_names)
    logits = [logits_of(item, labels, cfg.seed) for item in inputs]
    return orjson.dumps(_body(sim, req, logits, sum(lengths), rid))


async def classify(sim: Simulator, request: Request) -> Response:
    """The route handler (SGLang's /v1/classify, vLLM's /classify)."""
    return await answered(sim, request, _answer)
