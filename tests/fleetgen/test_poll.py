"""fleetgen.poll: a condition looked at every interval until it holds or the deadline."""

from __future__ import annotations

import time

import pytest

from fleetgen.poll import poll, wait_until


def test_poll_returns_the_first_answer_that_is_not_none() -> None:
    answers = iter([None, None, "ready"])
    assert poll(lambda: next(answers), 5.0, 0.01) == "ready"


def test_poll_gives_none_at_the_deadline_and_looks_once_more_there() -> None:
    looks: list[float] = []
    start = time.monotonic()
    assert poll(lambda: looks.append(time.monotonic()), 0.3, 0.2) is None
    assert len(looks) == 3 and looks[-1] - start == pytest.approx(0.3, abs=0.1)


def test_an_error_of_the_condition_ends_the_wait_at_once() -> None:
    def exited() -> None:
        raise RuntimeError("the process exited")

    with pytest.raises(RuntimeError, match="exited"):
        poll(exited, 5.0, 0.01)


def test_wait_until_names_what_it_waited_for() -> None:
    with pytest.raises(TimeoutError, match="timed out after 0.1s waiting for redis"):
        wait_until(lambda: False, 0.1, what="redis")
