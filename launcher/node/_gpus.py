"""Which GPUs this node has (`nvidia-smi`) and which of them a `--gpus` spec selects.

    gpus = discover_gpus()     # [Gpu(index=0, name='NVIDIA H100 80GB HBM3', memory_mib=81559)]
    parse_gpu_spec("0-3,6")             # [0, 1, 2, 3, 6]
    group_gpus([0, 1, 2, 3], 2, "--tp-size 2")   # [(0, 1), (2, 3)]: one server each

Indices are nvidia-smi's (PCI bus order); the launcher starts each server with
`CUDA_DEVICE_ORDER=PCI_BUS_ID` so CUDA numbers the devices the same way.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from launcher.node._errors import GpuSpecError, NoGpuError

QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"]
# nvidia-smi can hang for tens of seconds on a wedged driver; a node that slow is not usable.
QUERY_TIMEOUT_S = 30.0

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi lists it."""

    index: int
    name: str
    memory_mib: int | None


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=QUERY_TIMEOUT_S,
                          check=False)


def discover_gpus(run: Runner = _run) -> list[Gpu]:
    """The GPUs nvidia-smi lists; raises NoGpuError saying why there are none."""
    try:
        done = run(QUERY)
    except FileNotFoundError:
        raise NoGpuError("nvidia-smi not found: this machine has no NVIDIA driver. "
                         "Use --sim to run the SGLang simulator instead.") from None
    except subprocess.TimeoutExpired:
        raise NoGpuError(f"nvidia-smi did not answer within {QUERY_TIMEOUT_S:.0f} s: "
                         "the driver looks wedged") from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise NoGpuError(f"nvidia-smi failed (exit {done.returncode}): "
                         f"{detail[0] if detail else 'no output'}. Use --sim without GPUs.")
    gpus = [parse_gpu_line(line) for line in done.stdout.splitlines() if line.strip()]
    if not gpus:
        raise NoGpuError("nvidia-smi lists no GPUs. Use --sim to run the simulator instead.")
    return gpus


def parse_gpu_line(line: str) -> Gpu:
    """One `index, name, memory.total` CSV row, e.g. `0, NVIDIA H100 80GB HBM3, 81559 MiB`."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 3 or not parts[0].isdigit():
        raise NoGpuError(f"cannot read nvidia-smi output line: {line!r}")
    memory = parts[-1].split()[0] if parts[-1] else ""
    return Gpu(int(parts[0]), ", ".join(parts[1:-1]), int(memory) if memory.isdigit() else None)


def parse_gpu_spec(spec: str) -> list[int]:
    """`0-6`, `0,1`, `0-3,6` → sorted unique indices; raises GpuSpecError."""
    indices: set[int] = set()
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise GpuSpecError(f"--gpus {spec!r}: expected indices and ranges like 0-6 or 0,1,4")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise GpuSpecError(f"--gpus {spec!r}: range {part.strip()} runs backwards")
        indices.update(range(first, last + 1))
    return sorted(indices)


def select_gpus(wanted: Sequence[int] | None, present: Sequence[Gpu]) -> list[Gpu]:
    """The present GPUs named by `wanted` (all of them when None); NoGpuError if one is absent."""
    by_index = {g.index: g for g in present}
    if wanted is None:
        return list(present)
    missing = [i for i in wanted if i not in by_index]
    if missing:
        have = ", ".join(str(i) for i in sorted(by_index)) or "none"
        raise NoGpuError(f"GPU {', '.join(map(str, missing))} not found (this node has {have})")
    return [by_index[i] for i in wanted]


def group_gpus(gpus: Sequence[int], size: int, why: str) -> list[tuple[int, ...]]:
    """`gpus` cut, in order, into groups of `size`: the GPUs of each server.

    `why` names the flags that set `size` (`--tp-size 2`), for the GpuSpecError raised when
    the GPUs do not divide into whole servers.
    """
    if len(gpus) % size:
        listed = ", ".join(map(str, gpus))
        raise GpuSpecError(f"{why}: each server holds {size} GPUs, but {len(gpus)} GPU(s) are "
                           f"selected ({listed}); select a multiple of {size} with --gpus")
    return [tuple(gpus[i:i + size]) for i in range(0, len(gpus), size)]
