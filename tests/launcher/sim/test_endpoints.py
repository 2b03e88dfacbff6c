"""/v1/completions and /v1/embeddings answer in SGLang's and vLLM's shapes, in the mode each
engine serves them (docs/development/simulator.md#completions-and-embeddings)."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from launcher.sim import embedding_of
from tests.sim_helpers import TLS, metric_sum, running_sim

TEXTS = [f"short text number {i}" for i in range(64)]


@pytest.fixture(scope="module")
def sglang_embedder() -> Iterator[str]:
    with running_sim("--is-embedding", "--instant") as url:
        yield url


@pytest.fixture(scope="module")
def vllm_embedder() -> Iterator[str]:
    with running_sim("--flavor", "vllm", "--runner", "pooling", "--instant",
                     "--matryoshka") as url:
        yield url


@pytest.fixture(scope="module")
def sglang_generator() -> Iterator[str]:
    with running_sim("--instant") as url:
        yield url


@pytest.fixture(scope="module")
def vllm_generator() -> Iterator[str]:
    with running_sim("--flavor", "vllm", "--instant") as url:
        yield url


def post(url: str, route: str, **body: Any) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=30, verify=TLS)


def test_sglang_embeddings_have_sglang_keys_and_the_vector_of_each_text(
        sglang_embedder: str) -> None:
    body = post(sglang_embedder, "/v1/embeddings", input=["alpha", "beta"], model="x").json()
    assert list(body) == ["data", "model", "object", "usage"]
    assert body["model"] == "sim/Qwen3.6-27B" and body["object"] == "list"
    assert [list(d) for d in body["data"]] == [["embedding", "index", "object"]] * 2
    assert [d["embedding"] for d in body["data"]] == [embedding_of("alpha"), embedding_of("beta")]
    assert body["usage"] == {"prompt_tokens": 2, "total_tokens": 2, "completion_tokens": 0,
                             "prompt_tokens_details": None, "reasoning_tokens": 0,
                             "completion_tokens_details": None}


def test_vllm_embeddings_have_vllm_keys_and_an_embd_id(vllm_embedder: str) -> None:
    body = post(vllm_embedder, "/v1/embeddings", input="alpha").json()
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert body["id"].startswith("embd-") and body["model"] == "sim/Qwen3.6-27B"
    assert body["data"] == [{"index": 0, "object": "embedding", "embedding": embedding_of("alpha")}]
    assert body["usage"] == {"prompt_tokens": 1, "total_tokens": 1, "completion_tokens": 0,
                             "prompt_tokens_details": None}


def test_a_vector_is_unit_length_and_the_same_for_the_same_text(sglang_embedder: str) -> None:
    first = post(sglang_embedder, "/v1/embeddings", input="the same text").json()
    again = post(sglang_embedder, "/v1/embeddings", input=["other", "the same text"]).json()
    vector = first["data"][0]["embedding"]
    assert len(vector) == 1024 and abs(sum(v * v for v in vector) - 1.0) < 1e-5
    assert again["data"][1]["embedding"] == vector != again["data"][0]["embedding"]


def test_token_id_inputs_are_one_sequence_each(sglang_embedder: str) -> None:
    body = post(sglang_embedder, "/v1/embeddings", input=[[1, 2, 3], [4, 5]]).json()
    assert [d["embedding"] for d in body["data"]] == [embedding_of([1, 2, 3]),
                                                      embedding_of([4, 5])]
    assert body["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("server", ["sglang_embedder", "vllm_embedder"])
def test_base64_decodes_to_the_float_vector(server: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(server)
    body = post(url, "/v1/embeddings", input="alpha", encoding_format="base64").json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == embedding_of("alpha")


def test_dimensions_cut_a_matryoshka_vector_to_unit_length(vllm_embedder: str) -> None:
    body = post(vllm_embedder, "/v1/embeddings", input="alpha", dimensions=64).json()
    vector = body["data"][0]["embedding"]
    assert vector == embedding_of("alpha", dimensions=64) and len(vector) == 64
    assert abs(sum(v * v for v in vector) - 1.0) < 1e-5


def test_dimensions_without_matryoshka_is_sglangs_400(sglang_embedder: str) -> None:
    response = post(sglang_embedder, "/v1/embeddings", input="alpha", dimensions=64)
    assert response.status_code == 400
    assert "does not support matryoshka representation" in response.json()["message"]


def test_a_bad_encoding_format_is_each_engines_400(sglang_embedder: str,
                                                   vllm_embedder: str) -> None:
    sglang = post(sglang_embedder, "/v1/embeddings", input="a", encoding_format="hex")
    vllm = post(vllm_embedder, "/v1/embeddings", input="a", encoding_format="hex")
    assert sglang.status_code == vllm.status_code == 400
    assert sglang.json()["message"] == ("encoding_format must be either 'float' or 'base64', "
                                        "got 'hex'")
    assert "literal_error" in vllm.json()["error"]["message"]


def test_an_input_longer_than_the_context_is_refused() -> None:
    with running_sim("--is-embedding", "--instant", "--context-length", "16") as url:
        response = post(url, "/v1/embeddings", input=" ".join(["word"] * 40))
    assert response.status_code == 400
    assert response.json()["message"] == ("The input (40 tokens) is longer than the model's "
                                          "context length (16 tokens).")


def test_embedding_servers_refuse_generation_as_their_engines_do(
        sglang_embedder: str, vllm_embedder: str) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert post(sglang_embedder, "/v1/chat/completions", **chat).status_code == 500
    assert post(sglang_embedder, "/v1/completions", prompt="hi").json()["message"] == (
        "Internal server error: 'text'")
    # vLLM answers its "does not support" error with status 200
    vllm_chat = post(vllm_embedder, "/v1/chat/completions", **chat)
    vllm_completion = post(vllm_embedder, "/v1/completions", prompt="hi")
    assert vllm_chat.status_code == vllm_completion.status_code == 200
    assert vllm_chat.json()["error"]["message"] == (
        "The model does not support Chat Completions API")
    assert vllm_completion.json()["error"]["message"] == "The model does not support Completions API"


def test_generation_servers_refuse_embeddings_as_their_engines_do(
        sglang_generator: str, vllm_generator: str) -> None:
    sglang = post(sglang_generator, "/v1/embeddings", input="hi")
    vllm = post(vllm_generator, "/v1/embeddings", input="hi")
    assert sglang.status_code == 400 and "--is-embedding" in sglang.json()["message"]
    assert vllm.status_code == 200
    assert vllm.json()["error"]["message"] == "The model does not support Embeddings API"


def test_model_info_says_an_embedding_model_is_not_generative(sglang_embedder: str) -> None:
    assert httpx.get(sglang_embedder + "/model_info", verify=TLS).json()["is_generation"] is False


def test_one_request_of_64_inputs_runs_as_one_forward_of_64_sequences() -> None:
    with running_sim("--is-embedding") as url:
        before = httpx.get(url + "/metrics", verify=TLS).text
        body = post(url, "/v1/embeddings", input=TEXTS).json()
        after = httpx.get(url + "/metrics", verify=TLS).text
        stats = httpx.get(url + "/sim/stats", verify=TLS).json()
    count = "sglang:num_requests_total"
    assert metric_sum(after, count) - metric_sum(before, count) == 64
    tokens = "sglang:prompt_tokens_total"
    assert metric_sum(after, tokens) - metric_sum(before, tokens) == body["usage"]["prompt_tokens"]
    assert stats["peak_in_flight"] == 64


def test_vllm_counts_an_embedding_requests_prompt_tokens(vllm_embedder: str) -> None:
    before = metric_sum(httpx.get(vllm_embedder + "/metrics",
                                  verify=TLS).text, "vllm:prompt_tokens_total")
    body = post(vllm_embedder, "/v1/embeddings", input=TEXTS[:8]).json()
    after = metric_sum(httpx.get(vllm_embedder + "/metrics",
                                 verify=TLS).text, "vllm:prompt_tokens_total")
    assert after - before == body["usage"]["prompt_tokens"] > 0


def test_sglang_completion_has_sglang_keys_and_counts_each_prompt_once(
        sglang_generator: str) -> None:
    body = post(sglang_generator, "/v1/completions", prompt=["Once upon", "a time"], n=2,
                max_tokens=5, model="m").json()
    assert list(body) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
    assert body["object"] == "text_completion" and body["model"] == "m"
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert list(choices[0]) == ["index", "text", "logprobs", "finish_reason", "matched_stop"]
    assert all(c["finish_reason"] == "length" and c["text"] for c in choices)
    assert choices[0]["text"] != choices[1]["text"]
    usage = body["usage"]
    assert usage["prompt_tokens"] == 2 + 2 and usage["completion_tokens"] == 4 * 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_vllm_completion_has_vllm_keys(vllm_generator: str) -> None:
    body = post(vllm_generator, "/v1/completions", prompt="Once upon", max_tokens=3).json()
    assert list(body) == ["id", "object", "created", "model", "choices", "service_tier",
                          "system_fingerprint", "usage", "kv_transfer_params"]
    assert body["id"].startswith("cmpl-") and body["model"] == "sim/Qwen3.6-27B"
    assert list(body["choices"][0]) == ["index", "text", "logprobs", "finish_reason",
                                        "stop_reason", "token_ids", "prompt_logprobs",
                                        "prompt_token_ids"]
    assert body["usage"]["completion_tokens"] == 3


def test_completion_echo_and_logprobs(sglang_generator: str) -> None:
    body = post(sglang_generator, "/v1/completions", prompt="Once upon", max_tokens=4, echo=True,
                logprobs=1).json()
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == "Once upon" + "".join(logprobs["tokens"])
    assert len(logprobs["token_logprobs"]) == 4 and all(v <= 0 for v in logprobs["token_logprobs"])
    assert logprobs["text_offset"][0] == len("Once upon")


def test_completion_stops_at_a_stop_string(sglang_generator: str) -> None:
    plain = post(sglang_generator, "/v1/completions", prompt="Tell", max_tokens=40).json()
    text = plain["choices"][0]["text"]
    word = text.split()[2]
    stopped = post(sglang_generator, "/v1/completions", prompt="Tell", max_tokens=40,
                   stop=word).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["matched_stop"] == word
    assert stopped["text"] == text[:text.index(word)]


def test_completion_past_the_context_is_each_engines_400() -> None:
    with running_sim("--instant", "--context-length", "32") as url:
        sglang = post(url, "/v1/completions", prompt="hi", max_tokens=64)
    assert sglang.status_code == 400
    assert "exceeds the model's maximum context length of 32" in sglang.json()["message"]
