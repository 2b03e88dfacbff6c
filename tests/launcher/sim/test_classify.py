"""/v1/classify (SGLang) and /classify (vLLM) answer a classifier's labels and probabilities in
each engine's shape, on an embedding server only (launcher/sim/classify.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.sim_helpers import TLS, running_sim


@pytest.fixture(scope="module")
def sglang_classifier() -> Iterator[str]:
    with running_sim("--is-embedding", "--instant", "--labels", "negative,positive") as url:
        yield url


@pytest.fixture(scope="module")
def vllm_classifier() -> Iterator[str]:
    with running_sim("--flavor", "vllm", "--runner", "pooling", "--instant") as url:
        yield url


@pytest.fixture(scope="module")
def vllm_reward_model() -> Iterator[str]:
    with running_sim("--flavor", "vllm", "--runner", "pooling", "--instant",
                     "--labels", "score") as url:
        yield url


def post(url: str, route: str, **body: Any) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=30, verify=TLS)


def test_sglang_classify_gives_a_label_and_probabilities_per_text(
        sglang_classifier: str) -> None:
    response = post(sglang_classifier, "/v1/classify", input=["alpha", "beta", "gamma"])
    body = response.json()
    assert response.status_code == 200
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for entry in body["data"]:
        assert list(entry) == ["index", "label", "probs", "num_classes"]
        assert entry["num_classes"] == 2 and math.isclose(sum(entry["probs"]), 1.0)
        chosen = entry["probs"].index(max(entry["probs"]))
        assert entry["label"] == ["negative", "positive"][chosen]
    assert body["usage"]["prompt_tokens"] == 3


def test_the_same_text_gets_the_same_answer_whatever_it_is_sent_with(
        sglang_classifier: str) -> None:
    alone = post(sglang_classifier, "/v1/classify", input="beta").json()["data"][0]
    together = post(sglang_classifier, "/v1/classify", input=["alpha", "beta"]).json()["data"][1]
    assert (alone["label"], alone["probs"]) == (together["label"], together["probs"])


def test_vllm_serves_it_at_classify_not_under_v1(vllm_classifier: str) -> None:
    assert post(vllm_classifier, "/classify", input="alpha").status_code == 200
    assert post(vllm_classifier, "/v1/classify", input="alpha").status_code == 404


def test_a_vllm_reward_model_gives_a_sigmoid_score_or_its_logit_without_activation(
        vllm_reward_model: str) -> None:
    scored = post(vllm_reward_model, "/classify", input="alpha").json()["data"][0]
    raw = post(vllm_reward_model, "/classify", input="alpha",
               use_activation=False).json()["data"][0]
    assert scored["label"] == "score" and scored["num_classes"] == 1
    assert math.isclose(scored["probs"][0], 1 / (1 + math.exp(-raw["probs"][0])))


def test_generation_servers_refuse_classify_as_their_engines_do() -> None:
    with running_sim("--instant") as sglang:
        refused = post(sglang, "/v1/classify", input="alpha")
        assert refused.status_code == 400
        assert "--is-embedding" in refused.json()["message"]
    with running_sim("--flavor", "vllm", "--instant") as vllm:
        refused = post(vllm, "/classify", input="alpha")
        assert refused.status_code == 501
        assert refused.json()["error"]["message"] == (
            "The model does not support Classification API")
