"""The simulator prints SGLang's log lines (docs/reference/sglang.md#logs), in each era's format."""

from __future__ import annotations

import logging
import re

import pytest

from launcher.sim import logs, startup
from launcher.sim.simulator import Simulator
from tests.sim_helpers import config

PLAIN = logs.BatchStats(running=3, queued=2, tokens=1200, token_usage=0.25, new_seq=2,
                        new_tokens=640, pending_tokens=90, throughput=1234.5, cuda_graph=True)
HYBRID_SPEC = logs.BatchStats(running=3, queued=0, tokens=1200, token_usage=0.25, mamba_num=12,
                              mamba_usage=0.15, accept_len=3.2, accept_rate=0.73,
                              throughput=250.0)
# docs/reference/sglang.md#serving-lines: parse by key, not by position
LINE = re.compile(r"^\[(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?:\.\d+)?"
                  r"(?P<ranks>(?: [A-Z_]+\d+)*)\] (?P<msg>.*)$")


@pytest.mark.parametrize(("era", "expected"), [
    ("r", ("Prefill batch, #new-seq: 2, #new-token: 640, #cached-token: 0, token usage: 0.25, "
           "#running-req: 3, #queue-req: 2, #pending-token: 90, cuda graph: True, "
           "input throughput (token/s): 1234.50")),
    ("2026-01", ("Prefill batch, #new-seq: 2, #new-token: 640, #cached-token: 0, token usage: "
                 "0.25, #running-req: 3, #queue-req: 2, input throughput (token/s): 1234.50, "
                 "cuda graph: True")),
    ("2025-10", ("Prefill batch, #new-seq: 2, #new-token: 640, #cached-token: 0, token usage: "
                 "0.25, #running-req: 3, #queue-req: 2, ")),
    ("2025-07", ("Prefill batch. #new-seq: 2, #new-token: 640, #cached-token: 0, token usage: "
                 "0.25, #running-req: 3, #queue-req: 2, ")),
    ("2025-06", ("Prefill batch. #new-seq: 2, #new-token: 640, #cached-token: 0, token usage: "
                 "0.25, #running-req: 3, #queue-req: 2")),
])
def test_prefill_line_follows_each_era(era: str, expected: str) -> None:
    assert logs.prefill_line(era, PLAIN) == expected


@pytest.mark.parametrize(("era", "expected"), [
    ("r", ("Decode batch, #running-req: 3, #token: 1200, token usage: 0.25, cuda graph: True, "
           "gen throughput (token/s): 1234.50, #queue-req: 2")),
    ("2025-10", ("Decode batch, #running-req: 3, #token: 1200, token usage: 0.25, cuda graph: "
                 "True, gen throughput (token/s): 1234.50, #queue-req: 2, ")),
    ("2025-06", ("Decode batch. #running-req: 3, #token: 1200, token usage: 0.25, cuda graph: "
                 "True, gen throughput (token/s): 1234.50, #queue-req: 2")),
])
def test_decode_line_follows_each_era(era: str, expected: str) -> None:
    assert logs.decode_line(era, PLAIN) == expected


def test_hybrid_speculative_decode_line_has_mamba_and_accept_fields() -> None:
    assert logs.decode_line("r", HYBRID_SPEC) == (
        "Decode batch, #running-req: 3, #full token: 1200, full token usage: 0.25, mamba num: 12, "
        "mamba usage: 0.15, accept len: 3.20, accept rate: 0.73, cuda graph: True, "
        "gen throughput (token/s): 250.00, #queue-req: 0")
    assert "accept rate" not in logs.decode_line("2025-07", HYBRID_SPEC)


def test_tp_prefix_marks_only_scheduler_lines() -> None:
    formatter = logs.SglangFormatter(tp_prefix=True)
    sched = logging.LogRecord(logs.SCHEDULER_LOGGER, logging.INFO, "", 0, "Decode", None, None)
    main = logging.LogRecord("launcher.sim.server", logging.INFO, "", 0, "fired", None, None)
    assert re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP0\] Decode$", formatter.format(sched))
    assert re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] fired$", formatter.format(main))


def _startup_messages(caplog: pytest.LogCaptureFixture, *flags: str) -> list[str]:
    caplog.set_level(logging.INFO, logger="launcher.sim")
    sim = Simulator(config(*flags))
    assert startup.announce(sim)
    return [r.getMessage() for r in caplog.records]


def test_startup_lines_come_in_sglangs_order(caplog: pytest.LogCaptureFixture) -> None:
    messages = _startup_messages(caplog, "--model-arch", "mamba-hybrid")
    starts = ["server_args={", "Load weight begin.", "Load weight end. elapsed=",
              "Mamba Cache is allocated.", "KV Cache is allocated. dtype: torch.bfloat16,",
              "Memory pool end.", "Capture target decode CUDA graph begin.",
              "Capture target decode CUDA graph end.", "max_total_num_tokens="]
    found = [next(i for i, m in enumerate(messages) if m.startswith(s)) for s in starts]
    assert found == sorted(found)


def test_old_eras_print_old_startup_lines(caplog: pytest.LogCaptureFixture) -> None:
    messages = _startup_messages(caplog, "--log-format", "2025-10")
    assert any(m.startswith("KV Cache is allocated. #tokens: ") for m in messages)
    assert any(m.startswith("Load weight end. type=Qwen3ForCausalLM, dtype=") for m in messages)
    assert "Capture cuda graph begin. This can take up to several minutes." in \
        "\n".join(messages)


def test_speculative_start_logs_the_48_reset_and_a_draft_model(
        caplog: pytest.LogCaptureFixture) -> None:
    messages = _startup_messages(caplog, "--speculative-algorithm", "EAGLE")
    assert any(m.startswith("Max running requests is reset to 48") for m in messages)
    assert sum(m.startswith("Load weight end.") for m in messages) == 2
    assert any("max_running_requests=48," in m for m in messages)


def test_formatted_lines_match_the_contracts_parsing_regex() -> None:
    formatter = logs.SglangFormatter(tp_prefix=False)
    record = logging.LogRecord(logs.SCHEDULER_LOGGER, logging.INFO, "", 0,
                               logs.decode_line("r", PLAIN), None, None)
    match = LINE.match(formatter.format(record))
    assert match is not None and match.group("ranks") == ""
    fields = dict(part.split(": ", 1) for part in
                  match.group("msg").removeprefix("Decode batch, ").split(", "))
    assert fields["#running-req"] == "3" and fields["#queue-req"] == "2"

