"""How much a worker keeps in hand: the reserve of unsent prompts that triggers the next batch."""

from __future__ import annotations

from types import SimpleNamespace

from kombu.transport.virtual.base import QoS

from workers.gate import (
    MIN_RESERVE,
    RESERVE_S,
    SendRate,
    held_on_channel,
    reserve,
    wanted_prefetch,
)


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


def test_one_more_batch_is_let_in_only_when_the_prompts_in_hand_run_low() -> None:
    steady = {"batches": 2, "held": 2, "loading": 0, "low_water": 20, "healthy": True, "cap": 8}
    assert wanted_prefetch(unsent=50, **steady) == 2  # enough in hand: no room for more
    assert wanted_prefetch(unsent=5, **steady) == 3  # running low: one more
    assert wanted_prefetch(unsent=5, **(steady | {"healthy": False})) == 2
    assert wanted_prefetch(unsent=5, **(steady | {"loading": 1})) == 2  # one is on its way
    assert wanted_prefetch(unsent=5, **(steady | {"batches": 8, "held": 8})) == 8  # the cap


def test_after_a_broker_reconnect_old_batches_open_no_room_for_new_ones() -> None:
    # 58 batches still running from the old connection, plenty of prompts in hand; the new
    # channel holds nothing. Counting the old ones let a worker take 58 more in 3 s.
    qos = QoS(SimpleNamespace(do_restore=False), prefetch_count=59)
    consumer = SimpleNamespace(task_consumer=SimpleNamespace(channel=SimpleNamespace(qos=qos)))
    held = held_on_channel(consumer)
    assert held == 0
    assert wanted_prefetch(batches=58, held=held, loading=0, unsent=900, low_water=20,
                           healthy=True, cap=64) == 1
    for tag in range(3):  # three delivered on this channel, not acked yet
        qos.append(SimpleNamespace(delivery_tag=tag), tag)
    assert held_on_channel(consumer) == 3
    assert wanted_prefetch(batches=61, held=3, loading=0, unsent=900, low_water=20,
                           healthy=True, cap=64) == 3
