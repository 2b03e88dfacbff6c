"""How much a worker keeps in hand: the reserve of unsent prompts that triggers the next batch."""

from __future__ import annotations

from workers.gate import MIN_RESERVE, RESERVE_S, SendRate, reserve


def test_reserve_is_a_second_of_sending_between_a_handful_and_a_servers_worth() -> None:
    assert reserve(None, 44) == 44  # rate unknown: a server's worth
    assert reserve(22.0, 44) == round(22 * RESERVE_S)
    assert reserve(0.3, 44) == MIN_RESERVE  # a slow GPU still gets its next batch early
    assert reserve(3000.0, 44) == 44  # an instant server: capped at what it can hold


def test_send_rate_is_unknown_until_half_a_window_then_follows_the_recent_count() -> None:
    rate = SendRate(window_s=2.0)
    assert rate.update(0.0, 0) is None
    assert rate.update(0.5, 10) is None
    assert rate.update(1.0, 20) == 20.0
    for step in range(1, 41):  # 10 s at 5 prompts/s: the early 20/s burst leaves the window
        value = rate.update(1.0 + step * 0.25, 20 + step * 5 // 4)
    assert value is not None and abs(value - 5.0) < 1.0
    assert rate.update(12.0, 70) is not None and rate.update(14.5, 70) == 0.0  # stalled
