"""Following a server's log since its start, and describing why a process failed."""

from __future__ import annotations

import signal
from collections import deque
from pathlib import Path

from launcher.logs import HINTS, Fatal, LogReport, parse_line
from launcher.process import MARKER

# Enough lines to show an argparse error or a traceback's last frame in a failure reason.
TAIL_LINES = 8
# Per poll; a server logging faster than this is caught up over the next rounds.
MAX_READ_BYTES = 4 << 20


class LogFollower:
    """Reads what a server appended to its log since `offset`, folding it into a LogReport."""

    def __init__(self, path: Path, offset: int | None = None) -> None:
        self.path = path
        self.offset = offset if offset is not None else _size(path)
        self.report = LogReport(str(path))
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._partial = b""

    @property
    def fatal(self) -> Fatal | None:
        """The most telling fatal line seen since this start (root causes outrank sigquit)."""
        return self.report.run.fatal

    def poll(self, final: bool = False) -> None:
        """Fold new complete lines (and, when `final`, an unterminated last line)."""
        try:
            with open(self.path, "rb") as log:
                log.seek(self.offset)
                chunk = log.read(MAX_READ_BYTES)
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = b"" if final else lines.pop()
        for raw in lines:
            # tqdm redraws with carriage returns; each redraw is a line of its own.
            for line in raw.decode("utf-8", "replace").split("\r"):
                self._fold(line)

    def _fold(self, line: str) -> None:
        self.report.lines += 1
        event = parse_line(line)
        if event is not None:
            self.report.add(event)
        if line.strip() and not line.startswith(MARKER):  # the tail is the server's own
            self.tail.append(line.strip())


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def describe_fatal(fatal: Fatal) -> str:
    """`kind: first line of the message (hint)`."""
    first = fatal.message.strip().splitlines()[0][:240] if fatal.message.strip() else fatal.kind
    return f"{fatal.kind}: {first} ({HINTS[fatal.kind]})"


def describe_exit(code: int, follower: LogFollower) -> str:
    """Why a process ended: its code or signal, then the fatal line or the last log line."""
    how = f"exited with code {code}" if code >= 0 else f"killed by {_signal_name(-code)}"
    if follower.fatal is not None:
        return f"{how}: {describe_fatal(follower.fatal)}"
    if code == -9:  # SGLang's own fatal path logs first; a silent -9 is usually the kernel
        how += " (the OS OOM killer? dmesg -T | grep -i oom)"
    if code == 2:
        how += " (bad arguments)"
    return f"{how}; last log line: {follower.tail[-1]}" if follower.tail else how


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
