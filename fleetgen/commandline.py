"""The one style of fleetgen's command lines: `python -m producer` and `python -m launcher`.

Every parser is a `CommandParser`: abbreviations are refused (`--max-token 100` is an error, not
`--max-tokens 100`), --help shows each flag's default, each command has an example in its
epilog, and an error names the command it is about with that command's flags:

    python -m producer status: error: unrecognized arguments: --wach
      (did you mean --watch? valid: --json, --watch, --interval, --no-servers)

argparse reports the unknown flags of a subcommand from the top-level parser, with the
top-level usage; `CommandParser.parse_args` hands them to the subcommand's parser instead.
The simulator (launcher/sim) keeps SGLang's own argparse behaviour on purpose.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

UNRECOGNIZED = "unrecognized arguments: "


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; each flag's help ends with its default, unless the
    help already says it or there is none worth saying (no value, off, or a positional)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or "default" in text
                or action.default in (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class CommandParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` in fleetgen's style (module doc); subparsers made with
    `add_subparsers().add_parser` are CommandParsers too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.chosen(parsed).error(UNRECOGNIZED + " ".join(extras))
        return parsed

    def chosen(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The (sub)parser of the command `parsed` is for: the deepest one chosen."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(parsed, action.dest, None)
                parser = action.choices.get(name) if isinstance(name, str) else None
                if isinstance(parser, CommandParser):
                    return parser.chosen(parsed)
                return parser or self
        return self

    def flags(self) -> list[str]:
        """This command's long flags, in the order --help lists them."""
        return [option for action in self._actions for option in action.option_strings
                if option.startswith("--") and option != "--help"]

    def error(self, message: str) -> NoReturn:
        if message.startswith(UNRECOGNIZED):
            message += self.hint(message.removeprefix(UNRECOGNIZED).split())
        super().error(message)

    def hint(self, unknown: list[str]) -> str:
        """`(did you mean --watch? valid: ...)` for the unknown flags among `unknown`."""
        valid = self.flags()
        guesses = [match for word in unknown if word.startswith("--")
                   for match in difflib.get_close_matches(word.split("=")[0], valid, n=1)]
        guess = f"did you mean {', '.join(dict.fromkeys(guesses))}? " if guesses else ""
        return f"\n  ({guess}{'valid: ' + ', '.join(valid) if valid else 'it takes no flags'})"
