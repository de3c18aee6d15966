"""The container spec (mounts, ports, namespaces, limits) is validated at once, and the operator's policy refuses
what an attacker would try, at the API and again on the node with real paths (issue 19).

The API runs in process over a real agent link with a scripted agent that never answers a create: a
request the API wrongly let through would show up as a 502 outcome_unknown after ``create_timeout``, never as the
fast 400 or 403 these tests expect, and the scripted agent would have received a create.
"""

from __future__ import annotations

import os
import threading

import pytest

from gpumgr.manager.api.app import create_app
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.service import Manager
from gpumgr.manager.tenancy.tenants import TenantConfig
from gpumgr.wire import protocol
from gpumgr.wire.errors import PolicyDenied
from gpumgr.wire.policy import Policy, check, on_node
from gpumgr.wire.runspec import RunSpec
from tests.fake_agent import FakeAgent

OPERATOR = "operator-token-0123456789"
ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdefgh"
IMAGE = "img"


@pytest.fixture
def stack(tmp_path):
    """A manager whose top-level policy allows binds under /data (read-only) and /scratch; bob may run privileged."""
    tenants = {"alice": TenantConfig(token=ALICE),
               "bob": TenantConfig(token=BOB, policy=Policy(privileged=True, host_network=True))}
    settings = ManagerSettings(agents="tcp://127.0.0.1:0", state_dir=str(tmp_path / "s"), create_timeout=3.0,
                               token=OPERATOR, tenants=tenants,
                               policy=Policy(bind_paths={"/data": "ro", "/scratch": "rw"}, networks=["train"],
                                             cap_add=["SYS_PTRACE"]))
    manager = Manager(settings)
    manager.start()
    agent = FakeAgent(manager.link.bound_endpoint, manager.admission.token(), node="fake", behaviour="silent")
    agent.register()
    stop = threading.Event()
    thread = agent.serve(stop)
    yield manager, create_app(manager).test_client(), agent
    stop.set()
    thread.join(2)
    agent.close()
    manager.stop()


def creates(agent: FakeAgent) -> list[dict]:
    """The create messages the scripted agent received, as plain data."""
    return [m.model_dump(mode="json") for m in list(agent.received) if isinstance(m, protocol.Create)]


def post(stack, token: str, **fields):
    _, client, _ = stack
    body = {"image": IMAGE, "gpu_memory": "1GiB", **fields}
    return client.post("/v1/containers", json=body, headers={"Authorization": f"Bearer {token}"})


ATTACKS = [
    ({"volumes": ["/:/host"]}, "bind_paths"),
    ({"volumes": ["/var/run/docker.sock:/var/run/docker.sock"]}, "bind_paths"),
    ({"mounts": [{"type": "bind", "source": "/etc", "target": "/e", "read_only": True}]}, "bind_paths"),
    ({"volumes": ["/database:/d:ro"]}, "bind_paths"),  # a prefix is a whole path component: /data is not /database
    ({"volumes": ["/data/sets:/d"]}, "bind_paths"),  # /data is read-only: a read-write bind is refused
    ({"volumes": ["/data/../etc:/e:ro"]}, None),  # '..' is refused outright (400), never normalised into /etc
    ({"privileged": True}, "privileged"),
    ({"pid_mode": "host"}, "host_pid"),
    ({"ipc_mode": "host"}, "host_ipc"),
    ({"network": "host"}, "host_network"),
    ({"network": "bridge"}, "networks"),
    ({"network": "container:victim"}, "container_namespaces"),
    ({"ipc_mode": "container:victim"}, "container_namespaces"),
    ({"cap_add": ["SYS_ADMIN"]}, "cap_add"),
    ({"cap_add": ["ALL"]}, "cap_add"),
    ({"devices": ["/dev/sda:/dev/sda:rwm"]}, "devices"),
    ({"devices": ["/dev/mem"]}, "devices"),
    ({"log_config": {"type": "syslog", "config": {"syslog-address": "tcp://10.0.0.1:514"}}}, "log_drivers"),
]


@pytest.mark.parametrize(("fields", "rule"), ATTACKS)
def test_a_tenant_is_refused_what_its_policy_does_not_allow(stack, fields, rule) -> None:
    _, _, agent = stack
    response = post(stack, ALICE, **fields)
    if rule is None:
        assert response.status_code == 400, response.json
        assert response.json["error"]["code"] == "invalid_request"
    else:
        assert response.status_code == 403, response.json
        error = response.json["error"]
        assert error["code"] == "policy_denied" and error["rule"] == rule, error
    assert not creates(agent)


def test_the_operator_and_a_tenant_with_its_own_policy_are_not_limited_by_the_default(stack) -> None:
    # both pass the policy and are placed: the silent agent then gets the create (never answering: 502 outcome_unknown)
    manager, _, agent = stack
    manager.settings = manager.settings.model_copy(update={"create_timeout": 0.5})
    assert post(stack, OPERATOR, privileged=True, volumes=["/:/host"]).status_code == 502
    assert post(stack, BOB, privileged=True, network="host").status_code == 502
    assert post(stack, BOB, volumes=["/data:/d:ro"]).status_code == 403  # bob's own policy replaces the default
    assert len(creates(agent)) == 2
    sent = creates(agent)[0]["spec"]
    assert sent["run"]["privileged"] is True and sent["policy"] is None
    assert creates(agent)[1]["spec"]["policy"]["privileged"] is True


def test_what_the_policy_allows_is_sent_to_the_node_with_the_policy(stack) -> None:
    manager, _, agent = stack
    manager.settings = manager.settings.model_copy(update={"create_timeout": 0.5})
    response = post(stack, ALICE, volumes=["/data/sets:/d:ro", "cache:/cache"], network="train",
                    mounts=[{"type": "bind", "source": "/scratch/a", "target": "/s"}], cap_add=["cap_sys_ptrace"],
                    shm_size="1g", working_dir="/s", user="1000:1000", entrypoint="python -u",
                    ports={"8080": 8080}, nano_cpus=2_000_000_000, mem_limit="16g",
                    ulimits=[{"name": "memlock", "soft": -1, "hard": -1}], stop_signal="SIGINT")
    assert response.status_code == 502, response.json
    spec = creates(agent)[0]["spec"]
    run = spec["run"]
    assert run["volumes"] == ["/data/sets:/d:ro", "cache:/cache"] and run["shm_size"] == 2**30
    assert run["entrypoint"] == ["python", "-u"] and run["ports"] == {"8080/tcp": 8080}
    assert run["cap_add"] == ["SYS_PTRACE"] and run["mem_limit"] == 16 * 2**30
    assert spec["policy"]["bind_paths"] == {"/data": "ro", "/scratch": "rw"}


BAD = [
    ({"restart_policy": {"Name": "always"}}, "restart_policy"),
    ({"security_opt": ["seccomp=unconfined"]}, "security_opt"),
    ({"volumes": ["relative/path:/x"]}, "volumes"),
    ({"volumes": ["/a:relative"]}, "volumes"),
    ({"volumes": ["/a:/b:rx"]}, "volumes"),
    ({"mounts": [{"type": "bind", "source": "data", "target": "/d"}]}, "mounts"),
    ({"mounts": [{"type": "tmpfs", "source": "/x", "target": "/d"}]}, "mounts"),
    ({"mounts": [{"type": "npipe", "target": "/d"}]}, "mounts"),
    ({"volumes": ["/data:/d:ro", "/data/x:/d:ro"]}, "share a target"),
    ({"ports": {"80/xyz": 1}}, "ports"),
    ({"ports": {"80": 70000}}, "ports"),
    ({"ports": {"80": "8080"}}, "ports"),
    ({"shm_size": "lots"}, "shm_size"),
    ({"shm_size": -1}, "shm_size"),
    ({"mem_limit": 1024}, "mem_limit"),
    ({"working_dir": "relative"}, "working_dir"),
    ({"user": "root; rm -rf /"}, "user"),
    ({"nano_cpus": 0}, "nano_cpus"),
    ({"ulimits": [{"name": "bogus", "soft": 1}]}, "ulimits"),
    ({"cap_add": ["sys admin"]}, "cap_add"),
    ({"stop_signal": "KILL ME"}, "stop_signal"),
    ({"privileged": "yes"}, "privileged"),
    ({"ipc_mode": "host!"}, "ipc_mode"),
]


@pytest.mark.parametrize(("fields", "words"), BAD)
def test_a_bad_field_is_a_400_naming_it(stack, fields, words) -> None:
    response = post(stack, OPERATOR, **fields)
    assert response.status_code == 400, response.json
    assert words in response.json["error"]["message"], response.json
    assert not creates(stack[2])


def test_the_node_resolves_symlinks_so_a_link_cannot_lead_out_of_an_allowed_prefix(tmp_path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "escape").symlink_to("/etc")
    (allowed / "inside").mkdir()
    policy = Policy(bind_paths={str(allowed): "ro"})
    run = RunSpec.model_validate({"volumes": [f"{allowed}/escape:/e:ro"]})
    check(run, policy)  # as written (the manager's view) it is inside the prefix
    with pytest.raises(PolicyDenied) as refused:
        check(run, policy, on_node)
    assert refused.value.rule == "bind_paths" and "/etc" in refused.value.message
    resolved = check(RunSpec.model_validate({"volumes": [f"{allowed}/inside:/i:ro"]}), policy, on_node)
    assert resolved.mounts[0].source == os.path.realpath(allowed / "inside") and resolved.volumes == []


def test_a_host_process_node_refuses_a_spec_it_cannot_honour(tmp_path) -> None:
    from gpumgr.agent.runtimes.process_runtime import ProcessRuntime
    from gpumgr.wire.errors import RuntimeFailure

    runtime = ProcessRuntime(lambda _: None, log_dir=str(tmp_path))
    spec = protocol.ContainerSpec(grant="g", name="n", command=["true"], gpus=["GPU-1"], gpu_memory=1,
                                  run=RunSpec.model_validate({"volumes": ["/data:/d"], "shm_size": "1g"}))
    with pytest.raises(RuntimeFailure) as refused:
        runtime.create(spec)
    assert refused.value.code == "invalid_request" and "volumes, shm_size" in refused.value.message
    assert runtime.managed() == []
