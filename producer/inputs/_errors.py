"""The errors a bad input raises, under fleetgen's root (fleetgen.errors):

    FleetgenError
      InputError        one bad line: FILE:LINE: FIELD: what is wrong (or a table's row:
                        FILE: row ROW: column COLUMN: what is wrong)
      InputErrors       several bad lines: the first ones kept, and the count of all
      NoPrompts         the file holds no prompt at all
      UnreadableInput   the input cannot be read as prompts at all: no such file or object,
                        a column no row could use, an unknown split, pyarrow missing
"""

from fleetgen.errors import FleetgenError

# An error keeps at most this much of its line, so a few bad lines of megabytes each cost a few
# kilobytes, not megabytes; it is also how much of the line a rejects file shows.
REJECT_RAW_CHARS = 1000


class InputError(FleetgenError):
    """One bad line. ``str(e)`` is ``FILE:LINE: FIELD: what is wrong``; ``raw`` is the line text,
    cut to REJECT_RAW_CHARS.

    A table's bad row has ``unit`` "row": ``line`` is its 1-based row in the file, ``field``
    the column (and the path inside it), and ``str(e)`` is ``FILE: row ROW: column FIELD: what
    is wrong``; a problem of the whole row has field "row" and names no column."""

    def __init__(self, path: str, line: int, field: str, message: str, raw: str | None = None,
                 unit: str = "line"):
        raw = None if raw is None else raw[:REJECT_RAW_CHARS]
        super().__init__(path, line, field, message, raw, unit)
        self.path = path
        self.line = line
        self.field = field
        self.message = message
        self.raw = raw
        self.unit = unit

    def __str__(self) -> str:
        if self.unit == "line":
            return f"{self.path}:{self.line}: {self.field}: {self.message}"
        column = "" if self.field == self.unit else f"column {self.field}: "
        return f"{self.path}: {self.unit} {self.line}: {column}{self.message}"


class InputErrors(FleetgenError):
    """Several bad lines: ``errors`` holds the first ones kept, ``total`` counts them all."""

    SHOWN = 20

    def __init__(self, errors: list[InputError], total: int | None = None):
        super().__init__(errors, total)
        self.errors = errors
        self.total = len(errors) if total is None else total

    def __str__(self) -> str:
        shown = [str(error) for error in self.errors[: self.SHOWN]]
        if self.total > len(shown):
            shown.append(f"... and {self.total - len(shown)} more")
        return "\n".join(shown)


class NoPrompts(FleetgenError):
    """The file holds no prompt: it is empty or blank, or every line was rejected.

    Such a job would be done the moment it was created and hold its name for good, so nothing
    is enqueued. ``rejects`` holds the first rejected lines, to show why.
    """

    def __init__(self, path: str, lines: int, rejected: int, rejects: list[InputError]):
        super().__init__(path, lines, rejected, rejects)
        self.path = path
        self.lines = lines
        self.rejected = rejected
        self.rejects = rejects

    def __str__(self) -> str:
        if self.rejected:
            why = f"{self.rejected:,} line{'' if self.rejected == 1 else 's'} rejected"
            if self.rejects:
                all_shown = len(self.rejects) == self.rejected
                why += ", see above" if all_shown else f", see the first {len(self.rejects)} above"
        elif self.lines:
            why = f"{self.lines:,} line{'' if self.lines == 1 else 's'}, all blank"
        else:
            why = "the file is empty"
        return f"{self.path}: no prompts ({why})"


class UnreadableInput(FleetgenError):
    """The input cannot be read as prompts at all, before any row is checked: no such file or
    object, a folder of no input files, a column no row could use, a Hugging Face dataset's
    split not named, pyarrow not installed."""
