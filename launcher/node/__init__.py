"""Node supervision: one SGLang server (or simulator) per GPU, or per group of GPUs for
tensor/data-parallel servers, kept running (`up`, `status`, `restart`, `advise`, `tune`).

    _commands.py    main: `up`, `status` (the table), `restart`
    _plan.py        NodePlan: each server's GPUs (Parallel), its and its worker's spec and
                    ports; restart.json -> Order
    _supervisor.py  Supervisor: the loops that keep each GPU's server and worker up; Policy,
                    Slot, Child, Order
    _watch.py       one server watched: LogFollower, wait_ready over /health, Reading once ready
    _process.py     LaunchSpec, spawn a child in its own process group
    _rundir.py      the run directory's files, typed: node.json (NodeState), restart.json
                    (RestartRequest), tune.json (TuneRecord); supervisor liveness
    _restart.py     one restart asked of the supervisor and followed to its end
    _advise.py      `advise`: what binds each GPU (or any SGLang server by URL), flags to try,
                    predicted running and tokens/s
    _tune.py        `tune` and `up --tune`: Tuning, one method per step (baseline,
                    candidates side by side, settle, choose, roll out); TuneSettings
    _tunelog.py     TuneLog: the tuning's record (tune.json), printed and published
    _kind.py        ServerLaunch: how each kind of server starts (SGLang, the simulator,
                    another engine's command): its command, argv and which flags apply
    _args.py        server arguments: profile, per-GPU layers, flag renames, flag values
    _flags.py       the flags each SGLang release accepts (sglang_flags.json), check_args
    _gpus.py        the GPUs nvidia-smi lists and a --gpus selection
    _clock.py       Clock: time as the supervisor sees it (tests pass a fake)
    _errors.py      NodeError and its subclasses

Exported: the commands (`main`), the node's state as `status` reads it (`read_state`), and
the flags table's builders (scripts/sglang_flags.py). Tests import the rest from its module.
"""

from launcher.node._commands import main
from launcher.node._errors import GpuSpecError, NodeError, NoGpuError, ProfileError
from launcher.node._flags import TABLE_FILE as SGLANG_FLAGS_FILE
from launcher.node._flags import read_wheel, table_json, wheel_release
from launcher.node._rundir import (
    NodeState,
    ProcessEntry,
    Rollout,
    ServerEntry,
    TuneRecord,
    TuneStep,
    read_state,
)

__all__ = [
    "SGLANG_FLAGS_FILE",
    "GpuSpecError",
    "NoGpuError",
    "NodeError",
    "NodeState",
    "ProcessEntry",
    "ProfileError",
    "Rollout",
    "ServerEntry",
    "TuneRecord",
    "TuneStep",
    "main",
    "read_state",
    "read_wheel",
    "table_json",
    "wheel_release",
]
