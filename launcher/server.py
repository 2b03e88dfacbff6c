"""One SGLang server process: its argv, spawning, readiness, reading its mind, stopping it.

    argv = build_argv(["sglang", "serve"], "/dev/shm/Qwen3.6-27B", 30000, 31000, user_args)
    proc = spawn(LaunchSpec("gpu0", argv, env, Path("logs/sglang_gpu0.log"), 30000))
    outcome = await wait_ready(proc, spec, LogFollower(spec.log_path), probe, clock, ...)
    await stop_process(proc, clock, timeout_s=60)

The server runs in its own session and process group with stdout and stderr merged into one
log file per GPU (docs/reference/sglang.md#process: SGLang logs to both). Readiness polls
`/health`, checks the return code and tails the log for fatal lines every round, under one
deadline (docs/reference/sglang.md#startup).

This module only re-exports, so callers keep one import site; the parts live in:

    errors.py       NodeError, PortBusyError, ProfileError (the launcher's error tree)
    argv.py         build_argv, flag_value, split_flags, redacted
    clock.py        Clock, SystemClock
    process.py      LaunchSpec, ServerProcess, PopenProcess, spawn, stop_process
    logfollower.py  LogFollower, describe_exit, describe_fatal
    readiness.py    Probe, HttpProbe, StartOutcome, wait_ready
    reading.py      Reading, read_server
"""

from __future__ import annotations

from launcher.argv import HOST, SECRET_FLAGS, build_argv, flag_value, redacted, split_flags
from launcher.clock import Clock, SystemClock
from launcher.errors import NodeError, PortBusyError, ProfileError
from launcher.logfollower import (
    MAX_READ_BYTES,
    TAIL_LINES,
    LogFollower,
    describe_exit,
    describe_fatal,
)
from launcher.process import (
    MARKER,
    LaunchSpec,
    PopenProcess,
    ServerProcess,
    spawn,
    stop_process,
)
from launcher.readiness import HEALTH_TIMEOUT_S, HttpProbe, Probe, StartOutcome, wait_ready
from launcher.reading import Reading, read_server

__all__ = [
    "HEALTH_TIMEOUT_S",
    "HOST",
    "MARKER",
    "MAX_READ_BYTES",
    "SECRET_FLAGS",
    "TAIL_LINES",
    "Clock",
    "HttpProbe",
    "LaunchSpec",
    "LogFollower",
    "NodeError",
    "PopenProcess",
    "PortBusyError",
    "Probe",
    "ProfileError",
    "Reading",
    "ServerProcess",
    "StartOutcome",
    "SystemClock",
    "build_argv",
    "describe_exit",
    "describe_fatal",
    "flag_value",
    "read_server",
    "redacted",
    "spawn",
    "split_flags",
    "stop_process",
    "wait_ready",
]
