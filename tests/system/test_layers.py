"""The packages keep one direction of use, and the launcher's parts load only what they need.

The rules are import-linter contracts in pyproject.toml ([tool.importlinter]); a broken one
fails here with lint-imports' report, which names the rule and the import that breaks it (that
test is marked `checks`; the others are what importing a part loads or says, unmarked).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Building the Celery app reads the settings from the environment; a malformed REDIS_URL
# makes any import that builds it fail loudly.
BAD_ENV = {**os.environ, "REDIS_URL": "garbage"}


@pytest.mark.checks
def test_every_import_contract_in_pyproject_is_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def _loaded_by(module: str) -> set[str]:
    """fleetgen's and Celery's modules that importing `module` loads, in a fresh interpreter."""
    script = (f"import sys, {module}\n"
              "print(sorted(m for m in sys.modules\n"
              "             if m.partition('.')[0] in ('celery', 'kombu', 'fleetgen', 'workers', 'producer')))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=BAD_ENV,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return set(ast.literal_eval(done.stdout))


def test_the_simulator_loads_no_celery_and_nothing_of_fleetgen() -> None:
    assert _loaded_by("launcher.sim") == set()


def test_the_node_supervisor_and_log_reader_load_no_celery_and_only_pure_shared_helpers() -> None:
    # Nothing of the worker; of the domain only what every command shares and reads no
    # environment: the command-line style, the one function that masks secrets, the error
    # types, the one reader of a server's info and /metrics (advise samples servers through
    # it), the server kinds whose gauges that reader knows, the names of queues and ports
    # (the launcher gives each worker its metrics port), the one wait on a condition, and the
    # one backoff policy (the supervisor's restarts), and the kinds of request (the routes a
    # server kind serves them at).
    shared = {"fleetgen", "fleetgen.commandline", "fleetgen.redact", "fleetgen.endpoints",
              "fleetgen.readings", "fleetgen.errors", "fleetgen.servers", "fleetgen.keys",
              "fleetgen.poll", "fleetgen.ports", "fleetgen.retry"}
    for module in ("launcher.node", "launcher.logs"):
        loaded = {m for m in _loaded_by(module) if not m.startswith("fleetgen.servers._")}
        assert loaded <= shared, module


def test_a_celery_command_with_a_bad_setting_says_one_error_line_and_exits_2() -> None:
    celery = Path(sys.executable).with_name("celery")
    for argv in ([str(celery), "worker", "-Q", "gpu0"], [str(celery), "-A", "workers", "flower"]):
        done = subprocess.run(argv, cwd=ROOT, env={**BAD_ENV, "CELERY_APP": "workers"},
                              capture_output=True, text=True, timeout=120, check=False)
        assert (done.returncode, done.stderr) == (
            2, "error: REDIS_URL must be a redis:// or sentinel:// URL, got 'garbage'\n"), argv


def test_sim_help_works_with_a_malformed_redis_url() -> None:
    done = subprocess.run([sys.executable, "-m", "launcher", "sim", "--help"], cwd=ROOT,
                          env=BAD_ENV, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m launcher sim")
    assert done.stderr == ""


def test_importing_the_packages_builds_no_celery_app_and_reads_no_environment() -> None:
    script = ("import sys, workers, producer, launcher, launcher.sim\n"
              "import fleetgen.ledger, fleetgen.sink, fleetgen.job, fleetgen.keys, producer.inputs\n"
              "print('workers.app' in sys.modules, 'celery' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=BAD_ENV,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_celery_finds_the_app_under_the_package_name() -> None:
    script = ("from celery.app.utils import find_app\n"
              "app = find_app('workers')\n"
              "print(app.main, app.conf.task_default_queue)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fleetgen", "fleetgen"]


def test_the_reconciler_writes_progress_json_without_loading_the_producer() -> None:
    script = ("import sys, workers.reconciler, fleetgen.progress\n"
              "print(sorted(m for m in sys.modules if m.partition('.')[0] == 'producer'))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
