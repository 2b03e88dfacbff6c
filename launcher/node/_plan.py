"""The node plan: which GPUs each server holds, how it and its worker are launched, on which
ports.

A server holds one GPU unless SGLang's own parallelism flags say more (`Parallel`): with
`--tp-size 2` on GPUs 0-3 the node runs two servers, on GPUs 0-1 and 2-3, each with one
worker. A server is known by its lead GPU (its first), which places its ports, and named by
its queue (`gpu0`, `gpu0-1`: fleetgen.keys.gpu_queue).

Also how a `restart.json` request turns into a supervisor Order and the plan it implies,
and the up-front check that every planned port is free.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from fleetgen.keys import METRICS_BASE_PORT, gpu_queue
from fleetgen.ports import HOST, busy_reason, ephemeral_range, port_is_free
from fleetgen.redact import redact, redact_argv
from launcher.errors import PortBusyError
from launcher.node._args import Profile, adapt_flags, flag_value, load_profile, merge_args
from launcher.node._errors import NodeError, ProfileError
from launcher.node._gpus import group_gpus
from launcher.node._kind import ServerLaunch, launch_for
from launcher.node._process import LaunchSpec
from launcher.node._rundir import REQUEST_FILE, RestartRequest
from launcher.node._supervisor import Order, OrderError

# The node commands' logger: its plan notes are the node's lines, not this module's.
log = logging.getLogger("launcher.node")

DEFAULT_BASE_PORT = 30000
# NCCL ports sit 1000 above the HTTP ports: outside 22000-29999, where SGLang picks random
# NCCL ports for servers not given one, so concurrent starts cannot collide
# (docs/reference/sglang.md#process).
NCCL_OFFSET = 1000
RANDOM_NCCL_RANGE = range(22000, 30000)
# A worker's /metrics port moves with --base-port, as its server's does: GPU N's worker takes
# METRICS_BASE_PORT+(BASE-30000)+N from the default base up, so two `launcher up` on one host
# (--base-port 30000 and 31000) take 20000+N and 21000+N, not both 20000+N. Below the default
# base that rule would walk down into other services' ports (12010 for 22010): there the
# worker's port sits beside its server's instead, at BASE+2000+N, above the NCCL ports.
METRICS_OFFSET = METRICS_BASE_PORT - DEFAULT_BASE_PORT
METRICS_BESIDE_OFFSET = 2 * NCCL_OFFSET
# How messages name a worker's metrics port (the HTTP and NCCL ports are named by their role).
METRICS_ROLE = "its worker's metrics port"
# What the workers inherit that says where they talk to, and what each means when unset: the
# Redis of the queues, the S3 endpoint of the results, the default output. The dry run shows
# them (redacted) so a wrong one is seen before anything starts.
WORKER_ENDPOINTS = {"REDIS_URL": "unset: this machine's embedded Redis",
                    "AWS_ENDPOINT_URL": "unset: AWS S3",
                    "FLEETGEN_OUTPUT": None}
# SGLang's parallelism flags in every spelling merge_args treats as one flag.
TP_FLAGS = ("--tp-size", "--tensor-parallel-size", "--tp")
DP_FLAGS = ("--dp-size", "--data-parallel-size", "--dp")
PP_FLAGS = ("--pp-size", "--pipeline-parallel-size")
DP_ATTENTION_FLAG = "--enable-dp-attention"


@dataclass(frozen=True)
class Parallel:
    """How one server spreads over GPUs, read from SGLang's own flags.

    Tensor and pipeline parallelism multiply the GPUs of a server; each data-parallel rank is
    one more tp x pp group of GPUs, except with --enable-dp-attention, where the DP ranks
    share the tensor-parallel GPUs (SGLang's DataParallelController).

        Parallel.from_args(["--tp-size", "2"]).width   # 2
    """

    tp: int = 1
    dp: int = 1
    pp: int = 1
    dp_attention: bool = False

    @classmethod
    def from_args(cls, args: Sequence[str]) -> Parallel:
        """The parallelism `args` ask for; ProfileError for a size that is not a count."""
        sizes = []
        for flags in (TP_FLAGS, DP_FLAGS, PP_FLAGS):
            value = flag_value(args, *flags)
            if value is not None and (not value.isdigit() or int(value) < 1):
                raise ProfileError(f"{flags[0]} {value!r}: expected a whole number, 1 or more")
            sizes.append(int(value) if value is not None else 1)
        attention = flag_value(args, DP_ATTENTION_FLAG)
        tp, dp, pp = sizes
        parallel = cls(tp, dp, pp, attention is not None
                       and attention.lower() not in ("false", "0", "no"))
        if parallel.dp_attention and tp % dp:
            raise ProfileError(f"{DP_ATTENTION_FLAG} with --tp-size {tp} --dp-size {dp}: the DP "
                               "ranks share the tensor-parallel GPUs, so --dp-size must divide "
                               "--tp-size")
        return parallel

    @property
    def width(self) -> int:
        """The GPUs one server holds."""
        return self.tp * self.pp * (1 if self.dp_attention else self.dp)

    @property
    def one_nccl_port(self) -> bool:
        """Whether the server takes the NCCL port the launcher gives it. DP ranks without DP
        attention each start their own tensor-parallel group and bind one NCCL port each
        (SGLang's launch_dp_schedulers), so one given port would clash: SGLang picks them."""
        return self.dp == 1 or self.dp_attention

    def text(self) -> str:
        """The flags that make a server wider than one GPU, e.g. `--tp-size 2 --dp-size 2`."""
        parts = [f"{flag} {n}" for flag, n in (("--tp-size", self.tp), ("--pp-size", self.pp),
                                                 ("--dp-size", self.dp)) if n > 1]
        if self.dp_attention:
            parts.append(DP_ATTENTION_FLAG)
        return " ".join(parts) or "one GPU per server"


@dataclass(frozen=True)
class NodePlan:
    """How every server and worker of the node is launched; `restart` replaces args or profile.

    Servers are keyed by their lead GPU (`servers`); a one-GPU server's lead is its GPU.
    """

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
    def launch(self) -> ServerLaunch:
        """The kind of server each GPU runs: SGLang, the simulator, or another engine."""
        return launch_for(self.profile, self.sim)

    @property
    def version(self) -> str:
        """The SGLang version whose flag names are used (the simulator mimics the newest)."""
        return self.launch.version(self.profile)

    def version_text(self) -> str:
        """Which SGLang the flags are spelled for, and where that version came from."""
        return self.launch.describe(self.profile)

    @property
    def parallel(self) -> Parallel:
        """How each server spreads over GPUs: the profile's `args` and the command line's."""
        return Parallel.from_args(merge_args(self.profile.args, self.cli_args))

    @property
    def servers(self) -> dict[int, tuple[int, ...]]:
        """Each server's GPUs by its lead GPU, the selected GPUs cut in order; GpuSpecError
        when they do not divide into whole servers."""
        parallel = self.parallel
        return {group[0]: group for group in group_gpus(self.gpus, parallel.width,
                                                        parallel.text())}

    def lead_of(self, gpu: int) -> int:
        """The lead GPU of the server holding `gpu` (NodeError when none does)."""
        for lead, group in self.servers.items():
            if gpu in group:
                return lead
        raise NodeError(f"GPU {gpu} not supervised here (GPUs {list(self.gpus)})")

    def metrics_port(self, gpu: int) -> int | None:
        """The /metrics port of the worker of the server led by GPU `gpu` (METRICS_OFFSET,
        METRICS_BESIDE_OFFSET below the default base); None when the environment turns the
        workers' metrics off (FLEETGEN_METRICS_PORT=0)."""
        if self.env.get("FLEETGEN_METRICS_PORT") == "0":
            return None
        offset = METRICS_OFFSET if self.base_port >= DEFAULT_BASE_PORT else METRICS_BESIDE_OFFSET
        return self.base_port + offset + gpu

    def server_spec(self, gpu: int) -> LaunchSpec:
        """The server led by GPU `gpu`: merged arguments, adapted flag names, ports, the GPUs
        it holds."""
        gpus = self.servers[gpu]
        name = gpu_queue(gpus)
        model, args = self.profile.for_gpu(gpu, self.cli_args, self.model)
        self._check_overrides(gpus, args)
        if self.launch.needs_model and model is None \
                and flag_value(args, "--model-path", "--model") is None:
            raise ProfileError("no model: pass --model PATH or set `model` in the profile")
        args, notes = adapt_flags(args, self.version)
        for note in notes:
            log.info("%s: flag %s", name, note)
        command = self.launch.command(self.profile, assume=self.assume_command)
        # base + lead GPU index, not position: a worker for queue gpuN (or gpuN-M) defaults
        # to port 30000+N.
        port = self.base_port + gpu
        nccl = port + NCCL_OFFSET if self.parallel.one_nccl_port else None
        argv = self.launch.argv(command, model, port, nccl, args, self.host)
        env = {**self.env, **self.profile.env_for_gpu(gpu),
               # nvidia-smi numbers GPUs in PCI bus order; CUDA's default order may differ.
               "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
               "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        return LaunchSpec(name, tuple(argv), env, self.log_dir / f"sglang_{name}.log",
                          port, flag_value(args, "--host") or self.host)

    def _check_overrides(self, gpus: tuple[int, ...], args: Sequence[str]) -> None:
        """A `[gpu.N]` section applies to the server N leads; it may not resize servers."""
        name = gpu_queue(gpus)
        for other in gpus[1:]:
            if other in self.profile.gpu:
                raise ProfileError(f"[gpu.{other}]: GPU {other} is part of server {name}, "
                                   f"whose settings go in [gpu.{gpus[0]}]")
        if Parallel.from_args(args) != self.parallel:
            raise ProfileError(f"[gpu.{gpus[0]}] args change how server {name} spreads over "
                               "GPUs: give --tp-size, --dp-size, --pp-size and "
                               f"{DP_ATTENTION_FLAG} in the profile's `args` or after `--`")

    def worker_spec(self, gpu: int, server: LaunchSpec) -> LaunchSpec:
        """The Celery worker of the server led by GPU `gpu`, pointed at that server."""
        queue = gpu_queue(self.servers[gpu])
        argv = (sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", queue,
                "-n", f"{queue}@%h", "--without-mingle", "--without-gossip", "--loglevel", "INFO")
        env = {**self.env, "FLEETGEN_SERVER_URL": server.url}
        metrics = self.metrics_port(gpu)
        if metrics is not None:
            env["FLEETGEN_METRICS_PORT"] = str(metrics)
        return LaunchSpec(f"worker{queue.removeprefix('gpu')}", argv, env,
                          self.log_dir / f"worker_{queue}.log")


def read_request(run_dir: Path, plan: NodePlan) -> tuple[Order | None, NodePlan]:
    """Turn `restart.json` into an Order and the plan it implies; (None, plan) if absent."""
    path = run_dir / REQUEST_FILE
    try:
        request = RestartRequest.from_json(path.read_text())
    except FileNotFoundError:
        return None, plan
    path.unlink(missing_ok=True)
    new = plan
    try:
        if request.args is not None:
            given = list(request.args)
            args = given if request.replace else merge_args(plan.cli_args, given)
            new = dataclasses.replace(new, cli_args=tuple(args))
        if request.profile:
            new = dataclasses.replace(new, profile=load_profile(Path(request.profile)))
        own = request.gpu_args or {}
        # Without `gpus`, a request of GPUs' own arguments restarts those GPUs alone.
        gpus = list(request.gpus or own or plan.gpus)
        gpus += [g for g in own if g not in gpus]
        missing = [g for g in gpus if g not in plan.gpus]
        if missing:
            raise NodeError(f"GPU {missing} not supervised here (GPUs {list(plan.gpus)})")
        if new.servers != plan.servers:  # the supervisor's slots are fixed at `up`
            raise NodeError(f"the new arguments ({new.parallel.text()}) would place servers "
                            f"over other GPUs than the running ones ({plan.parallel.text()}): "
                            "stop the node and start it again with `launcher up`")
        # A GPU names the server holding it: a group server restarts as a whole.
        specs = {lead: new.server_spec(lead) for lead in sorted({plan.lead_of(g) for g in gpus})}
        for gpu, own_args in own.items():
            # This restart's own arguments for one server; the node's stay as they were.
            lead = plan.lead_of(gpu)
            mine = dataclasses.replace(new, cli_args=tuple(merge_args(new.cli_args, list(own_args))))
            if mine.servers != plan.servers:
                raise NodeError(f"GPU {gpu}'s arguments would place servers over other GPUs")
            specs[lead] = mine.server_spec(lead)
    except NodeError as exc:
        raise OrderError(request.id, str(exc)) from None
    return Order(request.id, specs, request.rolling, request.drain_s), new


def render_dry_run(plan: NodePlan, specs: Mapping[int, LaunchSpec],
                   workers: Mapping[int, LaunchSpec]) -> str:
    """What `up` would start, per server: environment it sets (its GPUs), ports, log, argv
    (secrets masked).

    The environment shown is what the launcher adds to the inherited one: the profile's `env`
    and the GPU pinning; the argv is exactly the one `up` executes, flags renamed for the
    SGLang version in use. With workers, the last line also shows where they would talk to:
    the inherited WORKER_ENDPOINTS, credentials masked.
    """
    head = f"{plan.version_text()}, {len(plan.gpus)} GPU(s)"
    parallel = plan.parallel
    if parallel.width > 1:
        head += f" in {len(specs)} server(s) of {parallel.width} ({parallel.text()})"
    lines = [f"{head}, logs in {plan.log_dir}"]
    for gpu, spec in specs.items():
        added = {k: v for k, v in spec.env.items() if plan.env.get(k) != v}
        nccl = flag_value(spec.argv, "--nccl-port")
        ports = plan.launch.ports_text(nccl)
        lines.append(f"{spec.name}: http {spec.url}, {ports}, log {spec.log_path}")
        lines.append("  env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(
            added.items())))
        lines.append("  argv " + shlex.join(redact_argv(spec.argv)))
        server_args = list(spec.argv[next((i for i, a in enumerate(spec.argv)
                                            if a.startswith("--")), len(spec.argv)):])
        # The simulator's flags are its own, and another engine's are that engine's.
        lines += [f"  warning: {p}" for p in plan.launch.warnings(server_args, plan.version)]
        if gpu in workers:
            worker = workers[gpu]
            metrics = worker.env.get("FLEETGEN_METRICS_PORT")
            lines.append(f"  worker FLEETGEN_SERVER_URL={worker.env['FLEETGEN_SERVER_URL']} "
                         + (f"FLEETGEN_METRICS_PORT={metrics} " if metrics else "")
                         + shlex.join(worker.argv))
    if workers:
        inherited = [f"{k}={shlex.quote(redact(plan.env[k], name=k))}" if plan.env.get(k)
                     else f"{k} ({unset})" for k, unset in WORKER_ENDPOINTS.items()
                     if plan.env.get(k) or unset]
        lines.append("workers inherit " + ", ".join(inherited))
    return "\n".join(lines)


class PlannedPort(NamedTuple):
    """One port a server or worker of the node will listen on."""

    whose: str  # "GPU 3", or "server gpu0-1" for one over several GPUs
    role: str  # "HTTP port", "NCCL port" or METRICS_ROLE
    port: int
    host: str


def check_ports(specs: Mapping[int, LaunchSpec],
                metrics: Mapping[int, int | None] | None = None) -> None:
    """Every HTTP and NCCL port, and each worker's /metrics port in `metrics` (lead GPU ->
    port), must lie between 1024 and the kernel's ephemeral range and be free now; raise
    PortBusyError otherwise.

    Below 1024 only root may listen; inside the ephemeral range outgoing connections take their
    local ports at random, so a server port there fails at random. Every port moves with
    --base-port, so the message names the bases that keep them all in between. Taken ports are
    named all at once, each with what holds it, and the ways out: another --base-port, or
    FLEETGEN_METRICS_PORT=0 when a worker's metrics port is taken (by a DCGM exporter, say).
    """
    planned = _planned_ports(specs, metrics or {})
    _check_range(planned, specs)
    _check_free(planned)
    for p in planned:
        if p.role != METRICS_ROLE and p.port in RANDOM_NCCL_RANGE:
            log.warning("%s: %s %d is in 22000-29999, where SGLang servers pick random NCCL "
                        "ports; a --base-port of 30000 or more avoids that", p.whose, p.role,
                        p.port)


def _planned_ports(specs: Mapping[int, LaunchSpec],
                   metrics: Mapping[int, int | None]) -> list[PlannedPort]:
    """The workers' metrics ports, then each server's HTTP and NCCL ports."""
    def who(gpu: int) -> str:
        name = specs[gpu].name if gpu in specs else gpu_queue(gpu)
        return f"GPU {gpu}" if name == gpu_queue(gpu) else f"server {name}"

    planned = [PlannedPort(who(gpu), METRICS_ROLE, port, HOST)
               for gpu, port in metrics.items() if port is not None]
    for gpu, spec in specs.items():
        assert spec.port is not None
        planned.append(PlannedPort(who(gpu), "HTTP port", spec.port, spec.host))
        nccl = flag_value(spec.argv, "--nccl-port")
        if nccl:
            planned.append(PlannedPort(who(gpu), "NCCL port", int(nccl), spec.host))
    return planned


def _check_range(planned: Sequence[PlannedPort], specs: Mapping[int, LaunchSpec]) -> None:
    """PortBusyError for the first port below 1024 or in the ephemeral range, naming the
    bases that keep every port out of both."""
    first, last = ephemeral_range()
    used = [p.port for p in planned]
    for p in planned:
        if 1024 <= p.port < first:
            continue
        where = (f"in the kernel's ephemeral range {first}-{last}, where outgoing connections "
                 "take their local ports at random" if p.port >= first
                 else "below 1024, where only root may listen")
        base = next(s.port - g for g, s in specs.items() if s.port is not None)
        low, high = base + 1024 - min(used), base + first - 1 - max(used)
        fix = (f"pass a --base-port from {low} to {high}, which keeps every port of this node "
               f"within 1024-{first - 1}" if low <= high else "use fewer GPUs per node")
        moved = " (moved with --base-port)" if p.role == METRICS_ROLE else ""
        raise PortBusyError(f"{p.whose}: {p.role}{moved} {p.port} is {where}; {fix}")


def _check_free(planned: Sequence[PlannedPort]) -> None:
    """PortBusyError naming every taken port with what holds it, and the ways out."""
    taken: dict[str, list[PlannedPort]] = {}  # why a port is taken -> the ports taken so
    for p in planned:
        if not port_is_free(p.port, p.host):
            taken.setdefault(busy_reason(p.port), []).append(p)
    if not taken:
        return
    held = [p for ports in taken.values() for p in ports]
    ways = ["stop what holds " + ("it" if len(held) == 1 else "them"),
            "pass another --base-port (it moves every port of this node)"]
    if any(p.role == METRICS_ROLE for p in held):
        ways.append("set FLEETGEN_METRICS_PORT=0 to run the workers without metrics")
    said = [", ".join(f"{p.whose}: {p.role} {p.port}" for p in ports)
            + f" {'is' if len(ports) == 1 else 'are'} {why}" for why, ports in taken.items()]
    raise PortBusyError("; ".join(said) + "; " + ", ".join(ways[:-1]) + ", or " + ways[-1])
