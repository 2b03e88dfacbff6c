"""Every flag a profile in docs/ or tests/ makes the launcher pass exists in each supported
SGLang release, with a value of the right kind.

The flag tables come from each release's `server_args.py` (and `arg_groups/fields/`), read with
`ast` by scripts/sglang_flags.py into launcher/node/sglang_flags.json. The table is checked in
so this runs offline; with SGLANG_WHEELS naming a folder of downloaded wheels
(`pip download sglang==X --no-deps -d DIR`), the table is regenerated and compared too.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.node import SGLANG_FLAGS_FILE, read_wheel, table_json, wheel_release
from launcher.node._args import adapt_flags, version_tuple
from launcher.node._flags import check_args, read_source, release_for, supported_releases
from launcher.node._kind import build_argv

ROOT = Path(__file__).resolve().parents[3]
TOML_ARGS = re.compile(r"""\bargs\s*=\s*(\[[^\]\n]*\])""")
COMMAND = re.compile(r"python -m launcher (?:up|restart)\b(?P<own>[^\n]*?) -- (?P<args>[^\n#]*)")


def emitted_argument_lists() -> dict[str, list[str]]:
    """Where → server arguments, for every profile and `up`/`restart -- ARGS` line in docs/ and
    tests/, plus what the launcher adds itself. Simulator command lines are not SGLang's."""
    found: dict[str, list[str]] = {
        "launcher defaults": build_argv(["sglang", "serve"], "/m", 30000, 31000, [])[2:]}
    files = [*ROOT.glob("docs/**/*.md"), *ROOT.glob("docs/**/*.toml"), *ROOT.glob("tests/*.py")]
    for path in files:
        text = path.read_text(encoding="utf-8")
        for m in TOML_ARGS.finditer(text):
            try:
                args = ast.literal_eval(m.group(1))
            except (ValueError, SyntaxError):
                continue  # a Python list built from variables, not a profile
            if args and all(isinstance(a, str) for a in args) and args[0].startswith("--") \
                    and "s3" not in args:
                line = text.count("\n", 0, m.start()) + 1
                found[f"{path.relative_to(ROOT)}:{line}"] = args
        for m in COMMAND.finditer(text if path.suffix == ".md" else ""):
            if "--sim" not in m["own"]:
                line = text.count("\n", 0, m.start()) + 1
                found[f"{path.relative_to(ROOT)}:{line}"] = shlex.split(m["args"].rstrip(" \\"))
    return found


EMITTED = emitted_argument_lists()


# What `launcher advise` and `tune` offer (launcher/node/_advise.py), where the release has it.
ADVICE_FLAGS = [["--max-mamba-cache-size", "200"], ["--mem-fraction-static", "0.93"],
                ["--max-running-requests", "40"], ["--cuda-graph-max-bs-decode", "64"]]


@pytest.mark.parametrize("release", supported_releases())
def test_the_advised_flags_exist_in_each_release_from_the_one_that_added_them(
    release: str,
) -> None:
    for args in ADVICE_FLAGS:
        adapted, _ = adapt_flags(args, release)
        problems = check_args(adapted, release)
        first = "0.5.2" if args[0] == "--max-mamba-cache-size" else "0.5.1"
        if version_tuple(release) >= version_tuple(first):
            assert problems == [], (release, args)
        else:
            assert problems == [f"{args[0]} does not exist in sglang {release}"]


def test_profiles_are_found_in_docs_and_tests() -> None:
    # The collector must see the guide's profile and the restart example, or it checks nothing.
    flags = {a for args in EMITTED.values() for a in args if a.startswith("--")}
    assert {"--mem-fraction-static", "--max-running-requests", "--speculative-algorithm",
            "--enable-metrics", "--log-level"} <= flags
    assert len(EMITTED) >= 5


@pytest.mark.parametrize("release", supported_releases())
def test_every_emitted_flag_exists_in_the_release_with_a_value_of_its_kind(release: str) -> None:
    problems = []
    for where, args in EMITTED.items():
        adapted, _ = adapt_flags(args, release)
        problems += [f"{where}: {p}" for p in check_args(adapted, release)]
    assert problems == []


def test_the_table_covers_every_release_from_0_5_1_to_the_newest_the_launcher_knows() -> None:
    from launcher.node._args import NEWEST_SGLANG
    releases = supported_releases()
    assert releases[0] == "0.5.1" and releases[-1] == NEWEST_SGLANG
    assert len(releases) == 23


def test_renamed_flags_are_spelled_as_each_release_accepts_them() -> None:
    for release in supported_releases():
        args, _ = adapt_flags(["--cuda-graph-max-bs", "16"], release)
        assert check_args(args, release) == [], release
    for release in [r for r in supported_releases() if version_tuple(r) >= (0, 5, 7)]:
        args, _ = adapt_flags(["--mamba-radix-cache-strategy", "no_buffer"], release)
        assert check_args(args, release) == [], release


def test_check_args_names_an_unknown_flag_a_bad_value_and_a_stray_value() -> None:
    assert check_args(["--max-mamba-cache-size", "200"], "0.5.23") == []
    assert check_args(["--max-mamba-cache-size", "many"], "0.5.23") == [
        "--max-mamba-cache-size: 'many' is not an int (sglang 0.5.23)"]
    assert check_args(["--mem-fraction-static=high"], "0.5.23") == [
        "--mem-fraction-static: 'high' is not a float (sglang 0.5.23)"]
    assert check_args(["--cuda-graph-max-bs", "8"], "0.5.23") == [
        "--cuda-graph-max-bs does not exist in sglang 0.5.23"]
    assert check_args(["--mamba-radix-cache-strategy", "always"], "0.5.23") == [
        "--mamba-radix-cache-strategy: 'always' is not one of auto, no_buffer, extra_buffer, "
        "extra_buffer_lazy (sglang 0.5.23)"]
    assert check_args(["--enable-metrics", "yes"], "0.5.23") == [
        "--enable-metrics: a switch takes no value, got 'yes' (sglang 0.5.23)"]


def test_a_post_release_is_checked_against_its_release() -> None:
    assert release_for("0.5.10.post1") == "0.5.10"
    assert release_for("0.6.0") == supported_releases()[-1]
    assert wheel_release(Path("sglang-0.5.10-py3-none-any.whl")) == "0.5.10"
    assert wheel_release(Path("sglang-0.5.10.post1-py3-none-any.whl")) is None


def test_both_declaration_styles_are_read_with_ast() -> None:
    source = '''
class ServerArgs:
    max_mamba_cache_size: A[Optional[int], "slots"] = None
    mem_fraction_static: A[float | None, Arg(help="x", aliases=["--mem-frac"])] = None
    enable_metrics: A[bool, "metrics"] = False
    strategy: A[Literal["auto", "no_buffer"], "s"] = "auto"
    hidden: A[int, Arg(help="h", no_cli=True)] = 1
    plain: int = 3

def add_cli_args(parser):
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None)
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--load-format", type=str, choices=["auto", "dummy"])
'''
    flags = {name: flag.to_json() for name, flag in read_source(source).items()}
    assert flags == {
        "--max-mamba-cache-size": {"kind": "int"}, "--mem-fraction-static": {"kind": "float"},
        "--mem-frac": {"kind": "float"}, "--enable-metrics": {"kind": "switch"},
        "--strategy": {"kind": "str", "choices": ["auto", "no_buffer"]},
        "--cuda-graph-max-bs": {"kind": "int"}, "--disable-radix-cache": {"kind": "switch"},
        "--load-format": {"kind": "str", "choices": ["auto", "dummy"]},
    }


WHEELS = Path(os.environ.get("SGLANG_WHEELS", Path.home() / ".cache/fleetgen/sglang-wheels"))


@pytest.mark.skipif(not any(WHEELS.glob("sglang-*.whl")),
                    reason=f"no SGLang wheels in {WHEELS} (set SGLANG_WHEELS)")
def test_the_checked_in_table_is_what_the_wheels_declare() -> None:
    tables = {r: read_wheel(p) for p in sorted(WHEELS.glob("sglang-*.whl"))
              if (r := wheel_release(p)) in supported_releases()}
    assert set(tables) == set(supported_releases()), "download every supported release"
    assert table_json(tables) == SGLANG_FLAGS_FILE.read_text(encoding="utf-8"), (
        "launcher/node/sglang_flags.json is stale: python scripts/sglang_flags.py " + str(WHEELS))


def dry_run(tmp_path: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "up", "--dry-run", "--run-dir", str(tmp_path), *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_dry_run_prints_each_gpus_argv_and_environment_with_flags_renamed_for_the_version(
    tmp_path: Path,
) -> None:
    profile = tmp_path / "node.toml"
    profile.write_text('model = "/models/q"\nsglang_version = "0.5.10"\n'
                       'args = ["--cuda-graph-max-bs-decode", "64", "--api-key", "sek"]\n'
                       '[gpu.3]\nenv = {NCCL_DEBUG = "INFO"}\n')
    out = dry_run(tmp_path, "--gpus", "2,3", "--profile", str(profile), "--base-port", "40000")
    assert "sglang 0.5.10" in out
    assert "gpu2: http http://127.0.0.1:40002, nccl port 41002" in out
    assert "  env CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=2\n" in out
    assert "  env CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=3 NCCL_DEBUG=INFO\n" in out
    argv = [line for line in out.splitlines() if line.startswith("  argv ")]
    assert len(argv) == 2
    words = shlex.split(argv[1][len("  argv "):])
    assert words[words.index("--cuda-graph-max-bs") + 1] == "64"  # 0.5.10's spelling
    assert "--cuda-graph-max-bs-decode" not in words and "sek" not in out
    assert words[words.index("--port") + 1] == "40003" and "--enable-metrics" in words
    assert "  warning:" not in out  # (a port in use elsewhere may warn at column 0)
    assert not (tmp_path / "node.json").exists()  # nothing was started


def test_dry_run_warns_about_a_flag_the_release_rejects(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "--gpus", "0", "--model", "/m", "--", "--max-mamba-cache-size",
                  "lots", "--mamba-radix-cache-strategy", "no_buffer")
    assert "warning: --max-mamba-cache-size: 'lots' is not an int (sglang 0.5.23)" in out
    assert "mamba-radix-cache-strategy" in out and out.count("  warning:") == 1


# Switches declared through argparse actions other than store_true (SGLang 0.5.23's own text).

ACTIONS_0_5_23 = '''
class DeprecatedAction(argparse.Action):
    def __init__(self, option_strings, dest, error_message=None, nargs=0, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)

class DeprecatedStoreTrueAction(argparse.Action):
    def __init__(self, option_strings, dest, new_flag=None, nargs=0, const=True,
                 default=False, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, const=const, default=default)

class DeprecatedStoreConstAction(argparse.Action):
    def __init__(self, option_strings, dest, new_flag=None, const_value=None, nargs=0,
                 default=None, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, default=default, **kwargs)

class DeprecatedAliasStoreAction(argparse.Action):
    def __init__(self, option_strings, dest, new_flag=None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
'''

SERVER_ARGS_0_5_23 = '''
class ServerArgs:
    lora_strict_loading: A[bool, Arg(help="s", action=argparse.BooleanOptionalAction)] = False
    lora_paths: A[Optional[list], Arg(help="p", action=LoRAPathAction,
                                       action_kwargs={"type": str, "nargs": "*"})] = None
    model_checksum: A[Optional[str], Arg(help="c", nargs="?", const="")] = None
    enable_dp_attention: A[bool, Arg(no_cli=True, resolvable=True)] = False

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--enable-dp-attention", action=DeprecatedStoreTrueAction,
                            new_flag="--attn-dp-size <dp-size>", help="Deprecated.")
        parser.add_argument("--collect-tokens-histogram", action=DeprecatedAction, help="x")
        parser.add_argument("--monokernel-backend", action=DeprecatedStoreConstAction,
                            dest="enable_amd_monokernel", nargs=None, choices=["amd"],
                            const_value=True, default=False)
        parser.add_argument("--old-size", action=DeprecatedAliasStoreAction, type=int)
'''


def test_actions_that_take_no_value_are_read_as_switches() -> None:
    from launcher.node._flags import read_actions
    actions = read_actions(ACTIONS_0_5_23)
    flags = {n: f.to_json() for n, f in read_source(SERVER_ARGS_0_5_23, actions).items()}
    assert flags == {
        "--enable-dp-attention": {"kind": "switch"},
        "--collect-tokens-histogram": {"kind": "switch"},
        "--lora-strict-loading": {"kind": "switch"},
        "--no-lora-strict-loading": {"kind": "switch"},  # BooleanOptionalAction adds it
        "--lora-paths": {"kind": "str", "many": True, "optional": True},
        "--model-checksum": {"kind": "str", "optional": True},
        "--monokernel-backend": {"kind": "any", "choices": ["amd"]},
        "--old-size": {"kind": "int"},
    }


# Flags SGLang declares as switches (store_true, a deprecated store-true action or
# BooleanOptionalAction), sampled from each release's server_args.py and arg_groups/fields/.
SWITCHES = {
    "0.5.1": ["--enable-dp-attention", "--disable-radix-cache", "--enable-metrics",
              "--disable-cuda-graph"],
    "0.5.13": ["--enable-dp-attention", "--collect-tokens-histogram", "--stream-output",
               "--lora-strict-loading", "--no-lora-strict-loading"],
    "0.5.20": ["--enable-dp-attention", "--disable-cuda-graph", "--ple-offload-embedding",
               "--no-ple-offload-embedding", "--enable-metrics"],
    "0.5.23": ["--enable-dp-attention", "--disable-cuda-graph", "--enable-metrics",
               "--disable-radix-cache", "--lora-strict-loading", "--enable-tf32-matmul",
               "--no-enable-tf32-matmul", "--mm-enable-dp-encoder"],
}


@pytest.mark.parametrize("release", sorted(SWITCHES))
def test_the_table_says_switch_for_each_switch_sglang_declares(release: str) -> None:
    for flag in SWITCHES[release]:
        assert check_args([flag], release) == [], (release, flag)
        assert check_args([flag, "1"], release) == [
            f"{flag}: a switch takes no value, got '1' (sglang {release})"]


def test_a_flag_whose_value_may_be_left_out_stands_alone() -> None:
    assert check_args(["--model-checksum"], "0.5.23") == []
    assert check_args(["--model-checksum", "abc"], "0.5.23") == []
    assert check_args(["--max-mamba-cache-size"], "0.5.23") == [
        "--max-mamba-cache-size: needs a value (sglang 0.5.23)"]


def test_dry_run_of_dp_attention_gives_no_warning(tmp_path: Path) -> None:
    profile = tmp_path / "node.toml"
    profile.write_text('model = "/models/q"\nsglang_version = "0.5.23"\n')
    out = dry_run(tmp_path, "--gpus", "0-1", "--profile", str(profile), "--",
                  "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")
    # Only warnings about the flags: a dry run also warns of a port that is taken on this machine.
    flag_warnings = [line for line in out.splitlines() if "warning" in line and "port" not in line]
    assert flag_warnings == [] and "needs a value" not in out
    assert "1 server(s) of 2 (--tp-size 2 --dp-size 2 --enable-dp-attention)" in out


def test_dry_run_shows_where_the_workers_would_talk_to_with_credentials_masked(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "REDIS_URL": "redis://:sekrit@10.0.0.9:6379/0",
           "AWS_ENDPOINT_URL": "http://10.0.0.9:8333", "FLEETGEN_OUTPUT": "s3://runs/night"}
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "up", "--dry-run", "--sim", "--workers", "--gpus",
         "0", "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert ("workers inherit REDIS_URL='redis://:***@10.0.0.9:6379/0', "
            "AWS_ENDPOINT_URL=http://10.0.0.9:8333, FLEETGEN_OUTPUT=s3://runs/night"
            ) in done.stdout
    assert "sekrit" not in done.stdout
    bare = {k: v for k, v in env.items()
            if k not in ("REDIS_URL", "AWS_ENDPOINT_URL", "FLEETGEN_OUTPUT")}
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "up", "--dry-run", "--sim", "--workers", "--gpus",
         "0", "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=bare, check=False)
    assert "workers inherit REDIS_URL (unset: this machine's embedded Redis), " \
        "AWS_ENDPOINT_URL (unset: AWS S3)\n" in done.stdout
