"""The stack file for several managers on etcd: what ``docker stack config`` of the CLI on PATH makes of it."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from gpumgr.agent.managers import parse_managers
from gpumgr.manager.control.ha import parse_store_url
from tests.procs import ROOT

STACK = ROOT / "examples" / "swarm" / "stack-ha.yml"
HOSTS = {"GPUMGR_HA1": "10.0.0.1", "GPUMGR_HA2": "10.0.0.2", "GPUMGR_HA3": "10.0.0.3"}


def config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    if shutil.which("docker") is None:
        pytest.fail("the docker CLI is needed to check the stack file")
    keep = {k: v for k, v in os.environ.items() if not k.startswith("GPUMGR_")}
    return subprocess.run(["docker", "stack", "config", "-c", str(STACK)], capture_output=True, text=True,
                          env={**keep, **env})


@pytest.fixture(scope="module")
def stack() -> dict:
    done = config({**HOSTS, "GPUMGR_TOKEN": "t0ken", "GPUMGR_JOIN_TOKEN": "j0in"})
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def test_three_etcd_members_one_per_manager_node_with_compaction(stack) -> None:
    members = [stack["services"][f"etcd{i}"] for i in (1, 2, 3)]
    for i, member in enumerate(members, 1):
        env = member["environment"]
        assert env["ETCD_NAME"] == f"etcd{i}" and env["ETCD_INITIAL_CLUSTER"].count("=http://") == 3
        assert env["ETCD_ADVERTISE_CLIENT_URLS"] == f"http://10.0.0.{i}:2379"
        assert env["ETCD_AUTO_COMPACTION_RETENTION"] == "1" and env["ETCD_MAX_TXN_OPS"] == "128"
        constraints = member["deploy"]["placement"]["constraints"]
        assert constraints == ["node.role == manager", f"node.labels.gpumgr.ha{i} == true"]
        assert list(member["networks"]) == ["hostnet"] and member["volumes"][0]["target"] == "/var/lib/etcd"
        assert member["entrypoint"] == ["etcd"] and member["image"] == stack["services"]["manager1"]["image"]
    assert stack["networks"]["hostnet"]["name"] == "host"


def test_three_managers_share_the_store_and_the_key_and_advertise_their_own_api(stack) -> None:
    for i in (1, 2, 3):
        manager = stack["services"][f"manager{i}"]
        env = manager["environment"]
        store = parse_store_url(env["GPUMGR_STORE"])
        assert store.endpoints == [f"http://10.0.0.{n}:2379" for n in (1, 2, 3)] and store.prefix == "/gpumgr/"
        assert manager["command"] == ["manager", "--api", f"10.0.0.{i}:9400", "--agents", f"tcp://10.0.0.{i}:9401",
                                      "--advertise-api", f"http://10.0.0.{i}:9400"]
        assert env["GPUMGR_TOKEN"] == "t0ken"
        assert manager["secrets"] == [{"source": "gpumgr-manager-key", "target": "/var/lib/gpumgr/manager_key.json",
                                       "mode": 0o400}]
        assert manager["deploy"]["replicas"] == 1
        assert f"node.labels.gpumgr.ha{i} == true" in manager["deploy"]["placement"]["constraints"]


def test_agents_are_global_and_given_every_manager(stack) -> None:
    agent = stack["services"]["agent"]
    assert agent["deploy"]["mode"] == "global" and list(agent["networks"]) == ["hostnet"]
    assert parse_managers(agent["command"][2]) == [f"tcp://10.0.0.{n}:9401" for n in (1, 2, 3)]
    mounts = {m["target"]: m["source"] for m in agent["volumes"]}
    assert mounts["/var/lib/gpumgr"] == "/var/lib/gpumgr"  # its key and fence.json outlive it


@pytest.mark.parametrize("missing", ["GPUMGR_HA1", "GPUMGR_HA3", "GPUMGR_TOKEN", "GPUMGR_JOIN_TOKEN"])
def test_the_stack_names_what_is_missing(missing) -> None:
    env = {**HOSTS, "GPUMGR_TOKEN": "t0ken", "GPUMGR_JOIN_TOKEN": "j0in"}
    del env[missing]
    done = config(env)
    assert done.returncode != 0 and missing in done.stderr
