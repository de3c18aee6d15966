"""The shipped Dockerfile and stack file parse and say what the README promises (no image can be built here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib

import pytest
import yaml

from tests.procs import ROOT

SWARM = ROOT / "examples" / "swarm"


@pytest.fixture(scope="module")
def stack() -> dict:
    if shutil.which("docker") is None:
        pytest.fail("the docker CLI is needed to check the stack file")
    result = subprocess.run(["docker", "stack", "config", "-c", str(SWARM / "stack.yml")], capture_output=True,
                            text=True, env={**os.environ, "GPUMGR_TOKEN": "t0ken", "GPUMGR_JOIN_TOKEN": "j0in"},
                            check=True)
    return yaml.safe_load(result.stdout)


def test_stack_runs_one_manager_on_a_manager_node(stack) -> None:
    manager = stack["services"]["manager"]
    assert manager["deploy"]["replicas"] == 1
    assert manager["deploy"]["placement"]["constraints"] == ["node.role == manager"]
    assert manager["environment"]["GPUMGR_TOKEN"] == "t0ken"
    assert manager["command"][:1] == ["manager"]


def test_stack_runs_a_global_agent_with_the_docker_socket_and_host_processes(stack) -> None:
    agent = stack["services"]["agent"]
    assert agent["deploy"]["mode"] == "global"
    mounts = {m["target"]: m["source"] for m in agent["volumes"]}
    assert mounts["/var/run/docker.sock"] == "/var/run/docker.sock"
    assert mounts["/host/proc"] == "/proc" and agent["environment"]["GPUMGR_PROC_ROOT"] == "/host/proc"
    assert mounts["/run/gpumgr"] == "/run/gpumgr"
    assert agent["command"] == ["agent", "--manager", "tcp://manager:9401"]
    # it joins once with the token, keeps its key on the host, and reads the engine's container records
    assert agent["environment"]["GPUMGR_JOIN_TOKEN"] == "j0in" and mounts["/var/lib/gpumgr"] == "/var/lib/gpumgr"
    assert mounts["/var/lib/docker/containers"] == "/var/lib/docker/containers"
    manager = {m["target"]: m["source"] for m in stack["services"]["manager"]["volumes"]}
    assert manager["/var/lib/gpumgr"] == "gpumgr-state"


def test_stack_refuses_to_deploy_without_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GPUMGR_TOKEN"}
    result = subprocess.run(["docker", "stack", "config", "-c", str(SWARM / "stack.yml")], capture_output=True,
                            text=True, env={**env, "GPUMGR_JOIN_TOKEN": "j0in"})
    assert result.returncode != 0 and "GPUMGR_TOKEN" in result.stderr
    result = subprocess.run(["docker", "stack", "config", "-c", str(SWARM / "stack.yml")], capture_output=True,
                            text=True, env={**env, "GPUMGR_TOKEN": "t0ken"})
    assert result.returncode != 0 and "GPUMGR_JOIN_TOKEN" in result.stderr


def test_dockerfile_copies_every_package_and_runs_gpumgr() -> None:
    instructions = [line.split(None, 1) for line in (SWARM / "Dockerfile").read_text().splitlines()
                    if line.strip() and not line.startswith("#")]
    copied = {src for op, args in instructions if op == "COPY" for src in args.split()[:-1]}
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    assert set(folders) <= copied and {"pyproject.toml", "README.md"} <= copied
    assert all((ROOT / src).exists() for src in copied)
    assert instructions[0][0] == "FROM" and ["ENTRYPOINT", '["gpumgr"]'] in instructions


@pytest.mark.parametrize("name, cls_path", [("manager.yaml", "gpumgr.manager.config:ManagerSettings"),
                                            ("agent.yaml", "gpumgr.agent.config:AgentSettings")])
def test_shipped_configs_load_and_name_only_known_settings(name, cls_path):
    import importlib

    from gpumgr.wire.config import load_settings

    module, _, cls = cls_path.partition(":")
    settings_class = getattr(importlib.import_module(module), cls)
    path = ROOT / "configs" / name
    settings = load_settings(settings_class, str(path))  # unknown keys are an error (extra="forbid")
    written = yaml.safe_load(path.read_text())
    assert written
    for key, value in written.items():
        assert getattr(settings, key) == value, key
