"""The node plan: how each GPU's server and worker is launched, on which ports.

Also how a `restart.json` request turns into a supervisor Order and the plan it implies,
and the up-front check that every planned port is free.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fleetgen.keys import METRICS_BASE_PORT
from fleetgen.redact import redact_argv
from launcher.errors import PortBusyError
from launcher.node._args import (
    NEWEST_SGLANG,
    Profile,
    adapt_flags,
    build_argv,
    flag_value,
    load_profile,
    merge_args,
    sglang_command,
)
from launcher.node._args import sglang_version as installed_sglang_version
from launcher.node._errors import NodeError, ProfileError
from launcher.node._flags import check_args
from launcher.node._process import LaunchSpec
from launcher.node._rundir import REQUEST_FILE
from launcher.node._supervisor import Order, OrderError
from launcher.ports import HOST, port_is_free

# The node commands' logger: its plan notes are the node's lines, not this module's.
log = logging.getLogger("launcher.node")

DEFAULT_BASE_PORT = 30000
# NCCL ports sit 1000 above the HTTP ports: outside 22000-29999, where SGLang picks random
# NCCL ports for servers not given one, so concurrent starts cannot collide
# (docs/reference/sglang.md#process).
NCCL_OFFSET = 1000
RANDOM_NCCL_RANGE = range(22000, 30000)
# A worker's /metrics port moves with --base-port, as its server's does: GPU N's worker takes
# 9400+N at the default base and 9400+(BASE-30000)+N otherwise, so two `launcher up` on one
# host (--base-port 30000 and 31000) take 9400+N and 10400+N, not both 9400+N.
METRICS_OFFSET = METRICS_BASE_PORT - DEFAULT_BASE_PORT
SIM_COMMAND = (sys.executable, "-m", "launcher", "sim")


@dataclass(frozen=True)
class NodePlan:
    """How every GPU's server and worker is launched; `restart` replaces args or profile."""

    gpus: tuple[int, ...]
    sim: bool
    workers: bool
    model: str | None
    profile: Profile
    cli_args: tuple[str, ...]
    base_port: int
    log_dir: Path
    env: Mapping[str, str]
    # A dry run on a machine without SGLang shows `sglang serve` instead of refusing to plan.
    assume_command: bool = False
    # Where the servers listen (`up --host`): loopback unless other nodes must read them.
    host: str = HOST

    @property
    def version(self) -> str:
        """The SGLang version whose flag names are used (the simulator mimics the newest)."""
        if self.sim:
            return NEWEST_SGLANG
        return self.profile.sglang_version or installed_sglang_version() or NEWEST_SGLANG

    def version_text(self) -> str:
        """Which SGLang the flags are spelled for, and where that version came from."""
        if self.sim:
            return f"simulator (flags of sglang {NEWEST_SGLANG})"
        if self.profile.sglang_version:
            return f"sglang {self.profile.sglang_version} (the profile's sglang_version)"
        installed = installed_sglang_version()
        if installed:
            return f"sglang {installed} (installed)"
        return (f"SGLang is not installed here: flags spelled and checked for sglang "
                f"{NEWEST_SGLANG}, the newest release the flags table was made from")

    def metrics_port(self, gpu: int) -> int | None:
        """GPU `gpu`'s worker's /metrics port (METRICS_OFFSET); None when the environment
        turns the workers' metrics off (FLEETGEN_METRICS_PORT=0)."""
        if self.env.get("FLEETGEN_METRICS_PORT") == "0":
            return None
        return self.base_port + METRICS_OFFSET + gpu

    def server_spec(self, gpu: int) -> LaunchSpec:
        """GPU `gpu`'s server: merged arguments, adapted flag names, ports, environment."""
        model, args = self.profile.for_gpu(gpu, self.cli_args, self.model)
        if not self.sim and model is None and flag_value(args, "--model-path", "--model") is None:
            raise ProfileError("no model: pass --model PATH or set `model` in the profile")
        args, notes = adapt_flags(args, self.version)
        for note in notes:
            log.info("gpu%d: flag %s", gpu, note)
        command = SIM_COMMAND if self.sim else tuple(self._command())
        # base + GPU index, not position: a worker for queue gpuN defaults to port 30000+N.
        port = self.base_port + gpu
        argv = build_argv(command, model, port, port + NCCL_OFFSET, args, self.host)
        env = {**self.env, **self.profile.env_for_gpu(gpu),
               # nvidia-smi numbers GPUs in PCI bus order; CUDA's default order may differ.
               "CUDA_VISIBLE_DEVICES": str(gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        return LaunchSpec(f"gpu{gpu}", tuple(argv), env, self.log_dir / f"sglang_gpu{gpu}.log",
                          port, flag_value(args, "--host") or self.host)

    def _command(self) -> list[str]:
        try:
            return sglang_command(self.profile)
        except ProfileError:
            if self.assume_command:
                return ["sglang", "serve"]
            raise

    def worker_spec(self, gpu: int, server: LaunchSpec) -> LaunchSpec:
        """GPU `gpu`'s Celery worker, pointed at its server."""
        argv = (sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", f"gpu{gpu}",
                "-n", f"gpu{gpu}@%h", "--without-mingle", "--without-gossip", "--loglevel", "INFO")
        env = {**self.env, "SGLANG_URL": server.url}
        metrics = self.metrics_port(gpu)
        if metrics is not None:
            env["FLEETGEN_METRICS_PORT"] = str(metrics)
        return LaunchSpec(f"worker{gpu}", argv, env, self.log_dir / f"worker_gpu{gpu}.log")


def read_request(run_dir: Path, plan: NodePlan) -> tuple[Order | None, NodePlan]:
    """Turn `restart.json` into an Order and the plan it implies; (None, plan) if absent."""
    path = run_dir / REQUEST_FILE
    try:
        request = json.loads(path.read_text())
    except FileNotFoundError:
        return None, plan
    path.unlink(missing_ok=True)
    request_id, new = str(request.get("id")), plan
    try:
        if request.get("args") is not None:
            given = [str(a) for a in request["args"]]
            args = given if request.get("replace") else merge_args(plan.cli_args, given)
            new = dataclasses.replace(new, cli_args=tuple(args))
        if request.get("profile"):
            new = dataclasses.replace(new, profile=load_profile(Path(request["profile"])))
        gpus = request.get("gpus") or list(plan.gpus)
        missing = [g for g in gpus if g not in plan.gpus]
        if missing:
            raise NodeError(f"GPU {missing} not supervised here (GPUs {list(plan.gpus)})")
        specs = {gpu: new.server_spec(gpu) for gpu in gpus}
    except NodeError as exc:
        raise OrderError(request_id, str(exc)) from None
    return Order(request_id, specs, bool(request.get("rolling", True))), new


def render_dry_run(plan: NodePlan, specs: Mapping[int, LaunchSpec],
                   workers: Mapping[int, LaunchSpec]) -> str:
    """What `up` would start, per GPU: environment it sets, ports, log, argv (secrets masked).

    The environment shown is what the launcher adds to the inherited one: the profile's `env`
    and the GPU pinning; the argv is exactly the one `up` executes, flags renamed for the
    SGLang version in use.
    """
    lines = [f"{plan.version_text()}, {len(specs)} GPU(s), logs in {plan.log_dir}"]
    for gpu, spec in specs.items():
        added = {k: v for k, v in spec.env.items() if plan.env.get(k) != v}
        lines.append(f"gpu{gpu}: http {spec.url}, nccl port {(spec.port or 0) + NCCL_OFFSET}, "
                     f"log {spec.log_path}")
        lines.append("  env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(
            added.items())))
        lines.append("  argv " + shlex.join(redact_argv(spec.argv)))
        server_args = list(spec.argv[next((i for i, a in enumerate(spec.argv)
                                            if a.startswith("--")), len(spec.argv)):])
        if not plan.sim:  # the simulator's flags are its own, not a release's
            lines += [f"  warning: {p}" for p in check_args(server_args, plan.version)]
        if gpu in workers:
            worker = workers[gpu]
            metrics = worker.env.get("FLEETGEN_METRICS_PORT")
            lines.append(f"  worker SGLANG_URL={worker.env['SGLANG_URL']} "
                         + (f"FLEETGEN_METRICS_PORT={metrics} " if metrics else "")
                         + shlex.join(worker.argv))
    return "\n".join(lines)


def check_ports(specs: Mapping[int, LaunchSpec],
                metrics: Mapping[int, int | None] | None = None) -> None:
    """Every HTTP and NCCL port, and each worker's /metrics port in `metrics` (GPU -> port),
    must be free now; raise PortBusyError naming the first taken."""
    for gpu, port in (metrics or {}).items():
        if port is None:
            continue
        if not 1024 <= port < 65536:
            raise PortBusyError(f"GPU {gpu}: its worker's metrics port {port} (9400+N moved "
                                "with --base-port) is out of range; pass a --base-port of "
                                f"{DEFAULT_BASE_PORT - METRICS_BASE_PORT + 1024} or more")
        if not port_is_free(port):
            raise PortBusyError(f"GPU {gpu}: its worker's metrics port {port} is already in "
                                "use (another node's launcher on this host?); pass another "
                                "--base-port")
    for gpu, spec in specs.items():
        assert spec.port is not None
        for role, port in (("HTTP", spec.port), ("NCCL", spec.port + NCCL_OFFSET)):
            if not 0 < port < 65536:
                raise PortBusyError(f"GPU {gpu}: {role} port {port} is out of range")
            if not port_is_free(port, spec.host):
                raise PortBusyError(f"GPU {gpu}: {role} port {port} is already in use; "
                                    "stop what listens there or pass another --base-port")
            if port in RANDOM_NCCL_RANGE:
                log.warning("GPU %d: %s port %d is in 22000-29999, where SGLang servers pick "
                            "random NCCL ports; a --base-port of 30000 or more avoids that",
                            gpu, role, port)

