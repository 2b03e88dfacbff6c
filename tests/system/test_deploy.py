"""The several-nodes deployment files stay valid (no container engine, Slurm or systemd runs
here): the control-plane and GPU-node compose files resolve with docker-compose, the Slurm
batch script passes shellcheck, the systemd unit passes `systemd-analyze verify` where present.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.system.test_docker import tool

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy/systemd/fleetgen-node.service"
SBATCH = ROOT / "deploy/slurm/fleetgen-node.sbatch"


def compose(name: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("docker-compose"), "-f", str(ROOT / "docker" / name), "config", *args],
        capture_output=True, text=True, env=env, timeout=60, check=False)


def fleet_env(tmp_path: Path) -> dict[str, str]:
    secret = tmp_path / "secret"
    secret.write_text("deploy-test-secret\n")
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "REDIS_"))},
            "CONTROL_ADDRESS": "10.0.0.2", "FLEETGEN_REDIS_PASSWORD_FILE": str(secret),
            "S3_SECRET_KEY_FILE": str(secret), "S3_ACCESS_KEY": "fleetgen",
            "FLOWER_BASIC_AUTH": "ops:secret", "REDIS_URL": "redis://10.0.0.2:6379/0",
            "AWS_ENDPOINT_URL": "http://10.0.0.2:9000", "AWS_ACCESS_KEY_ID": "fleetgen",
            "AWS_SECRET_ACCESS_KEY": "s3-key", "MODEL_DIR": "/dev/shm/model"}


def test_the_control_plane_publishes_redis_and_s3_on_its_address_and_flower_on_loopback(
    tmp_path: Path,
) -> None:
    result = compose("control.yaml", fleet_env(tmp_path), "--format", "json")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert set(services) == {"redis", "s3", "flower"}
    assert services["redis"]["ports"][0]["host_ip"] == "10.0.0.2"
    assert "--appendonly yes" in services["redis"]["command"][0]
    assert services["s3"]["ports"][0]["host_ip"] == "10.0.0.2"
    assert services["flower"]["ports"][0]["host_ip"] == "127.0.0.1"
    assert "deploy-test-secret" not in result.stdout


def test_a_gpu_node_runs_the_launcher_on_the_host_network_with_its_servers_reachable(
    tmp_path: Path,
) -> None:
    result = compose("gpu-node.yaml", fleet_env(tmp_path), "--format", "json")
    assert result.returncode == 0, result.stderr
    node = json.loads(result.stdout)["services"]["node"]
    assert node["network_mode"] == "host"
    command = node["command"]
    assert command[:5] == ["python", "-m", "launcher", "up", "--workers"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert node["environment"]["FLEETGEN_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password"


@pytest.mark.parametrize("missing", ["CONTROL_ADDRESS", "FLEETGEN_REDIS_PASSWORD_FILE",
                                     "FLOWER_BASIC_AUTH"])
def test_the_control_plane_refuses_to_start_without_its_address_or_secrets(
    tmp_path: Path, missing: str,
) -> None:
    env = fleet_env(tmp_path)
    del env[missing]
    result = compose("control.yaml", env, "-q")
    assert result.returncode != 0 and missing in result.stderr


def test_the_slurm_script_passes_shellcheck() -> None:
    result = subprocess.run([tool("shellcheck"), str(SBATCH)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout


def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (no systemd here)")
    # The unit names the install path of its docs; here the interpreter running the tests.
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/fleetgen/.venv/bin/python", sys.executable))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert f"{unit.name}:" not in result.stderr, result.stderr
