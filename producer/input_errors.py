"""The errors a bad input line raises: one InputError per line, InputErrors for several."""


class InputError(Exception):
    """One bad line. ``str(e)`` is ``FILE:LINE: FIELD: what is wrong``; ``raw`` is the line text."""

    def __init__(self, path: str, line: int, field: str, message: str, raw: str | None = None):
        super().__init__(path, line, field, message, raw)
        self.path = path
        self.line = line
        self.field = field
        self.message = message
        self.raw = raw

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.field}: {self.message}"


class InputErrors(Exception):
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
