"""The node's run directory and its files, typed: `node.json` the supervisor publishes,
`restart.json` it is sent, `tune.json` `launcher tune` keeps (copied into node.json).

Each file is a dataclass with one writer (`to_json`) and one reader (`from_json`); every command
(status, restart, advise, tune) reads the typed objects. A field missing from a file reads as
its default, so a file written by another release of the launcher still reads; anything that is
not such a file raises ValueError.

    write_atomic(run_dir / STATE_FILE, state.to_json())
    state = read_state(run_dir)          # NodeState, or None when `up` never ran here
    state.gpus[0].server.state           # "ready"

Also the pid check that tells a live supervisor from a stale file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from launcher.node._errors import NodeError
from launcher.node._watch import Reading

DEFAULT_RUN_DIR = Path(".fleetgen/node")
STATE_FILE, REQUEST_FILE, TUNE_FILE = "node.json", "restart.json", "tune.json"

State = Literal["starting", "ready", "running", "restarting", "crashed", "stopped"]
RolloutState = Literal["running", "done", "failed"]
T = TypeVar("T")


@dataclass(frozen=True)
class ProcessEntry:
    """One supervised process, a server or its worker, as node.json shows it."""

    name: str = ""
    pid: int | None = None
    state: State = "starting"
    since: float = 0.0
    restarts: int = 0
    last_reason: str | None = None
    log: str = ""
    argv: tuple[str, ...] = ()
    # Added by `status` (pid_alive), never written by the supervisor.
    pid_alive: bool | None = None

    def _json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.pid_alive is None:
            del data["pid_alive"]
        return {**data, "argv": list(self.argv)}

    @classmethod
    def _read(cls, data: Mapping[str, Any]) -> ProcessEntry:
        return cls(**{**_known(cls, data), "argv": tuple(str(a) for a in data.get("argv") or ())})


@dataclass(frozen=True)
class ServerEntry:
    """One server in node.json: the GPUs it holds, where it listens, its process (whose
    fields node.json writes at this level), what it said once ready, and its worker."""

    gpu: int | None  # its lead GPU; None for a server known only by URL (`advise --url`)
    server: ProcessEntry
    gpus: tuple[int, ...] = ()
    port: int | None = None
    url: str = ""
    ready_s: float | None = None
    capacity: Reading | None = None
    # The most requests its log showed running at once since this start.
    peak_running: int | None = None
    worker: ProcessEntry | None = None

    @property
    def held(self) -> tuple[int, ...]:
        """Every GPU it holds (its lead alone when not said)."""
        return self.gpus or ((self.gpu,) if self.gpu is not None else ())

    def _json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "gpus": list(self.held), "port": self.port, "url": self.url,
                **self.server._json(), "ready_s": self.ready_s,
                "capacity": dataclasses.asdict(self.capacity) if self.capacity else None,
                "peak_running": self.peak_running,
                "worker": self.worker._json() if self.worker else None}

    @classmethod
    def _read(cls, data: Mapping[str, Any]) -> ServerEntry:
        capacity, worker = data.get("capacity"), data.get("worker")
        return cls(gpu=data.get("gpu"), server=ProcessEntry._read(data),
                   gpus=tuple(data.get("gpus") or ()), port=data.get("port"),
                   url=str(data.get("url") or ""), ready_s=data.get("ready_s"),
                   capacity=_reading(capacity) if capacity else None,
                   peak_running=data.get("peak_running"),
                   worker=ProcessEntry._read(worker) if worker else None)


def _reading(data: Mapping[str, Any]) -> Reading:
    fields: dict[str, Any] = {f.name: data.get(f.name) for f in dataclasses.fields(Reading)}
    return Reading(**{**fields, "reason": str(data.get("reason") or "")})


@dataclass(frozen=True)
class Rejected:
    """A restart request the supervisor turned down, and why."""

    id: str
    reason: str


@dataclass(frozen=True)
class Rollout:
    """The latest restart (`restart`, or `tune`'s) and the latest rejected request.

    Before any restart ran, a rejection is all there is: `id` is None then and node.json
    shows `rejected` alone; `rejected` is left out until a request is turned down."""

    id: str | None = None
    state: RolloutState | None = None
    rolling: bool = True
    gpus: tuple[int, ...] = ()
    done: tuple[int, ...] = ()
    current: int | None = None
    reason: str | None = None
    rejected: Rejected | None = None

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed")

    def _json(self) -> dict[str, Any]:
        data: dict[str, Any] = {} if self.id is None else {
            "id": self.id, "state": self.state, "rolling": self.rolling, "gpus": list(self.gpus),
            "done": list(self.done), "current": self.current, "reason": self.reason}
        if self.rejected is not None:
            data["rejected"] = dataclasses.asdict(self.rejected)
        return data

    @classmethod
    def _read(cls, data: Mapping[str, Any]) -> Rollout:
        rejected = data.get("rejected")
        return cls(**{**_known(cls, data), "gpus": tuple(data.get("gpus") or ()),
                      "done": tuple(data.get("done") or ()),
                      "rejected": Rejected(str(rejected["id"]), str(rejected["reason"]))
                      if rejected else None})


@dataclass(frozen=True)
class TuneStep:
    """One step of `launcher tune`: what was measured or tried on which GPU(s). The measures
    a step did not take are left out of the file."""

    at: float
    kind: str  # baseline, plan, failed, won, lost, rolled-back, rolled-out, stop, waiting, ...
    gpu: int | tuple[int, ...] | None  # None: the node as a whole
    flags: tuple[str, ...] | None = None
    tokens_per_s: float | None = None
    share: float | None = None
    share_before: float | None = None
    expected: float | None = None  # the tokens/s gain the memory and step models predict
    until: float | None = None  # when a step under way expects to end (time.time())
    note: str | None = None

    def describe(self) -> str:
        """One line: `tune: gpu0 baseline: 2,325 tokens/s` or `tune: gpu0 lost `--x 1` ...`."""
        gpu = "node" if self.gpu is None else \
            f"gpu{list(self.gpu) if isinstance(self.gpu, tuple) else self.gpu}"
        text = f"tune: {gpu} {self.kind}"
        if self.flags:
            text += f" `{' '.join(self.flags)}`"
        if self.tokens_per_s is not None:
            text += f": {self.tokens_per_s:,.0f} tokens/s"
        if self.share is not None:
            text += f", share {self.share:.3f} (before {self.share_before or 0:.3f})"
        if self.expected is not None:
            text += f", expected {self.expected:+.1%}"
        if self.until is not None:
            text += f", ~{max(0.0, self.until - time.time()):.0f} s left"
        if self.note:
            text += f" ({self.note})"
        return text

    def _json(self) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None or k in ("at", "kind", "gpu")}
        if isinstance(self.gpu, tuple):
            data["gpu"] = list(self.gpu)
        if self.flags is not None:
            data["flags"] = list(self.flags)
        return data

    @classmethod
    def _read(cls, data: Mapping[str, Any]) -> TuneStep:
        gpu, flags = data.get("gpu"), data.get("flags")
        return cls(**{**_known(cls, data), "at": float(data.get("at") or 0.0),
                      "kind": str(data["kind"]),
                      "gpu": tuple(gpu) if isinstance(gpu, list) else gpu,
                      "flags": tuple(str(f) for f in flags) if flags is not None else None})


@dataclass
class TuneRecord:
    """tune.json: the tuning's state, the flags chosen so far, and every step."""

    state: str = "running"  # running, waiting, dry-run, done
    chosen: list[str] = field(default_factory=list)
    steps: list[TuneStep] = field(default_factory=list)

    @property
    def current(self) -> list[TuneStep]:
        """The latest step: the last one, or every candidate being tried side by side."""
        group = self.steps[-1:]
        while group and group[0].kind == "trying" and len(group) < len(self.steps) \
                and self.steps[-1 - len(group)].kind == "trying":
            group.insert(0, self.steps[-1 - len(group)])
        return group

    def describe(self) -> str:
        """In one line: state, chosen flags, the latest step."""
        text = f"tune: {self.state}"
        if self.chosen:
            text += f", chosen `{' '.join(self.chosen)}`"
        if self.steps:
            text += "; last " + "; ".join(s.describe().removeprefix("tune: ")
                                          for s in self.current)
        return text

    def to_json(self) -> str:
        return _dumps(self._json())

    @classmethod
    def from_json(cls, text: str) -> TuneRecord:
        """The record `to_json` wrote; ValueError if `text` is not one."""
        return _parse(text, cls._read)

    def _json(self) -> dict[str, Any]:
        return {"state": self.state, "chosen": list(self.chosen),
                "steps": [s._json() for s in self.steps]}

    @classmethod
    def _read(cls, data: Mapping[str, Any]) -> TuneRecord:
        return cls(state=str(data.get("state") or "running"),
                   chosen=[str(f) for f in data.get("chosen") or ()],
                   steps=[TuneStep._read(s) for s in data.get("steps") or ()])


@dataclass(frozen=True)
class NodeState:
    """node.json: how the node was started, the supervisor's latest snapshot (each server,
    the latest rollout) and the tuning's log."""

    run_dir: str = ""
    log_dir: str = ""
    sim: bool = False
    workers: bool = False
    started_at: float = 0.0
    sglang_version: str | None = None
    supervisor_pid: int | None = None
    updated_at: float = 0.0
    gpus: tuple[ServerEntry, ...] = ()
    rollout: Rollout | None = None
    tune: TuneRecord | None = None
    # Added by `status` (as each process's pid_alive), never written by the supervisor.
    supervisor_alive: bool | None = None

    @property
    def ready(self) -> list[ServerEntry]:
        """The servers that are ready."""
        return [g for g in self.gpus if g.server.state == "ready"]

    @property
    def all_ready(self) -> bool:
        """Whether every server is ready (none is out: crashed, restarting, starting)."""
        return bool(self.gpus) and len(self.ready) == len(self.gpus)

    def entry(self, gpu: int) -> ServerEntry | None:
        """The server led by GPU `gpu`, if any."""
        return next((g for g in self.gpus if g.gpu == gpu), None)

    def with_liveness(self) -> NodeState:
        """This state with `supervisor_alive` and each process's `pid_alive` (for `status`)."""
        def alive(p: ProcessEntry) -> ProcessEntry:
            return dataclasses.replace(p, pid_alive=pid_alive(p.pid))
        gpus = tuple(dataclasses.replace(g, server=alive(g.server),
                                         worker=alive(g.worker) if g.worker else None)
                     for g in self.gpus)
        return dataclasses.replace(self, gpus=gpus,
                                   supervisor_alive=pid_alive(self.supervisor_pid))

    def to_json(self) -> str:
        data = {"run_dir": self.run_dir, "log_dir": self.log_dir, "sim": self.sim,
                "workers": self.workers, "started_at": self.started_at,
                "sglang_version": self.sglang_version, "supervisor_pid": self.supervisor_pid,
                "updated_at": self.updated_at, "gpus": [g._json() for g in self.gpus],
                "rollout": self.rollout._json() if self.rollout else None,
                "tune": self.tune._json() if self.tune else None}
        if self.supervisor_alive is not None:
            data["supervisor_alive"] = self.supervisor_alive
        return _dumps(data)

    @classmethod
    def from_json(cls, text: str) -> NodeState:
        """The state `to_json` wrote; ValueError if `text` is not one."""
        return _parse(text, cls._read)

    @classmethod
    def _read(cls, data: Mapping[str, Any]) -> NodeState:
        rollout, tune = data.get("rollout"), data.get("tune")
        return cls(**{**_known(cls, data),
                      "gpus": tuple(ServerEntry._read(g) for g in data.get("gpus") or ()),
                      "rollout": Rollout._read(rollout) if rollout else None,
                      "tune": TuneRecord._read(tune) if tune else None})


@dataclass(frozen=True)
class RestartRequest:
    """restart.json: what `launcher restart` (or `tune`) asks of the supervisor, sent by
    SIGHUP. `args` None keeps the server arguments; `gpus` None means every GPU.
    `gpu_args` gives GPUs arguments of their own for this restart (merged over the node's
    like `args`; the node's arguments stay as they were): `tune` measures several candidates
    at once that way. `drain_s` is how long each server's running requests may finish before
    the rest are cut and go back to the queue (None: the node's `--drain-timeout`)."""

    id: str
    rolling: bool = True
    args: tuple[str, ...] | None = None
    replace: bool = False
    gpus: tuple[int, ...] | None = None
    profile: str | None = None  # a profile file to reload
    gpu_args: Mapping[int, tuple[str, ...]] | None = None
    drain_s: float | None = None

    def to_json(self) -> str:
        return _dumps({"id": self.id, "rolling": self.rolling,
                       "args": list(self.args) if self.args is not None else None,
                       "replace": self.replace,
                       "gpus": list(self.gpus) if self.gpus is not None else None,
                       "profile": self.profile,
                       "gpu_args": {str(g): list(a) for g, a in self.gpu_args.items()}
                       if self.gpu_args is not None else None,
                       "drain_s": self.drain_s})

    @classmethod
    def from_json(cls, text: str) -> RestartRequest:
        """The request `to_json` wrote; ValueError if `text` is not one."""
        def read(data: Mapping[str, Any]) -> RestartRequest:
            args, gpus, own = data.get("args"), data.get("gpus"), data.get("gpu_args")
            drain = data.get("drain_s")
            return cls(**{**_known(cls, data), "id": str(data.get("id")),
                          "args": tuple(str(a) for a in args) if args is not None else None,
                          "gpus": tuple(int(g) for g in gpus) if gpus else None,
                          "gpu_args": {int(g): tuple(str(a) for a in v) for g, v in own.items()}
                          if own is not None else None,
                          "drain_s": float(drain) if drain is not None else None})
        return _parse(text, read)


def _known(cls: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of dataclass `cls` that `data` holds (the rest keep their defaults)."""
    return {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}


def _dumps(data: Mapping[str, Any]) -> str:
    return json.dumps(data, indent=1, default=str)


def _parse(text: str, read: Callable[[Mapping[str, Any]], T]) -> T:
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
        return read(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"not a launcher file: {exc}") from None


def write_atomic(path: Path, text: str) -> None:
    """Write atomically: readers see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_state(run_dir: Path) -> NodeState | None:
    """node.json, or None when there is none (never started here); NodeError when the file
    there is not the launcher's."""
    path = run_dir / STATE_FILE
    try:
        return NodeState.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise NodeError(f"{path}: {exc}") from None


def read_tune(run_dir: Path) -> TuneRecord | None:
    """tune.json (None when `tune` never ran here, or it cannot be read)."""
    try:
        return TuneRecord.from_json((run_dir / TUNE_FILE).read_text())
    except (OSError, ValueError):
        return None


def pid_alive(pid: int | None) -> bool:
    """Whether a process with this pid exists (zombies included)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
