"""Node supervision: one SGLang server (or simulator) per GPU, or per group of GPUs for
tensor/data-parallel servers, kept running (`up`, `status`, `restart`).

    _commands.py    main: `up`, `status` (the table), `restart` (and following it)
    _plan.py        NodePlan: each server's GPUs (Parallel), its and its worker's spec and
                    ports; restart.json -> Order
    _supervisor.py  Supervisor: the loops that keep each GPU's server and worker up; Policy,
                    Slot, Child, Order
    _watch.py       one server watched: LogFollower, wait_ready over /health, Reading once ready
    _process.py     LaunchSpec, spawn and stop a child in its own process group
    _advise.py      `advise`: what binds each GPU (or any SGLang server by URL), flags to try,
                    predicted running and tokens/s
    _tune.py        `tune`: one GPU's experiment at a time via rolling restarts; tune.json
    _args.py        server arguments: profile, per-GPU layers, flag renames, build_argv
    _flags.py       the flags each SGLang release accepts (sglang_flags.json), check_args
    _gpus.py        the GPUs nvidia-smi lists and a --gpus selection
    _rundir.py      the run directory: node.json, restart.json, supervisor liveness
    _clock.py       Clock: time as the supervisor sees it (tests pass a fake)
    _errors.py      NodeError and its subclasses
"""

from launcher.node._advise import (
    Advice,
    Observed,
    advise,
    entry_for_url,
    entry_from_server_info,
    observe,
    relative_throughput,
)
from launcher.node._args import (
    NEWEST_SGLANG,
    GpuOverride,
    Profile,
    adapt_flags,
    build_argv,
    flag_value,
    load_profile,
    merge_args,
    profile_from_mapping,
    sglang_command,
    sglang_version,
    split_flags,
    version_tuple,
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
from launcher.node._errors import GpuSpecError, NodeError, NoGpuError, ProfileError
from launcher.node._flags import TABLE_FILE as SGLANG_FLAGS_FILE
from launcher.node._flags import (
    Flag,
    check_args,
    load_table,
    read_actions,
    read_source,
    read_wheel,
    release_for,
    supported_releases,
    table_json,
    wheel_release,
)
from launcher.node._gpus import (
    Gpu,
    discover_gpus,
    group_gpus,
    parse_gpu_line,
    parse_gpu_spec,
    select_gpus,
)
from launcher.node._plan import (
    DEFAULT_BASE_PORT,
    NCCL_OFFSET,
    SIM_COMMAND,
    NodePlan,
    Parallel,
    check_ports,
    read_request,
    render_dry_run,
)
from launcher.node._process import (
    MARKER,
    LaunchSpec,
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
from launcher.node._tune import TUNE_FILE, TuneLog, previous_values, run_tune, smaller_step
from launcher.node._watch import (
    HttpProbe,
    LogFollower,
    Probe,
    Reading,
    StartOutcome,
    describe_exit,
    describe_fatal,
    limits_reading,
    wait_ready,
)

__all__ = [
    "DEFAULT_BASE_PORT",
    "DEFAULT_RUN_DIR",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "MARKER",
    "NCCL_OFFSET",
    "NEWEST_SGLANG",
    "REQUEST_FILE",
    "SGLANG_FLAGS_FILE",
    "SIM_COMMAND",
    "STATE_FILE",
    "TUNE_FILE",
    "Advice",
    "Child",
    "Clock",
    "Flag",
    "Gpu",
    "GpuOverride",
    "GpuSpecError",
    "HttpProbe",
    "LaunchSpec",
    "LogFollower",
    "NoGpuError",
    "NodeError",
    "NodePlan",
    "Observed",
    "Order",
    "OrderError",
    "Parallel",
    "Policy",
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
    "TuneLog",
    "adapt_flags",
    "advise",
    "annotate",
    "build_argv",
    "check_args",
    "check_ports",
    "describe_exit",
    "describe_fatal",
    "discover_gpus",
    "entry_for_url",
    "entry_from_server_info",
    "flag_value",
    "follow",
    "group_gpus",
    "limits_reading",
    "load_profile",
    "load_table",
    "main",
    "merge_args",
    "observe",
    "parse_gpu_line",
    "parse_gpu_spec",
    "pid_alive",
    "previous_values",
    "profile_from_mapping",
    "read_actions",
    "read_request",
    "read_source",
    "read_state",
    "read_wheel",
    "relative_throughput",
    "release_for",
    "render_dry_run",
    "render_status",
    "run_tune",
    "select_gpus",
    "sglang_command",
    "sglang_version",
    "smaller_step",
    "spawn",
    "split_flags",
    "stop_process",
    "supported_releases",
    "table_json",
    "up_parser",
    "version_tuple",
    "wait_ready",
    "wheel_release",
    "write_json",
]
