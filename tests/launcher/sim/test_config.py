"""SimConfig: SGLang-style flags, defaults, precedence, and the documented flag list."""

from __future__ import annotations

import pytest

from launcher.sim import SimConfig
from launcher.sim.cli import main
from launcher.sim.config import build_parser
from tests.sim_helpers import REPO


def test_defaults_equal_the_cli_defaults() -> None:
    assert SimConfig.from_argv([], environ={}) == SimConfig()


def test_sglang_aliases_and_parser_switches_are_understood() -> None:
    cfg = SimConfig.from_argv(["--model", "org/m", "--reasoning-parser", "none",
                               "--speculative-algorithm", "nextn", "--disable-metrics",
                               "--fail-prompt", "A", "--fail-prompt", "B"], environ={})
    assert cfg.model_path == "org/m" and cfg.served_name == "org/m"
    assert cfg.reasoning_parser is None and cfg.speculative_algorithm == "NEXTN"
    assert cfg.enable_metrics is False and cfg.fail_prompt == ("A", "B")


def test_force_shutdown_comes_from_the_flag_or_sglangs_env_var() -> None:
    assert SimConfig.from_argv([], environ={"SGL_FORCE_SHUTDOWN": "1"}).force_shutdown
    assert not SimConfig.from_argv([], environ={}).force_shutdown
    assert SimConfig.from_argv(["--force-shutdown"], environ={}).force_shutdown


@pytest.mark.parametrize("argv", [["--speed", "0"], ["--fail-rate", "2"], ["--bogus"],
                                  ["--mamba-radix-cache-strategy", "sometimes"],
                                  ["--max-tool-turns", "-1"]])
def test_bad_flags_exit_2_like_argparse(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("usage: python -m launcher sim")


def test_the_docs_describe_every_flag() -> None:
    docs = (REPO / "docs" / "development" / "simulator.md").read_text()
    flags = {opt for action in build_parser()._actions for opt in action.option_strings
             if opt.startswith("--") and opt != "--help"}
    assert {flag for flag in flags if f"`{flag}`" not in docs} == set()
