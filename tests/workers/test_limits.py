"""The worker's in-flight limit (workers/limits.py): the limiter every request holds slots of,
the server's real slot count, resized while requests run and served in arrival order."""

from __future__ import annotations

import asyncio

from fleetgen.servers import KINDS, Server
from fleetgen.settings import Settings
from workers.flow import ServerWatch
from workers.limits import PROBE_START, InFlight, Limiter, QueueProbe, queue_margin


async def _holders(limiter: Limiter, names: list[str], entered: list[str],
                   release: dict[str, asyncio.Event]) -> list[asyncio.Task[None]]:
    async def hold(name: str) -> None:
        async with limiter:
            entered.append(name)
            await release[name].wait()

    tasks = []
    for name in names:
        tasks.append(asyncio.create_task(hold(name)))
        await asyncio.sleep(0)  # each one queues before the next (arrival order)
    await asyncio.sleep(0)
    return tasks


def test_slots_go_to_waiters_in_arrival_order_and_never_past_the_limit() -> None:
    async def scenario() -> None:
        limiter = Limiter(2)
        names = ["a", "b", "c", "d", "e"]
        entered: list[str] = []
        release = {n: asyncio.Event() for n in names}
        tasks = await _holders(limiter, names, entered, release)
        assert entered == ["a", "b"] and limiter.active == 2
        release["b"].set()
        await asyncio.sleep(0.01)
        assert entered == ["a", "b", "c"] and limiter.active == 2
        # A newcomer does not overtake the queue: the next free slot is d's.
        late = await _holders(limiter, ["f"], entered, {"f": release.setdefault("f", asyncio.Event())})
        release["a"].set()
        await asyncio.sleep(0.01)
        assert entered == ["a", "b", "c", "d"] and limiter.active == 2
        for event in release.values():
            event.set()
        await asyncio.gather(*tasks, *late)
        assert entered == ["a", "b", "c", "d", "e", "f"] and limiter.active == 0

    asyncio.run(scenario())


def test_a_larger_limit_lets_waiters_in_at_once_and_a_smaller_one_waits_for_releases() -> None:
    async def scenario() -> None:
        limiter = Limiter(1)
        names = [f"p{i}" for i in range(6)]
        entered: list[str] = []
        release = {n: asyncio.Event() for n in names}
        tasks = await _holders(limiter, names, entered, release)
        assert entered == ["p0"]
        await limiter.set_limit(4)  # the server reported its real capacity
        await asyncio.sleep(0)
        assert entered == ["p0", "p1", "p2", "p3"] and limiter.active == 4
        await limiter.set_limit(2)  # nothing is taken back; releases drain to the new limit
        release["p0"].set()
        release["p1"].set()
        await asyncio.sleep(0.01)
        assert limiter.active == 2 and entered == ["p0", "p1", "p2", "p3"]
        release["p2"].set()
        await asyncio.sleep(0.01)
        assert limiter.active == 2 and entered[-1] == "p4"
        for event in release.values():
            event.set()
        await asyncio.gather(*tasks)
        assert limiter.active == 0

    asyncio.run(scenario())


def test_a_cancelled_waiter_keeps_no_slot_even_if_cancelled_as_it_was_handed_one() -> None:
    async def scenario() -> None:
        limiter = Limiter(1)
        names = ["a", "b", "c"]
        entered: list[str] = []
        release = {n: asyncio.Event() for n in names}
        tasks = await _holders(limiter, names, entered, release)
        tasks[1].cancel()  # b gives up while waiting
        await asyncio.sleep(0)
        release["a"].set()
        await asyncio.sleep(0.01)
        assert entered == ["a", "c"] and limiter.active == 1
        # c is handed the slot and cancelled in the same loop pass: the slot is passed on.
        more = await _holders(limiter, ["d"], entered, {"d": release.setdefault("d", asyncio.Event())})
        release["c"].set()
        await asyncio.sleep(0)  # c's exit hands the slot to d ...
        more[0].cancel()  # ... and d is cancelled before it runs
        await asyncio.sleep(0.01)
        assert limiter.active == 0
        await asyncio.gather(*tasks, *more, return_exceptions=True)
        async with limiter:
            assert limiter.active == 1

    asyncio.run(scenario())


def test_a_request_of_several_answers_holds_a_slot_per_answer_and_keeps_its_turn() -> None:
    async def scenario() -> None:
        limiter = Limiter(4)
        entered: list[str] = []
        release = {n: asyncio.Event() for n in ("one", "four", "late", "huge")}

        async def hold(name: str, count: int) -> None:
            async with limiter.slots(count):
                entered.append(name)
                await release[name].wait()

        tasks = [asyncio.create_task(hold("one", 1))]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(hold("four", 4)))
        await asyncio.sleep(0)
        # A single answer fits, but waits behind the four-answer request that came first.
        tasks.append(asyncio.create_task(hold("late", 1)))
        await asyncio.sleep(0.01)
        assert entered == ["one"] and limiter.active == 1 and limiter.waiting == 2
        release["one"].set()
        await asyncio.sleep(0.01)
        assert entered == ["one", "four"] and limiter.active == 4
        release["four"].set()
        await asyncio.sleep(0.01)
        assert entered == ["one", "four", "late"] and limiter.active == 1
        # More answers than the limit go alone, once nothing else runs.
        tasks.append(asyncio.create_task(hold("huge", 6)))
        await asyncio.sleep(0.01)
        assert "huge" not in entered
        release["late"].set()
        await asyncio.sleep(0.01)
        assert entered[-1] == "huge" and limiter.active == 6
        release["huge"].set()
        await asyncio.gather(*tasks)
        assert limiter.active == 0

    asyncio.run(scenario())


def in_flight_of_a_server_that_states_nothing() -> tuple[InFlight, ServerWatch]:
    watch = ServerWatch()
    in_flight = InFlight(Settings(), "w0@test", "http://fake", watch)
    in_flight.found(Server(KINDS["openai"], ("m",)))
    return in_flight, watch


def test_a_stated_request_budget_is_kept_in_flight_at_once_and_probes_stop() -> None:
    in_flight, _ = in_flight_of_a_server_that_states_nothing()
    in_flight.budgeted(60)
    assert in_flight.control is None
    assert in_flight.limit == 60 + queue_margin(Settings(), 60)
    # Found again at the next refresh: still the budget, never a probe controller.
    in_flight.found(Server(KINDS["openai"], ("m",)))
    assert in_flight.control is None and in_flight.limit == 66


def test_an_unstated_budget_grows_from_what_runs_each_quiet_second() -> None:
    in_flight, watch = in_flight_of_a_server_that_states_nothing()
    before = in_flight.limit
    in_flight.budgeted(None)
    assert in_flight.control is None
    assert in_flight.limit == max(before, PROBE_START)
    assert watch.ceiling.value == in_flight.limit


def test_a_holder_over_a_cut_limit_waits_in_line_again_and_a_cancelled_one_keeps_the_count() -> None:
    async def scenario() -> None:
        limiter = Limiter(4)
        for _ in range(4):
            await limiter.acquire(1)
        await limiter.set_limit(2)
        # Four hold slots under a limit of two: two of them wait in line again.
        again = [asyncio.create_task(limiter.requeue(1)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert limiter.active == 2 and sum(t.done() for t in again) == 1
        again[1].cancel()
        await asyncio.sleep(0.01)
        # Cancelled in line: counted as held again, for its holder's own release.
        assert limiter.active == 3 and again[1].cancelled()
        for _ in range(3):
            limiter.release(1)
        await asyncio.sleep(0.01)
        assert again[2].done() and limiter.active == 1
        await limiter.requeue(1)  # under the limit: keeps its slot, no wait
        assert limiter.active == 1

    asyncio.run(scenario())


def test_a_draining_job_is_not_a_smaller_server() -> None:
    """Probes that come back a little slower than the idle one while nothing waits at the
    worker (fewer requests left, not fewer slots) keep the capacity measured under load; the
    same wait while requests queue at the worker lowers it."""
    probe = QueueProbe(lambda capacity: capacity // 4, idle_s=0.02)
    # Under load: 480 out, requests waiting here, ~7 queued at the server ahead of the probe.
    for _ in range(5):
        probe.on_probe(0.1, 480, True, answers_per_s=100.0)
    assert probe.capacity == 473
    # Draining: fewer out each probe, none waiting here, each probe ~5 answers slower.
    for in_flight in (400, 300, 216, 120):
        probe.on_probe(0.08, in_flight, False, answers_per_s=100.0)
        assert probe.capacity == 473 and probe.limit == 473 + 473 // 4
    assert "keeping ~473 measured" in probe.how
    # A server that lost slots while work waits here is followed down.
    probe.on_probe(0.1, 240, True, answers_per_s=100.0)
    assert probe.capacity == 233
