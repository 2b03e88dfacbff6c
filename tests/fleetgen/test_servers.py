"""The server-kind seam (fleetgen/servers): how a stored body is shaped for each kind, what a
strict server's refusals teach, and how the two capacity controllers move the limit.

Pure and fast; the same seam against real HTTP servers is in tests/workers/test_client_engines.py."""

from __future__ import annotations

import pytest

from fleetgen.errors import ModelChoiceError
from fleetgen.job import GenerationParams
from fleetgen.records import Origin, result_record
from fleetgen.server_info import parse_server_info
from fleetgen.servers import KINDS, Server
from workers.limits import Gradient, QueueWatch

STORED = GenerationParams().request_body({"messages": [{"role": "user", "content": "hi"}]})
STRICT_422 = "HTTP 422: Unexpected fields in the request: {'separate_reasoning'}"


def test_a_stored_body_is_neutral_openai_chat() -> None:
    assert set(STORED) == {"messages", "max_tokens", "temperature", "top_p"}
    named = GenerationParams(model="m").request_body({"messages": []})
    assert named["model"] == "m"


def test_sglang_gets_separate_reasoning_and_thinking_at_send_time() -> None:
    server = Server(KINDS["sglang"], info=parse_server_info({"model_path": "/models/q"}))
    body = server.prepare(STORED, thinking=False)
    assert body["separate_reasoning"] is True
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["model"] == "/models/q"


def test_a_lines_own_template_kwargs_win_and_are_merged() -> None:
    stored = {**STORED, "chat_template_kwargs": {"enable_thinking": False, "x": 1}}
    body = Server(KINDS["vllm"], ("m",)).prepare(stored, thinking=True)
    assert body["chat_template_kwargs"] == {"enable_thinking": False, "x": 1}
    assert "separate_reasoning" not in body


def test_a_generic_server_gets_nothing_beyond_openais_schema_and_its_only_model() -> None:
    body = Server(KINDS["openai"], ("only",)).prepare(STORED, thinking=True)
    assert set(body) == set(STORED) | {"model"}
    assert body["model"] == "only"


def test_a_server_with_several_models_and_a_job_naming_none_is_refused_with_the_list() -> None:
    server = Server(KINDS["vllm"], ("a", "b"))
    with pytest.raises(ModelChoiceError, match=r"serves 2 models \(a, b\).*--model NAME"):
        server.prepare(STORED, thinking=True)
    assert server.prepare({**STORED, "model": "b"}, thinking=True)["model"] == "b"


def test_a_refused_field_fleetgen_added_is_dropped_and_remembered() -> None:
    server = Server(KINDS["sglang"])
    sent = server.prepare(STORED, thinking=True)
    assert server.learn(422, STRICT_422, sent, STORED) == "refuses separate_reasoning: no longer sent"
    again = server.prepare(STORED, thinking=True)
    assert "separate_reasoning" not in again
    assert again["chat_template_kwargs"] == {"enable_thinking": True}
    assert server.learn(422, STRICT_422, again, STORED) is None  # nothing new: the prompt's
    assert not server.resend(again, STORED, thinking=True)


def test_a_request_refused_before_another_taught_the_same_is_sent_again_quietly() -> None:
    server = Server(KINDS["sglang"])
    first, second = (server.prepare(STORED, thinking=True) for _ in range(2))
    assert server.learn(422, STRICT_422, first, STORED) is not None
    assert server.learn(422, STRICT_422, second, STORED) is None  # said once
    assert server.resend(second, STORED, thinking=True)
    pinned = Server(KINDS["openai"])
    first, second = (pinned.prepare(STORED, thinking=True) for _ in range(2))
    message = "HTTP 400: Server is pinned to '/m'; requested 'default'."
    assert pinned.learn(400, message, first, STORED) is not None
    assert pinned.learn(400, message, second, STORED) is None
    assert pinned.resend(second, STORED, thinking=True)


def test_a_refused_field_of_the_prompt_line_itself_is_not_dropped() -> None:
    server = Server(KINDS["openai"], ("m",))
    stored = {**STORED, "separate_reasoning": True}
    sent = server.prepare(stored, thinking=True)
    assert server.learn(422, STRICT_422, sent, stored) is None
    assert server.prepare(stored, thinking=True)["separate_reasoning"] is True


def test_a_server_pinned_to_one_model_teaches_its_name() -> None:
    server = Server(KINDS["openai"])
    sent = server.prepare(STORED, thinking=True)
    assert sent["model"] == "default"
    message = "HTTP 400: Server is pinned to '/tmp/model'; requested 'default'."
    assert server.learn(400, message, sent, STORED) is not None
    assert server.prepare(STORED, thinking=True)["model"] == "/tmp/model"
    # A job that named its model keeps it: the refusal is the job's to see.
    named = {**STORED, "model": "mine"}
    assert server.learn(400, message, server.prepare(named, thinking=True), named) is None


def test_other_client_errors_teach_nothing() -> None:
    server = Server(KINDS["sglang"])
    sent = server.prepare(STORED, thinking=True)
    assert server.learn(400, "HTTP 400: maximum context length exceeded", sent, STORED) is None
    assert server.learn(500, STRICT_422, sent, STORED) is None


def test_thinking_follows_the_line_then_the_job() -> None:
    params = GenerationParams(thinking=True)
    assert params.thinking_of(STORED) is True
    assert params.thinking_of({"chat_template_kwargs": {"enable_thinking": False}}) is False


def test_queue_watch_doubles_until_requests_wait_then_keeps_capacity_plus_margin() -> None:
    watch = QueueWatch(margin=lambda n: max(4, n // 10), start=8)
    limits = []
    for _ in range(3):  # the server runs everything sent
        limits.append(watch.on_load(running=watch.limit, waiting=0, saturated=True))
    assert limits == [16, 32, 64]
    assert watch.on_load(running=24, waiting=40, saturated=True) == 28
    assert watch.capacity == 24
    assert "24 running" in watch.how
    # A tick that catches a slot between two requests does not lower the capacity.
    assert watch.on_load(running=22, waiting=6, saturated=True) == 28


def test_queue_watch_does_not_grow_a_limit_nobody_waited_for() -> None:
    watch = QueueWatch(margin=lambda n: 4, start=8)
    assert watch.on_load(running=3, waiting=0, saturated=False) == 8


def ms_per_token(limit: int, capacity: int, step_s: float = 0.01) -> float:
    """A server with `capacity` slots: below it every request decodes at one token per step;
    past it the extra requests queue, and latency per token grows in proportion."""
    return step_s * max(1.0, limit / capacity)


def run_gradient(capacity: int, windows: int = 60) -> list[int]:
    control = Gradient(start=4)
    limits = []
    for _ in range(windows):
        per_token = ms_per_token(control.limit, capacity)
        new = None
        while new is None:
            new = control.on_answer(per_token * 300, 300, saturated=True)
        limits.append(new)
    return limits


@pytest.mark.parametrize("capacity", [3, 24, 200])
def test_the_gradient_controller_settles_between_capacity_and_twice_it(capacity: int) -> None:
    settled = run_gradient(capacity)[-20:]
    assert min(settled) >= capacity
    assert max(settled) <= 2 * capacity + 2 * int(capacity ** 0.5) + 2


def test_the_gradient_controller_does_not_grow_when_nothing_waits() -> None:
    control = Gradient(start=4)
    for _ in range(10):
        control.on_answer(0.3, 300, saturated=False)
    assert control.limit == 4


def test_an_aborted_answer_is_not_read_as_reasoning_split_and_a_think_block_is() -> None:
    origin = Origin("s", "w", 1)
    response = {"choices": [{"finish_reason": "stop", "message": {
        "content": "<think>\nweigh it</think>\n\nThe answer."}}], "usage": {}}
    record = result_record("q", 1, response, 0.1, origin)
    assert (record["reasoning_content"], record["content"]) == ("weigh it", "The answer.")
    vllm = {"choices": [{"finish_reason": "stop", "message": {
        "content": "A.", "reasoning": "because"}}], "usage": {}}
    assert result_record("q", 1, vllm, 0.1, origin)["reasoning_content"] == "because"


def test_answers_to_requests_sent_before_the_limit_changed_do_not_judge_it() -> None:
    clock = [1.0]
    control = Gradient(start=4, now=lambda: clock[0])
    while control.on_answer(0.3, 300, saturated=True, sent_at=0.0) is None:
        pass
    assert control.limit == 8  # doubled at 1.0
    # Slow answers still coming back from before the doubling: they say nothing of 8.
    for _ in range(20):
        assert control.on_answer(30.0, 300, saturated=True, sent_at=0.5) is None
    assert control.limit == 8
    while control.on_answer(0.3, 300, saturated=True, sent_at=1.5) is None:
        pass
    assert control.limit == 16


def test_one_lucky_window_does_not_stop_the_doubling() -> None:
    control = Gradient(start=8)
    # The first window is a lucky one: against it the next ones look 1.45-1.55x slower.
    per_token = [0.055, 0.085, 0.08, 0.082, 0.085]
    for value in per_token:
        while control.on_answer(value * 100, 100, saturated=True) is None:
            pass
    assert control.limit == 8 * 2 ** len(per_token)
    # Two windows above 1.5x in a row end it.
    for value in (0.09, 0.09):
        while control.on_answer(value * 100, 100, saturated=True) is None:
            pass
    assert control.limit < 8 * 2 ** (len(per_token) + 2)
