"""The node's run directory: `node.json` the supervisor publishes, `restart.json` it is sent.

Also the file helpers every node command shares to read and write them, and the pid check
that tells a live supervisor from a stale file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_RUN_DIR = Path(".fleetgen/node")
STATE_FILE, REQUEST_FILE = "node.json", "restart.json"


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write atomically: readers see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """node.json, or None when there is none (never started here)."""
    try:
        data = json.loads((run_dir / STATE_FILE).read_text())
    except FileNotFoundError:
        return None
    return data if isinstance(data, dict) else None


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
