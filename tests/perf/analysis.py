"""Figures of one generation run, computed server-side from scrapes and request logs.

Definitions (the same for fleetgen and the hand-written script):

- steady window: from the first scrape in which every server runs `slots` requests, to the
  first scrape after the last prompt was first sent in which no server has a waiting request.
  Before it the fleet ramps up; after it nothing is left to start, so idle slots are the
  unavoidable drain. A slot idle inside it while some prompt has not been sent yet (e.g. it
  sits in another worker's batch) is the pipeline's fault and counts against it.
- saturation: output tokens generated in the window ÷ (servers × slots × per-slot rate ×
  window). Tokens generated so far are exact at each scrape because every prompt has the same
  input size: `generation_tokens_total + num_used_tokens - input_tokens * num_running_reqs`.
- occupancy: the mean of running / slots over the window's scrapes (cross-check).
- tail: time from the 99th-percentile prompt's answer to the last answer ÷ the longest single
  request (the longest answer's tokens ÷ the per-slot rate).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.perf.sampler import Tick
from tests.perf.workload import Workload

RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
GENERATED = "sglang:generation_tokens_total"
USED = "sglang:num_used_tokens"


@dataclass
class Requests:
    """What the servers received and answered, from the recording simulators' logs."""

    received: list[tuple[float, str, str]] = field(default_factory=list)  # (t, id, server)
    answered: list[tuple[float, str, str, int, int]] = field(default_factory=list)
    # answered: (t, id, server, HTTP status, completion tokens)

    @classmethod
    def load(cls, logs: dict[str, Path]) -> Requests:
        """Read `recsim` logs, one per server name."""
        reqs = cls()
        for server, path in logs.items():
            for line in path.read_text().splitlines():
                parts = line.split()
                if parts[0] == "R":
                    reqs.received.append((float(parts[1]), parts[2], server))
                elif parts[0] == "D":
                    reqs.answered.append((float(parts[1]), parts[2], server, int(parts[3]),
                                          int(parts[4])))
        reqs.received.sort()
        reqs.answered.sort()
        return reqs

    def first_sent(self) -> dict[str, float]:
        """Prompt id -> when a server first received it."""
        first: dict[str, float] = {}
        for t, pid, _ in self.received:
            first.setdefault(pid, t)
        return first

    def first_answered(self) -> dict[str, tuple[float, int]]:
        """Prompt id -> (time, completion tokens) of its first 200 answer."""
        first: dict[str, tuple[float, int]] = {}
        for t, pid, _, status, tokens in self.answered:
            if status == 200:
                first.setdefault(pid, (t, tokens))
        return first

    def resent_after(self, moment: float) -> set[str]:
        """Ids a server received at or after `moment` that some server had received before."""
        before = {pid for t, pid, _ in self.received if t < moment}
        return {pid for t, pid, _ in self.received if t >= moment and pid in before}

    def per_server(self) -> dict[str, int]:
        """Requests received, by server."""
        counts: dict[str, int] = defaultdict(int)
        for _, _, server in self.received:
            counts[server] += 1
        return dict(counts)


@dataclass(frozen=True)
class RunFigures:
    """Figures 1-3 of one run (times in seconds, monotonic clock)."""

    name: str
    prompts_answered: int
    requests_sent: int
    resent: int
    first_request: float
    last_answer: float
    steady_start: float | None
    steady_end: float | None
    saturation: float | None
    occupancy: float | None
    total_tokens: int
    longest_tokens: int
    longest_s: float
    t99_to_t100_s: float
    tail_ratio: float
    peak_in_flight: dict[str, int]
    peak_running: dict[str, int]
    wall_s: float | None = None

    @property
    def server_makespan_s(self) -> float:
        """First request received to last answer sent, over all servers."""
        return self.last_answer - self.first_request

    @property
    def steady_s(self) -> float:
        if self.steady_start is None or self.steady_end is None:
            return 0.0
        return max(0.0, self.steady_end - self.steady_start)

    def as_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data.update(server_makespan_s=self.server_makespan_s, steady_s=self.steady_s)
        return data


def figures(name: str, wl: Workload, ticks: Sequence[Tick], reqs: Requests, servers: Sequence[str],
            wall_s: float | None = None) -> RunFigures:
    """Compute a run's figures; `servers` are the sim names used as keys in ticks and logs."""
    complete = [t for t in ticks if all(t.values.get(s) for s in servers)]
    answered = reqs.first_answered()
    sent = reqs.first_sent()
    start, end = steady_window(wl, complete, servers, max(sent.values(), default=math.inf))
    saturation = occupancy = None
    if start is not None and end is not None and end.t > start.t:
        made = generated(wl, end, servers) - generated(wl, start, servers)
        saturation = made / (wl.ideal_rate * (end.t - start.t))
        inside = [t for t in complete if start.t <= t.t <= end.t]
        occupancy = sum(sum(t.values[s][RUNNING] for s in servers) for t in inside) / (
            len(inside) * wl.servers * wl.slots)
    done_times = sorted(t for t, _ in answered.values())
    longest = max((tokens for _, tokens in answered.values()), default=0)
    longest_s = longest / wl.slot_rate
    t99 = done_times[math.ceil(0.99 * len(done_times)) - 1] if done_times else 0.0
    tail = (done_times[-1] - t99) if done_times else 0.0
    return RunFigures(
        name=name, prompts_answered=len(answered), requests_sent=len(reqs.received),
        resent=len(reqs.received) - len(sent),
        first_request=reqs.received[0][0] if reqs.received else 0.0,
        last_answer=reqs.answered[-1][0] if reqs.answered else 0.0,
        steady_start=start.t if start else None, steady_end=end.t if end else None,
        saturation=saturation, occupancy=occupancy,
        total_tokens=sum(tokens for _, tokens in answered.values()),
        longest_tokens=longest, longest_s=longest_s, t99_to_t100_s=tail,
        tail_ratio=tail / longest_s if longest_s else math.inf,
        peak_in_flight={s: int(max((t.values[s][RUNNING] + t.values[s][QUEUED]
                                    for t in complete), default=0)) for s in servers},
        peak_running={s: int(max((t.values[s][RUNNING] for t in complete), default=0))
                      for s in servers},
        wall_s=wall_s,
    )


def steady_window(wl: Workload, ticks: Sequence[Tick], servers: Sequence[str],
                  last_sent: float) -> tuple[Tick | None, Tick | None]:
    """The first all-servers-full scrape and the first no-waiting scrape after `last_sent`."""
    start = next((t for t in ticks if all(t.values[s][RUNNING] >= wl.slots for s in servers)),
                 None)
    end = next((t for t in ticks if t.t >= last_sent
                and sum(t.values[s][QUEUED] for s in servers) == 0), None)
    return start, end


def generated(wl: Workload, tick: Tick, servers: Sequence[str]) -> float:
    """Output tokens the servers had produced by this scrape, running requests included."""
    return sum(tick.values[s][GENERATED] + tick.values[s][USED]
               - wl.input_tokens * tick.values[s][RUNNING] for s in servers)


def series(ticks: Sequence[Tick], server: str, family: str, origin: float
           ) -> list[tuple[float, float]]:
    """(seconds since origin, value) of one family of one target, for plots."""
    return [(t.t - origin, t.values[server][family]) for t in ticks if t.values.get(server)]
