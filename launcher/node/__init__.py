"""Node supervision: one SGLang server (or simulator) per GPU, kept running (`up`, `status`,
`restart`).

    _commands.py    main: `up`, `status` (the table), `restart` (and following it)
    _plan.py        NodePlan: each GPU's server and worker spec and ports; restart.json -> Order
    _supervisor.py  Supervisor: the loops that keep each GPU's server and worker up; Policy,
                    Slot, Child, Order
    _watch.py       one server watched: LogFollower, wait_ready over /health, Reading once ready
    _process.py     LaunchSpec, spawn and stop a child in its own process group
    _args.py        server arguments: profile, per-GPU layers, flag renames, build_argv
    _gpus.py        the GPUs nvidia-smi lists and a --gpus selection
    _rundir.py      the run directory: node.json, restart.json, supervisor liveness
    _clock.py       Clock: time as the supervisor sees it (tests pass a fake)
    _errors.py      NodeError and its subclasses
"""

from launcher.node._args import (
    HOST,
    NEWEST_SGLANG,
    SECRET_FLAGS,
    GpuOverride,
    Profile,
    adapt_flags,
    build_argv,
    flag_value,
    load_profile,
    merge_args,
    profile_from_mapping,
    redacted,
    sglang_command,
    sglang_version,
    split_flags,
)
from launcher.node._clock import Clock, SystemClock
from launcher.node._commands import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    annotate,
    follow,
    main,
    render_status,
    up_parser,
)
from launcher.node._errors import GpuSpecError, NodeError, NoGpuError, PortBusyError, ProfileError
from launcher.node._gpus import Gpu, discover_gpus, parse_gpu_line, parse_gpu_spec, select_gpus
from launcher.node._plan import (
    DEFAULT_BASE_PORT,
    NCCL_OFFSET,
    SIM_COMMAND,
    NodePlan,
    check_ports,
    read_request,
)
from launcher.node._process import (
    MARKER,
    LaunchSpec,
    PopenProcess,
    ServerProcess,
    spawn,
    stop_process,
)
from launcher.node._rundir import (
    DEFAULT_RUN_DIR,
    REQUEST_FILE,
    STATE_FILE,
    pid_alive,
    read_state,
    write_json,
)
from launcher.node._supervisor import (
    Child,
    Order,
    OrderError,
    Policy,
    Slot,
    Spawn,
    State,
    Supervisor,
)
from launcher.node._watch import (
    HttpProbe,
    LogFollower,
    Probe,
    Reading,
    StartOutcome,
    describe_exit,
    describe_fatal,
    read_server,
    wait_ready,
)

__all__ = [
    "DEFAULT_BASE_PORT",
    "DEFAULT_RUN_DIR",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "HOST",
    "MARKER",
    "NCCL_OFFSET",
    "NEWEST_SGLANG",
    "REQUEST_FILE",
    "SECRET_FLAGS",
    "SIM_COMMAND",
    "STATE_FILE",
    "Child",
    "Clock",
    "Gpu",
    "GpuOverride",
    "GpuSpecError",
    "HttpProbe",
    "LaunchSpec",
    "LogFollower",
    "NoGpuError",
    "NodeError",
    "NodePlan",
    "Order",
    "OrderError",
    "Policy",
    "PopenProcess",
    "PortBusyError",
    "Probe",
    "Profile",
    "ProfileError",
    "Reading",
    "ServerProcess",
    "Slot",
    "Spawn",
    "StartOutcome",
    "State",
    "Supervisor",
    "SystemClock",
    "adapt_flags",
    "annotate",
    "build_argv",
    "check_ports",
    "describe_exit",
    "describe_fatal",
    "discover_gpus",
    "flag_value",
    "follow",
    "load_profile",
    "main",
    "merge_args",
    "parse_gpu_line",
    "parse_gpu_spec",
    "pid_alive",
    "profile_from_mapping",
    "read_request",
    "read_server",
    "read_state",
    "redacted",
    "render_status",
    "select_gpus",
    "sglang_command",
    "sglang_version",
    "spawn",
    "split_flags",
    "stop_process",
    "up_parser",
    "wait_ready",
    "write_json",
]
