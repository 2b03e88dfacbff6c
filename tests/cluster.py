"""A fleet of real nodes on one machine, made of Linux network namespaces.

Each node is a network namespace with its own address on a private bridge and its own host
name (a UTS namespace), so its processes see what they would on a machine of their own: their
own loopback and ports, `socket.gethostname()`, a route to Redis over a real interface. The
control node runs two Valkeys (AOF on), REDIS_URL's and a second ledger shard
(FLEETGEN_LEDGER_URLS, given to every process of the fleet), and SeaweedFS, with
`python -m launcher redis|s3 --host ADDR`; each GPU node runs
`python -m launcher up --sim --workers --gpus 0,1 --host 0.0.0.0`, exactly as an operator would. The test process itself sits on the bridge too (`Cluster.gateway`), so it
reads Redis and the servers over the same network.

    cluster = Cluster.build(tmp_path, valkey_bin, weed_bin)
    cluster.start_node("node1"); cluster.node("node1").kill()     # every process SIGKILLed
    cluster.node("node2").partition(); ...; cluster.node("node2").heal()
    cluster.close()                                             # processes, namespaces, bridge

Needs root and iproute2 (`ip`, `unshare`); the `cluster` fixture (tests/conftest.py) skips
without them, and fails under CI=true. All traffic stays on the bridge it creates.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fleetgen.poll import wait_until
from launcher.services import free_s3_base, redis_password
from tests.stack import FAST_WORKER_ENV, PYTHON, ROOT, Proc

REDIS_PORT = 6389
# The second Valkey of the control node: a ledger shard (FLEETGEN_LEDGER_URLS) beside REDIS_URL's.
LEDGER_PORT = 6390
BUCKET = "fleetgen"
# Simulated GPUs: 8 slots, ~2 s answers; a node of two does about 8 prompts/s.
SIM_FLAGS = ("--max-running-requests", "8", "--decode-tps", "80", "--mean-output-tokens", "160",
             "--speed", "1")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass
class Namespace:
    """One machine: a network namespace on the bridge, with its own host name."""

    name: str
    hostname: str
    address: str
    veth: str  # the bridge's end of its cable; down = the node is partitioned

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run on this machine (its network, its host name)."""
        return ["ip", "netns", "exec", self.name, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname, *argv]

    def run(self, argv: Sequence[str], env: Mapping[str, str],
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(argv), env=dict(env), cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, check=False)

    def pids(self) -> list[int]:
        out = ip("netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self) -> None:
        """SIGKILL every process of this machine at once, as a power cut would."""
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def partition(self) -> None:
        ip("link", "set", self.veth, "down")

    def heal(self) -> None:
        ip("link", "set", self.veth, "up")


@dataclass
class Node:
    """A GPU node: its namespace and its `launcher up` process."""

    ns: Namespace
    run_dir: Path
    proc: Proc

    @property
    def name(self) -> str:
        return self.ns.hostname

    def workers(self) -> list[str]:
        return [f"gpu0@{self.name}", f"gpu1@{self.name}"]

    def log(self) -> str:
        logs = [self.proc.log()] + [p.read_text(errors="replace")[-3000:]
                                    for p in sorted((self.run_dir / "logs").glob("*.log"))]
        return f"==== {self.name} ====\n" + "\n".join(logs)


@dataclass
class Cluster:
    tmp: Path
    tag: str
    subnet: str  # "10.213.N": /24 on the bridge
    bridge: str
    control: Namespace
    env: dict[str, str] = field(default_factory=dict)
    namespaces: list[Namespace] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)

    @property
    def gateway(self) -> str:
        """The test process's own address on the bridge."""
        return f"{self.subnet}.1"

    @classmethod
    def build(cls, tmp: Path, valkey_bin: Path, weed_bin: Path) -> Cluster:
        """The bridge, the control node with Redis and S3 up; no GPU node yet."""
        tag = secrets.token_hex(2)
        # A random /24 inside 10.213/16, so a second run on this machine does not collide.
        subnet = f"10.213.{secrets.randbelow(250) + 1}"
        bridge = f"fgbr{tag}"
        ip("link", "add", bridge, "type", "bridge")
        control = Namespace(f"fg{tag}ctl", "control", f"{subnet}.2", f"fgv{tag}c")
        cluster = cls(tmp, tag, subnet, bridge, control)
        try:
            ip("addr", "add", f"{cluster.gateway}/24", "dev", bridge)
            ip("link", "set", bridge, "up")
            cluster._add_namespace(control)
            cluster._start_control(valkey_bin, weed_bin)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _add_namespace(self, ns: Namespace) -> None:
        peer = f"fgp{self.tag}{ns.veth[-2:]}"
        ip("netns", "add", ns.name)
        self.namespaces.append(ns)
        ip("link", "add", ns.veth, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", ns.name)
        ip("link", "set", ns.veth, "master", self.bridge, "up")
        ip("-n", ns.name, "link", "set", peer, "name", "eth0")
        ip("-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", "eth0")
        ip("-n", ns.name, "link", "set", "eth0", "up")
        ip("-n", ns.name, "link", "set", "lo", "up")

    def _start_control(self, valkey_bin: Path, weed_bin: Path) -> None:
        access, secret = secrets.token_hex(10), secrets.token_hex(20)
        # Not 8333: SeaweedFS keeps gRPC sockets in /tmp named by port, which every namespace
        # shares; the block free here is free of another run's sockets too.
        s3_port = free_s3_base()
        base = {**os.environ, "PYTHONUNBUFFERED": "1"}
        s3_dir = self.tmp / "control" / "s3"
        address = self.control.address
        redis_dirs = {port: self.tmp / "control" / name
                      for port, name in ((REDIS_PORT, "redis"), (LEDGER_PORT, "redis2"))}
        for port, data_dir in redis_dirs.items():
            self._start(self.control, data_dir.name,
                        [PYTHON, "-m", "launcher", "redis", "--host", address, "--port",
                         str(port), "--data-dir", str(data_dir)], base)
        s3 = self._start(self.control, "s3",
                         [PYTHON, "-m", "launcher", "s3", "--host", address, "--port",
                          str(s3_port), "--data-dir", str(s3_dir), "--bucket", BUCKET],
                         {**base, "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret})
        urls = {port: self._wait_redis(port, data_dir) for port, data_dir in redis_dirs.items()}
        wait_until(lambda: "serving" in s3.log(), 60, interval=0.2,
                   what=f"SeaweedFS on the control node\n{s3.log()}")
        self.env = {
            "REDIS_URL": urls[REDIS_PORT], "FLEETGEN_LEDGER_URLS": urls[LEDGER_PORT],
            "AWS_ENDPOINT_URL": f"http://{address}:{s3_port}", "AWS_ACCESS_KEY_ID": access,
            "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1",
            **FAST_WORKER_ENV,
        }

    def _wait_redis(self, port: int, data_dir: Path) -> str:
        """The URL of the control node's Valkey on `port` once it answers (its password is the
        one `launcher redis` generated into `data_dir`)."""
        import redis

        address = self.control.address

        def up() -> bool:
            if not (data_dir / "password").exists():
                return False
            client = redis.Redis(host=address, port=port, password=redis_password(data_dir),
                                 socket_timeout=1, socket_connect_timeout=1)
            try:
                with contextlib.closing(client):
                    return bool(client.ping())
            except redis.RedisError:
                return False

        wait_until(up, 30, interval=0.2, what=f"Valkey on the control node, port {port}")
        return f"redis://:{redis_password(data_dir)}@{address}:{port}/0"

    def _start(self, ns: Namespace, name: str, argv: list[str], env: Mapping[str, str]) -> Proc:
        proc = Proc(name, ns.argv(argv), dict(env), self.tmp / f"{name}.log").start()
        self.procs.append(proc)
        return proc

    def process_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment every fleet process gets: Redis and its second ledger shard, S3,
        fast leases."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FLEETGEN_"))}
        return {**env, "PYTHONUNBUFFERED": "1", **self.env, **(extra or {})}

    def start_node(self, name: str, extra_env: Mapping[str, str] | None = None) -> Node:
        """`launcher up --sim --workers --gpus 0,1` on a new machine; returns once both workers
        are ready."""
        index = len(self.nodes) + 1
        ns = Namespace(f"fg{self.tag}{name}", name, f"{self.subnet}.{10 + index}",
                       f"fgv{self.tag}{index:02d}"[-15:])
        self._add_namespace(ns)
        run_dir = self.tmp / name
        argv = [PYTHON, "-m", "launcher", "up", "--sim", "--workers", "--gpus", "0,1",
                "--host", "0.0.0.0", "--run-dir", str(run_dir), "--", *SIM_FLAGS]
        node = Node(ns, run_dir, self._start(ns, name, argv, self.process_env(extra_env)))
        self.nodes[name] = node

        def ready() -> bool:
            assert node.proc.alive(), node.log()
            logs = [run_dir / "logs" / f"worker_gpu{g}.log" for g in (0, 1)]
            return all(p.exists() and "ready." in p.read_text(errors="replace") for p in logs)

        wait_until(ready, 120, interval=0.5, what=f"{name}'s two workers ready")
        return node

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def producer(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """`python -m producer ARGS` on the control node; AssertionError if it fails."""
        result = self.control.run([PYTHON, "-m", "producer", *args], self.process_env(),
                                  timeout=timeout)
        if result.returncode != 0:
            raise AssertionError(f"producer {args} exited {result.returncode}:\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    def requests_served(self, node: Node) -> int:
        """Requests both of `node`'s simulated GPUs have finished (their /metrics)."""
        total = 0.0
        for port in (30000, 30001):
            text = httpx.get(f"http://{node.ns.address}:{port}/metrics", timeout=5).text
            for line in text.splitlines():
                if line.startswith("sglang:num_requests_total"):
                    total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def logs(self) -> str:
        return "\n".join([*(n.log() for n in self.nodes.values()),
                          *(f"==== {p.name} ====\n{p.log()}" for p in self.procs[:3])])

    def close(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL of whatever is left in each namespace),
        delete the namespaces and the bridge."""
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop(grace=10)
        for ns in self.namespaces:
            ns.kill()
            ip("netns", "del", ns.name, check=False)
            # The kernel frees a namespace (and its end of the cable) lazily: cut it now.
            ip("link", "del", ns.veth, check=False)
        ip("link", "del", self.bridge, check=False)


def leases_held(r: Any, job: str, host: str) -> set[str]:
    """Batches of `job` whose lease a worker of `host` holds (lease values: `worker/token`)."""
    from fleetgen import keys

    held = set()
    for key in r.scan_iter(match=f"{keys.PREFIX}:lease:{job}:*"):
        owner = r.get(key)
        if owner and keys.lease_owner(owner.decode()).endswith(f"@{host}"):
            held.add(key.decode().rsplit(":", 1)[1])
    return held

