"""The one child-process class (launcher/child.py) every server, worker and test process uses."""

from __future__ import annotations

import os
from pathlib import Path

from fleetgen.poll import wait_until
from launcher.child import ChildProcess


def gone(pid: int) -> bool:
    """No such process, or only its zombie (nobody has reaped it yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_stopping_a_child_sweeps_the_grandchild_it_left_in_its_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    # The trap first: the pid file then means the shell already exits 0 on SIGTERM (a SIGTERM
    # before the trap, on a busy machine, ended it with -15).
    script = f"trap 'exit 0' TERM; sleep 300 & echo $! > {pidfile}; wait"
    child = ChildProcess(["sh", "-c", script], tmp_path / "child.log",
                         env={"PATH": os.environ["PATH"]}, header="[test] starting sh")
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip() != "", 10,
               what="the grandchild's pid")
    grandchild = int(pidfile.read_text())

    assert child.stop(grace=10) == 0  # the leader left on SIGTERM, its grandchild did not
    wait_until(lambda: gone(grandchild), 10, what="the grandchild swept with the group")
    assert (tmp_path / "child.log").read_text().startswith("[test] starting sh\n")


def test_a_killed_child_reports_sigkill_and_is_no_longer_alive(tmp_path: Path) -> None:
    child = ChildProcess(["sleep", "300"], tmp_path / "child.log", env={"PATH": os.environ["PATH"]})
    assert child.alive()
    child.kill_group()
    assert (child.alive(), child.returncode) == (False, -9)
