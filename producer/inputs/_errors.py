"""The errors a bad input raises, under fleetgen's root (fleetgen.errors):

    FleetgenError
      InputError     one bad line: FILE:LINE: FIELD: what is wrong
      InputErrors    several bad lines: the first ones kept, and the count of all
      NoPrompts      the file holds no prompt at all
"""

from fleetgen.errors import FleetgenError

# An error keeps at most this much of its line, so a few bad lines of megabytes each cost a few
# kilobytes, not megabytes; it is also how much of the line a rejects file shows.
REJECT_RAW_CHARS = 1000


class InputError(FleetgenError):
    """One bad line. ``str(e)`` is ``FILE:LINE: FIELD: what is wrong``; ``raw`` is the line text,
    cut to REJECT_RAW_CHARS."""

    def __init__(self, path: str, line: int, field: str, message: str, raw: str | None = None):
        raw = None if raw is None else raw[:REJECT_RAW_CHARS]
        super().__init__(path, line, field, message, raw)
        self.path = path
        self.line = line
        self.field = field
        self.message = message
        self.raw = raw

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.field}: {self.message}"


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
