"""The docs build, say what the code does, and stay inside the repository.

- `mkdocs build --strict` of docs/ (a broken link or anchor fails; the tests that build the
  site are marked `checks`, the rest read files and code and are not);
- every flag of `python -m producer` and `python -m launcher` (read from their argparse
  parsers) has a table row in its command's section of docs/reference/cli.md; the
  simulator's flags are checked against its own page by tests/launcher/sim/test_config.py;
- every setting of fleetgen/settings.py and every FLEETGEN_* name in the code is in
  docs/reference/configuration.md;
- every fleetgen_* metric of workers/metrics.py is in docs/reference/metrics.md, and the page
  lists no metric the code lacks;
- no file refers to the reference notes outside the repository; every `docs/...md#anchor` and
  every SGLang `§N` in the code points to a section that exists;
- the one-machine walkthrough (docs/getting-started/own-data.md) runs as written and exports,
  and the README's quick start is its commands, in its order;
- the log lines the docs tell a reader to wait for are the lines the code prints;
- no example port in the docs lies in the kernel's ephemeral range.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NoReturn

import pytest

from fleetgen.settings import ENV_DOC, Settings
from launcher import cli as launcher_cli
from producer import cli as producer_cli
from workers import metrics

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGES = ("fleetgen", "workers", "producer", "launcher")
README_MAX_LINES = 200


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def unavailable(reason: str) -> NoReturn:
    """Skip locally, fail on CI (as tests/conftest.py does for missing services)."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: this fails the run)", pytrace=False)
    pytest.skip(reason)


def page(relative: str) -> str:
    return (DOCS / relative).read_text(encoding="utf-8")


def mentions(text: str, name: str) -> bool:
    """`name` appears as a whole word (a flag, a variable, a metric) somewhere in `text`."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def repository_files() -> list[Path]:
    """Tracked files plus new ones not ignored: what a commit of this tree would hold."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    return [ROOT / name for name in listed if name and (ROOT / name).is_file()]


def text_of(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


# --- the site ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs built with `mkdocs build --strict` (warnings, broken links and anchors fail)."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[test]'", pytrace=False)
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def html_of(site: Path, doc: str) -> Path:
    """The built page of docs/`doc` (mkdocs' directory URLs: a/b.md -> a/b/index.html)."""
    stem = doc.removesuffix(".md")
    if stem == "index" or stem.endswith("/index"):
        return site / stem.removesuffix("index") / "index.html"
    return site / stem / "index.html"


@pytest.mark.checks
def test_the_docs_build_with_mkdocs_strict(site: Path) -> None:
    assert html_of(site, "index.md").is_file()
    assert html_of(site, "reference/sglang.md").is_file()


@pytest.mark.checks
def test_the_changelog_page_shows_the_changelog(site: Path) -> None:
    first_entry = next(line for line in (ROOT / "CHANGELOG.md").read_text().splitlines()
                       if line.startswith("- "))
    words = " ".join(first_entry[2:].split()[:4])
    assert words in html_of(site, "changelog.md").read_text(encoding="utf-8")


def test_the_readme_is_a_short_landing_page_whose_links_exist() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links into docs/"
    assert [t for t in local if not (ROOT / t).exists()] == []


# --- the CLI reference ----------------------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings
            if opt.startswith("--") and opt != "--help"}


class _Parsed(BaseException):
    """Raised instead of parsing: carries the parser a command built (BaseException, so no
    command's own `except` can swallow it)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def launcher_parser(command: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser `python -m launcher COMMAND` builds, caught at its first parse."""

    picker = launcher_cli.build_parser()  # parses only the command's name, for real
    passed = [picker, *subcommands(picker).values()]
    parse = argparse.ArgumentParser.parse_known_args

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        if any(self is parser for parser in passed):
            return parse(self, *args, **kwargs)
        raise _Parsed(self)

    monkeypatch.setattr(launcher_cli, "build_parser", lambda: picker)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    try:
        launcher_cli.main([command, "--help"])
    except _Parsed as parsed:
        # `redis` and `s3` share one parser with a subcommand each.
        found = subcommands(parsed.parser).get(command, parsed.parser)
        assert flags(found), f"launcher {command}: no flags caught"
        return found
    pytest.fail(f"launcher {command} parsed no arguments")


def cli_sections() -> dict[tuple[str, str], str]:
    """docs/reference/cli.md cut into (program, command) sections by its ## and ### headings."""
    sections: dict[tuple[str, str], str] = {}
    program, commands = "", [""]
    lines: list[str] = []
    for line in [*page("reference/cli.md").splitlines(), "## end"]:
        if line.startswith(("## ", "### ")):
            for command in commands:
                sections[(program, command)] = "\n".join(lines)
            lines = []
            if line.startswith("## "):
                program, commands = line, [""]
            else:
                commands = re.findall(r"`([\w-]+)`", line)
        lines.append(line)
    return sections


def described(text: str, flag: str) -> bool:
    """`flag` starts a row of a table in `text` (a usage line alone does not describe it)."""
    return re.search(rf"^\| `{re.escape(flag)}(?![\w-])", text, re.MULTILINE) is not None


def section(program: str, command: str) -> str:
    for (heading, name), text in cli_sections().items():
        if program in heading and name == command:
            return text
    pytest.fail(f"docs/reference/cli.md has no section for `{program} {command}`")


PRODUCER_COMMANDS = sorted(subcommands(producer_cli.build_parser()))
# The simulator's flags are on docs/development/simulator.md (tests/launcher/sim/test_config.py).
LAUNCHER_COMMANDS = sorted(name for name in launcher_cli.COMMANDS if name != "sim")


@pytest.mark.parametrize("command", PRODUCER_COMMANDS)
def test_the_cli_reference_names_every_flag_of_the_producer(command: str) -> None:
    parser = subcommands(producer_cli.build_parser())[command]
    text = section("python -m producer", command)
    assert {flag for flag in flags(parser) if not described(text, flag)} == set()


@pytest.mark.parametrize("command", LAUNCHER_COMMANDS)
def test_the_cli_reference_names_every_flag_of_the_launcher(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = launcher_parser(command, monkeypatch)
    text = section("python -m launcher", command)
    assert {flag for flag in flags(parser) if not described(text, flag)} == set()


def test_every_launcher_command_has_a_section_in_the_cli_reference() -> None:
    documented = {name for (heading, name) in cli_sections() if "python -m launcher" in heading}
    assert set(launcher_cli.COMMANDS) - documented == set()


# --- the configuration reference ------------------------------------------------------------


def environment_names() -> set[str]:
    """Every variable fleetgen reads: the Settings fields under the names `from_env` reads,
    ENV_DOC's names, and every FLEETGEN_* spelled in the packages."""
    names = {part.strip() for key in ENV_DOC for part in key.split("/")}
    for field in dataclasses.fields(Settings):
        if "Mapping" in str(field.type):
            continue  # `extra`: not read from the environment
        plain = field.name.upper()
        names.add(plain if plain in names else f"FLEETGEN_{plain}")
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r"\bFLEETGEN_[A-Z0-9_]+\b", path.read_text(encoding="utf-8")))
    return names


def test_the_configuration_page_names_every_variable() -> None:
    text = page("reference/configuration.md")
    names = environment_names()
    assert "FLEETGEN_LEASE_TTL_S" in names and "REDIS_URL" in names
    assert {name for name in names if not mentions(text, name)} == set()


# --- the metrics reference ------------------------------------------------------------------


def exported_metrics() -> set[str]:
    """The sample names a scrape shows for each fleetgen_* family (counters end in _total)."""
    names = set()
    for family in metrics.REGISTRY.collect():
        if family.name.startswith("fleetgen_"):
            names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_the_metrics_page_names_every_worker_metric() -> None:
    text = page("reference/metrics.md")
    exported = exported_metrics()
    assert "fleetgen_prompts_done_total" in exported
    assert {name for name in exported if not mentions(text, name)} == set()


def test_the_metrics_table_lists_only_metrics_the_workers_export() -> None:
    listed = set(re.findall(r"^\| `(fleetgen_\w+)`", page("reference/metrics.md"), re.MULTILINE))
    assert listed
    assert listed - exported_metrics() == set()


# --- references -----------------------------------------------------------------------------

# Notes that live outside the repository; nothing in it may send a reader there.
OUTSIDE = ("shared/reference", "../shared", "contract §", "celery-redis.md", "sglang-contract")
POINTER = re.compile(r"\bdocs/([\w./-]+\.md)(?:#([\w-]+))?")
SECTION = re.compile(r"§(\d+(?:\.\d+)?)")


def test_no_file_refers_to_notes_outside_the_repository() -> None:
    found = []
    for path in repository_files():
        if path == Path(__file__).resolve():
            continue
        text = text_of(path)
        for n, line in enumerate((text or "").splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                      for needle in OUTSIDE if needle in line]
    assert found == []


def test_every_docs_pointer_in_the_repository_names_a_page_and_anchor_that_exist(
    site: Path,
) -> None:
    broken = []
    for path in repository_files():
        if DOCS in path.parents or path == Path(__file__).resolve():
            continue  # pages link each other relatively; the strict build checks those
        for doc, anchor in POINTER.findall(text_of(path) or ""):
            if not (DOCS / doc).is_file():
                broken.append(f"{path.relative_to(ROOT)}: docs/{doc}")
            elif anchor and f'id="{anchor}"' not in html_of(site, doc).read_text("utf-8"):
                broken.append(f"{path.relative_to(ROOT)}: docs/{doc}#{anchor}")
    assert broken == []


def test_every_sglang_section_number_in_the_code_exists_in_the_contract() -> None:
    numbered = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", page("reference/sglang.md"),
                              re.MULTILINE))
    assert {"1", "4.3", "6.4", "7", "7.3"} <= numbered
    cited = []
    for path in repository_files():
        if path.suffix == ".py" and path.relative_to(ROOT).parts[0] in (*PACKAGES, "tests"):
            cited += [(path.name, n) for n in SECTION.findall(text_of(path) or "")]
    assert cited
    assert [(name, n) for name, n in cited if n not in numbered] == []


# --- what a new user looked for (tests/system/test_new_user.py checks the code) --------------------

README = ROOT / "README.md"
GETTING_STARTED = ("getting-started/demo.md", "getting-started/own-data.md",
                   "getting-started/gpu-node.md", "getting-started/several-nodes.md")


def shell_lines(text: str) -> list[str]:
    """The lines of the text's ```sh blocks, continuation lines joined."""
    blocks = re.findall(r"```sh\n(.*?)```", text, re.DOTALL)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]


def quick_start() -> list[str]:
    readme = README.read_text(encoding="utf-8")
    return shell_lines(readme.split("## Quick start on your own data", 1)[1].split("\n## ", 1)[0])


def test_the_readme_quick_start_shows_each_port_and_the_workers_name() -> None:
    """With :30000 taken, the quick start's worker silently used another stack's
    server; without `-n gpu0@%h` a second GPU's worker was refused."""
    lines = quick_start()
    sim = next(line for line in lines if "launcher sim" in line)
    assert "--port 30000" in sim
    worker = next(line for line in lines if "celery" in line)
    assert worker.startswith("FLEETGEN_SERVER_URL=http://127.0.0.1:30000 ")
    assert "-A workers worker -Q gpu0 -n gpu0@%h" in worker
    readme = " ".join(README.read_text(encoding="utf-8").split())
    assert "says which process holds it and exits; move it with `--port`" in readme


def test_every_celery_command_a_user_may_copy_names_the_app() -> None:
    """`celery worker -Q gpu0` without `-A` retried amqp://localhost for minutes."""
    texts = [README.read_text(encoding="utf-8"), *(page(doc) for doc in GETTING_STARTED)]
    commands = [line for text in texts for line in shell_lines(text)
                if re.search(r"\bcelery (\S+ )*(worker|flower)\b", line)]
    assert commands
    assert [line for line in commands if "-A workers" not in line] == []
    own_data = " ".join(page("getting-started/own-data.md").split())
    assert "Always type `-A workers`: without it" in own_data
    assert "retries a broker at `amqp://localhost` for minutes" in own_data


def test_the_demo_page_says_keep_leaves_the_stack_up_and_how_to_stop_it() -> None:
    text = " ".join(page("getting-started/demo.md").split())
    assert "With `--keep`, the stack stays up after the demo exits" in text
    assert "pid is in `.fleetgen/demo/demo.pid`" in text
    assert "stop it: kill 48213" in text and "Flower: http://127.0.0.1:5555" in text
    assert ".venv/bin/python -m launcher demo --input my-prompts.jsonl" in text
    assert "An `--input` file that does not exist is refused before anything starts." in text


def test_the_walkthrough_says_what_to_do_about_a_taken_port_and_another_directory() -> None:
    text = " ".join(page("getting-started/own-data.md").split())
    assert "error: port 30000 on 127.0.0.1 is in use by pid 4242" in text
    assert "give the worker of step 3 the same one in `FLEETGEN_SERVER_URL`" in text
    assert "else in the clone (where `.env` names it), so a command run from another " \
           "directory finds it too" in text


def test_the_gpu_node_guide_answers_a_new_users_questions() -> None:
    """The dry run, --gpus' default, busy GPUs, the ports of two launchers on one
    host, the SGLang range, and Redis 6379 against 6389."""
    text = " ".join(page("getting-started/gpu-node.md").split())
    assert "python -m launcher up --gpus 0-6 --workers --model /dev/shm/Qwen3.6-27B --dry-run" \
        in text
    assert "`--gpus` defaults to every GPU `nvidia-smi` lists (with `--sim`: GPU 0 only)" in text
    assert "## Are my GPUs busy?" in page("getting-started/gpu-node.md")
    assert "python -m producer status distill-v1" in text and "run/max" in text
    assert "curl -s http://127.0.0.1:20000/metrics" in text
    assert "its worker's Prometheus `/metrics` on `20000+(B-30000)+i`" in text
    assert "`--base-port 30100` (metrics 20000+*i* and 20100+*i*)" in text
    assert "A supported SGLang: **0.5.15 up to (not including) 0.6**" in text
    assert '"sglang>=0.5.15,<0.6"' in (ROOT / "pyproject.toml").read_text()
    assert "**Redis port.**" in text and "listens on `6389` instead" in text
    assert "6389" in (ROOT / "docker/control.yaml").read_text()


def add_a_node_checklist() -> str:
    text = page("getting-started/several-nodes.md")
    return text.split("### Adding node 2: a checklist", 1)[1].split("\n### ", 1)[0]


def test_several_nodes_has_an_add_a_node_checklist() -> None:
    steps = re.findall(r"^\d+\. \*\*(.+?)\*\*", add_a_node_checklist(), re.MULTILINE)
    assert steps == ["Install", "Copy node 1's secrets", "The same settings as node 1",
                     "Reach the shared services.", "Dry run:", "Start", "Check"]


def test_the_add_a_node_checklist_can_be_typed_as_it_stands() -> None:
    """The checklist asked for `redis-cli` (not installed), port 6379 against the
    embedded 6389, and never said which of node 1's secret files to copy under which
    variables."""
    checklist = add_a_node_checklist()
    lines = shell_lines(checklist)
    assert [line for line in lines if "redis-cli" in line] == []
    assert "python -m producer jobs" in [line.strip() for line in lines]
    # The embedded services of node 1, reachable from node 2, on the ports they really take.
    assert any("launcher redis --host 10.0.0.2" in line for line in lines)
    assert any("launcher s3 --host 10.0.0.2" in line for line in lines)
    exports = dict(re.findall(r"^\s*export (\w+)=(\S+)$", "\n".join(lines), re.MULTILINE))
    assert exports["REDIS_URL"] == "redis://10.0.0.2:6389/0"
    assert exports["AWS_ENDPOINT_URL"] == "http://10.0.0.2:8333"
    # Each copied secret file lands where a variable names it.
    copied = {Path(src).name: dest for src, dest in
              re.findall(r"^\s*scp \S+:(\S+) (\S+)$", "\n".join(lines), re.MULTILINE)}
    assert set(copied) == {"password", "credentials"}
    home = "$HOME/"
    assert exports["FLEETGEN_REDIS_PASSWORD_FILE"] == copied["password"].replace("~/", home)
    assert exports["AWS_SHARED_CREDENTIALS_FILE"] == copied["credentials"].replace("~/", home)
    configuration = page("reference/configuration.md")
    assert [name for name in exports if not mentions(configuration, name)] == []


def test_a_gpu_node_given_another_machines_redis_is_given_its_password_and_s3_too() -> None:
    """The GPU guides' "for real" blocks pointed the workers at a remote Redis with no
    password and at S3 with placeholder keys: typed as they stand, every worker refused."""
    for name in ("getting-started/gpu-node.md", "guides/gpu-nodes.md"):
        joined = "\n".join(shell_lines(page(name)))
        remote = re.findall(r"REDIS_URL=redis://(?!127\.0\.0\.1)([^\s/]+)", joined)
        assert remote, name
        for variable in ("FLEETGEN_REDIS_PASSWORD_FILE", "AWS_ENDPOINT_URL",
                         "AWS_SHARED_CREDENTIALS_FILE", "AWS_DEFAULT_REGION"):
            assert re.search(rf"\b{variable}=\S", joined), (name, variable)
        assert "..." not in joined.split("REDIS_URL=", 1)[1].split("python -m launcher up")[0]


def command_of(line: str) -> str:
    """A shell line without its trailing `# comment`."""
    return re.sub(r"\s+#\s.*$", "", line).strip()


def test_the_readme_quick_start_is_the_walkthroughs_commands_in_order() -> None:
    """The README's quick start and the walkthrough gave different flags in a
    different order; the README's lines are lines of the blocks the walkthrough test runs."""
    readme = [command_of(line) for line in quick_start() if command_of(line)]
    walkthrough = [command_of(line) for block in walkthrough_blocks()
                   for line in block.script.splitlines()]
    assert len(readme) == 6
    assert [line for line in readme if line not in walkthrough] == []
    remaining = iter(walkthrough)
    assert all(line in remaining for line in readme), "the README's order is the walkthrough's"


def test_the_readme_says_how_long_the_tests_take_and_how_to_run_the_fast_layer() -> None:
    """The README's test line gave no duration and did not name the fast layer; it names its
    halves too, the behaviour tests and the checks, as testing.md gives them."""
    commands = [line for line in shell_lines(page("development/testing.md"))
                if "not e2e" in line or "-m checks" in line]
    readme = " ".join(README.read_text(encoding="utf-8").split())
    assert len(commands) == 3
    assert [line for line in commands if f"`{line}`" not in readme] == []
    assert "whole test suite, two test files at a time" in readme
    assert "about 22 minutes on two cores, 23 with the other core busy (CI runs exactly" in readme
    assert "The fast layer alone takes about 53 s on an idle two-core machine" in readme


def test_the_walkthrough_says_what_flower_and_an_s3_output_want() -> None:
    """Flower's API wants a login; an s3:// output without AWS_ENDPOINT_URL goes to
    real AWS."""
    text = " ".join(page(WALKTHROUGH).split())
    assert "FLOWER_BASIC_AUTH=ops:secret .venv/bin/celery -A workers flower" in text
    assert "curl -fsS -u ops:secret 'http://127.0.0.1:5555/api/workers?refresh=1'" in text
    assert "its API (`/api/...`, which the pages' buttons such as *Refresh* use) answers 401" \
        in text
    assert "Without `AWS_ENDPOINT_URL`, boto3 calls **real AWS**" in text
    env = "".join(block.script for block in walkthrough_blocks() if block.kind == "env")
    for name in ("AWS_ENDPOINT_URL", "AWS_SHARED_CREDENTIALS_FILE", "AWS_DEFAULT_REGION"):
        assert f"export {name}=" in env
    flower = " ".join(page("guides/flower.md").split("## What it shows", 1)[0].split())
    assert "answers 401 until Flower has one: start it with `FLOWER_BASIC_AUTH=user:password`" \
        in flower


# The lines the docs tell a reader to wait for, as the code prints them (printf formats).
LOG_FORMATS = {
    "launcher/services/_command.py":
        "%s: serving %s (ports %s) until SIGTERM/SIGINT; credentials in %s",
    "launcher/sim/server.py": "The server is fired up and ready to roll!",
    "workers/tasks.py": "worker %s ready: queues %s, server %s, requests in flight up to %d (%s)",
    "workers/limits.py": "worker %s: %s is %s; %s; keeping %d in flight",
    "celery/apps/worker.py": "%s ready.",  # Celery's own
}
LOG_WORDS = (": serving ", " ready", "fired up", " in flight")


def source_of(module_path: str) -> str:
    path = ROOT / module_path
    if not path.is_file():
        spec = importlib.util.find_spec(module_path.removesuffix(".py").replace("/", "."))
        assert spec is not None and spec.origin is not None
        path = Path(spec.origin)
    return path.read_text(encoding="utf-8")


def prints(fmt: str, quote: str) -> bool:
    """The code's `fmt` can print the line `quote` shows: `<x>` stands for a value, and a
    trailing `...` for the rest of the line. A value holds no `;` and no parenthesis."""
    line = re.sub(r"<[^>]+>", "x", " ".join(quote.split()))
    tokens = [t for t in re.split(r"(%[sd])", fmt) if t]

    def pattern(part: list[str]) -> str:
        return "".join({"%s": r"[^;()]+", "%d": r"\d+"}.get(t, re.escape(t)) for t in part)

    if not line.endswith("..."):
        return re.fullmatch(pattern(tokens), line) is not None
    start = line.removesuffix("...")
    for k, token in enumerate([*tokens, ""]):
        rest = {"%s": r"[^;()]*", "%d": r"\d*"}.get(token) or "(?:{})".format(
            "|".join(re.escape(token[:n]) for n in range(len(token) + 1)))
        if re.fullmatch(pattern(tokens[:k]) + rest, start):
            return True
    return False


def quoted_log_lines(text: str) -> list[str]:
    """The `code spans` and ```text lines of `text` that quote a ready or serving line."""
    texts = re.findall(r"```text\n(.*?)```", text, re.DOTALL)
    spans = re.findall(r"(?<!`)`([^`]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
    quotes = [line for block in texts for line in block.splitlines()] + spans
    return [q for q in quotes if any(word in " ".join(q.split()) for word in LOG_WORDS)]


def test_the_ready_lines_the_docs_quote_are_the_lines_the_code_prints() -> None:
    """The walkthrough quoted Redis' ready line without the ports it names."""
    for module_path, fmt in LOG_FORMATS.items():
        assert f'"{fmt}"' in source_of(module_path) or f"'{fmt}'" in source_of(module_path), \
            f"{module_path} no longer prints {fmt!r}"
    quotes = [*quoted_log_lines(README.read_text(encoding="utf-8")),
              *quoted_log_lines(page(WALKTHROUGH))]
    assert [q for q in quotes if not any(prints(f, q) for f in LOG_FORMATS.values())] == []
    assert len(quotes) >= 8  # Redis, S3, the simulator, the worker's: each is quoted


def test_quoting_a_log_line_checks_the_words_between_its_values() -> None:
    serving = LOG_FORMATS["launcher/services/_command.py"]
    assert prints(serving, "redis: serving ...")
    assert prints(serving, "redis: serving redis://127.0.0.1:6389/0 (ports 6389) until "
                           "SIGTERM/SIGINT; credentials in ...")
    assert not prints(serving, "redis: serving redis://127.0.0.1:6389/0 until SIGTERM/SIGINT; "
                               "credentials in ...")
    assert prints(LOG_FORMATS["celery/apps/worker.py"], "gpu0@<host> ready.")
    assert not prints(LOG_FORMATS["celery/apps/worker.py"], "gpu0@<host> ready!")


# The kernel hands ports 32768-60999 (net.ipv4.ip_local_port_range) to outgoing connections:
# a server told to listen there can find its port taken by any client of the machine.
EPHEMERAL_PORTS = range(32768, 61000)
# A port in an example: after a host (not a FILE:LINE) and a colon, a port flag, a *_PORT
# variable, or the word port.
EXAMPLE_PORT = re.compile(
    r"\b(?:\d{1,3}(?:\.\d{1,3}){3}|localhost|[a-z][\w.-]*)(?<!\.jsonl)(?<!\.py)(?<!\.md)"
    r":(\d{2,5})\b"
    r"|--[\w-]*port[\w-]*[= ](\d{2,5})\b|_PORT=(\d{2,5})\b|\bports? (\d{2,5})\b",
    re.IGNORECASE)


def example_ports(text: str) -> list[tuple[int, str]]:
    """(port, line) for each example port in `text`, leaving out lines that state the range."""
    found = []
    for line in text.splitlines():
        if "32768" in line and "60999" in line:
            continue
        found += [(int(next(g for g in m.groups() if g)), line.strip())
                  for m in EXAMPLE_PORT.finditer(line)]
    return found


def test_no_example_port_in_the_docs_lies_in_the_ephemeral_range() -> None:
    """An example on an ephemeral port (status.md showed servers on 34849 and 47441)
    teaches a port that may be taken at any moment."""
    assert example_ports("curl 127.0.0.1:34849/x; --port 47441; prompts.jsonl:40000") == [
        (34849, "curl 127.0.0.1:34849/x; --port 47441; prompts.jsonl:40000"),
        (47441, "curl 127.0.0.1:34849/x; --port 47441; prompts.jsonl:40000")]
    pages = [README, *sorted(DOCS.rglob("*.md"))]
    found = [(port, line) for path in pages for port, line in example_ports(text_of(path) or "")]
    assert len(found) > 50
    assert [(port, line) for port, line in found if port in EPHEMERAL_PORTS] == []


def test_the_input_format_page_tells_the_typo_hint_and_the_canary_demo_file() -> None:
    text = " ".join(page("guides/input-format.md").split())
    assert "`promt: unknown field; did you mean 'prompt'?`" in text
    assert "`--canary-demo` caps them at 512 and 256 tokens instead" in text


# --- the one-machine walkthrough ------------------------------------------------------------

WALKTHROUGH = "getting-started/own-data.md"
# Every port the walkthrough's processes listen on: Valkey, the simulator, the worker's
# metrics, SeaweedFS (S3 and its inner parts).
WALKTHROUGH_PORTS = (6389, 30000, 20000, *range(8333, 8342), 18341)
# What a fresh terminal does not have: settings a developer's shell may hold.
FRESH_TERMINAL_DROPS = ("REDIS_URL", "FLEETGEN_SERVER_URL", "CELERY_APP", "AWS_", "FLEETGEN_")
READY_TIMEOUT_S = 180.0
STEP_TIMEOUT_S = 600.0


@dataclasses.dataclass
class Block:
    kind: str  # env (kept for the blocks after it), terminal N, or step
    script: str
    terminal: int | None = None
    ready: str | None = None


def walkthrough_blocks() -> list[Block]:
    """The shell blocks of the walkthrough marked
    `<!-- walkthrough: env | step | terminal N; ready when "X" -->`."""
    found = re.findall(
        r"<!-- walkthrough: (\w+)(?: (\d+))?(?:; ready when \"([^\"]+)\")? -->\n```sh\n(.*?)```",
        page(WALKTHROUGH), re.DOTALL)
    return [Block(kind, script, int(n) if n else None, ready or None)
            for kind, n, ready, script in found]


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@dataclasses.dataclass
class Terminal:
    process: subprocess.Popen[bytes]
    log: Path
    out: IO[bytes]

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def interrupt(self) -> None:
        """Ctrl-C, as a reader stops the part; killed if it has not stopped in 30 s."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.out.close()


@pytest.fixture
def terminals() -> Iterator[dict[int, Terminal]]:
    """The walkthrough's long-running parts by terminal; stopped last started first."""
    started: dict[int, Terminal] = {}
    yield started
    for term in reversed(started.values()):
        term.interrupt()


def fresh_environment() -> dict[str, str]:
    """A new terminal's environment; output unbuffered, as on a terminal, so that a part's
    ready line reaches its log when it is printed."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith(FRESH_TERMINAL_DROPS)}
    return {**kept, "PYTHONUNBUFFERED": "1"}


def test_the_walkthrough_marks_its_blocks_for_the_test_that_runs_it() -> None:
    blocks = walkthrough_blocks()
    assert [b.terminal for b in blocks if b.kind == "terminal"] == [1, 2, 3, 4, 5, 3]
    assert all(b.ready for b in blocks if b.kind == "terminal")
    assert [b.kind for b in blocks].count("env") == 1
    assert "export mine " in blocks[-1].script or "export mine-s3 " in blocks[-1].script


@pytest.mark.e2e
def test_the_one_machine_walkthrough_runs_as_written_and_exports(
    tmp_path: Path, terminals: dict[int, Terminal]
) -> None:
    blocks = walkthrough_blocks()
    taken = [port for port in WALKTHROUGH_PORTS if port_taken(port)]
    if taken:
        unavailable(f"the walkthrough's ports are taken: {taken}")
    # The walkthrough runs from the repository root, where .venv is; here a scratch folder
    # with that venv linked in stands for it, so the run leaves nothing in the repository.
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env, fresh = "", fresh_environment()
    for n, block in enumerate(blocks):
        if block.kind == "env":
            env += block.script
        elif block.kind == "terminal":
            assert block.terminal is not None and block.ready is not None
            if block.terminal in terminals:  # the same terminal again: Ctrl-C, then the line
                terminals.pop(block.terminal).interrupt()
            log = tmp_path / f"block{n}-terminal{block.terminal}.log"
            out = log.open("wb")
            process = subprocess.Popen(
                ["bash", "-c", env + block.script], cwd=tmp_path, stdout=out, env=fresh,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            term = terminals[block.terminal] = Terminal(process, log, out)
            deadline = time.monotonic() + READY_TIMEOUT_S
            while block.ready not in term.text():
                # A part may print its ready line and end (`status --watch` at `[done]`).
                assert process.poll() is None or block.ready in term.text(), \
                    f"block {n} exited:\n{term.text()}"
                assert time.monotonic() < deadline, f"block {n} not ready:\n{term.text()}"
                time.sleep(0.2)
        else:
            done = subprocess.run(["bash", "-ec", env + block.script], cwd=tmp_path, env=fresh,
                                  check=False, capture_output=True, text=True,
                                  timeout=STEP_TIMEOUT_S)
            logs = "\n".join(f"--- {t.log.name}\n{t.text()[-3000:]}" for t in terminals.values())
            assert done.returncode == 0, f"step {n} failed:\n{block.script}\n{done.stdout}" \
                f"\n{done.stderr}\n{logs}"
    ids = [json.loads(line)["id"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()
           if "custom_id" not in line] + ["q3"]
    for export in ("mine.jsonl", "mine-s3.jsonl"):
        rows = [json.loads(line) for line in (tmp_path / export).read_text().splitlines()]
        assert sorted(row["id"] for row in rows) == sorted(ids)
        assert all(row["content"] for row in rows)
