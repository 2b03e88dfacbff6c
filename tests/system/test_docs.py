"""The docs build, say what the code does, and stay inside the repository.

- `mkdocs build --strict` of docs/ (a broken link or anchor fails);
- every flag of `python -m producer` and `python -m launcher` (read from their argparse
  parsers) has a table row in its command's section of docs/reference/cli.md; the
  simulator's flags are checked against its own page by tests/launcher/sim/test_config.py;
- every setting of fleetgen/settings.py and every FLEETGEN_* name in the code is in
  docs/reference/configuration.md;
- every fleetgen_* metric of workers/metrics.py is in docs/reference/metrics.md, and the page
  lists no metric the code lacks;
- no file refers to the reference notes outside the repository; every `docs/...md#anchor` and
  every SGLang `§N` in the code points to a section that exists;
- the one-machine walkthrough (docs/getting-started/own-data.md) runs as written and exports.
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


def test_the_docs_build_with_mkdocs_strict(site: Path) -> None:
    assert html_of(site, "index.md").is_file()
    assert html_of(site, "reference/sglang.md").is_file()


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
    program, commands, lines = "", [""], []
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
    """Item 3: with :30000 taken, the quick start's worker silently used another stack's
    server; item 8: without `-n gpu0@%h` a second GPU's worker was refused."""
    lines = quick_start()
    sim = next(line for line in lines if "launcher sim" in line)
    assert "--port 30000" in sim
    worker = next(line for line in lines if "celery" in line)
    assert worker.startswith("SGLANG_URL=http://127.0.0.1:30000 ")
    assert "-A workers worker -Q gpu0 -n gpu0@%h" in worker
    readme = " ".join(README.read_text(encoding="utf-8").split())
    assert "says which process holds it and exits; move it with `--port`" in readme


def test_every_celery_command_a_user_may_copy_names_the_app() -> None:
    """Item 8: `celery worker -Q gpu0` without `-A` retried amqp://localhost for minutes."""
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
    assert "its pid is in `.fleetgen/demo.pid`" in text
    assert "stop it: kill 48213" in text and "Flower: http://127.0.0.1:5555" in text
    assert ".venv/bin/python -m launcher demo --input my-prompts.jsonl" in text
    assert "An `--input` file that does not exist is refused before anything starts." in text


def test_the_walkthrough_says_what_to_do_about_a_taken_port_and_another_directory() -> None:
    text = " ".join(page("getting-started/own-data.md").split())
    assert "error: port 30000 on 127.0.0.1 is in use by pid 4242" in text
    assert "give the worker of step 4 the same one in `SGLANG_URL`" in text
    assert "else in the clone (where `.env` names it), so a command run from another " \
           "directory finds it too" in text


def test_the_gpu_node_guide_answers_a_new_users_questions() -> None:
    """Item 11: the dry run, --gpus' default, busy GPUs, the ports of two launchers on one
    host, the SGLang range, and Redis 6379 against 6389."""
    text = " ".join(page("getting-started/gpu-node.md").split())
    assert "python -m launcher up --gpus 0-6 --workers --model /dev/shm/Qwen3.6-27B --dry-run" \
        in text
    assert "`--gpus` defaults to every GPU `nvidia-smi` lists (with `--sim`: GPU 0 only)" in text
    assert "## Are my GPUs busy?" in page("getting-started/gpu-node.md")
    assert "python -m producer status distill-v1" in text and "run/max" in text
    assert "curl -s http://127.0.0.1:9400/metrics" in text
    assert "its worker's Prometheus `/metrics` on `9400+(B-30000)+i`" in text
    assert "`--base-port 31000` (metrics 9400+*i* and 10400+*i*)" in text
    assert "A supported SGLang: **0.5.15 up to (not including) 0.6**" in text
    assert '"sglang>=0.5.15,<0.6"' in (ROOT / "pyproject.toml").read_text()
    assert "**Redis port.**" in text and "listens on `6389` instead" in text
    assert "6389" in (ROOT / "docker/control.yaml").read_text()


def test_several_nodes_has_an_add_a_node_checklist() -> None:
    text = page("getting-started/several-nodes.md")
    checklist = text.split("### Adding node 2: a checklist", 1)[1].split("\n### ", 1)[0]
    steps = re.findall(r"^\d+\. \*\*(.+?)\*\*", checklist, re.MULTILINE)
    assert steps == ["Reach the shared services.", "The same settings as node 1.", "Install",
                     "Dry run:", "Start", "Check"]


def test_the_input_format_page_tells_the_typo_hint_and_the_canary_demo_file() -> None:
    text = " ".join(page("guides/input-format.md").split())
    assert "`promt: unknown field; did you mean 'prompt'?`" in text
    assert "`--canary-demo` caps them at 512 and 256 tokens instead" in text


# --- the one-machine walkthrough ------------------------------------------------------------

WALKTHROUGH = "getting-started/own-data.md"
# Every port the walkthrough's processes listen on: Valkey, SeaweedFS (S3 and its inner
# parts), the simulator, the worker's metrics.
WALKTHROUGH_PORTS = (6389, *range(8333, 8342), 18341, 30000, 9400)
READY_TIMEOUT_S = 180.0
STEP_TIMEOUT_S = 600.0


@dataclasses.dataclass
class Block:
    kind: str  # env, terminal or step
    script: str
    ready: str | None = None


def walkthrough_blocks() -> list[Block]:
    """The shell blocks of the walkthrough marked `<!-- walkthrough: KIND[; ready when "X"] -->`."""
    found = re.findall(
        r"<!-- walkthrough: (\w+)(?:; ready when \"([^\"]+)\")? -->\n```sh\n(.*?)```",
        page(WALKTHROUGH), re.DOTALL)
    return [Block(kind, script, ready or None) for kind, ready, script in found]


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


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    """The walkthrough's long-running parts; stopped as Ctrl-C would, last started first."""
    started: list[Terminal] = []
    yield started
    for term in reversed(started):
        if term.process.poll() is None:
            os.killpg(term.process.pid, signal.SIGINT)
            try:
                term.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(term.process.pid, signal.SIGKILL)
                term.process.wait(10)
        term.out.close()


@pytest.mark.e2e
def test_the_one_machine_walkthrough_runs_as_written_and_exports(
    tmp_path: Path, terminals: list[Terminal]
) -> None:
    blocks = walkthrough_blocks()
    assert [b.kind for b in blocks].count("env") == 1
    assert [b.kind for b in blocks].count("terminal") == 4
    assert "export" in blocks[-1].script
    taken = [port for port in WALKTHROUGH_PORTS if port_taken(port)]
    if taken:
        unavailable(f"the walkthrough's ports are taken: {taken}")
    # The walkthrough runs from the repository root, where .venv is; here a scratch folder
    # with that venv linked in stands for it, so the run leaves nothing in the repository.
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = next(b.script for b in blocks if b.kind == "env")
    for n, block in enumerate(blocks):
        if block.kind == "terminal":
            log = tmp_path / f"terminal{len(terminals) + 1}.log"
            out = log.open("wb")
            process = subprocess.Popen(
                ["bash", "-c", env + block.script], cwd=tmp_path, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            term = Terminal(process, log, out)
            terminals.append(term)
            assert block.ready, f"block {n}: a terminal says what to wait for"
            deadline = time.monotonic() + READY_TIMEOUT_S
            while block.ready not in term.text():
                assert process.poll() is None, f"block {n} exited:\n{term.text()}"
                assert time.monotonic() < deadline, f"block {n} not ready:\n{term.text()}"
                time.sleep(0.2)
        elif block.kind == "step":
            done = subprocess.run(["bash", "-ec", env + block.script], cwd=tmp_path, check=False,
                                  capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
            logs = "\n".join(f"--- {t.log.name}\n{t.text()[-3000:]}" for t in terminals)
            assert done.returncode == 0, f"step {n} failed:\n{block.script}\n{done.stdout}" \
                f"\n{done.stderr}\n{logs}"
    rows = [json.loads(line) for line in (tmp_path / "mine.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rows] == ["q1", "q2", "q3"]
    assert all(row["content"] for row in rows)
