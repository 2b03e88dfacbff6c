"""The one child-process class (launcher/child.py) every server, worker and test process uses."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from fleetgen.poll import wait_until
from launcher.child import ChildProcess, stop_process, stop_process_async


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


class Stubborn:
    """A scripted child that ignores SIGTERM until its group is killed."""

    pid = 4242

    def __init__(self, exits_on_term: bool) -> None:
        self.code: int | None = None
        self.exits_on_term = exits_on_term
        self.signals: list[str] = []

    def poll(self) -> int | None:
        return self.code

    def terminate(self) -> None:
        self.signals.append("TERM")
        if self.exits_on_term:
            self.code = 0

    def send_signal(self, sig: int) -> None:
        self.signals.append(str(sig))

    def kill_group(self) -> None:
        self.signals.append("KILL group")
        self.code = -9 if self.code is None else self.code


def test_a_child_deaf_to_sigterm_is_killed_at_the_deadline_blocking_or_on_a_loop() -> None:
    deaf = Stubborn(exits_on_term=False)
    assert stop_process(deaf, grace=0.1) == (-9, True)
    assert deaf.signals == ["TERM", "KILL group"]
    polite = Stubborn(exits_on_term=True)
    assert asyncio.run(stop_process_async(polite, grace=5.0)) == (0, False)
    assert polite.signals == ["TERM", "KILL group"]  # the group swept after a clean exit too
    crash = Stubborn(exits_on_term=True)
    assert stop_process(crash, grace=0) == (-9, True) and crash.signals == ["KILL group"]
