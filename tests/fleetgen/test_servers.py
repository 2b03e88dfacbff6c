"""The server-kind seam (fleetgen/servers): how a stored body is shaped for each kind, what a
strict server's refusals teach, and how the two capacity controllers move the limit.

Pure and fast; the same seam against real HTTP servers is in tests/workers/test_client_engines.py."""

from __future__ import annotations

import pytest

from fleetgen.errors import ModelChoiceError
from fleetgen.job import GenerationParams
from fleetgen.records import Origin, result_record, split_choices
from fleetgen.servers import KINDS, Server, parse_server_info, stated_capacity
from workers.limits import QueueProbe, QueueWatch

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


def probe_latency(in_flight: int, capacity: int, answer_s: float, base_s: float = 0.02) -> float:
    """A server with `capacity` slots and answers of `answer_s`: a probe starts at once while a
    slot is free, else after the requests queued ahead of it (a slot frees every
    answer_s / capacity)."""
    queued = max(0, in_flight + 1 - capacity)
    return base_s + queued * answer_s / capacity


def run_probes(capacity: int, answer_s: float, probes: int = 30) -> list[int]:
    """The limits a QueueProbe sets, one probe a second, the worker always having work."""
    control = QueueProbe(margin=lambda n: max(4, n // 10), start=8, idle_s=0.02)
    limits = []
    for _ in range(probes):
        n = control.limit
        rate = min(n, capacity) / answer_s
        limits.append(control.on_probe(probe_latency(n, capacity, answer_s), n, True, rate))
    return limits


@pytest.mark.parametrize("answer_s", [1.0, 25.0, 60.0])
@pytest.mark.parametrize("capacity", [3, 24, 64, 200])
def test_the_probe_fills_a_server_within_seconds_and_never_passes_one_and_a_half_times_it(
        capacity: int, answer_s: float) -> None:
    limits = run_probes(capacity, answer_s)
    full_at = next(i for i, n in enumerate(limits) if n >= capacity)
    assert full_at <= 10
    assert max(limits) <= max(1.5 * capacity, capacity + 4)
    assert all(capacity <= n <= capacity + max(4, capacity // 10) + 1 for n in limits[-10:])


def test_the_probe_follows_a_capacity_that_falls_at_the_next_probe() -> None:
    control = QueueProbe(margin=lambda n: 4, start=8, idle_s=0.02)
    for _ in range(20):
        n = control.limit
        control.on_probe(probe_latency(n, 64, 20.0), n, True, min(n, 64) / 20.0)
    assert 64 <= control.limit <= 70
    n = control.limit  # the server restarts with 16 slots; the worker still has n out
    limit = control.on_probe(probe_latency(n, 16, 20.0), n, True, 16 / 20.0)
    assert 16 <= limit <= 21


def test_before_any_answer_longer_steps_do_not_end_the_ramp_and_a_queue_does() -> None:
    control = QueueProbe(margin=lambda n: 4, start=8, idle_s=0.1)
    for latency in (0.2, 0.3, 0.35):  # a busier GPU server's longer steps
        control.on_probe(latency, control.limit, True, answers_per_s=0.0)
    assert control.limit == 27  # 8 -> 12 -> 18 -> 27
    control.on_probe(2.0, control.limit, True, answers_per_s=0.0)  # waited for a slot
    assert control.limit == 27
    control.on_probe(0.2, control.limit, True, answers_per_s=0.0)
    assert control.limit == 33  # past the ramp: grows by a quarter


def test_the_probe_does_not_grow_a_limit_nobody_waited_for() -> None:
    control = QueueProbe(margin=lambda n: 4, start=8)
    for _ in range(10):
        control.on_probe(0.02, 3, False, 0.5)
    assert control.limit == 8


def test_an_aborted_answer_is_not_read_as_reasoning_split_and_a_think_block_is() -> None:
    origin = Origin("s", "w", 1)
    response = {"choices": [{"finish_reason": "stop", "message": {
        "content": "<think>\nweigh it</think>\n\nThe answer."}}], "usage": {}}
    record = result_record("q", 1, response, 0.1, origin)
    assert (record["reasoning_content"], record["content"]) == ("weigh it", "The answer.")
    vllm = {"choices": [{"finish_reason": "stop", "message": {
        "content": "A.", "reasoning": "because"}}], "usage": {}}
    assert result_record("q", 1, vllm, 0.1, origin)["reasoning_content"] == "because"




def test_sglang_and_vllm_take_n_but_not_an_unknown_kind_nor_a_deterministic_sglang() -> None:
    assert Server(KINDS["sglang"]).takes_n and Server(KINDS["vllm"]).takes_n
    assert not Server(KINDS["openai"]).takes_n
    # With deterministic inference SGLang seeds every choice alike: n copies of one answer.
    info = parse_server_info({"enable_deterministic_inference": True})
    assert not Server(KINDS["sglang"], info=info).takes_n
    assert Server(KINDS["sglang"]).prepare(STORED, thinking=True, n=4)["n"] == 4
    assert "n" not in Server(KINDS["sglang"]).prepare(STORED, thinking=True, n=1)


def test_a_refusal_of_n_is_learned_only_from_a_request_that_asked_several() -> None:
    server = Server(KINDS["vllm"])
    several = server.prepare(STORED, thinking=True, n=4)
    one = server.prepare(STORED, thinking=True)
    assert server.learn(400, "HTTP 400: n > 1 is not supported", one, STORED) is None
    assert server.learn(400, "HTTP 400: prompt is too long", several, STORED) is None
    assert server.takes_n
    assert server.learn(400, "HTTP 400: Unsupported parameter: 'n'", several, STORED) == (
        "refuses n (several answers in one request): one request per answer")
    assert not server.takes_n and "without n" in server.describe()


def test_the_choices_of_an_n_answer_split_the_usage_so_the_totals_stay_the_engines() -> None:
    origin = Origin("s", "w", 1)
    response = {"choices": [
        {"index": 1, "finish_reason": "stop",
         "message": {"content": "a" * 30, "reasoning_content": "r" * 10}},
        {"index": 0, "finish_reason": "length", "message": {"content": "b" * 10}},
        {"index": 2, "finish_reason": "stop", "message": {"content": "", "tool_calls": None}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 101,
                  "completion_tokens_details": {"reasoning_tokens": 9}}}
    records = [result_record("q", 1, r, 0.1, origin, i)
               for i, r in enumerate(split_choices(response))]
    assert [r["finish_reason"] for r in records] == ["length", "stop", "stop"]  # by index
    usage = [r["usage"] for r in records]
    assert sum(u["completion_tokens"] for u in usage) == 101
    assert sum(u["reasoning_tokens"] for u in usage) == 9
    assert [u["reasoning_tokens"] for u in usage] == [0, 9, 0]
    assert usage[1]["completion_tokens"] > usage[0]["completion_tokens"] > 0
    assert usage[2]["completion_tokens"] == 0
    assert all(u["prompt_tokens"] == 7 for u in usage)


def test_behind_a_router_a_minority_of_waiting_probes_keeps_the_limit_growing() -> None:
    # A least-in-flight router over a 32-slot and an 8-slot backend: a probe that lands on
    # the small one waits, one on the large one does not.
    control = QueueProbe(margin=lambda n: 4, start=40, idle_s=0.1, several=True)
    control._ramping = False
    for latency in (2.0, 0.1, 2.0, 0.1, 0.1):  # two of five waited
        control.on_probe(latency, control.limit, True, answers_per_s=20.0)
    assert control.limit > 40 and control.capacity is None
    for _ in range(3):  # now most wait, ~29 ahead of each at 70 in flight: the router is full
        control.on_probe(1.6, 70, True, answers_per_s=20.0)
    assert (control.capacity, control.limit) == (41, 45)


def test_a_single_server_is_sized_by_its_first_waiting_probe() -> None:
    control = QueueProbe(margin=lambda n: 4, start=40, idle_s=0.1)
    control._ramping = False
    control.on_probe(1.1, 40, True, answers_per_s=20.0)  # ~19 waited ahead of it
    assert control.capacity == 21 and control.limit == 25


def test_sglang_routers_info_makes_it_a_router_that_states_no_capacity() -> None:
    info = parse_server_info({"router_manager": True, "routers_count": 1, "workers_count": 2,
                              "default_router": "http-regular"}, "/get_server_info")
    assert info.router and stated_capacity(info) is None
    assert not parse_server_info({"max_running_requests": 8}).router
