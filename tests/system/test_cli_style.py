"""Both command lines in one style (fleetgen/commandline.py), as a user meets them.

What a new operator hit: `python -m launcher --help` was a hand-written list, a typo in a
subcommand's flag printed the top-level usage, `enqueue --help` showed no defaults, and
`--max-token 100` was silently taken for `--max-tokens 100`.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from fleetgen.job import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from launcher import cli as launcher_cli
from producer import cli as producer_cli

ROOT = Path(__file__).resolve().parents[2]
PRODUCER_COMMANDS = sorted(producer_cli.COMMANDS)
# The simulator keeps SGLang's own argparse behaviour (it stands in for `sglang serve`).
LAUNCHER_COMMANDS = sorted(name for name in launcher_cli.COMMANDS if name != "sim")
# What a command needs before a flag error can be about the flag.
POSITIONALS = {"explain": ["gpu0.log"]}


def run(main: object, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of a CLI's `main(argv)` (argparse exits; commands return)."""
    assert callable(main)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def test_a_misspelt_flag_names_the_subcommand_its_flags_and_the_likely_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(producer_cli.main, ["status", "distill-v1", "--wach"], capsys)
    assert code == 2
    assert "python -m producer status: error: unrecognized arguments: --wach" in err
    assert "did you mean --watch? valid: --json, --watch, --interval, --no-servers" in err
    assert "usage: python -m producer status" in err
    assert "COMMAND ..." not in err  # not the top-level usage


def test_an_abbreviated_flag_is_an_error_not_a_guess(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(producer_cli.main, ["enqueue", "in.jsonl", "--max-token", "100"], capsys)
    assert code == 2
    assert "python -m producer enqueue: error: unrecognized arguments: --max-token 100" in err
    assert "did you mean --max-tokens?" in err


def test_enqueue_help_tells_each_generation_flag_and_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out, _ = run(producer_cli.main, ["enqueue", "--help"], capsys)
    text = " ".join(out.split("options:", 1)[1].split())
    for flag, default in (("--max-tokens N", DEFAULT_MAX_TOKENS), ("--temperature T",
                          DEFAULT_TEMPERATURE), ("--top-p P", DEFAULT_TOP_P)):
        entry = text.split(flag, 1)[1].split(" --", 1)[0]
        assert "wins" in entry and f"(default: {default})" in entry, (flag, entry)
    assert "--batch-size N answers per batch (one per prompt unless --samples" in text
    assert "default: answers/64" in text


@pytest.mark.parametrize("command", PRODUCER_COMMANDS)
def test_every_producer_command_refuses_abbreviations_and_shows_an_example(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = producer_cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sub.choices[command].allow_abbrev is False
    _, out, _ = run(producer_cli.main, [command, "--help"], capsys)
    assert f"python -m producer {command}" in out.split("example", 1)[1]


@pytest.mark.parametrize("command", LAUNCHER_COMMANDS)
def test_every_launcher_command_refuses_abbreviations_and_shows_an_example(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(launcher_cli.main, [command, *POSITIONALS.get(command, []), "--hel"],
                       capsys)
    assert code == 2
    assert f"python -m launcher {command}: error: unrecognized arguments: --hel" in err
    _, out, _ = run(launcher_cli.main, [command, "--help"], capsys)
    assert f"python -m launcher {command}" in out.split("example", 1)[1]


def test_launcher_help_is_generated_from_its_commands_and_a_typo_lists_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(launcher_cli.main, ["--help"], capsys)
    assert code == 0 and out.startswith("usage: python -m launcher [-h] COMMAND ...")
    for name, (_, _, help_) in launcher_cli.COMMANDS.items():
        assert f"    {name:<10}{help_}" in out
    code, _, err = run(launcher_cli.main, ["stauts"], capsys)
    assert code == 2
    assert "invalid choice: 'stauts' (choose from 'up', 'status'" in err


def test_each_console_script_the_package_declares_is_the_one_the_docs_use() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("scripts", {})
    docs = " ".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    assert [name for name in scripts if name not in docs] == []


def test_the_simulators_usage_names_the_command_the_user_typed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`launcher sim --help` said `usage: sglang serve`, a command the user never typed."""
    code, out, _ = run(launcher_cli.main, ["sim", "--help"], capsys)
    assert code == 0 and out.startswith("usage: python -m launcher sim ")
    code, _, err = run(launcher_cli.main, ["sim", "--no-such-flag"], capsys)
    assert code == 2
    assert err.startswith("usage: python -m launcher sim ")
    assert "python -m launcher sim: error: unrecognized arguments: --no-such-flag" in err
